"""The skeleton every TCP protocol session shares: read loop, output buffer, store barrier, drain, close.

One session per connection, two tasks. The reader hands everything a read returned to the
protocol (`handle`), which works synchronously (engine calls never await) and queues its answers
with `send`; while it does, the store holds its commits (`Storage.hold_work`) and writes what
the read changed when it is done, then the reader flushes the answers itself when the writer is
idle (one task switch less per request/response round trip). The writer task sends output that
arrives outside a read (deliveries caused by other connections, timers) as one write.

The store barrier: a delivery of a durable queue that waits for an acknowledgement leaves only
once the record of its attempts is written (`delivered_unstored`), so a process crash never
brings it back with fewer attempts than a client saw. Output is bounded: past
`MAX_PENDING_OUTPUT` the reader stops reading until a slow client has taken it.
"""

from __future__ import annotations

import logging

import trio

from polymq.adapters.transport import SocketTransport, Transport
from polymq.core.engine import Engine

# How much one read asks the socket for: large enough for a batch of requests in a few reads,
# small enough to keep one client from monopolising the loop.
READ_SIZE = 256 * 1024
# The reader stops reading while this much output waits for a slow client (bounded memory).
MAX_PENDING_OUTPUT = 8 * 1024 * 1024
# At the end, output still queued gets this long to go out.
DRAIN_TIMEOUT_S = 1.0


class StreamSession:
    """Subclasses implement `handle` (a read's bytes, synchronously) and `closed` (cleanup)."""

    log = logging.getLogger("polymq.session")

    def __init__(self, engine: Engine, transport: Transport) -> None:
        self.engine = engine
        self.transport = transport
        self.peer = transport.peer
        self.out: list[bytes] = []
        self._out_bytes = 0
        self._wake = trio.Event()
        self._drained = trio.Event()
        self._sending = False  # a task is inside `_flush`
        self._reading = False  # output queued while handling a read is flushed when it is done
        self._closed = False
        self._stopping: str | None = None  # why the session ends after its output is sent
        self._delivered_unstored = False
        self._cancel_scope: trio.CancelScope | None = None

    # -- what a protocol provides --------------------------------------------------------------

    def handle(self, data: bytes) -> None:
        """Everything one read returned (b"" at the end of the stream), synchronously."""
        raise NotImplementedError

    def closed(self) -> None:
        """The connection is gone: give back what the session held (consumers, deliveries)."""

    def before_send(self) -> object:
        """Called before each write of queued output; what it returns goes to `after_send`."""
        return None

    def after_send(self, token: object) -> None:
        """That output was written (e.g. an auto-ack consumer's credit comes back now)."""

    # -- lifecycle -----------------------------------------------------------------------------

    async def run(self) -> None:
        try:
            async with trio.open_nursery() as nursery:
                self._cancel_scope = nursery.cancel_scope
                nursery.start_soon(self._write_loop)
                await self._read_loop()
                await self._drain_output()
                nursery.cancel_scope.cancel()
        except* (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as group:
            self.log.debug("%s: connection ended: %r", self.peer, group.exceptions)
        finally:
            self._closed = True
            self.closed()
            with trio.CancelScope(shield=True), trio.move_on_after(1):
                await self.transport.aclose()

    def close(self) -> None:
        """End the session now, from outside (shutdown, a deleted queue)."""
        if self._cancel_scope is not None:
            self._cancel_scope.cancel()

    def stop(self, reason: str) -> None:
        """End the session once the output queued so far is sent (a protocol error, say)."""
        if self._stopping is None:
            self._stopping = reason

    # -- reading -------------------------------------------------------------------------------

    async def _read_loop(self) -> None:
        storage = self.engine.storage
        while True:
            data = await self.transport.receive_some(READ_SIZE)
            self._reading = True
            # What this read changes is written at its end, by this task (`release_work`).
            storage.hold_work()
            try:
                self.handle(data)
            finally:
                storage.release_work()
                self._reading = False
            if not data or self._stopping is not None:
                return
            if self.out and not self._sending:
                await self._flush()  # answer from here: one task switch less per round trip
            if self._out_bytes > MAX_PENDING_OUTPUT:
                self._drained = trio.Event()
                self._wake.set()
                await self._drained.wait()

    # -- writing -------------------------------------------------------------------------------

    def send(self, chunk: bytes) -> None:
        self.out.append(chunk)
        self._out_bytes += len(chunk)
        if not self._reading and not self._wake.is_set():
            self._wake.set()

    def send_delivery(self, chunk: bytes, *, unstored: bool) -> None:
        """`send` for a delivery; with `unstored` it leaves only once its attempt record is written."""
        self.out.append(chunk)
        self._out_bytes += len(chunk)
        if unstored:
            self._delivered_unstored = True
        if not self._reading and not self._wake.is_set():
            self._wake.set()

    async def _write_loop(self) -> None:
        while True:
            if self.out and not self._sending:
                await self._flush()
                continue
            await self._wake.wait()
            self._wake = trio.Event()

    async def _flush(self) -> None:
        self._sending = True
        try:
            while self.out:
                token = self.before_send()
                if self._delivered_unstored:
                    self._delivered_unstored = False
                    self.engine.storage.write_now()
                chunks = self.out
                self.out = []
                data = b"".join(chunks)
                self._out_bytes -= len(data)
                await self.transport.send_all(data)
                self.after_send(token)
        finally:
            self._sending = False
        self._drained.set()

    async def _drain_output(self) -> None:
        with trio.move_on_after(DRAIN_TIMEOUT_S):
            while self._sending:
                self._drained = trio.Event()
                await self._drained.wait()
            if self.out:
                await self._flush()


class Listener:
    """The sessions of one listener: runs each, forgets it when it ends, closes them all at shutdown."""

    log = logging.getLogger("polymq.session")

    def __init__(self) -> None:
        self.sessions: set[StreamSession] = set()

    def new_session(self, transport: Transport) -> StreamSession:
        raise NotImplementedError

    async def handle_connection(self, transport: SocketTransport) -> None:
        session = self.new_session(transport)
        self.sessions.add(session)
        try:
            await session.run()
        except Exception:
            # A bug in one session must not end the accept loop, i.e. the whole gateway.
            self.log.exception("%s: session failed", transport.peer)
        finally:
            self.sessions.discard(session)

    async def shutdown(self) -> None:
        for session in list(self.sessions):
            session.close()

