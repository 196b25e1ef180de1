"""The skeleton every TCP protocol session shares: read loop, output buffer, store barrier, drain, close.

One session per connection, two tasks. The reader hands everything a read returned to the
protocol (`handle`), which works synchronously (engine calls never await) and queues its answers
with `send`; while it does, the store holds its commits (`Storage.hold_work`) and writes what
the read changed when it is done, then the reader flushes the answers itself when the writer is
idle (one task switch less per request/response round trip). A command that must wait (a TLS
handshake, an auth server, the store) is an awaitable `handle` returns: the store is released
while it runs, and `resume` carries on with the rest of the read. The writer task sends output
that arrives outside a read (deliveries caused by other connections, timers) as one write.

Under the gateway's host loop (`--loop epoll`, adapters/host_loop.py) the loop reads a plain TCP
socket instead of the reader task: its callback reads until the socket is empty, handles each read
as above and sends the answers without waiting (`_flush_without_waiting`); the reader task only
takes over for an awaitable `handle`, the end of the input or output past its bound, then gives
the socket back. Output queued outside a read goes at the end of the loop's pass, one write per
session; what the kernel does not take at once (`_tail`) the writer task sends, first.

Output is urgent (answers: sent at the end of the read, or at once) or buffered (deliveries a
protocol lets wait, like NSQ's `output_buffer_timeout`: sent when something urgent goes, or at
their deadline). A protocol may encode what goes out (compression) with `output_encoder`.

The store barrier: a delivery of a durable queue that waits for an acknowledgement leaves only
once the record of its attempts is written (`unstored`), so a process crash never brings it back
with fewer attempts than a client saw. Output is bounded: past `MAX_PENDING_OUTPUT` the reader
stops reading until a slow client has taken it, and a client whose unsent output stays past
`OutputLimit.max_bytes` for `OutputLimit.grace_s` (deliveries it does not read) is disconnected by
its service's watch, which looks at every session once per `WATCH_INTERVAL_S`, never per message.

Limits of the listener: past `max_connections` a new client gets the protocol's refusal
(`Listener.refusal`) and is closed. Each connection opened and closed is logged with its peer and
why it closed; refusals are summed up (`RateLimitedLog`) so that a flood writes a few lines.
"""

from __future__ import annotations

import logging
import math
import socket
from collections.abc import Awaitable, Callable
from typing import ClassVar, Final

import trio
from mypy_extensions import mypyc_attr

from polymq.adapters import host_loop
from polymq.adapters.connection_end import until_connection_ends
from polymq.adapters.host_loop import HostLoop
from polymq.adapters.log_limit import RateLimitedLog
from polymq.adapters.protocol import OutputLimit
from polymq.adapters.traffic import Traffic
from polymq.adapters.transport import SocketTransport, Transport, serve_tcp, stop_listening
from polymq.core.engine import Engine

# How much one read asks the socket for: large enough for a batch of requests (an NSQ MPUB of
# 200 x 200 B) in a few reads, small enough to keep one client from monopolising the loop.
READ_SIZE: Final = 256 * 1024
# The reader stops reading while this much output waits for a slow client (bounded memory).
MAX_PENDING_OUTPUT: Final = 8 * 1024 * 1024
# At the end, output still queued gets this long to go out (`drain_timeout`).
DRAIN_TIMEOUT_S: Final = 1.0
# How often a service looks at its sessions' unsent output: a fraction of the shortest sane grace.
WATCH_INTERVAL_S: Final = 0.25
# A refused client gets this long, and this many bytes, to read its refusal and close (its first
# request read and dropped): a second, as `DRAIN_TIMEOUT_S`; a request line or two.
REFUSAL_LINGER_S: Final = 1.0
REFUSAL_READ_LIMIT: Final = 64 * 1024


# Compiled (mypyc): the other protocols' sessions and listeners are interpreted subclasses.
@mypyc_attr(allow_interpreted_subclasses=True)
class StreamSession:
    """Subclasses implement `handle` (a read's bytes, synchronously) and `closed` (cleanup)."""

    log: ClassVar[logging.Logger] = logging.getLogger("polymq.session")

    def __init__(self, engine: Engine, transport: Transport) -> None:
        self.engine = engine
        self.transport = transport
        self.peer = transport.peer
        self.out: list[bytes] = []
        self.output_encoder: Callable[[bytes], bytes] | None = None
        self._out_bytes = 0
        self._in_send = 0  # bytes of the write under way (`_flush`), not yet known to be sent
        self._over_since: float | None = None  # trio time the watch first saw too much unsent output
        self._urgent = False  # queued output to send at the end of the read, or at once
        self._flush_at = math.inf  # trio time by which buffered output must go
        self._wake = trio.Event()
        self._drained = trio.Event()
        self._sending = False  # a task is inside `_flush` (or holds `exclusive_output`)
        self.send_started: float | None = None  # engine clock time the write under way began
        self._reading = False  # output queued while handling a read is flushed when it is done
        self._closed = False
        self._stopping: str | None = None  # why the session ends after its output is sent
        self.closing_reason: str | None = None
        self._delivered_unstored = False
        self._cancel_scope: trio.CancelScope | None = None
        self.traffic = Traffic()  # its listener's, once it runs there
        # Under a host loop (adapters/host_loop.py) the socket is read by the loop's callback, and
        # output queued outside a read is sent at the end of the loop's pass, not by the writer task.
        self._host: HostLoop | None = None
        self._host_reader = self._read_on_host
        self._host_flush = self._flush_after_pass
        self._flush_queued = False
        self._handed_over = trio.Event()  # the host's read needs the task: see `_read_loop_on_host`
        self._handed_pending: Awaitable[None] | None = None
        self._handed_error: BaseException | None = None
        self._input_ended = False
        # What a write without waiting left unsent (sent first by the writer) and its `before_send` token.
        self._tail: bytes | None = None
        self._tail_token: object = None

    # -- what a protocol provides --------------------------------------------------------------

    def handle(self, data: bytes) -> Awaitable[None] | None:
        """Everything one read returned (b"" at the end of the stream), synchronously.

        Returns an awaitable when a command must wait; `resume` goes on once it is done."""
        raise NotImplementedError

    def resume(self) -> Awaitable[None] | None:
        """Go on with the read after an awaitable `handle` (or an earlier `resume`) returned."""
        return None

    def closed(self) -> None:
        """The connection is gone: give back what the session held (consumers, deliveries)."""

    def before_send(self) -> object:
        """Called before each write of queued output; what it returns goes to `after_send`."""
        return None

    def after_send(self, token: object) -> None:
        """That output was written (e.g. an auto-ack consumer's credit comes back now)."""

    def drain_timeout(self) -> float:
        return DRAIN_TIMEOUT_S

    def slow_error(self, unsent: int) -> tuple[str, bytes]:
        """The error code a client that does not read its output is disconnected with, and its bytes
        (b"": the protocol has none). Sent only when no write is half done (it would cut a frame)."""
        return "slow client", b""

    # -- the output's bound --------------------------------------------------------------------

    def unsent(self) -> int:
        """Output queued or in a write that has not finished."""
        return self._out_bytes + self._in_send

    def disconnect_slow(self, unsent: int, held_s: float) -> str:
        """Disconnect a client whose output waited too long: what is queued is dropped (what it held goes
        back to its queues in `closed`), its protocol's error goes out if a frame can. Returns the code."""
        code, error = self.slow_error(unsent)
        if error and self._in_send == 0 and not self._sending:
            self.transport.try_send(error)
        self.out = []
        self._out_bytes = 0
        self._tail = None
        self.close(f"{code}: {unsent} bytes unsent for {held_s:.1f} s")
        return code

    # -- lifecycle -----------------------------------------------------------------------------

    async def run(self) -> None:
        try:
            await until_connection_ends(self._run_tasks, self.log, self.peer)
        finally:
            self._closed = True
            self.log.info("%s: connection closed: %s", self.peer,
                          self.closing_reason or self._stopping or "client went away")
            self.closed()
            with trio.CancelScope(shield=True), trio.move_on_after(1):
                await self.transport.aclose()

    async def _run_tasks(self) -> None:
        async with trio.open_nursery() as nursery:
            self._cancel_scope = nursery.cancel_scope
            nursery.start_soon(self._write_loop)
            await self._read_loop()
            await self._drain_output()
            nursery.cancel_scope.cancel()

    def close(self, reason: str | None = None) -> None:
        """End the session now, from outside (shutdown, a deleted queue, a deadline)."""
        if reason is not None:
            self.closing_reason = reason
        if self._cancel_scope is not None:
            self._cancel_scope.cancel()

    def stop(self, reason: str) -> None:
        """End the session once the output queued so far is sent (a protocol error, say).

        Nothing more of the input is handled: `handle` checks `_stopping` between requests."""
        if self._stopping is None:
            self._stopping = reason
            self._wake.set()

    # -- reading -------------------------------------------------------------------------------

    async def _read_loop(self) -> None:
        host = host_loop.current()
        while host is not None and isinstance(self.transport, SocketTransport):
            if await self._read_loop_on_host(host, self.transport):
                return
        self._host = None  # the socket went to a stream (TLS): its task reads and writes it
        while True:
            data = await self.transport.receive_some(READ_SIZE)
            self.traffic.bytes_in += len(data)
            pending = self._handle_read(data)
            if pending is not None:
                await self._resume_read(pending)
            if not data or self._stopping is not None:
                return
            await self._after_read()

    async def _after_read(self) -> None:
        """The read is handled: send its answers, let buffered output wait, stop at the output's bound."""
        if self._urgent and not self._sending:
            await self._flush()  # answer from here: one task switch less per round trip
        elif self.out:
            self._wake.set()  # buffered output: the writer keeps its deadline
        if self._out_bytes > MAX_PENDING_OUTPUT:
            await self._wait_for_output()

    def _handle_read(self, data: bytes) -> Awaitable[None] | None:
        """`handle` one read with the store held: what it changes is written at its end, from here."""
        storage = self.engine.storage
        self._reading = True
        storage.hold_work()
        try:
            return self.handle(data)
        finally:
            self._reading = False
            storage.release_work()

    async def _resume_read(self, pending: Awaitable[None] | None) -> None:
        """A command of the read must wait: await it (the store released meanwhile), then go on."""
        storage = self.engine.storage
        while pending is not None:
            await pending
            self._reading = True
            storage.hold_work()
            try:
                pending = self.resume()
            finally:
                self._reading = False
                storage.release_work()

    async def _wait_for_output(self) -> None:
        """Stop reading while a slow client's output is past `MAX_PENDING_OUTPUT`, until it is sent."""
        self._drained = trio.Event()
        self._urgent = True
        self._wake.set()
        await self._drained.wait()

    async def _read_loop_on_host(self, host: HostLoop, transport: SocketTransport) -> bool:
        """Let the host loop read and handle the socket until its read needs this task: a command that
        waits, the end of the input, output past its bound. True when the input has ended."""
        self._host = host
        fd = transport.sock.fileno()
        self._handed_over = trio.Event()
        host.add_reader(fd, self._host_reader)
        try:
            await self._handed_over.wait()
        finally:
            host.remove_reader(fd)
        if self._handed_error is not None:
            error, self._handed_error = self._handed_error, None
            raise error
        pending, self._handed_pending = self._handed_pending, None
        if pending is not None:
            await self._resume_read(pending)
        if self._input_ended or self._stopping is not None:
            return True
        await self._after_read()
        return False

    def _read_on_host(self, events: int) -> None:
        """The host loop's callback: the socket has bytes. Read, handle and answer until it is empty."""
        transport = self.transport
        host = self._host
        if host is None or not isinstance(transport, SocketTransport) or self._handed_over.is_set():
            return
        scope = self._cancel_scope
        if scope is not None and scope.cancel_called:
            return  # closed from outside: the task ends the session
        sock = transport.sock
        while True:
            try:
                data = sock.recv(READ_SIZE)
            except BlockingIOError:
                return
            except OSError as error:
                self._hand_over(host, sock, None, error)
                return
            self.traffic.bytes_in += len(data)
            try:
                pending = self._handle_read(data)
            except BaseException as error:  # raised in the task, as a read of its own would
                self._hand_over(host, sock, None, error)
                return
            if pending is not None or not data or self._stopping is not None:
                self._input_ended = not data
                self._hand_over(host, sock, pending, None)
                return
            if self._urgent and not self._sending:
                self._flush_without_waiting()
            elif self.out:
                self._wake.set()  # buffered output: the writer keeps its deadline
            if self._out_bytes > MAX_PENDING_OUTPUT:
                self._hand_over(host, sock, None, None)
                return
            if len(data) < READ_SIZE:
                if events & host_loop.ENDED:
                    continue  # the end of the input is there, and brings no new edge: read it
                return  # the socket is empty: its next bytes are a new edge
            host.read_again(self._host_reader)  # let the others read before this one goes on
            return

    def _hand_over(self, host: HostLoop, sock: socket.socket, pending: Awaitable[None] | None,
                   error: BaseException | None) -> None:
        host.remove_reader(sock.fileno())
        self._handed_pending = pending
        self._handed_error = error
        self._handed_over.set()

    # -- writing -------------------------------------------------------------------------------

    def send(self, chunk: bytes, *, now: bool = False) -> None:
        """Queue an answer. Outside a read it goes at once: with `now` from here (a storage
        callback saves the writer task's turn), else by the writer."""
        self.out.append(chunk)
        self._out_bytes += len(chunk)
        self._urgent = True
        if self._reading:
            return
        if now:
            self._send_now()
        elif self._host is not None:
            self._flush_at_end_of_pass(self._host)
        elif not self._wake.is_set():
            self._wake.set()

    def send_delivery(self, chunk: bytes, body: bytes | None = None, unstored: bool = False,
                      flush_within: float | None = None) -> None:
        """Queue a delivery (`chunk`, then `body` when given: no copy to join them).

        With `unstored` it leaves only once its attempt record is written. `flush_within` lets it
        wait for more: None sends it like an answer; > 0 at most that long; 0 until something
        urgent goes or the reader blocks on its output."""
        out = self.out
        out.append(chunk)
        size = len(chunk)
        if body is not None:
            out.append(body)
            size += len(body)
        self._out_bytes += size
        if unstored:
            self._delivered_unstored = True
        if flush_within is None:
            self._urgent = True
            if self._host is not None:
                if not self._reading:
                    self._flush_at_end_of_pass(self._host)
                return
        elif flush_within > 0 and self._flush_at == math.inf:
            self._flush_at = trio.current_time() + flush_within
        else:
            return
        if not self._reading and not self._wake.is_set():
            self._wake.set()

    def _send_now(self) -> None:
        """Send the queued output from here when the writer is idle and it is one chunk; else wake it."""
        if (self._sending or self._delivered_unstored or self.output_encoder is not None or len(self.out) != 1
                or self._tail is not None):
            self._wake.set()
            return
        data = self.out[0]
        sent = self.transport.try_send(data)
        self.traffic.bytes_out += sent
        if sent == len(data):
            self.out.clear()
            self._out_bytes = 0
            self._urgent = False
            if self._stopping is not None:
                self._wake.set()  # the writer ends the session
            return
        if sent:
            self.out[0] = data[sent:]
            self._out_bytes -= sent
        self._wake.set()

    def _flush_at_end_of_pass(self, host: HostLoop) -> None:
        if not self._flush_queued:
            self._flush_queued = True
            host.after_batch(self._host_flush)

    def _flush_after_pass(self) -> None:
        self._flush_queued = False
        if self._urgent and not self._closed:
            self._flush_without_waiting()

    def _flush_without_waiting(self) -> None:
        """Send what is queued as far as the kernel takes it now; the writer task sends the rest."""
        if self._sending or self._tail is not None:
            self._wake.set()
            return
        while self.out:
            token, data = self._take_output()
            sent = self.transport.try_send(data)
            self.traffic.bytes_out += sent
            if sent < len(data):
                self._tail = data[sent:]
                self._tail_token = token
                self._in_send = len(data) - sent
                self._urgent = True
                self._wake.set()
                return
            self.after_send(token)
        if not self._drained.is_set():
            self._drained.set()
        if self._stopping is not None:
            self._wake.set()

    def _take_output(self) -> tuple[object, bytes]:
        """Everything queued, as the bytes of one write (encoded), and `before_send`'s token for it;
        a delivery waiting for its record (`unstored`) has it written first."""
        token = self.before_send()
        if self._delivered_unstored:
            self._delivered_unstored = False
            self.engine.storage.write_now()
        chunks = self.out
        self.out = []
        data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        self._out_bytes -= len(data)
        self._urgent = False
        self._flush_at = math.inf
        if self.output_encoder is not None:
            data = self.output_encoder(data)
        return token, data

    async def _write_loop(self) -> None:
        while True:
            if ((self.out or self._tail is not None) and not self._sending
                    and (self._urgent or trio.current_time() >= self._flush_at)):
                await self._flush()
                continue
            if self._stopping is not None and not self.out and self._tail is None and not self._sending:
                self.close()
                return
            if self.out and not self._urgent and self._flush_at < math.inf:
                with trio.move_on_at(self._flush_at):
                    await self._wake.wait()
            else:
                await self._wake.wait()
            self._wake = trio.Event()

    async def _flush(self) -> None:
        """Send everything queued. Only one task sends at a time (`_sending`)."""
        self._sending = True
        self.send_started = self.engine.clock.now()
        try:
            tail = self._tail
            if tail is not None:  # what a write without waiting left: it goes first, as it is
                token = self._tail_token
                self._tail = None
                self._tail_token = None
                self._in_send = len(tail)
                await self.transport.send_all(tail)
                self._in_send = 0
                self.traffic.bytes_out += len(tail)
                self.after_send(token)
            while self.out:
                token, data = self._take_output()
                self._in_send = len(data)
                await self.transport.send_all(data)
                self._in_send = 0
                self.traffic.bytes_out += len(data)
                self.after_send(token)
        finally:
            self._sending = False
            self._in_send = 0
            self.send_started = None
        self._drained.set()
        if self._stopping is not None:
            self._wake.set()

    async def _drain_output(self) -> None:
        with trio.move_on_after(self.drain_timeout()):
            while self._sending:  # the writer is mid-send: its loop sends what is queued too
                self._drained = trio.Event()
                await self._drained.wait()
            if self.out or self._tail is not None:
                await self._flush()

    async def exclusive_output(self) -> bytes:
        """Hold the output for a hand-over (a TLS upgrade): waits for the writer to be idle and
        returns what is queued, which the caller sends itself. `release_output` ends the hold."""
        while self._sending:
            self._drained = trio.Event()
            await self._drained.wait()
        self._sending = True
        data = b"".join(self.out)
        if self._tail is not None:
            data = self._tail + data
            self._tail = None
        self.out = []
        self._out_bytes = 0
        self._in_send = 0
        self._over_since = None
        self._urgent = False
        return data

    def release_output(self) -> None:
        self._sending = False
        if self.out:
            self._wake.set()


@mypyc_attr(allow_interpreted_subclasses=True)
class Listener:
    """The sessions of one listener: runs each, forgets it when it ends, closes them all at shutdown."""

    log: ClassVar[logging.Logger] = logging.getLogger("polymq.session")

    def __init__(self) -> None:
        self.sessions: set[StreamSession] = set()
        self.traffic = Traffic()
        self.max_connections = 0  # 0: no limit; the unit sets it from its setting
        self.address = ""  # host:port it listens on, for the log lines (`TcpService` sets it)
        self.refusals = RateLimitedLog(self.log)

    def new_session(self, transport: Transport) -> StreamSession:
        raise NotImplementedError

    def refusal(self) -> tuple[str, bytes]:
        """What a client past `max_connections` is told before it is closed: the protocol's error code
        and its bytes (b"": the protocol has no such answer, the connection is only closed)."""
        return "too many connections", b""

    async def handle_connection(self, transport: SocketTransport) -> None:
        if self.max_connections and len(self.sessions) >= self.max_connections:
            await self._refuse(transport)
            return
        self.log.info("%s: connection opened on %s", transport.peer, self.address)
        session = self.new_session(transport)
        session.traffic = self.traffic
        self.traffic.connections_opened += 1
        self.sessions.add(session)
        try:
            await session.run()
        except Exception:
            # A bug in one session must not end the accept loop, i.e. the whole gateway.
            self.log.exception("%s: session failed", transport.peer)
        finally:
            self.sessions.discard(session)

    async def _refuse(self, transport: SocketTransport) -> None:
        self.traffic.connections_refused += 1
        code, answer = self.refusal()
        self.traffic.error(error_label(code))
        self.refusals.note(code, f"{transport.peer}: connection refused on {self.address} with {code}: "
                                 f"{self.max_connections} connections are open (the limit)")
        try:
            if answer:
                transport.try_send(answer)  # a new socket's buffer takes a short answer whole
                # Closing with the client's first bytes unread would reset the connection and could
                # lose the answer: say we are done, then read what it sends until it closes too.
                transport.sock.shutdown(socket.SHUT_WR)
                with trio.move_on_after(REFUSAL_LINGER_S):
                    read = 0
                    while read < REFUSAL_READ_LIMIT:
                        data = await transport.receive_some(READ_SIZE)
                        if not data:
                            break
                        read += len(data)
        except OSError:
            pass
        finally:
            await transport.aclose()

    def watch_output(self, limit: OutputLimit, now: float) -> None:
        """Disconnect the sessions whose unsent output has stayed past the limit for its grace."""
        for session in list(self.sessions):
            unsent = session.unsent()
            if unsent <= limit.max_bytes:
                session._over_since = None
            elif session._over_since is None:
                session._over_since = now
            elif now - session._over_since >= limit.grace_s:
                held = now - session._over_since
                code = session.disconnect_slow(unsent, held)
                self.traffic.slow_disconnected += 1
                self.traffic.error(error_label(code))
                self.refusals.note(f"slow {code}", f"{session.peer}: disconnected with {code}: {unsent} bytes "
                                                   f"unsent for {held:.1f} s (the limit: {limit.max_bytes} bytes "
                                                   f"for {limit.grace_s:g} s)")

    async def shutdown(self) -> None:
        for session in list(self.sessions):
            session.close("server shutting down")


@mypyc_attr(allow_interpreted_subclasses=True)
class TcpService:
    """The service of a protocol that serves session listeners on TCP sockets the gateway bound:
    run accepts on each, stop refuses new clients and then ends every session."""

    def __init__(self, served: list[tuple[socket.socket, Listener]], output_limit: OutputLimit | None = None) -> None:
        self.served = served
        self.output_limit = output_limit or OutputLimit()
        for sock, listener in served:
            listener.address = _address(sock)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            for sock, listener in self.served:
                await nursery.start(serve_tcp, listener.handle_connection, sock)
                nursery.start_soon(listener.refusals.run)  # the summaries of repeated refusals
            if self.served and self.output_limit.max_bytes:
                nursery.start_soon(self._watch_output)
            task_status.started()

    async def _watch_output(self) -> None:
        interval = min(WATCH_INTERVAL_S, self.output_limit.grace_s / 4 or WATCH_INTERVAL_S)
        while True:
            await trio.sleep(interval)
            now = trio.current_time()
            for _, listener in self.served:
                listener.watch_output(self.output_limit, now)

    async def stop(self) -> None:
        for sock, _ in self.served:
            stop_listening(sock)
        for _, listener in self.served:
            await listener.shutdown()

    def connections(self) -> int:
        return sum(len(listener.sessions) for _, listener in self.served)

    def peers(self) -> list[tuple[str, str]]:
        """(the listener's address, the client's) for each client connected now."""
        found = []
        for _, listener in self.served:
            found += sorted((listener.address, session.peer) for session in listener.sessions)
        return found

    def traffic(self) -> Traffic:
        total = Traffic()
        for _, listener in self.served:
            total.add(listener.traffic)
        return total


def error_label(code: str) -> str:
    """The code of a refusal or a slow client's disconnection as counted: its protocol's code without the
    words that say why (MQKS's `error (too many connections)` is an `error`)."""
    return code.split(" (", 1)[0]


def _address(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
