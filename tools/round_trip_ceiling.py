"""The round-trip ceiling of an I/O loop in this interpreter: a server that answers every NSQ
`IDENTIFY`, `PUB` and `MPUB` with `OK` and does nothing else, on trio's loop (one-shot `wait_readable` per read, as
the gateway's transport), on a bare edge-triggered epoll loop that keeps each socket registered,
on that epoll loop run inside trio as one task (`reactor`), or on that epoll loop hosting trio in
guest mode (`guest`: trio runs its tasks from the host loop, the sockets never pass through it).

Run it and drive it with nsq's own `bench_writer --batch-size=1` (one message per round trip), then
the same against the gateway and nsqd: what the loop alone allows, beside what the gateway does.
It reads commands with a few lines of its own, not the gateway's codec: the codec's cost, run from
this interpreted loop, would be counted against the loop (measured: below the gateway's own rate).

    .venv/bin/python tools/round_trip_ceiling.py --loop trio --port 24160 &
    bench_writer --nsqd-tcp-address=127.0.0.1:24160 --runfor=5s --size=200 --batch-size=1 --topic=t
"""

from __future__ import annotations

import collections
import contextlib
import os
import select
import socket
import struct
from collections.abc import Callable

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


class Connections:
    """The sockets an epoll loop serves, each registered once, edge-triggered."""

    def __init__(self, poller: select.epoll) -> None:
        self.poller = poller
        self.open: dict[int, tuple[socket.socket, bytearray]] = {}

    def add(self, conn: socket.socket) -> None:
        self.open[conn.fileno()] = (conn, bytearray())
        self.poller.register(conn.fileno(), select.EPOLLIN | select.EPOLLET)

    def serve(self, fd: int) -> None:
        """Read what `fd` has until a read drains it (the edge of the next bytes wakes the poll)."""
        conn, buffer = self.open[fd]
        while True:
            try:
                data = conn.recv(RECV_BYTES)
            except BlockingIOError:
                return
            try:
                if not data:
                    raise Refused("closed")
                buffer += data
                count = answered(buffer)
            except Refused:
                self.poller.unregister(fd)
                conn.close()
                del self.open[fd]
                return
            if count:
                conn.send(nsq.FRAME_OK * count)  # a few bytes: the socket's buffer takes them
            if len(data) < RECV_BYTES:
                return


def run_epoll(listener: socket.socket) -> None:
    """Each socket registered once, edge-triggered: a read that drains it waits in the next poll."""
    poller = select.epoll()
    poller.register(listener.fileno(), select.EPOLLIN)
    conns = Connections(poller)
    while True:
        for fd, _ in poller.poll():
            if fd == listener.fileno():
                with contextlib.suppress(BlockingIOError):
                    conns.add(_accepted(listener))
            else:
                conns.serve(fd)


# How often the guest's task wakes, as the gateway's timers would (its watch runs every 0.25 s).
GUEST_TICK_S = 0.01


def run_guest(listener: socket.socket) -> None:
    """The epoll loop as the host and trio as its guest (`trio.lowlevel.start_guest_run`): trio waits
    for its own events in a thread of its own and runs its steps from this loop when they come, with
    a task waking every `GUEST_TICK_S`; the sockets never pass through trio."""
    import trio

    poller = select.epoll()
    poller.register(listener.fileno(), select.EPOLLIN)
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_read, False)
    os.set_blocking(wake_write, False)
    poller.register(wake_read, select.EPOLLIN)
    steps: collections.deque[Callable[[], object]] = collections.deque()

    def run_soon(step: Callable[[], object]) -> None:  # from trio's thread, or this one
        steps.append(step)
        with contextlib.suppress(BlockingIOError):  # a full pipe wakes the loop all the same
            os.write(wake_write, b"!")

    async def ticking() -> None:
        while True:
            await trio.sleep(GUEST_TICK_S)

    trio.lowlevel.start_guest_run(ticking, run_sync_soon_threadsafe=run_soon, done_callback=lambda _outcome: None)
    conns = Connections(poller)
    while True:
        for fd, _ in poller.poll():
            if fd == wake_read:
                with contextlib.suppress(BlockingIOError):
                    os.read(wake_read, 4096)
                while steps:
                    steps.popleft()()
            elif fd == listener.fileno():
                with contextlib.suppress(BlockingIOError):
                    conns.add(_accepted(listener))
            else:
                conns.serve(fd)


async def run_reactor(listener: socket.socket) -> None:
    """The epoll loop inside trio: one task waits (`wait_readable`) for an epoll of every socket,
    edge-triggered, and serves all that are ready; a second task accepts."""
    import trio

    poller = select.epoll()
    conns = Connections(poller)

    async def accepting() -> None:
        while True:
            await trio.lowlevel.wait_readable(listener)
            with contextlib.suppress(BlockingIOError):
                conns.add(_accepted(listener))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(accepting)
        while True:
            await trio.lowlevel.wait_readable(poller.fileno())
            for fd, _ in poller.poll(0):
                conns.serve(fd)


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
@click.option("--loop", "loop_kind", type=click.Choice(["trio", "epoll", "reactor", "guest"]), required=True,
              help="trio's loop (as the gateway); a bare edge-triggered epoll loop; that epoll loop inside "
                   "trio as one task (reactor); or that epoll loop as the host of trio in guest mode.")
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
        elif loop_kind == "guest":
            run_guest(listener)
        elif loop_kind == "reactor":
            import trio

            trio.run(run_reactor, listener)
        else:
            import trio

            trio.run(run_trio, listener)
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
