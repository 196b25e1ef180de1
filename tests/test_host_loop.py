"""The epoll loop that hosts trio (adapters/host_loop.py) and the session skeleton's read path on it.

Each test runs a whole trio run under `HostLoop.run`, as `polymq serve --loop epoll` does: a
listener with a line session, and clients on plain sockets of the same run. What is checked: every
answer's bytes and order, that a request was handled by the loop's callback (outside any trio
task) or by the session's task when it had to wait, output that did not fit the socket, output
queued from outside a read, the end of the input, and a close from outside.
"""

from __future__ import annotations

import socket

import pytest
import trio

from polymq.adapters import host_loop
from polymq.adapters.host_loop import HostLoop
from polymq.adapters.session import Listener, StreamSession, TcpService
from polymq.core.engine import Engine


def _in_task() -> bool:
    try:
        trio.lowlevel.current_task()
    except RuntimeError:
        return False
    return True


class LineSession(StreamSession):
    """Answers `echo X` with `X`, `wait X` with `X` after a wait of the session's task, `big N` with N
    bytes then `end`, `tell NAME X` by queuing `X` on the session `NAME` announced with `name NAME`."""

    def __init__(self, server: LineServer, transport) -> None:
        super().__init__(server.engine, transport)
        self.server = server
        self.buffer = b""
        self.lines: list[bytes] = []
        self.closed_seen = False

    def handle(self, data: bytes):
        self.server.handled_in_task.append(_in_task())
        self.buffer += data
        *lines, self.buffer = self.buffer.split(b"\n")
        self.lines = lines
        return self.resume()

    def resume(self):
        while self.lines:
            verb, _, rest = self.lines.pop(0).partition(b" ")
            if verb == b"echo":
                self.send(rest + b"\n")
            elif verb == b"wait":
                return self._later(rest)
            elif verb == b"big":
                self.send(b"x" * int(rest))
                self.send(b"end\n")
            elif verb == b"name":
                self.server.named[rest] = self
                self.send(b"named\n")
            elif verb == b"tell":
                name, _, said = rest.partition(b" ")
                self.server.named[name].send(said + b"\n")
                self.send(b"told\n")
            elif verb == b"quit":
                self.stop("asked to")
                return None
        return None

    async def _later(self, rest: bytes) -> None:
        await trio.sleep(0.001)
        self.server.handled_in_task.append(_in_task())
        self.send(rest + b"\n")

    def closed(self) -> None:
        self.closed_seen = True
        self.server.closed.set()


class LineServer(Listener):
    def __init__(self) -> None:
        super().__init__()
        self.engine = Engine()
        self.handled_in_task: list[bool] = []
        self.named: dict[bytes, LineSession] = {}
        self.closed = trio.Event()

    def new_session(self, transport) -> StreamSession:
        return LineSession(self, transport)


async def _connected(port: int) -> trio.SocketStream:
    return await trio.open_tcp_stream("127.0.0.1", port)


async def _read_until(stream: trio.SocketStream, end: bytes, limit: int = 64 << 20) -> bytes:
    got = b""
    while not got.endswith(end):
        chunk = await stream.receive_some(1 << 16)
        assert chunk, f"closed after {got[-80:]!r}"
        got += chunk
        assert len(got) <= limit
    return got


def _served(test) -> object:
    """Run `test(server, port)` in a trio run hosted by a `HostLoop`, the listener served meanwhile."""

    async def main() -> object:
        assert host_loop.current() is not None
        server = LineServer()
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        service = TcpService([(sock, server)])
        async with trio.open_nursery() as nursery:
            await nursery.start(service.run)
            with trio.fail_after(30):
                result = await test(server, sock.getsockname()[1])
            await service.stop()
            nursery.cancel_scope.cancel()
        return result

    return HostLoop().run(main)


def test_the_loop_runs_trio_and_returns_its_result_or_raises_its_error() -> None:
    async def answer(value: int) -> int:
        await trio.sleep(0.001)
        assert host_loop.current() is not None
        return value * 2

    assert HostLoop().run(answer, 21) == 42

    async def fail() -> None:
        await trio.sleep(0)
        raise ValueError("from the guest")

    with pytest.raises(ValueError, match="from the guest"):
        HostLoop().run(fail)


def test_plain_trio_has_no_host_loop() -> None:
    async def which() -> object:
        return host_loop.current()

    assert trio.run(which) is None


def test_a_request_is_answered_by_the_loops_callback_outside_any_task() -> None:
    async def test(server: LineServer, port: int) -> list[bool]:
        stream = await _connected(port)
        for number in range(50):
            await stream.send_all(b"echo %d\n" % number)
            assert await _read_until(stream, b"\n") == b"%d\n" % number
        await stream.send_all(b"".join(b"echo %d\n" % number for number in range(1000)))
        assert await _read_until(stream, b"999\n") == b"".join(b"%d\n" % number for number in range(1000))
        await stream.aclose()
        await server.closed.wait()
        return server.handled_in_task

    handled_in_task = _served(test)
    assert handled_in_task and not any(handled_in_task)


def test_a_request_that_waits_goes_to_the_sessions_task_and_the_read_goes_on_in_order() -> None:
    async def test(server: LineServer, port: int) -> list[bool]:
        stream = await _connected(port)
        await stream.send_all(b"echo a\nwait b\necho c\n")
        assert await _read_until(stream, b"c\n") == b"a\nb\nc\n"
        await stream.send_all(b"echo d\n")
        assert await _read_until(stream, b"d\n") == b"d\n"
        return server.handled_in_task

    # The read, on the loop; the wait, in the task; the next read, on the loop again.
    assert _served(test) == [False, True, False]


def test_output_the_socket_does_not_take_at_once_is_sent_whole_and_in_order_by_the_writer() -> None:
    size = 7 << 20  # several times a loopback socket's buffer, under the output's bound

    async def test(server: LineServer, port: int) -> bytes:
        stream = await _connected(port)
        # The loop's write is made while this task cannot read: the socket's buffers take a fraction.
        await stream.send_all(b"big %d\necho after\n" % size)
        return await _read_until(stream, b"after\n")

    got = _served(test)
    assert got == b"x" * size + b"end\nafter\n"


def test_output_queued_from_another_sessions_read_goes_out_at_the_end_of_the_pass() -> None:
    async def test(server: LineServer, port: int) -> tuple[bytes, bytes]:
        listener = await _connected(port)
        await listener.send_all(b"name L\n")
        assert await _read_until(listener, b"\n") == b"named\n"
        teller = await _connected(port)
        await teller.send_all(b"tell L hello\ntell L again\n")
        return await _read_until(teller, b"told\ntold\n"), await _read_until(listener, b"again\n")

    told, heard = _served(test)
    assert (told, heard) == (b"told\ntold\n", b"hello\nagain\n")


def test_the_end_of_the_input_and_a_stop_end_the_session() -> None:
    async def test(server: LineServer, port: int) -> bytes:
        stream = await _connected(port)
        await stream.send_all(b"echo last\nquit\necho never\n")
        got = b""
        while chunk := await stream.receive_some(1 << 16):
            got += chunk
        await server.closed.wait()
        return got

    assert _served(test) == b"last\n"


def test_a_request_and_the_end_of_the_input_in_one_edge_are_both_read() -> None:
    """The end of the stream reported with the last bytes brings no edge of its own: the session still
    sees it, answers, and ends."""

    async def test(server: LineServer, port: int) -> tuple[bytes, list[bool]]:
        plain = socket.create_connection(("127.0.0.1", port))
        # Both sent before this task lets the loop run: its first pass finds them together.
        plain.sendall(b"echo bye\n")
        plain.shutdown(socket.SHUT_WR)
        plain.setblocking(False)
        sock = trio.socket.from_stdlib_socket(plain)
        got = b""
        while chunk := await sock.recv(1 << 16):
            got += chunk
        await server.closed.wait()
        sock.close()
        return got, server.handled_in_task

    # Both read by the loop's callback: the request, then the end (`handle(b"")`).
    assert _served(test) == (b"bye\n", [False, False])


def test_a_session_closed_from_outside_ends_and_leaves_the_loop() -> None:
    async def test(server: LineServer, port: int) -> tuple[bytes, int]:
        stream = await _connected(port)
        await stream.send_all(b"name S\n")
        assert await _read_until(stream, b"\n") == b"named\n"
        server.named[b"S"].close("closed by the test")
        await server.closed.wait()
        rest = await stream.receive_some(1 << 16)
        return rest, len(server.sessions)

    assert _served(test) == (b"", 0)


def test_a_zeromq_pump_on_the_loop_echoes_every_message_and_reads_what_waited_before_it_started() -> None:
    """Its turns run on the loop's pass: each send may eat the edge that announced the next request, a
    burst larger than one turn's batch is read in several, and what waited before it ran is read."""
    import zmq

    from polymq.adapters.zmq_pump import RECEIVE_BATCH, ZmqPump

    async def main() -> tuple[list[bytes], list[list[bytes]], bool]:
        with zmq.Context() as context:
            # No high-water marks: the burst's sends must not block this thread, the loop's.
            context.setsockopt(zmq.SNDHWM, 0)
            context.setsockopt(zmq.RCVHWM, 0)
            server = context.socket(zmq.ROUTER)
            port = server.bind_to_random_port("tcp://127.0.0.1")
            clients = []
            for _ in range(3):
                client = context.socket(zmq.DEALER)
                client.setsockopt(zmq.LINGER, 0)
                client.connect(f"tcp://127.0.0.1:{port}")
                clients.append(client)
            clients[0].send_multipart([b"early"])
            pump: ZmqPump

            def echo(messages: list[list[bytes]]) -> None:
                handled_in_task.append(_in_task())
                for frames in messages:
                    pump.send(frames)

            handled_in_task: list[bool] = []
            pump = ZmqPump(server, echo)
            answers: dict[int, list[list[bytes]]] = {}

            async def ping_pong(index: int) -> None:
                client = clients[index]
                got = answers.setdefault(index, [])
                for number in range(300):
                    client.send_multipart([b"%d" % number])
                    while True:
                        try:
                            got.append(client.recv_multipart(zmq.NOBLOCK))
                            break
                        except zmq.Again:
                            await trio.sleep(0.0005)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(pump.run)
                with trio.fail_after(30):
                    async with trio.open_nursery() as clients_nursery:
                        for index in range(3):
                            clients_nursery.start_soon(ping_pong, index)
                    burst = clients[2]  # every echo it asked for it read: what comes now is the burst's
                    for number in range(RECEIVE_BATCH * 3):
                        burst.send_multipart([b"b%d" % number])
                    bursts: list[list[bytes]] = []
                    while len(bursts) < RECEIVE_BATCH * 3:
                        try:
                            bursts.append(burst.recv_multipart(zmq.NOBLOCK))
                        except zmq.Again:
                            await trio.sleep(0.001)
                pump.close()  # the pump's task ends: the nursery closes without a cancel
            for client in clients:
                client.close()
            early_and_echoes = [frames[0] for frames in answers[0]]
            return early_and_echoes, bursts, any(handled_in_task)

    echoes, bursts, any_in_task = HostLoop().run(main)
    assert echoes == [b"early"] + [b"%d" % number for number in range(299)]
    assert [frames[0] for frames in bursts] == [b"b%d" % number for number in range(len(bursts))]
    assert not any_in_task


@pytest.mark.parametrize("hosted", [True, False], ids=["host loop", "plain trio"])
def test_serve_readable_calls_back_on_each_readiness_and_raises_the_callbacks_error(hosted: bool) -> None:
    """The store's sync completions are read this way: every readiness reaches the callback (on the
    loop's pass, or from the task under plain trio), and an error of the callback ends the task."""
    import os

    from polymq.adapters.host_loop import serve_readable

    async def main() -> tuple[list[int], str]:
        read_end, write_end = os.pipe()
        os.set_blocking(read_end, False)
        seen: list[int] = []
        got_three = trio.Event()

        def drain() -> None:
            data = os.read(read_end, 4096)
            seen.extend(data)
            if len(seen) >= 3:
                got_three.set()
            if b"!" in data:
                raise RuntimeError("a bad completion")

        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(serve_readable, read_end, drain)
                for value in (1, 2, 3):
                    os.write(write_end, bytes([value]))
                    await trio.sleep(0.001)
                with trio.fail_after(10):
                    await got_three.wait()
                os.write(write_end, b"!")
                with trio.fail_after(10):
                    await trio.sleep_forever()
        except BaseExceptionGroup as group:
            [error] = group.exceptions
            return seen, str(error)
        finally:
            os.close(read_end)
            os.close(write_end)
        return seen, "no error"

    seen, error = HostLoop().run(main) if hosted else trio.run(main)
    assert seen[:3] == [1, 2, 3] and error == "a bad completion"
