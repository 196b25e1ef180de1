"""An MQKS client on trio, with the reconnect behaviour of the original client library.

The original (`denis-ryzhkov/mqks:client/mqks.py`, docs/protocols/mqks.md) is a module of gevent
greenlets; this is the same protocol behaviour as one object per connection:

- every id (message, consumer, request) is a 24-character time + random string;
- a keep-alive `{id} ping mqks.client` every 15 s;
- after a lost connection: wait 1 s, reconnect, re-send `consume` for every consumer under a
  NEW consumer id with the consume line of its latest `--update`, and call
  `on_reconnect(old_id, new_id)`; requests queued meanwhile are sent after those consumes;
- `error` responses are logged, except where a caller waits for the answer (`_eval`, and any
  request sent with `confirm=True`), which raises `MQKSError`.

Differences, all on the side of safety: a connection whose keep-alive ping is still unanswered
when the next one is due is closed and reconnected (the original only noticed a dead peer when a
write failed); a caller waiting on a request that went out on a connection that was then lost
gets `MQKSConnectionLost` instead of waiting forever; bodies are bytes, encoded with the
gateway's reversible `polymq:base64:` encoding when a line cannot carry them verbatim.

Usage::

    async with MQKSClient("127.0.0.1", 25000) as client:
        consumer_id = await client.consume("q1", ["e1"], on_msg=handle, confirm=True)
        await client.publish("e1", b"hello")

All writes go through one writer task: the requests queued during one scheduler turn leave in
one `send`. `connect()`/`aclose()` (or `async with`) must run in the same task, as for any trio
nursery: the client's background tasks live in a nursery it opens in `connect()`.
"""

from __future__ import annotations

import contextlib
import datetime
import inspect
import logging
import random
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import attrs
import trio

from polymq.codecs import mqks_client as codec
from polymq.codecs.mqks import ALL_FLAG, MANUAL_ACK_FLAG, WHEN_UNUSED_FLAG, error_id

log = logging.getLogger("polymq.mqks_client")

# The original's `config.ping_seconds`, `config.reconnect_seconds` and the data of its
# keep-alive ping (`config.logger_name`), client/mqks.py.
DEFAULT_PING_INTERVAL_S = 15.0
DEFAULT_RECONNECT_DELAY_S = 1.0
KEEPALIVE_DATA = "mqks.client"
# The original's worker port for a one-worker deployment (docs/protocols/mqks.md).
DEFAULT_PORT = 25000
# Bytes per recv(): a burst of deliveries is split with one `bytes.split` per read.
RECV_BYTES = 256 * 1024
# publish() without confirm waits for the writer once this much is queued, so a publishing
# loop cannot grow the outbox without end while the connection is slow or down.
OUTBOX_HIGH_WATER = 1024 * 1024
# How long aclose() tries to flush requests still queued (publish_nowait then aclose).
CLOSE_FLUSH_TIMEOUT_S = 1.0

Callback = Callable[..., Any]


class MQKSError(Exception):
    """The server answered `{request_id} error {error_id}` (details are in the server's log)."""

    def __init__(self, request_id: str, error_id: str) -> None:
        super().__init__(f"{request_id} error {error_id}")
        self.request_id = request_id
        self.error_id = error_id


class MQKSConnectionLost(ConnectionError):
    """The request went out on a connection that was lost (or the client closed) before the answer."""


_rng = random.Random()


def new_id() -> str:
    """A 24-character id of the original's shape: UTC `%Y%m%d%H%M%S%f` + 4 base62 characters."""
    return error_id(datetime.datetime.now(datetime.UTC), _rng)


def _check_name(kind: str, name: str) -> str:
    # Names are space-separated tokens on a line (mqks.txt: no space, tab or newline in ids).
    if not name or any(ch.isspace() for ch in name) or name.startswith("--"):
        raise ValueError(f"bad {kind} name {name!r}")
    return name


def consume_line(queue: str, events: Iterable[str] = (), add: Iterable[str] = (),
                 delete_queue_when_unused: bool | float | None = None, manual_ack: bool = False) -> str:
    """The data of a `consume` request: `{queue}[ ev…][ --add ev…][ --delete-queue-when-unused[=s]][ --manual-ack]`."""
    parts = [_check_name("queue", queue)]
    parts += (_check_name("event", event) for event in events)
    added = [_check_name("event", event) for event in add]
    if added:
        parts += ["--add", *added]
    if delete_queue_when_unused is True:
        parts.append(WHEN_UNUSED_FLAG)
    elif delete_queue_when_unused is not None and delete_queue_when_unused is not False:
        parts.append(f"{WHEN_UNUSED_FLAG}={delete_queue_when_unused}")
    if manual_ack:
        parts.append(MANUAL_ACK_FLAG)
    return " ".join(parts)


@attrs.define(slots=True, eq=False)
class Message:
    """One delivery. `ack()`/`reject()` queue the request and return at once (callable from a sync on_msg)."""

    consumer_id: str
    id: str
    event: str
    retry: int
    body: bytes
    props: dict[str, str]
    client: MQKSClient = attrs.field(repr=False)

    def ack(self) -> None:
        self.client.ack_nowait(self.consumer_id, self.id)

    def reject(self) -> None:
        self.client.reject_nowait(self.consumer_id, self.id)


@attrs.define(slots=True, eq=False)
class _Waiter:
    """A caller waiting for the answer to one request."""

    seq: int  # position of its request in the send order (see MQKSClient._sent_seq)
    event: trio.Event = attrs.field(factory=trio.Event)
    data: bytes = b""
    error: BaseException | None = None

    def resolve(self, data: bytes) -> None:
        self.data = data
        self.event.set()

    def fail(self, error: BaseException) -> None:
        self.error = error
        self.event.set()


@attrs.define(slots=True, eq=False)
class _Consumer:
    id: str
    line: str  # the consume data (no --confirm); replaced by each `--update`
    on_msg: Callback
    on_reconnect: Callback | None
    on_disconnect: Callback | None
    seq: int  # send order of its consume request; above _sent_seq = not sent yet
    confirm: _Waiter | None = None  # consume(confirm=True) still waiting; follows the consumer across reconnects


class MQKSClient:
    """One MQKS connection with auto-reconnect. Use as `async with MQKSClient(host, port) as client`."""

    def __init__(self, host: str = "127.0.0.1", port: int = DEFAULT_PORT, *,
                 reconnect_delay_s: float = DEFAULT_RECONNECT_DELAY_S,
                 ping_interval_s: float | None = DEFAULT_PING_INTERVAL_S,
                 on_reconnect: Callback | None = None) -> None:
        self.host = host
        self.port = port
        self.reconnect_delay_s = reconnect_delay_s
        self.ping_interval_s = ping_interval_s
        self.on_reconnect = on_reconnect  # called (old_id, new_id) for every re-created consumer
        self.connections = 0  # successful connects so far (1 after connect(), +1 per reconnect)
        self._transport: trio.SocketStream | None = None
        self._connected = trio.Event()
        self._stack: contextlib.AsyncExitStack | None = None
        self._nursery: trio.Nursery | None = None
        self._closed = False
        self._consumers: dict[str, _Consumer] = {}
        self._waiters: dict[str, _Waiter] = {}
        self._outbox: list[bytes] = []
        self._outbox_bytes = 0
        self._seq = 0  # requests queued so far
        self._sent_seq = 0  # requests handed to a transport so far
        self._wake_writer = trio.Event()
        self._flushed = trio.Event()
        self._writing = False  # the writer is inside send_all
        self._write_broken = False  # a write stopped half-way on the current connection
        self._keepalive_id: str | None = None

    # --- life cycle ---------------------------------------------------------------------

    async def __aenter__(self) -> MQKSClient:
        await self.connect()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def connect(self) -> None:
        """Connect (an error here is raised, later losses reconnect) and start the background tasks."""
        if self._stack is not None:
            raise RuntimeError("already connected")
        transport = await self._open()
        stack = contextlib.AsyncExitStack()
        try:
            self._nursery = await stack.enter_async_context(trio.open_nursery())
        except BaseException:
            await transport.aclose()
            raise
        self._stack = stack
        self._set_transport(transport)
        self._nursery.start_soon(self._connection_loop, transport)
        self._nursery.start_soon(self._writer)
        if self.ping_interval_s:
            self._nursery.start_soon(self._keepalive, self.ping_interval_s)

    async def aclose(self) -> None:
        """Flush what is queued (briefly), close, fail pending waiters, call on_disconnect callbacks."""
        if self._closed:
            return
        # Shielded: `async with` calls this also when the body was cancelled (the writer with
        # it), and every step below must run for the nursery to be exited.
        with trio.move_on_after(CLOSE_FLUSH_TIMEOUT_S, shield=True):
            await self._flush_for_close()
        self._closed = True
        transport = self._transport
        self._lost(MQKSConnectionLost("client closed"), include_consumers=True)
        self._flushed.set()  # publishers waiting for room see the close
        if self._nursery is not None:
            self._nursery.cancel_scope.cancel()
        if self._stack is not None:
            # Nothing may await between the cancel and here: this task runs inside the nursery's
            # cancelled scope until it exits. Exit it without the body's exception: handed in, it
            # would come back wrapped in an ExceptionGroup; it propagates from `async with` anyway.
            await self._stack.aclose()
        self._transport = None
        if transport is not None:
            await transport.aclose()

    @property
    def connected(self) -> bool:
        return self._transport is not None

    async def wait_connected(self) -> None:
        await self._connected.wait()

    @property
    def consumers(self) -> dict[str, str]:
        """Current consumer id → the consume line re-sent on reconnect (tracks `--update`)."""
        return {cid: consumer.line for cid, consumer in self._consumers.items()}

    # --- requests -----------------------------------------------------------------------

    async def publish(self, event: str, data: bytes, *, confirm: bool = False) -> str:
        """Publish; returns the message id. Without confirm this only queues (and waits while
        more than OUTBOX_HIGH_WATER bytes are queued)."""
        msg_id = new_id()
        line = codec.request(msg_id, "publish", _check_name("event", event).encode() + b" "
                             + codec.publish_data(data), confirm=confirm)
        if confirm:
            await self._call(msg_id, line)
        else:
            self._queue(line)
            await trio.lowlevel.checkpoint_if_cancelled()
            while self._outbox_bytes > OUTBOX_HIGH_WATER and not self._closed:
                await self._flushed.wait()
        return msg_id

    def publish_nowait(self, event: str, data: bytes) -> str:
        msg_id = new_id()
        self._queue(codec.request(msg_id, "publish", _check_name("event", event).encode() + b" "
                                  + codec.publish_data(data)))
        return msg_id

    async def consume(self, queue: str, events: Iterable[str] = (), *, on_msg: Callback, add: Iterable[str] = (),
                      delete_queue_when_unused: bool | float | None = None, manual_ack: bool = False,
                      confirm: bool = False, on_reconnect: Callback | None = None,
                      on_disconnect: Callback | None = None) -> str:
        """Start a consumer; returns its id (with confirm: the id under which it was confirmed,
        which is a new one if the connection was lost on the way).

        `events` replace the queue's bindings (none given: keep them), `add` adds to them.
        `on_msg(Message)` may be sync or async; `on_reconnect(old_id, new_id)` and
        `on_disconnect()` as in the original.
        """
        line = consume_line(queue, events, add, delete_queue_when_unused, manual_ack)
        consumer_id = new_id()
        consumer = _Consumer(consumer_id, line, on_msg, on_reconnect, on_disconnect, seq=0)
        self._consumers[consumer_id] = consumer
        if not confirm:
            consumer.seq = self._queue(codec.request(consumer_id, "consume", line))
            return consumer_id
        consumer.confirm = waiter = _Waiter(seq=0)
        consumer.seq = waiter.seq = self._queue(codec.request(consumer_id, "consume", line, confirm=True))
        try:
            await waiter.event.wait()
        finally:
            consumer.confirm = None
        if waiter.error is not None:
            if isinstance(waiter.error, MQKSError):  # refused: nothing to re-create on reconnect
                self._consumers.pop(consumer.id, None)
            raise waiter.error
        return consumer.id

    async def rebind(self, queue: str, replace: Iterable[str] = (), remove: Iterable[str] = (),
                     remove_mask: Iterable[str] = (), add: Iterable[str] = (), *, confirm: bool = False) -> None:
        """Change a queue's bindings; the server applies replace, remove, remove-mask, add in that order."""
        parts = [_check_name("queue", queue), *(_check_name("event", e) for e in replace)]
        for flag, names in (("--remove", remove), ("--remove-mask", remove_mask), ("--add", add)):
            names = [_check_name("event", name) for name in names]
            if names:
                parts += [flag, *names]
        if len(parts) == 1:
            raise ValueError("rebind needs at least one event to replace, remove or add")
        await self._request("rebind", " ".join(parts), confirm)

    async def ack(self, consumer_id: str, msg_id: str | None, *, confirm: bool = False) -> None:
        """Ack one message, or all of the consumer's (`msg_id=None`: `--all`).

        Like the original, nothing is sent for a consumer this client does not know (deleted,
        or replaced on reconnect: the server requeued its messages already); note that the
        server never answers a confirm for a consumer it does not know.
        """
        if consumer_id in self._consumers:
            await self._request("ack", f"{consumer_id} {msg_id or ALL_FLAG}", confirm)

    async def reject(self, consumer_id: str, msg_id: str | None, *, confirm: bool = False) -> None:
        """Return one message (or all: `msg_id=None`) to the tail of its queue with retry+1."""
        if consumer_id in self._consumers:
            await self._request("reject", f"{consumer_id} {msg_id or ALL_FLAG}", confirm)

    def ack_nowait(self, consumer_id: str, msg_id: str | None) -> None:
        if consumer_id in self._consumers:
            self._queue(codec.request(new_id(), "ack", f"{consumer_id} {msg_id or ALL_FLAG}"))

    def reject_nowait(self, consumer_id: str, msg_id: str | None) -> None:
        if consumer_id in self._consumers:
            self._queue(codec.request(new_id(), "reject", f"{consumer_id} {msg_id or ALL_FLAG}"))

    async def delete_consumer(self, consumer_id: str, *, confirm: bool = False) -> None:
        """Stop a consumer (its unacked messages go back with retry+1); it is not re-created on reconnect."""
        if self._consumers.pop(consumer_id, None) is not None:
            await self._request("delete_consumer", consumer_id, confirm)

    async def delete_queue(self, queue: str, *, confirm: bool = False) -> None:
        await self._request("delete_queue", _check_name("queue", queue), confirm)

    async def ping(self, data: str | bytes = KEEPALIVE_DATA) -> bytes:
        """Round trip; returns the echoed data (the server strips trailing whitespace)."""
        raw = data.encode() if isinstance(data, str) else data
        if not raw.strip() or b"\n" in raw:
            raise ValueError("ping data must be non-empty and one line")
        request_id = new_id()
        return await self._call(request_id, codec.request(request_id, "ping", raw))

    async def eval(self, code: str, worker: int | None = None) -> str:
        """`_eval`: the server's answer as text; raises MQKSError on `error` (as the original does)."""
        if not code.strip() or "\n" in code:
            raise ValueError("code must be non-empty and one line")
        request_id = new_id()
        data = code if worker is None else f"--worker={worker} {code}"
        return (await self._call(request_id, codec.request(request_id, "_eval", data))).decode(errors="replace")

    # --- sending ------------------------------------------------------------------------

    def _queue(self, line: bytes) -> int:
        if self._closed:
            raise trio.ClosedResourceError("MQKS client is closed")
        self._outbox.append(line)
        self._outbox_bytes += len(line)
        self._seq += 1
        self._wake_writer.set()
        return self._seq

    async def _request(self, action: str, data: str, confirm: bool) -> None:
        request_id = new_id()
        line = codec.request(request_id, action, data, confirm=confirm)
        if confirm:
            await self._call(request_id, line)
        else:
            self._queue(line)
            await trio.lowlevel.checkpoint_if_cancelled()

    async def _call(self, request_id: str, line: bytes) -> bytes:
        """Queue a request and wait for its one answer (`ok` data, or MQKSError)."""
        waiter = _Waiter(seq=0)
        self._waiters[request_id] = waiter
        try:
            waiter.seq = self._queue(line)
            await waiter.event.wait()
        finally:
            self._waiters.pop(request_id, None)
        if waiter.error is not None:
            raise waiter.error
        return waiter.data

    async def _flush_for_close(self) -> None:
        while self._writing:  # a write in progress goes first: lines must not interleave
            await self._flushed.wait()
        transport = self._transport
        if transport is not None and self._outbox and not self._write_broken:
            with contextlib.suppress(OSError, trio.ClosedResourceError, trio.BrokenResourceError):
                await transport.send_all(self._take_outbox())

    def _take_outbox(self) -> bytes:
        data = b"".join(self._outbox)
        self._outbox.clear()
        self._outbox_bytes = 0
        self._sent_seq = self._seq
        return data

    async def _writer(self) -> None:
        while True:
            await self._wake_writer.wait()
            self._wake_writer = trio.Event()
            transport = self._transport
            if transport is None or not self._outbox:
                continue  # woken again on reconnect
            data = self._take_outbox()
            self._writing = True
            written = False
            try:
                await transport.send_all(data)
                written = True
            except (OSError, trio.ClosedResourceError, trio.BrokenResourceError) as exc:
                # What was in this write is lost with the connection, as in the original; the
                # reader sees the close and reconnects.
                log.warning("%s:%s: write failed: %r", self.host, self.port, exc)
                await transport.aclose()
            finally:
                self._writing = False
                # Cancelled half-way: part of a line may be out; nothing more may follow it.
                self._write_broken = not written
                flushed, self._flushed = self._flushed, trio.Event()
                flushed.set()

    async def _keepalive(self, interval: float) -> None:
        while True:
            await trio.sleep(interval)
            transport = self._transport
            if transport is None:
                continue
            if self._keepalive_id is not None:
                # No pong for a whole interval: the connection is dead or the server is stuck.
                log.warning("%s:%s: no answer to keep-alive ping, reconnecting", self.host, self.port)
                self._keepalive_id = None
                await transport.aclose()
                continue
            self._keepalive_id = new_id()
            self._queue(codec.request(self._keepalive_id, "ping", KEEPALIVE_DATA))

    # --- connection ---------------------------------------------------------------------

    async def _open(self) -> trio.SocketStream:
        return await trio.open_tcp_stream(self.host, self.port)

    def _set_transport(self, transport: trio.SocketStream) -> None:
        self._transport = transport
        self._write_broken = False
        self.connections += 1
        self._keepalive_id = None
        self._connected.set()
        self._wake_writer.set()

    async def _connection_loop(self, transport: trio.SocketStream) -> None:
        while True:
            try:
                await self._read(transport)
                log.info("%s:%s: server closed the connection", self.host, self.port)
            except (OSError, trio.ClosedResourceError, trio.BrokenResourceError, codec.ResponseError) as exc:
                log.info("%s:%s: connection lost: %r", self.host, self.port, exc)
            self._transport = None
            self._connected = trio.Event()
            await transport.aclose()
            self._lost(MQKSConnectionLost("connection lost before the answer"), include_consumers=False)
            transport = await self._reconnect()
            self._reconsume()
            self._set_transport(transport)

    async def _reconnect(self) -> trio.SocketStream:
        while True:
            await trio.sleep(self.reconnect_delay_s)
            try:
                transport = await self._open()
            except OSError as exc:
                log.info("%s:%s: reconnect failed: %s", self.host, self.port, exc)
                continue
            log.info("%s:%s: reconnected", self.host, self.port)
            return transport

    def _lost(self, error: BaseException, *, include_consumers: bool) -> None:
        """The connection went away: fail waiters whose request was sent on it; on_disconnect callbacks."""
        for waiter in list(self._waiters.values()):
            if include_consumers or waiter.seq <= self._sent_seq:
                waiter.fail(error)
        for consumer in list(self._consumers.values()):
            if include_consumers and consumer.confirm is not None:
                consumer.confirm.fail(error)
            if consumer.on_disconnect is not None:
                self._call_back(consumer.on_disconnect)

    def _reconsume(self) -> None:
        """Re-create every consumer under a new id, ahead of the requests queued meanwhile."""
        lines: list[bytes] = []
        renamed: list[tuple[_Consumer, str, str]] = []
        for old_id, consumer in list(self._consumers.items()):
            if consumer.seq > self._sent_seq:
                continue  # its consume never went out: it goes now, as queued, under its own id
            new = new_id()
            del self._consumers[old_id]
            consumer.id = new
            self._consumers[new] = consumer
            # Before the queued requests: a rebind queued during the outage must come after
            # the consume that re-binds the queue, or the consume would undo it.
            lines.append(codec.request(new, "consume", consumer.line, confirm=consumer.confirm is not None))
            renamed.append((consumer, old_id, new))
        if lines:
            self._outbox[:0] = lines
            self._outbox_bytes += sum(map(len, lines))
        for consumer, old_id, new in renamed:
            for callback in (consumer.on_reconnect, self.on_reconnect):
                if callback is not None:
                    self._call_back(callback, old_id, new)

    async def _read(self, transport: trio.SocketStream) -> None:
        reader = codec.LineReader()
        dispatch = self._dispatch
        while True:
            data = await transport.receive_some(RECV_BYTES)
            if not data:
                return
            for line in reader.feed(data):
                dispatch(line)

    def _dispatch(self, line: bytes) -> None:
        try:
            response = codec.parse_response(line)
        except codec.ResponseError:
            log.warning("%s:%s: unparsable response %r", self.host, self.port, line[:200])
            return
        request_id, data = response.request_id, response.data
        consumer = self._consumers.get(request_id)
        if not response.ok:
            error = MQKSError(request_id, data.decode(errors="replace"))
            waiter = self._waiters.get(request_id)
            if consumer is not None:
                waiter, consumer.confirm = consumer.confirm, None
            if waiter is not None:
                waiter.fail(error)
            else:  # the original only logs these (crit)
                log.error("%s:%s: %s", self.host, self.port, error)
            return
        if consumer is not None:
            if not data:
                if consumer.confirm is not None:
                    consumer.confirm.resolve(data)
                    consumer.confirm = None
            elif codec.is_update(data):
                consumer.line = codec.parse_update(data).line
            else:
                self._deliver(consumer, data)
            return
        waiter = self._waiters.get(request_id)
        if waiter is not None:
            waiter.resolve(data)
        elif request_id == self._keepalive_id:
            self._keepalive_id = None
        else:
            # Deliveries still in flight for a deleted or replaced consumer, late pongs, …
            log.debug("%s:%s: response to no one: %r", self.host, self.port, line[:200])

    def _deliver(self, consumer: _Consumer, data: bytes) -> None:
        try:
            delivery = codec.parse_delivery(data)
        except (codec.ResponseError, ValueError):
            log.warning("%s:%s: unparsable delivery %r", self.host, self.port, data[:200])
            return
        message = Message(consumer.id, delivery.msg_id, delivery.event, delivery.retry, delivery.body,
                          delivery.props, self)
        self._call_back(consumer.on_msg, message)

    def _call_back(self, callback: Callback, *args: Any) -> None:
        """Run a user callback: a sync one inline, an async one as a task; an exception is logged."""
        try:
            result = callback(*args)
        except Exception:
            log.exception("MQKS client callback %r failed", callback)
            return
        if inspect.isawaitable(result) and self._nursery is not None:
            self._nursery.start_soon(self._await_callback, result, callback)

    @staticmethod
    async def _await_callback(awaitable: Awaitable[Any], callback: Callback) -> None:
        try:
            await awaitable
        except Exception:
            log.exception("MQKS client callback %r failed", callback)
