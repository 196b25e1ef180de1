"""The round-trip ceiling of an I/O loop in this interpreter: a server that answers every NSQ
`IDENTIFY`, `PUB` and `MPUB` with `OK` and does nothing else, on trio's loop (one-shot `wait_readable` per read, as
the gateway's transport) or on a bare edge-triggered epoll loop that keeps each socket registered.

Run it and drive it with nsq's own `bench_writer --batch-size=1` (one message per round trip), then
the same against the gateway and nsqd: what the loop alone allows, beside what the gateway does.
It reads commands with a few lines of its own, not the gateway's codec: the codec's cost, run from
this interpreted loop, would be counted against the loop (measured: below the gateway's own rate).

    .venv/bin/python tools/round_trip_ceiling.py --loop trio --port 24160 &
    bench_writer --nsqd-tcp-address=127.0.0.1:24160 --runfor=5s --size=200 --batch-size=1 --topic=t
"""

from __future__ import annotations

import select
import socket
import struct

import click

from polymq.codecs import nsq

MAGIC = b"  V2"
BODY_SIZE = struct.Struct(">i")
RECV_BYTES = 65536
# nsqd's default --max-body-size (5 MiB): a larger body is refused, checked before it is read.
MAX_BODY_BYTES = 5 * 1024 * 1024


# The commands answered (each carries a body): bench_writer identifies itself, then publishes.
ANSWERED = (b"IDENTIFY\n", b"PUB ", b"MPUB ")


class Refused(Exception):
    """Not a command this server answers: the connection is closed."""


def answered(buffer: bytearray) -> int:
    """Take every complete command of ANSWERED off the front of `buffer`; how many there were."""
    count = 0
    while True:
        if buffer[:4] == MAGIC:
            del buffer[:4]
            continue
        end = buffer.find(b"\n")
        if end < 0:
            return count
        if not buffer.startswith(ANSWERED):
            raise Refused(bytes(buffer[:end])[:40].decode("ascii", "replace"))
        if len(buffer) < end + 1 + BODY_SIZE.size:
            return count
        (size,) = BODY_SIZE.unpack_from(buffer, end + 1)
        if not 0 <= size <= MAX_BODY_BYTES:
            raise Refused(f"body of {size} bytes")
        whole = end + 1 + BODY_SIZE.size + size
        if len(buffer) < whole:
            return count
        del buffer[:whole]
        count += 1


def _listener(port: int) -> socket.socket:
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    sock.listen(128)
    sock.setblocking(False)
    return sock


def _accepted(listener: socket.socket) -> socket.socket:
    conn, _ = listener.accept()
    conn.setblocking(False)
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return conn


def run_epoll(listener: socket.socket) -> None:
    """Each socket registered once, edge-triggered: a read that drains it waits in the next poll."""
    poller = select.epoll()
    poller.register(listener.fileno(), select.EPOLLIN)
    conns: dict[int, tuple[socket.socket, bytearray]] = {}
    while True:
        for fd, _ in poller.poll():
            if fd == listener.fileno():
                try:
                    conn = _accepted(listener)
                except BlockingIOError:
                    continue
                conns[conn.fileno()] = (conn, bytearray())
                poller.register(conn.fileno(), select.EPOLLIN | select.EPOLLET)
                continue
            conn, buffer = conns[fd]
            while True:
                try:
                    data = conn.recv(RECV_BYTES)
                except BlockingIOError:
                    break
                try:
                    if not data:
                        raise Refused("closed")
                    buffer += data
                    count = answered(buffer)
                except Refused:
                    poller.unregister(fd)
                    conn.close()
                    del conns[fd]
                    break
                if count:
                    conn.send(nsq.FRAME_OK * count)  # a few bytes: the socket's buffer takes them
                if len(data) < RECV_BYTES:
                    break  # drained: the edge of the next bytes wakes the poll


async def run_trio(listener: socket.socket) -> None:
    """As the gateway's transport: after a read that drained the socket, `wait_readable` first."""
    import trio

    async def serve(conn: socket.socket) -> None:
        buffer = bytearray()
        drained = False
        with conn:
            while True:
                if drained:
                    await trio.lowlevel.wait_readable(conn)
                try:
                    data = conn.recv(RECV_BYTES)
                except BlockingIOError:
                    await trio.lowlevel.wait_readable(conn)
                    continue
                drained = len(data) < RECV_BYTES
                try:
                    if not data:
                        return
                    buffer += data
                    count = answered(buffer)
                except Refused:
                    return
                if count:
                    conn.send(nsq.FRAME_OK * count)

    async with trio.open_nursery() as nursery:
        while True:
            await trio.lowlevel.wait_readable(listener)
            try:
                conn = _accepted(listener)
            except BlockingIOError:
                continue
            nursery.start_soon(serve, conn)


@click.command()
@click.option("--loop", "loop_kind", type=click.Choice(["trio", "epoll"]), required=True,
              help="trio's loop (as the gateway), or a bare edge-triggered epoll loop.")
@click.option("--port", type=click.IntRange(1, 65535), default=4150, show_default=True,
              help="Port on 127.0.0.1.")
def main(loop_kind: str, port: int) -> None:
    """Answer NSQ IDENTIFY, PUB and MPUB with OK and nothing else, until stopped (SIGTERM, or Ctrl-C)."""
    try:
        listener = _listener(port)
    except OSError as error:
        raise click.ClickException(f"cannot listen on 127.0.0.1:{port}: {error.strerror}") from None
    try:
        if loop_kind == "epoll":
            run_epoll(listener)
        else:
            import trio

            trio.run(run_trio, listener)
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
