"""A NATS client on trio: one connection to one server of a list, kept up as NATS clients keep theirs.

polymq is a trio program and nats-py is asyncio-only, so this is our own small client: the sans-IO codec
`polymq.codecs.nats` and a few trio tasks around one TCP (or TLS) stream, nothing crossing a thread.

- Output is batched: `publish`, `subscribe` and the rest only append to an output buffer, and the writer
  task sends everything buffered in one `send_all`. Input too: the reader takes up to RECV_BYTES per
  read, parses every event in it at once and dispatches them synchronously, in order (a subscription's
  callback runs in the reader task, once per message).
- Requests share one wildcard inbox subscription, `_INBOX.<random>.*`, a token per request; one task
  serves every request's timeout from a heap.
- A lost link (EOF, an error, a fatal `-ERR`, or silence: nothing at all from the server, not even the
  PONG of any of `max_pings_out` PINGs sent `ping_interval` apart — a link stalled without a FIN, a
  paused server — so silence is noticed within STALE_LINK_S) calls
  `on_disconnected`, fails the pending requests with ConnectionLost and tries the servers again, round
  robin: the configured ones, then those the servers announced in INFO's `connect_urls`, with
  `reconnect_wait` between full rounds. Once one answers: CONNECT, every subscription again under its
  sid, then what was buffered meanwhile (up to RECONNECT_BUF_SIZE), then `on_reconnected`.

Authentication by user and password or by token (in NatsOptions, or `user:pass@` / `token@` in a URL),
and TLS (a `tls://` URL, `NatsOptions.tls`, or a server whose INFO says `tls_required`) are supported.

Usage::

    async with trio.open_nursery() as nursery:
        connection = await NatsConnection.connect(NatsOptions(servers=["nats://127.0.0.1:4222"]), nursery)
        connection.subscribe("orders.>", handle)
        connection.publish("orders.new", b"...")
        reply = await connection.request("$JS.API.INFO", b"")
        await connection.close()
"""

from __future__ import annotations

import heapq
import itertools
import logging
import math
import secrets
import ssl
import urllib.parse
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any

import attrs
import trio

from polymq import __version__
from polymq.codecs import nats as codec
from polymq.codecs.nats import Msg

__all__ = ["ConnectionLost", "Msg", "NatsConnection", "NatsError", "NatsOptions", "NoResponders", "NoServers",
           "RequestTimeout"]

log = logging.getLogger("polymq.jetstream")

DEFAULT_PORT = 4222
LANG = "python-trio-polymq"
PROTOCOL = 1  # the dynamic-reconfiguration protocol: the server sends INFO updates with connect_urls
# Bytes per read: a burst of messages is parsed in one go.
RECV_BYTES = 256 * 1024
# What publish may buffer while no server is connected: nats.go's default ReconnectBufSize (8 MiB).
RECONNECT_BUF_SIZE = 8 * 1024 * 1024
# What publish may buffer while connected, for a writer slower than its publishers: nats-server's
# default max_pending (64 MiB), past which a server cuts off a client reading that slowly.
MAX_OUTPUT_BYTES = 64 * 1024 * 1024
# How long close() tries to get what is buffered to the server.
CLOSE_FLUSH_TIMEOUT_S = 5.0
INBOX_PREFIX = "_INBOX."
NO_RESPONDERS = 503  # the status of a request's reply when nothing subscribes to its subject
# -ERR texts after which nats-server keeps the connection (it reports them and goes on); any other
# -ERR is followed by the server closing it.
_NON_FATAL_ERRORS = ("permissions violation", "invalid subject", "invalid publish subject",
                     "maximum subscriptions exceeded")

_LINK_ERRORS = (OSError, trio.BrokenResourceError, trio.ClosedResourceError)


class NatsError(Exception):
    """Base of this client's errors."""


class NoServers(NatsError):
    """None of the servers answered; the message names every address tried and why."""


class ConnectionLost(NatsError):
    """The link dropped (or the connection was closed) before the answer came."""


class RequestTimeout(NatsError):
    """No answer within the request's timeout."""


class NoResponders(NatsError):
    """Nothing subscribes to the request's subject (the server answered with status 503)."""


# A link the server sends nothing on (no message, no PONG) for this long is left and another server tried:
# the pinger's check comes every PING_INTERVAL_S, and the link goes at the check after MAX_PINGS_OUT PINGs
# sent in silence (nats.go's 2 PINGs out, at a far shorter interval than its 2 minutes, so that a stalled
# link costs seconds; a busy link carries data, which counts as an answer).
PING_INTERVAL_S = 2.0
MAX_PINGS_OUT = 2
STALE_LINK_S = PING_INTERVAL_S * (MAX_PINGS_OUT + 1)


@attrs.define(slots=True)
class NatsOptions:
    """How to reach the servers: URLs `nats://host:port`, `tls://host:port` or `host:port`, with
    `user:pass@` or `token@` allowed; user/password/token and TLS are supported (no creds or nkeys)."""

    servers: list[str]
    name: str = "polymq"
    user: str | None = None
    password: str | None = None
    token: str | None = None
    tls: ssl.SSLContext | None = None  # TLS to every server; also used for tls:// URLs and tls_required
    connect_timeout: float = 2.0  # per server: TCP, INFO, TLS, CONNECT and its PONG
    ping_interval: float = PING_INTERVAL_S
    max_pings_out: int = MAX_PINGS_OUT  # PINGs sent in silence after which the link counts as lost
    reconnect_wait: float = 0.5  # between two full rounds over the servers
    max_reconnect_attempts: int = -1  # full rounds before giving up; -1: never give up
    request_timeout: float = 5.0  # request() and flush() without a timeout of their own
    # Take the servers an INFO announces (`connect_urls`) as more to reconnect to, as NATS clients do by
    # default; False keeps to the configured ones (nats.go's IgnoreDiscoveredServers).
    discover: bool = True


@attrs.frozen(slots=True)
class _Server:
    host: str
    port: int
    tls: bool = False  # a tls:// URL
    user: str | None = None
    password: str | None = None
    token: str | None = None
    implicit: bool = False  # learned from a server's connect_urls

    @property
    def address(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    @property
    def url(self) -> str:
        """Without credentials: for logs and `connected_url`."""
        return f"{'tls' if self.tls else 'nats'}://{self.address}"


def _parse_server_url(url: str, *, implicit: bool = False) -> _Server:
    """A server of `nats://[user:pass@]host[:port]`, `tls://…` or `host[:port]`."""
    parts = urllib.parse.urlsplit(url if "://" in url else f"nats://{url}")
    if parts.scheme not in ("nats", "tls"):
        raise ValueError(f"bad NATS server URL {url!r}: the scheme must be nats:// or tls://")
    try:
        port = parts.port or DEFAULT_PORT
    except ValueError as error:
        raise ValueError(f"bad NATS server URL {url!r}: {error}") from None
    if not parts.hostname:
        raise ValueError(f"bad NATS server URL {url!r}: no host")
    user = urllib.parse.unquote(parts.username) if parts.username else None
    password = urllib.parse.unquote(parts.password) if parts.password is not None else None
    token = None
    if user is not None and password is None:  # nats://token@host
        user, token = None, user
    return _Server(parts.hostname, port, parts.scheme == "tls", user, password, token, implicit)


def _describe(error: BaseException) -> str:
    """Why a connection attempt failed, in words: trio's `all attempts to connect … failed` hides the
    reasons in its cause, an exception group of one error per address tried, and its BrokenResourceError
    of a failed TLS handshake the SSLError."""
    cause = error.__cause__
    if isinstance(cause, BaseExceptionGroup):
        return "; ".join(dict.fromkeys(_describe(inner) for inner in cause.exceptions))
    if isinstance(error, OSError) and error.strerror:
        return error.strerror
    if cause is not None:
        return _describe(cause)
    return repr(error)


@attrs.define(slots=True, eq=False)
class _Subscription:
    subject: str
    queue: str | None
    callback: Callable[[Msg], None]


@attrs.define(slots=True, eq=False)
class _Request:
    subject: str
    callback: Callable[[Msg | NatsError], None]


@attrs.define(slots=True, eq=False)
class _PongWaiter:
    """A flush() waiting for the PONG of its PING."""

    event: trio.Event = attrs.field(factory=trio.Event)
    error: NatsError | None = None
    then: Callable[[], None] | None = None  # called at the PONG, or once the link is lost

    def done(self) -> None:
        self.event.set()
        if self.then is not None:
            self.then()

    def fail(self, error: NatsError) -> None:
        self.error = error
        self.done()


@attrs.define(slots=True, eq=False)
class _Link:
    """One established connection to one server."""

    server: _Server
    stream: trio.abc.Stream  # the TLS stream over `socket`, or `socket` itself
    socket: trio.SocketStream
    parser: codec.ClientConnection
    info: dict[str, Any]
    leftover: list[codec.Event]  # events that came with the handshake's PONG
    kill_reason: str | None = None


class _AttemptFailed(Exception):
    """One server did not take the connection; the text says why."""


class NatsConnection:
    """One NATS connection with its reconnection; made by `await NatsConnection.connect(options, nursery)`."""

    def __init__(self, options: NatsOptions, *, on_disconnected: Callable[[], None] | None = None,
                 on_reconnected: Callable[[], None] | None = None) -> None:
        if not options.servers:
            raise ValueError("NatsOptions.servers is empty")
        self.options = options
        self.connected_url: str | None = None  # the server it talks to now; None while disconnected
        self.server_info: dict[str, Any] = {}  # the last INFO
        self._info_came = trio.Event()  # set by the next INFO (`next_info`)
        self.server_pings = 0  # PINGs the servers sent, all answered
        self._on_disconnected = on_disconnected
        self._on_reconnected = on_reconnected
        self._servers = [_parse_server_url(url) for url in options.servers]
        self._tls_name = self._servers[0].host  # what implicit servers' certificates are checked against
        self._link: _Link | None = None
        self._connected = trio.Event()  # set while a link is up (and once closed, to wake waiters)
        self._closed = False
        self._close_reason = "the connection was closed"
        self._done = trio.Event()
        self._tasks: trio.Nursery | None = None
        self._max_payload = codec.DEFAULT_MAX_PAYLOAD
        # Output: chunks to send in one write; PINGs among them, whose PONGs come on the next link if any.
        self._out: list[bytes] = []
        self._out_bytes = 0
        self._pings_in_out = 0
        self._wake_writer = trio.Event()
        self._pongs: deque[_PongWaiter | None] = deque()  # one per PING on the link, in order
        self._late: dict[int, Callable[[Msg], None]] = {}  # unsubscribed, still taking what was on its way
        self._pings_out = 0  # the pinger's PINGs since the server last sent anything
        self._subs: dict[int, _Subscription] = {}
        self._sids = itertools.count(1)
        self._inbox_prefix: str | None = None  # `_INBOX.<random>.`, subscribed at the first request
        self._requests: dict[str, _Request] = {}
        self._tokens = itertools.count(1)
        self._deadlines: list[tuple[float, str]] = []  # heap of (deadline, token); answered ones dropped lazily
        self._wake_timer = trio.Event()

    # --- life cycle -------------------------------------------------------------------------------------

    @classmethod
    async def connect(cls, options: NatsOptions, nursery: trio.Nursery, *,
                      on_disconnected: Callable[[], None] | None = None,
                      on_reconnected: Callable[[], None] | None = None) -> NatsConnection:
        """Connect to the first server that answers (NoServers if none does) and start the connection's
        tasks in `nursery`; returns once the server answered the first PING."""
        self = cls(options, on_disconnected=on_disconnected, on_reconnected=on_reconnected)
        link = await self._first_link()
        await nursery.start(self._run, link)
        return self

    async def close(self) -> None:
        """Get what is buffered to the server (for up to CLOSE_FLUSH_TIMEOUT_S), close the socket, stop the
        tasks; pending requests and flushes get ConnectionLost."""
        if not self._closed:
            try:
                if self._link is not None:
                    await self.flush(CLOSE_FLUSH_TIMEOUT_S)
                elif self._out_bytes:
                    log.warning("close: %d bytes buffered while disconnected are dropped", self._out_bytes)
            except NatsError as error:
                log.info("close: what was buffered may not have reached the server: %s", error)
            finally:  # also when the caller is cancelled during the flush: the tasks stop all the same
                self._closed = True
                if self._tasks is not None:
                    self._tasks.cancel_scope.cancel()
        await self._done.wait()

    @property
    def is_connected(self) -> bool:
        return self._link is not None

    @property
    def is_closed(self) -> bool:
        return self._closed

    @property
    def max_payload(self) -> int:
        """The largest message (headers and payload) the server takes."""
        return self._max_payload

    # --- publishing, subscribing ------------------------------------------------------------------------

    def publish(self, subject: str, payload: bytes, *, reply: str | None = None,
                headers: Mapping[str, str] | None = None) -> None:
        """Buffer one message; the writer sends it with everything else buffered. ValueError for a bad
        subject or header; NatsError when closed, over max_payload, or when the buffer is full."""
        self._check_open()
        if headers is None:
            size = len(payload)
            data = codec.pub(subject, payload, reply)
        else:
            size = len(codec.encode_headers(headers)) + len(payload)
            data = codec.hpub(subject, headers, payload, reply)
        if size > self._max_payload:
            raise NatsError(f"a message of {size} bytes to {subject!r} is over the server's max_payload "
                            f"of {self._max_payload}")
        limit = MAX_OUTPUT_BYTES if self._link is not None else RECONNECT_BUF_SIZE
        if self._out_bytes + len(data) > limit:
            state = "connected" if self._link is not None else "disconnected"
            raise NatsError(f"output buffer full ({self._out_bytes} bytes, {state}; the limit is {limit})")
        self._queue(data)

    def subscribe(self, subject: str, callback: Callable[[Msg], None], *, queue: str | None = None) -> int:
        """Subscribe; returns the sid. `callback(msg)` runs in the reader task, once per message, in order."""
        self._check_open()
        sid = next(self._sids)
        data = codec.sub(subject, sid, queue)
        self._subs[sid] = _Subscription(subject, queue, callback)
        if self._link is not None:  # else it is sent with every other subscription on reconnect
            self._queue(data)
        return sid

    def unsubscribe(self, sid: int, *, late: Callable[[Msg], None] | None = None) -> None:
        """Unsubscribe. `late`, when given, gets what the server sent the subscription before it read the
        UNSUB (until the PONG of a PING sent after it); otherwise such messages are dropped."""
        if self._subs.pop(sid, None) is not None and not self._closed:
            self._queue(codec.unsub(sid))  # also while disconnected: a SUB may still be buffered
            if late is not None and self._link is not None:
                self._late[sid] = late
                self._ping(_PongWaiter(then=lambda: self._late.pop(sid, None)))

    # --- requests ---------------------------------------------------------------------------------------

    def new_inbox(self) -> str:
        return INBOX_PREFIX + secrets.token_urlsafe(16)

    def request_nowait(self, subject: str, payload: bytes, callback: Callable[[Msg | NatsError], None], *,
                       headers: Mapping[str, str] | None = None, timeout: float | None = None) -> None:
        """Publish a request; `callback` gets, exactly once, the reply Msg or NoResponders, RequestTimeout
        or ConnectionLost. A request that cannot be published raises here and has no callback."""
        self._request(subject, payload, callback, headers, timeout)

    async def request(self, subject: str, payload: bytes, *, headers: Mapping[str, str] | None = None,
                      timeout: float | None = None) -> Msg:
        """The reply; raises NoResponders, RequestTimeout or ConnectionLost."""
        answers: list[Msg | NatsError] = []
        answered = trio.Event()

        def on_answer(answer: Msg | NatsError) -> None:
            answers.append(answer)
            answered.set()

        token = self._request(subject, payload, on_answer, headers, timeout)
        try:
            await answered.wait()
        finally:
            if not answered.is_set():  # cancelled: no answer is wanted any more
                self._requests.pop(token, None)
        answer = answers[0]
        if isinstance(answer, NatsError):
            raise answer
        return answer

    async def flush(self, timeout: float | None = None) -> None:
        """Send a PING and wait for its PONG: everything buffered before reached the server. Waits for a
        reconnection first when disconnected; RequestTimeout after `timeout` (default request_timeout)."""
        timeout = self.options.request_timeout if timeout is None else timeout
        with trio.move_on_after(timeout):
            while self._link is None:
                self._check_open(ConnectionLost)
                await self._connected.wait()
            self._check_open(ConnectionLost)
            waiter = _PongWaiter()
            self._ping(waiter)
            await waiter.event.wait()
            if waiter.error is not None:
                raise waiter.error
            return
        raise RequestTimeout(f"flush: no PONG within {timeout} s")

    def _request(self, subject: str, payload: bytes, callback: Callable[[Msg | NatsError], None],
                 headers: Mapping[str, str] | None, timeout: float | None) -> str:
        self._check_open()
        if self._inbox_prefix is None:
            self._inbox_prefix = self.new_inbox() + "."
            self.subscribe(self._inbox_prefix + "*", self._on_reply)
        token = f"{next(self._tokens):x}"
        self.publish(subject, payload, reply=self._inbox_prefix + token, headers=headers)
        self._requests[token] = _Request(subject, callback)
        deadline = trio.current_time() + (self.options.request_timeout if timeout is None else timeout)
        if len(self._deadlines) > 1024 and len(self._deadlines) > 4 * len(self._requests):
            # Mostly answered requests: rebuild rather than let the heap grow with the request rate.
            self._deadlines = [entry for entry in self._deadlines if entry[1] in self._requests]
            heapq.heapify(self._deadlines)
        heapq.heappush(self._deadlines, (deadline, token))
        if self._deadlines[0][1] == token:
            self._wake_timer.set()
        return token

    def _on_reply(self, msg: Msg) -> None:
        assert self._inbox_prefix is not None
        request = self._requests.pop(msg.subject[len(self._inbox_prefix) :], None)
        if request is None:
            return  # timed out, failed or cancelled already
        if msg.status == NO_RESPONDERS and not msg.payload:
            self._answer(request, NoResponders(f"no responders on {request.subject!r}"))
        else:
            self._answer(request, msg)

    def _answer(self, request: _Request, answer: Msg | NatsError) -> None:
        try:
            request.callback(answer)
        except Exception:
            log.exception("request callback %r failed", request.callback)

    def _fail_requests(self, reason: str) -> None:
        requests, self._requests = self._requests, {}
        self._deadlines.clear()
        for request in requests.values():
            self._answer(request, ConnectionLost(f"request to {request.subject!r}: {reason}"))

    # --- output -----------------------------------------------------------------------------------------

    def _check_open(self, error: type[NatsError] = NatsError) -> None:
        if self._closed:
            raise error(self._close_reason)

    def _queue(self, data: bytes) -> None:
        self._out.append(data)
        self._out_bytes += len(data)
        self._wake_writer.set()

    def _ping(self, waiter: _PongWaiter | None) -> None:
        self._pongs.append(waiter)
        self._pings_in_out += 1
        self._queue(codec.PING)

    # --- tasks ------------------------------------------------------------------------------------------

    async def _run(self, link: _Link, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        try:
            async with trio.open_nursery() as tasks:
                self._tasks = tasks
                self._use(link)
                tasks.start_soon(self._writer)
                tasks.start_soon(self._pinger)
                tasks.start_soon(self._timer)
                task_status.started()
                await self._keep_linked(link)
                tasks.cancel_scope.cancel()
        finally:
            self._closed = True
            self._link = None
            self.connected_url = None
            self._fail_requests(self._close_reason)
            self._fail_pongs(self._close_reason)
            self._connected.set()  # flushes waiting for a link see the close
            self._done.set()

    async def _keep_linked(self, link: _Link) -> None:
        """The reader, and the reconnections; returns when closed or when reconnecting gave up."""
        while True:
            reason = await self._read(link)
            if self._closed:
                return
            self._lost(link, reason)
            found = await self._reconnect(link.server)
            if found is None:
                return
            link = found
            self._use(link)
            log.info("reconnected to %s", link.server.url)
            self._call_back(self._on_reconnected)

    async def _read(self, link: _Link) -> str:
        """Read and dispatch until the link is lost; why it was."""
        try:
            reason = self._dispatch(link, link.leftover)
            while reason is None:
                data = await link.stream.receive_some(RECV_BYTES)
                if not data:
                    return link.kill_reason or "the server closed the connection"
                self._pings_out = 0  # the link is alive: silence is what the pinger looks for
                link.parser.receive_data(data)
                reason = self._dispatch(link, link.parser.next_events())
            return reason
        except _LINK_ERRORS as error:
            return link.kill_reason or f"read failed: {error!r}"
        except codec.ProtocolError as error:
            log.error("%s: protocol error, dropping the link: %s", link.server.url, error)
            return f"protocol error: {error}"
        finally:
            await trio.aclose_forcefully(link.stream)

    def _dispatch(self, link: _Link, events: list[codec.Event]) -> str | None:
        """Handle the events of one read; a reason to drop the link, if one of them is."""
        subs = self._subs
        for event in events:
            if isinstance(event, Msg):
                sub = subs.get(event.sid)
                callback = sub.callback if sub is not None else self._late.get(event.sid)
                if callback is not None:  # else unsubscribed while it was on its way
                    try:
                        callback(event)
                    except Exception:
                        log.exception("subscription callback %r failed", callback)
            elif isinstance(event, codec.Ping):
                self.server_pings += 1
                self._queue(codec.PONG)
            elif isinstance(event, codec.Pong):
                self._pong()
            elif isinstance(event, codec.Info):
                self._info(event.data)
            elif isinstance(event, codec.Err):
                reason = self._server_error(link, event.message)
                if reason is not None:
                    return reason
        return None

    def _pong(self) -> None:
        self._pings_out = 0
        waiter = self._pongs.popleft() if self._pongs else None
        if waiter is not None:
            waiter.done()

    def _fail_pongs(self, reason: str) -> None:
        pongs, self._pongs = self._pongs, deque()
        for waiter in pongs:
            if waiter is not None:
                waiter.fail(ConnectionLost(f"flush: {reason}"))

    async def next_info(self) -> None:
        """Return when the next INFO came (a server sends one when a route tells it of a new server)."""
        await self._info_came.wait()

    def _info(self, info: dict[str, Any]) -> None:
        self.server_info = info
        self._info_came.set()
        self._info_came = trio.Event()
        max_payload = info.get("max_payload")
        if isinstance(max_payload, int) and not isinstance(max_payload, bool) and max_payload > 0:
            self._max_payload = max_payload
        self._discover(info)

    def _discover(self, info: dict[str, Any]) -> None:
        """Add the servers an INFO announces (`connect_urls`) to the list, as NATS clients do."""
        urls = info.get("connect_urls")
        if not isinstance(urls, list) or not self.options.discover:
            return
        known = {server.address for server in self._servers}
        for url in urls:
            try:
                server = _parse_server_url(str(url), implicit=True)
            except ValueError:
                log.warning("ignoring a bad connect_url %r", url)
                continue
            if server.address not in known:
                known.add(server.address)
                self._servers.append(server)

    def _server_error(self, link: _Link, message: str) -> str | None:
        """A reason to drop the link for a fatal -ERR; None for one the server goes on after."""
        if message.lower().startswith(_NON_FATAL_ERRORS):
            log.warning("%s: server error %r", link.server.url, message)
            return None
        log.error("%s: server error %r, dropping the link", link.server.url, message)
        return f"server error {message!r}"

    async def _writer(self) -> None:
        while True:
            await self._wake_writer.wait()
            self._wake_writer = trio.Event()
            link = self._link
            if link is None or not self._out:
                continue  # woken again on reconnection
            data = b"".join(self._out)
            self._out.clear()
            self._out_bytes = 0
            self._pings_in_out = 0
            try:
                await link.stream.send_all(data)
            except _LINK_ERRORS as error:
                # What this write held is lost with the link, as with any client.
                await self._kill(link, f"write failed: {error!r}")

    async def _pinger(self) -> None:
        while True:
            await trio.sleep(self.options.ping_interval)
            link = self._link
            if link is None:
                continue
            if self._pings_out >= self.options.max_pings_out:
                await self._kill(link, f"stale connection: nothing from the server through {self._pings_out} PINGs")
                continue
            self._pings_out += 1
            self._ping(None)

    async def _timer(self) -> None:
        """Fails requests whose deadline passed; one task for all of them."""
        while True:
            now = trio.current_time()
            while self._deadlines and self._deadlines[0][0] <= now:
                _, token = heapq.heappop(self._deadlines)
                request = self._requests.pop(token, None)
                if request is not None:
                    self._answer(request, RequestTimeout(f"no reply to the request to {request.subject!r} in time"))
            self._wake_timer = trio.Event()
            with trio.move_on_at(self._deadlines[0][0] if self._deadlines else math.inf):
                await self._wake_timer.wait()

    async def _kill(self, link: _Link, reason: str) -> None:
        """Drop a link from another task than the reader: closing its socket wakes the reader."""
        if link is not self._link or link.kill_reason is not None:
            return
        link.kill_reason = reason
        await trio.aclose_forcefully(link.socket)

    # --- links ------------------------------------------------------------------------------------------

    def _use(self, link: _Link) -> None:
        """Make `link` the current one: every subscription again, then what was buffered meanwhile."""
        self._link = link
        self.connected_url = link.server.url
        self._info(link.info)
        self._pings_out = 0
        # PINGs still buffered go out on this link: their PONGs have no one waiting any more.
        self._pongs = deque([None] * self._pings_in_out)
        subs = [codec.sub(sub.subject, sid, sub.queue) for sid, sub in self._subs.items()]
        if subs:
            self._out[:0] = subs
            self._out_bytes += sum(map(len, subs))
        self._connected.set()
        self._wake_writer.set()

    def _lost(self, link: _Link, reason: str) -> None:
        log.warning("lost the link to %s: %s", link.server.url, reason)
        self._link = None
        self.connected_url = None
        self._connected = trio.Event()
        self._call_back(self._on_disconnected)
        self._fail_requests(f"the link to {link.server.url} was lost ({reason})")
        self._fail_pongs(f"the link to {link.server.url} was lost ({reason})")

    def _call_back(self, callback: Callable[[], None] | None) -> None:
        if callback is None:
            return
        try:
            callback()
        except Exception:
            log.exception("connection callback %r failed", callback)

    async def _first_link(self) -> _Link:
        """The configured servers in order, then those they announced; NoServers when none answered."""
        failures: list[str] = []
        index = 0
        while index < len(self._servers):  # grows with the connect_urls of servers that answered
            server = self._servers[index]
            index += 1
            try:
                return await self._open(server)
            except _AttemptFailed as error:
                failures.append(f"{server.url}: {error}")
        raise NoServers("no NATS server answered: " + "; ".join(failures))

    async def _reconnect(self, lost: _Server) -> _Link | None:
        """Round robin over the servers, the lost one last; None when closed or out of attempts."""
        rounds = 0
        while not self._closed:
            if 0 <= self.options.max_reconnect_attempts <= rounds:
                self._close_reason = f"gave up reconnecting after {rounds} rounds over the servers"
                log.error("%s", self._close_reason)
                return None
            if rounds:
                await trio.sleep(self.options.reconnect_wait)
            rounds += 1
            start = self._servers.index(lost) + 1 if lost in self._servers else 0
            for server in self._servers[start:] + self._servers[:start]:
                try:
                    return await self._open(server)
                except _AttemptFailed as error:
                    log.info("reconnecting: %s: %s", server.url, error)
        return None

    async def _open(self, server: _Server) -> _Link:
        """TCP, INFO, TLS if wanted, CONNECT and PING, then its PONG: a link, or _AttemptFailed."""
        try:
            with trio.fail_after(self.options.connect_timeout):
                socket = await trio.open_tcp_stream(server.host, server.port)
                try:
                    return await self._handshake(server, socket)
                except BaseException:
                    await trio.aclose_forcefully(socket)
                    raise
        except trio.TooSlowError:
            raise _AttemptFailed(f"no answer within {self.options.connect_timeout} s") from None
        except (*_LINK_ERRORS, codec.ProtocolError) as error:
            raise _AttemptFailed(_describe(error)) from None

    async def _handshake(self, server: _Server, socket: trio.SocketStream) -> _Link:
        parser = codec.ClientConnection()
        events: deque[codec.Event] = deque()
        stream: trio.abc.Stream = socket
        info = await self._next_event(stream, parser, events)
        if not isinstance(info, codec.Info):
            raise _AttemptFailed(f"the server did not start with INFO but {type(info).__name__}")
        self._discover(info.data)
        tls = self.options.tls is not None or server.tls or bool(info.data.get("tls_required"))
        if tls:
            if not (info.data.get("tls_required") or info.data.get("tls_available")):
                raise _AttemptFailed("TLS wanted, but the server offers none")
            context = self.options.tls or ssl.create_default_context()
            stream = trio.SSLStream(socket, context, server_hostname=self._tls_name if server.implicit else server.host)
            await stream.do_handshake()
        await stream.send_all(codec.connect(self._connect_options(server, tls)) + codec.PING)
        while True:
            event = await self._next_event(stream, parser, events)
            if isinstance(event, codec.Pong):
                return _Link(server, stream, socket, parser, info.data, list(events))
            if isinstance(event, codec.Err):
                raise _AttemptFailed(f"server error {event.message!r}")
            if isinstance(event, codec.Ping):
                await stream.send_all(codec.PONG)
            elif isinstance(event, codec.Info):
                info = event
                self._discover(info.data)

    @staticmethod
    async def _next_event(stream: trio.abc.Stream, parser: codec.ClientConnection,
                          events: deque[codec.Event]) -> codec.Event:
        while not events:
            data = await stream.receive_some(RECV_BYTES)
            if not data:
                raise _AttemptFailed("the server closed the connection")
            parser.receive_data(data)
            events.extend(parser.next_events())
        return events.popleft()

    def _connect_options(self, server: _Server, tls: bool) -> dict[str, Any]:
        options: dict[str, Any] = {
            "verbose": False, "pedantic": False, "tls_required": tls, "headers": True, "no_responders": True,
            "protocol": PROTOCOL, "name": self.options.name, "lang": LANG, "version": __version__,
        }
        user = server.user if server.user is not None else self.options.user
        password = server.password if server.user is not None else self.options.password
        token = server.token if server.token is not None else self.options.token
        if user is not None:
            options["user"] = user
            options["pass"] = password or ""
        if token is not None:
            options["auth_token"] = token
        return options
