"""NSQ V2 sessions: codec commands to engine calls, engine deliveries to message frames.

One `NSQSession` per TCP connection, on the shared session skeleton (adapters/session.py): the
reader parses everything a read returned and handles it synchronously (engine calls never
await); IDENTIFY's upgrades and AUTH are the commands that wait. Message frames follow nsqd's
output buffering (docs/protocols/nsq.md): they are flushed when the buffer fills, when the
client's in-flight count reaches its RDY, or when `output_buffer_timeout` passes. Heartbeats are
sent every `heartbeat_interval`, and a client that says nothing for two intervals is closed.

Topic `t` is engine topic `t`; channel `c` of topic `t` is engine queue `t/c`, bound to `t` and
owned by it, whose dead letters go to topic `t.c.dead` (docs/architecture.md). Unlike nsqd, a
disconnected consumer's in-flight messages return to the channel at once instead of after their
timeout: nobody can FIN them any more, and the redelivery is sooner.
"""

from __future__ import annotations

import json
import logging
import random
import re
import socket
import ssl
import time
import urllib.parse
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any, ClassVar, Final, NoReturn, cast

import attrs
import h11
import trio

from polymq.adapters.session import Listener, StreamSession
from polymq.adapters.transport import SocketTransport, StreamTransport, Transport
from polymq.codecs import nsq
from polymq.codecs.compression import (
    DecompressionError,
    DeflateCompressor,
    DeflateDecompressor,
    SnappyCompressor,
    SnappyDecompressor,
)
from polymq.core.engine import DEAD_LETTER_SUFFIX, DEAD_LETTER_TOPIC_OPTION, Consumer, Engine, Message, Outcome, Queue
from polymq.core.timers import Timer
from polymq.core.trace import Client

ORIGIN: Final = "nsq"  # the protocol the engine keeps with what comes in here


def shown_id(message: Message) -> str:
    """The id an NSQ client sees for a message: the 16 hex digits of its engine id."""
    return nsq.message_id_of(message.id).decode()

log = logging.getLogger("polymq.nsq")

# Bound on an auth server's reply body (nsqd reads it whole; a reply is a few hundred bytes).
MAX_AUTH_REPLY: Final = 1024 * 1024
# nsqd's auth HTTP client timeouts (--http-client-connect-timeout 2 s, request timeout 5 s).
AUTH_TIMEOUT_S: Final = 5.0
# nsqd client states as /stats reports them (docs/protocols/nsq.md).
STATE_INIT, STATE_SUBSCRIBED, STATE_CLOSING = 0, 3, 4
# Deadline checks run on heartbeat ticks; allow for the timer firing a hair early or late.
TICK_TOLERANCE_S: Final = 0.005
READ_TIMEOUT_REASON: Final = "client timed out: no data for two heartbeat intervals"
# A TLS handshake gets at least this long (or one heartbeat interval, if longer).
TLS_HANDSHAKE_TIMEOUT_S: Final = 5.0
# The fatal errors of polymq's own limits (nsqd has neither): a client past --nsq-max-connections, and
# one that leaves its output unread past --max-client-output.
TOO_MANY_CONNECTIONS: Final = "E_TOO_MANY_CONNECTIONS"
SLOW_CLIENT: Final = "E_SLOW_CLIENT"
# What a failed FIN, REQ or TOUCH says after `<id> failed ` (nsqd's channel.go errors).
ACK_FAILED_TEXT: Final[dict[Outcome, bytes]] = {
    Outcome.NOT_IN_FLIGHT: b"ID not in flight",
    Outcome.NOT_OWNED: b"client does not own message",
}


def queue_name(topic: str, channel: str) -> str:
    return f"{topic}/{channel}"


def dead_letter_topic(queue: str) -> str:
    """Where channel `t/c`'s dead letters go: `t.c.dead`, a topic NSQ clients can SUB to (no `/` in NSQ names)."""
    return queue.replace("/", ".") + DEAD_LETTER_SUFFIX


def ensure_channel(engine: Engine, topic: str, channel: str) -> Queue:
    """Channel `c` of topic `t`: the queue `t/c`, owned by `t` (deleting `t` deletes it) and bound to it,
    made if missing. The topic is the caller's to make first (it may be ephemeral)."""
    name = queue_name(topic, channel)
    queue = engine.ensure_queue(name, ephemeral=nsq.is_ephemeral(channel), owner_topic=topic, origin=ORIGIN,
                                options={DEAD_LETTER_TOPIC_OPTION: dead_letter_topic(name)})
    engine.bind(name, topic)
    return queue


def claim_channels(engine: Engine) -> int:
    """Stores written before queue records kept an owner hold NSQ channels without one: a restored
    queue named `t/…` and bound to `t` is one (deleting `t` deleted such queues then), so `t` becomes
    its owner and its dead letters keep going to `t.c.dead`. A queue whose record has an owner, or
    none on purpose, is left alone. Returns how many were claimed."""
    claimed = 0
    for queue in list(engine.queues.values()):
        if queue.owner_topic_recorded:
            continue
        topic = next((name for name in queue.topics if queue.name.startswith(name + "/")), None)
        if topic is None:
            continue
        if DEAD_LETTER_TOPIC_OPTION not in queue.options:
            engine.configure_queue(queue, auto_delete=queue.auto_delete,
                                   options={DEAD_LETTER_TOPIC_OPTION: dead_letter_topic(queue.name)})
        engine.set_owner_topic(queue, topic)
        claimed += 1
    return claimed


def sampler(sample_rate: int) -> Callable[[Message], bool] | None:
    """IDENTIFY's sample_rate (1 to 99) as the consumer's filter; 0 is none. nsqd's messagePump skips a
    message when `rand.Int31n(100) > sampleRate`: that client never gets it, and the channel loses it."""
    if not sample_rate:
        return None
    draw = random.randrange
    return lambda message: draw(100) <= sample_rate


@attrs.define(slots=True)
class Authorization:
    topic: re.Pattern[str]
    channels: list[re.Pattern[str]]
    permissions: list[str]

    def allows(self, topic: str, channel: str) -> bool:
        # nsqd internal/auth: a channel means subscribe, none means publish; regexes are unanchored.
        needed = "subscribe" if channel else "publish"
        if needed not in self.permissions or not self.topic.search(topic):
            return False
        return any(pattern.search(channel) for pattern in self.channels)


@attrs.define(slots=True)
class AuthState:
    identity: str
    identity_url: str
    authorizations: list[Authorization]
    expires_at: float


class AuthError(Exception):
    pass


class NSQServer(Listener):
    """Everything the NSQ listeners share: the engine, limits, the sessions."""

    log: ClassVar[logging.Logger] = log

    def __init__(
        self,
        engine: Engine,
        limits: nsq.ServerLimits,
        *,
        ssl_context: ssl.SSLContext | None = None,
        auth_http_address: str | None = None,
    ) -> None:
        super().__init__()
        self.engine = engine
        self.limits = limits
        self.ssl_context = ssl_context
        self.auth_http_address = auth_http_address
        self.tcp_port = 0
        self.http_port = 0
        self.start_time = int(time.time())
        self.hostname = socket.gethostname()
        # What nsqlookupd is told (--broadcast-address and its ports); the NSQ unit sets them.
        self.broadcast_address = self.hostname
        self.broadcast_tcp_port = 0
        self.broadcast_http_port = 0
        # Made right after the engine's restore, before any client or other protocol acts on it.
        claimed = claim_channels(engine)
        if claimed:
            log.info("%d channels of a store written before queues kept their topic: now owned by it", claimed)

    @property
    def auth_enabled(self) -> bool:
        return self.auth_http_address is not None

    def new_session(self, transport: Transport) -> NSQSession:
        return NSQSession(self, transport)

    def refusal(self) -> tuple[str, bytes]:
        # nsqd has no connection limit; its fatal error frame is what any client handles before a close.
        return TOO_MANY_CONNECTIONS, nsq.frame_error(nsq.fatal(TOO_MANY_CONNECTIONS, "too many connections"))

    def client_stats(self) -> list[dict[str, Any]]:
        return [session.stats() for session in list(self.sessions)]  # type: ignore[attr-defined]

    async def query_auth(self, secret: bytes, remote_ip: str, tls: bool) -> AuthState:
        """nsqd's auth call: GET /auth?common_name=&remote_ip=&secret=&tls= (docs/protocols/nsq.md)."""
        assert self.auth_http_address is not None
        host, _, port = self.auth_http_address.rpartition(":")
        query = urllib.parse.urlencode(
            {"common_name": "", "remote_ip": remote_ip, "secret": secret.decode("utf-8", "replace"),
             "tls": "true" if tls else "false"}
        )
        try:
            with trio.fail_after(AUTH_TIMEOUT_S):
                body = await _http_get(host, int(port), f"/auth?{query}")
        except (OSError, trio.TooSlowError, h11.ProtocolError) as exc:
            raise AuthError(str(exc)) from exc
        try:
            data = json.loads(body)
            ttl = int(data["ttl"])
            if ttl <= 0:
                raise AuthError("invalid TTL")
            authorizations = [
                Authorization(re.compile(item["topic"]), [re.compile(c) for c in item["channels"]],
                              list(item["permissions"]))
                for item in data.get("authorizations") or []
            ]
        except (ValueError, KeyError, TypeError, re.error) as exc:
            raise AuthError(f"bad auth reply: {exc}") from exc
        return AuthState(str(data.get("identity", "")), str(data.get("identity_url", "")), authorizations,
                         time.monotonic() + ttl)


async def _http_get(host: str, port: int, target: str) -> bytes:
    stream = await trio.open_tcp_stream(host, port)
    async with stream:
        connection = h11.Connection(h11.CLIENT)
        request = h11.Request(method="GET", target=target, headers=[("Host", f"{host}:{port}"),
                                                                      ("Connection", "close")])
        await stream.send_all(connection.send(request) + connection.send(h11.EndOfMessage()))
        status = 0
        body = bytearray()
        while True:
            event = connection.next_event()
            if event is h11.NEED_DATA:
                data = await stream.receive_some(65536)
                connection.receive_data(data)
                continue
            if isinstance(event, h11.Response):
                status = event.status_code
            elif isinstance(event, h11.Data):
                # h11 hands over a bytearray though it says `bytes`: read untyped, or compiled code rejects it.
                body += cast(Any, event).data
                if len(body) > MAX_AUTH_REPLY:
                    raise OSError("auth reply too large")
            elif isinstance(event, h11.EndOfMessage | h11.ConnectionClosed):
                break
        if status != 200:
            raise OSError(f"auth server answered {status}")
        return bytes(body)


class _Fatal(Exception):
    """A command's fatal error: sent after the answers to earlier publishes (`_send_fatal`)."""

    def __init__(self, error: nsq.ProtocolError) -> None:
        super().__init__(error.frame_text.decode("utf-8", "replace"))
        self.error = error


class NSQSession(StreamSession):
    log: ClassVar[logging.Logger] = log

    def __init__(self, server: NSQServer, transport: Transport) -> None:
        super().__init__(server.engine, transport)
        self.server = server
        self.limits = server.limits
        self.ssl_stream: trio.SSLStream[trio.SocketStream] | None = None
        self.codec = nsq.ServerConnection(server.limits)
        self.remote_address = self.peer
        self.connect_ts = int(time.time())
        # Negotiated settings (IDENTIFY); defaults are nsqd's.
        self.client_id = self.remote_address.rsplit(":", 1)[0]
        self.hostname = self.client_id
        self.client = Client(ORIGIN, self.peer, self.client_id)  # as traces show it
        self.user_agent = ""
        self.heartbeat_interval = self.limits.heartbeat_interval_ms / 1000
        self.output_buffer_size = self.limits.output_buffer_size
        self.output_buffer_timeout = self.limits.output_buffer_timeout_ms / 1000
        self.msg_timeout = self.limits.msg_timeout_ms / 1000
        self.sample_rate = 0
        self.tls = False
        self.deflate = False
        self.snappy = False
        self.auth: AuthState | None = None
        self._auth_secret = b""
        self.consumer: Consumer | None = None
        self.topic: str | None = None
        self.channel: str | None = None
        self.pub_counts: dict[str, int] = {}
        self._tick: Timer | None = None
        self._read_check: Timer | None = None
        self._refill = False  # FINs of this read freed credit: dispatch once at the end
        # Deliveries from a durable channel wait for their STATE record before they are sent.
        self._durable_channel = False
        # Publishes waiting for the storage: (command name, why it was refused or None), in order.
        self._pending_publishes: deque[tuple[str, str | None]] = deque()
        # The storage's callback for each publish, made once (not a bound method per publish).
        self._ack = self._ack_publish
        self._compressor: DeflateCompressor | SnappyCompressor | None = None
        self._decompressor: DeflateDecompressor | SnappyDecompressor | None = None
        self._last_read = self.engine.clock.now()
        self._schedule_tick()

    # -- lifecycle ---------------------------------------------------------------------------

    def closed(self) -> None:
        for timer in (self._tick, self._read_check):
            if timer is not None:
                timer.cancel()
        if self.consumer is not None:
            self.consumer.detach()
            self.consumer = None

    def drain_timeout(self) -> float:
        return max(self.heartbeat_interval, 1.0)

    def slow_error(self, unsent: int) -> tuple[str, bytes]:
        return SLOW_CLIENT, nsq.frame_error(nsq.fatal(SLOW_CLIENT, f"{unsent} bytes of output not read"))

    def _end(self, reason: str) -> None:
        """A fatal error or a corrupt stream: what is queued goes out, then the connection closes."""
        if self.consumer is not None:
            self.consumer.set_credit(0)  # no message frames after a fatal error frame
        self.stop(reason)

    def _schedule_tick(self) -> None:
        if self._tick is not None:
            self._tick.cancel()
            self._tick = None
        if self.heartbeat_interval > 0:
            self._tick = self.engine.timers.schedule(
                self.engine.clock.now() + self.heartbeat_interval, self._on_tick
            )

    def _on_tick(self) -> None:
        """Every heartbeat interval (engine timer): send `_heartbeat_`, enforce nsqd's deadlines.

        Read deadline: two intervals without a byte from the client. Write deadline: one
        interval stuck in a send (docs/protocols/nsq.md). Checking them here keeps cancel scopes off
        every read and write.
        """
        self._tick = None
        now = self.engine.clock.now()
        interval = self.heartbeat_interval
        if self.send_started is not None and now - self.send_started >= interval:
            self.close("write deadline exceeded")
            return
        self.send(nsq.FRAME_HEARTBEAT)
        read_deadline = self._last_read + 2 * interval
        if now >= read_deadline - TICK_TOLERANCE_S:
            self.stop(READ_TIMEOUT_REASON)
            return
        if read_deadline < now + interval and self._read_check is None:
            # The deadline falls before the next tick: check it at the exact time, as nsqd does.
            self._read_check = self.engine.timers.schedule(read_deadline, self._check_read_deadline)
        self._schedule_tick()

    def _check_read_deadline(self) -> None:
        self._read_check = None
        interval = self.heartbeat_interval
        if interval > 0 and self.engine.clock.now() - self._last_read >= 2 * interval - TICK_TOLERANCE_S:
            self.stop(READ_TIMEOUT_REASON)

    # -- reading -----------------------------------------------------------------------------

    def handle(self, data: bytes) -> Awaitable[None] | None:
        if not data:
            return None
        self._last_read = self.engine.clock.now()
        if self._decompressor is not None:
            try:
                data = self._decompressor.decompress(data)
            except DecompressionError as exc:
                self._end(f"bad compressed stream: {exc}")
                return None
        self.codec.receive_data(data)
        return self.resume()

    def resume(self) -> Awaitable[None] | None:
        codec = self.codec
        while self._stopping is None:
            event = codec.next_event()
            if event is nsq.NEED_DATA:
                break
            if isinstance(event, nsq.ProtocolError):
                if event.fatal:
                    return self._send_fatal(event)
                self._send_error(event)
                continue
            if isinstance(event, nsq.CloseSilently):
                self._end(event.reason)
                return None
            try:
                result = self._command(event)
            except _Fatal as fatal:
                codec.closed()
                return self._send_fatal(fatal.error)
            if result is not None:  # a command that must wait (IDENTIFY's upgrade, AUTH)
                return self._waited(result)
        if self._refill:
            self._refill = False
            if self.consumer is not None:
                self.consumer.refill()
        return None

    def _command(self, event: nsq.Event) -> Any:
        """Run one command; returns an awaitable when it must wait. The busiest first: a type
        test each is cheaper, compiled, than a dict lookup and a call through it."""
        if isinstance(event, nsq.Fins):
            self._fins(event)
        elif isinstance(event, nsq.Fin):
            self._fin(event)
        elif isinstance(event, nsq.Mpub):
            return self._mpub(event)
        elif isinstance(event, nsq.Pub):
            return self._pub(event)
        elif isinstance(event, nsq.Rdy):
            self._rdy(event)
        elif isinstance(event, nsq.Req):
            self._req(event)
        elif isinstance(event, nsq.Touch):
            self._touch(event)
        elif isinstance(event, nsq.Dpub):
            return self._dpub(event)
        elif isinstance(event, nsq.Nop):
            self._nop(event)
        elif isinstance(event, nsq.Sub):
            return self._sub(event)
        elif isinstance(event, nsq.Identify):
            return self._identify(event)
        elif isinstance(event, nsq.Auth):
            return self._auth(event)
        elif isinstance(event, nsq.Cls):
            self._cls(event)
        else:
            raise KeyError(type(event))  # as the table of handlers it replaces: a codec bug
        return None

    async def _waited(self, pending: Awaitable[None]) -> None:
        try:
            await pending
        except _Fatal as fatal:
            self.codec.closed()
            await self._send_fatal(fatal.error)

    # -- writing -----------------------------------------------------------------------------

    def _send_error(self, error: nsq.ProtocolError) -> None:
        self.traffic.error(error.code)
        self.send(nsq.frame_error(error))

    async def _stored(self) -> None:
        """Wait until everything reported to the storage so far is stored under its policy."""
        stored = trio.Event()
        self.engine.storage.sync(lambda _error: stored.set())
        self.engine.storage.write_now()
        await stored.wait()

    def _deliver(self, message: Message) -> None:
        self.traffic.messages_out += 1
        body = message.body
        header = nsq.frame_message_header_of(message.timestamp_ns, message.attempts, message.id, len(body))
        consumer = self.consumer
        # Positional arguments: this runs once per message.
        if (self._out_bytes + len(header) + len(body) >= self.output_buffer_size
                or (consumer is not None and consumer.available() <= 0)):
            self.send_delivery(header, body, self._durable_channel, None)
        else:
            self.send_delivery(header, body, self._durable_channel, self.output_buffer_timeout)

    # -- commands ----------------------------------------------------------------------------

    def _identify(self, command: nsq.Identify) -> Any:
        self.client_id = command.client_id or self.client_id
        self.hostname = command.hostname or self.hostname
        self.client.name = self.client_id
        self.user_agent = command.user_agent
        self.heartbeat_interval = -1.0 if command.heartbeat_interval_ms == -1 else command.heartbeat_interval_ms / 1000
        self.output_buffer_size = command.output_buffer_size
        self.output_buffer_timeout = command.output_buffer_timeout_ms / 1000
        self.msg_timeout = command.msg_timeout_ms / 1000
        self.sample_rate = command.sample_rate
        self._schedule_tick()
        tls = command.tls_v1 and self.limits.tls_available
        if not command.feature_negotiation:
            self.send(nsq.FRAME_OK)
            return None
        self.send(nsq.frame_response(nsq.identify_response(command, self.limits, tls=tls)))
        if not (tls or command.deflate or command.snappy):
            return None
        return self._upgrade(tls, command)

    async def _upgrade(self, tls: bool, command: nsq.Identify) -> None:
        """After the IDENTIFY reply: TLS handshake, then compression, each confirmed by `OK`.

        The writer is held off (`exclusive_output`) for the whole sequence, so nothing else (a
        heartbeat, say) can slip between the reply, the handshake and the `OK` the client waits for.
        """
        reply = await self.exclusive_output()
        try:
            await self.transport.send_all(reply)
            leftover = self.codec.take_buffered()
            if tls:
                assert self.server.ssl_context is not None
                assert isinstance(self.transport, SocketTransport)
                ssl_stream = trio.SSLStream(self.transport.to_stream(), self.server.ssl_context, server_side=True)
                with trio.fail_after(max(self.heartbeat_interval, TLS_HANDSHAKE_TIMEOUT_S)):
                    await ssl_stream.do_handshake()
                self.transport = StreamTransport(ssl_stream, self.remote_address)
                self.ssl_stream = ssl_stream
                self.tls = True
                self.codec.tls_active = True
                await self.transport.send_all(nsq.FRAME_OK)
            if command.deflate:
                self._compressor = DeflateCompressor(command.deflate_level)
                self._decompressor = DeflateDecompressor(self.limits.max_body_size + 2 * nsq.MAX_LINE_LENGTH)
                self.deflate = True
            elif command.snappy:
                self._compressor = SnappyCompressor()
                self._decompressor = SnappyDecompressor()
                self.snappy = True
            if self._compressor is not None:
                self.output_encoder = self._compressor.compress
                await self.transport.send_all(self._compressor.compress(nsq.FRAME_OK))
                if leftover and self._decompressor is not None:
                    try:
                        leftover = self._decompressor.decompress(leftover)
                    except DecompressionError as exc:
                        self._end(f"bad compressed stream: {exc}")
                        return
            if leftover:
                self.codec.receive_data(leftover)
        finally:
            self.release_output()

    def _auth(self, command: nsq.Auth) -> Any:
        if self.auth is not None:
            self._fatal("E_INVALID", "AUTH already set")
        if not self.server.auth_enabled:
            self._fatal("E_AUTH_DISABLED", "AUTH disabled")
        return self._do_auth(command.secret)

    async def _do_auth(self, secret: bytes) -> None:
        try:
            state = await self.server.query_auth(secret, self.remote_address.rsplit(":", 1)[0], self.tls)
        except AuthError as exc:
            log.warning("%s: auth query failed: %s", self.remote_address, exc)
            self._fatal("E_AUTH_FAILED", "AUTH failed")
        if not state.authorizations:
            self._fatal("E_UNAUTHORIZED", "AUTH no authorizations found")
        self.auth = state
        self._auth_secret = secret
        reply = {"identity": state.identity, "identity_url": state.identity_url,
                 "permission_count": len(state.authorizations)}
        self.send(nsq.frame_response(json.dumps(reply, separators=(",", ":")).encode()))

    def _fatal(self, code: str, text: str) -> NoReturn:
        raise _Fatal(nsq.fatal(code, text))

    async def _send_fatal(self, error: nsq.ProtocolError) -> None:
        """The last frame: after the answers to earlier publishes, as nsqd answers one command at a time."""
        if self._pending_publishes:
            await self._stored()
        if self._stopping is None:  # else a failed publish's fatal error went out already
            self._send_error(error)
        self._end(error.frame_text.decode("utf-8", "replace"))

    def _check_auth(self, command: str, topic: str, channel: str = "") -> Any:
        """nsqd's CheckAuth; returns an awaitable when the cached authorization has expired."""
        if not self.server.auth_enabled:
            return None
        if self.auth is None:
            self._fatal("E_AUTH_FIRST", f"AUTH required before {command}")
        assert self.auth is not None
        if time.monotonic() >= self.auth.expires_at:
            return self._refresh_auth(command, topic, channel)
        self._authorize(command, topic, channel)
        return None

    async def _refresh_auth(self, command: str, topic: str, channel: str) -> None:
        try:
            self.auth = await self.server.query_auth(self._auth_secret, self.remote_address.rsplit(":", 1)[0],
                                                     self.tls)
        except AuthError:
            self._fatal("E_AUTH_FAILED", "AUTH failed")
        self._authorize(command, topic, channel)

    def _authorize(self, command: str, topic: str, channel: str) -> None:
        assert self.auth is not None
        if not any(a.allows(topic, channel) for a in self.auth.authorizations):
            self._fatal("E_UNAUTHORIZED",
                        f"AUTH failed for {command} on {nsq.go_quote(topic.encode())} {nsq.go_quote(channel.encode())}")

    def _sub(self, command: nsq.Sub) -> Any:
        pending = self._check_auth("SUB", command.topic, command.channel)
        if pending is not None:
            return self._after(pending, lambda: self._subscribe(command))
        self._subscribe(command)
        return None

    def _subscribe(self, command: nsq.Sub) -> None:
        engine = self.engine
        engine.ensure_topic(command.topic, ephemeral=nsq.is_ephemeral(command.topic), origin=ORIGIN)
        queue = ensure_channel(engine, command.topic, command.channel)
        self.topic, self.channel = command.topic, command.channel
        self.consumer = engine.attach(
            queue.name,
            self._deliver,
            credit=0,
            msg_timeout=self.msg_timeout,
            max_msg_timeout=self.limits.max_msg_timeout_ms / 1000,
            accept=sampler(self.sample_rate),
            on_close=self.close,
            tag=self,
            client=self.client,
        )
        self._durable_channel = self.consumer.queue.durable
        self.codec.subscribed()
        engine.settled(self._subscribed)

    def _subscribed(self, error: OSError | None) -> None:
        if self._stopping is not None:
            return
        if error is None:
            self.send(nsq.FRAME_OK, now=True)  # in the read that subscribed: at its end
        else:
            self.send(nsq.frame_error(nsq.fatal("E_INVALID", f"SUB failed {error}")), now=True)
            self._end(f"SUB failed: {error}")

    async def _after(self, pending: Any, then: Callable[[], None]) -> None:
        await pending
        then()

    def _rdy(self, command: nsq.Rdy) -> None:
        if self.consumer is not None:
            self.consumer.set_credit(command.count)

    def _target(self, raw_id: bytes) -> tuple[Consumer, int] | None:
        """The consumer and engine id a FIN/REQ/TOUCH names, or None when it can name nothing."""
        message_id = nsq.message_id_number(raw_id)
        if self.consumer is None or message_id < 0:
            return None
        return self.consumer, message_id

    def _ack_failed(self, name: bytes, code: str, raw_id: bytes, outcome: Outcome) -> None:
        # nsqd: `E_FIN_FAILED FIN <id> failed ID not in flight` (non-fatal, docs/protocols/nsq.md).
        self._send_error(nsq.non_fatal(code, name + b" " + raw_id + b" failed " + ACK_FAILED_TEXT[outcome]))

    def _fin(self, command: nsq.Fin) -> None:
        consumer = self.consumer
        outcome = Outcome.NOT_IN_FLIGHT
        if consumer is not None:
            failed = consumer.finish_many([nsq.message_id_number(command.msg_id)])
            if not failed:
                self._refill = True
                return
            outcome = failed[0][1]
        self._ack_failed(b"FIN", "E_FIN_FAILED", command.msg_id, outcome)

    def _fins(self, command: nsq.Fins) -> None:
        # One FIN per delivered message: the run's ids are read in bulk and finished in a compiled
        # loop, and the freed credit is used once per read (`_refill` at its end), not per FIN.
        consumer = self.consumer
        if consumer is None:
            for raw_id in command.msg_ids:
                self._ack_failed(b"FIN", "E_FIN_FAILED", raw_id, Outcome.NOT_IN_FLIGHT)
            return
        numbers = nsq.fin_numbers(command.lines)
        failed = consumer.finish_many(numbers)
        if len(failed) < len(numbers):
            self._refill = True
        for index, outcome in failed:
            self._ack_failed(b"FIN", "E_FIN_FAILED", command.msg_id(index), outcome)

    def _req(self, command: nsq.Req) -> None:
        target = self._target(command.msg_id)
        outcome = target[0].requeue(target[1], command.timeout_ms / 1000) if target else Outcome.NOT_IN_FLIGHT
        if outcome is not Outcome.OK:
            self._ack_failed(b"REQ", "E_REQ_FAILED", command.msg_id, outcome)

    def _touch(self, command: nsq.Touch) -> None:
        target = self._target(command.msg_id)
        outcome = target[0].touch(target[1]) if target else Outcome.NOT_IN_FLIGHT
        if outcome is not Outcome.OK:
            self._ack_failed(b"TOUCH", "E_TOUCH_FAILED", command.msg_id, outcome)

    def _cls(self, command: nsq.Cls) -> None:
        if self.consumer is not None:
            self.consumer.set_credit(0)
        self.codec.closing()
        self.send(nsq.FRAME_CLOSE_WAIT)

    def _nop(self, command: nsq.Nop) -> None:
        pass

    def _ensure_topic(self, topic: str) -> None:
        if topic not in self.engine.topics:
            self.engine.ensure_topic(topic, ephemeral=nsq.is_ephemeral(topic), origin=ORIGIN)

    def _refused(self, name: str, topic: str, count: int) -> bool:
        """While the storage cannot write, or a queue of the topic is full (the engine's depth policy),
        a publish is refused (in its turn, after earlier answers)."""
        failure = self.engine.storage.failure or self.engine.publish_refusal(topic, count)
        if failure is None:
            return False
        self.server.refusals.note(f"E_{name}_FAILED", f"{self.peer}: E_{name}_FAILED {name} failed {failure}")
        self._pending_publishes.append((name, failure))
        self.engine.storage.sync(self._ack)
        return True

    def _published(self, name: str, topic: str, count: int) -> None:
        self.pub_counts[topic] = self.pub_counts.get(topic, 0) + count
        self.traffic.messages_in += count
        # The acknowledgement waits for the storage's durability policy (group commit).
        self._pending_publishes.append((name, None))
        self.engine.storage.sync(self._ack)

    def _ack_publish(self, error: OSError | None) -> None:
        name, refused = self._pending_publishes.popleft()
        if self._stopping is not None:
            return  # a fatal error went out already: nothing may follow it
        if error is None and refused is None:
            # From a storage callback this goes out at once (`now`); in a read, at its end.
            self.send(nsq.FRAME_OK, now=True)
        else:
            # nsqd: `E_PUB_FAILED PUB failed <error>`, fatal (E_MPUB_FAILED, E_DPUB_FAILED alike).
            reason = refused or (error.strerror if error is not None and error.strerror else str(error))
            self.traffic.error(f"E_{name}_FAILED")
            self.send(nsq.frame_error(nsq.fatal(f"E_{name}_FAILED", f"{name} failed {reason}")), now=True)
            self._end(f"{name} failed: {reason}")

    def _pub(self, command: nsq.Pub) -> Any:
        pending = self._check_auth("PUB", command.topic)
        if pending is not None:
            return self._after(pending, lambda: self._pub(command))
        if self._refused("PUB", command.topic, 1):
            return None
        self._ensure_topic(command.topic)
        self.engine.publish(command.topic, command.body, origin=ORIGIN, client=self.client)
        self._published("PUB", command.topic, 1)
        return None

    def _mpub(self, command: nsq.Mpub) -> Any:
        pending = self._check_auth("MPUB", command.topic)
        if pending is not None:
            return self._after(pending, lambda: self._mpub(command))
        if self._refused("MPUB", command.topic, len(command.bodies)):
            return None
        self._ensure_topic(command.topic)
        self.engine.publish_many(command.topic, command.bodies, origin=ORIGIN, client=self.client)
        self._published("MPUB", command.topic, len(command.bodies))
        return None

    def _dpub(self, command: nsq.Dpub) -> Any:
        pending = self._check_auth("DPUB", command.topic)
        if pending is not None:
            return self._after(pending, lambda: self._dpub(command))
        if self._refused("DPUB", command.topic, 1):
            return None
        self._ensure_topic(command.topic)
        self.engine.publish(command.topic, command.body, delay=command.defer_ms / 1000, origin=ORIGIN,
                            client=self.client)
        self._published("DPUB", command.topic, 1)
        return None

    # -- stats -------------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """One client as nsqd's /stats shows it (keys in nsqd's order), plus routing keys."""
        consumer = self.consumer
        state = {nsq.ClientState.SUBSCRIBED: STATE_SUBSCRIBED, nsq.ClientState.CLOSING: STATE_CLOSING}.get(
            self.codec.state, STATE_INIT
        )
        cipher = ""
        version = ""
        if self.ssl_stream is not None:
            try:
                cipher = self.ssl_stream.cipher()[0]
                version = self.ssl_stream.version() or ""
            except (ssl.SSLError, trio.NeedHandshakeError, AttributeError):
                pass
        stats: dict[str, Any] = {
            "client_id": self.client_id,
            "hostname": self.hostname,
            "version": "V2",
            "remote_address": self.remote_address,
            "state": state,
            "ready_count": consumer.credit if consumer is not None else 0,
            "in_flight_count": len(consumer.in_flight) if consumer is not None else 0,
            "message_count": consumer.message_count if consumer is not None else 0,
            "finish_count": consumer.finish_count if consumer is not None else 0,
            "requeue_count": consumer.requeue_count if consumer is not None else 0,
            "connect_ts": self.connect_ts,
            "sample_rate": self.sample_rate,
            "deflate": self.deflate,
            "snappy": self.snappy,
            "user_agent": self.user_agent,
        }
        if self.auth is not None:
            stats.update(authed=True, auth_identity=self.auth.identity, auth_identity_url=self.auth.identity_url)
        if self.pub_counts:
            stats["pub_counts"] = [{"topic": t, "count": c} for t, c in self.pub_counts.items()]
        stats.update(
            tls=self.tls,
            tls_cipher_suite=cipher,
            tls_version=version,
            tls_negotiated_protocol="",
            tls_negotiated_protocol_is_mutual=False,
        )
        stats["_topic"] = self.topic
        stats["_channel"] = self.channel
        return stats
