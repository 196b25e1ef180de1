"""The nsqd HTTP API (port 4151), request in, response out: no sockets, no trio, no hypercorn.

`NsqHttpApi.handle(Request)` routes like nsqd v1.3.0 (httprouter with its 404/405/OPTIONS and
trailing-slash redirects) and answers with a `Response`, or with `NeedBody` when the endpoint
reads the request body (/pub, /mpub, PUT /config): the server reads at most `read_max` bytes
and calls `complete(body)`. Check order, status codes and bodies follow `nsqio/nsq:nsqd/http.go`
and `internal/http_api` (docs/protocols/nsq.md), except for its defects (docs/protocols/nsq.md), which
are noted where polymq differs.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import json
import logging
import os
import re
import sys
import time
import zlib
from collections import deque
from collections.abc import Callable
from datetime import datetime
from typing import Any, Protocol

from polymq.adapters.http import (
    JSON_TYPE,
    Later,
    NeedBody,
    QueryError,
    Request,
    Response,
    go_json,
    parse_query,
    then,
)
from polymq.adapters.nsq.tcp import ORIGIN as NSQ_ORIGIN
from polymq.adapters.nsq.tcp import ensure_channel
from polymq.adapters.traffic import Traffic
from polymq.codecs.nsq import ProtocolError, ServerLimits, is_ephemeral, is_valid_name, parse_mpub_body
from polymq.core.cluster import queue_share, topic_share
from polymq.core.engine import Engine, Queue, Topic
from polymq.core.trace import Client

log = logging.getLogger("polymq.nsq_http")

# Every nsqd API response carries this header (internal/http_api RespondV1).
NSQ_CONTENT_TYPE_HEADER = ("X-NSQ-Content-Type", "nsq; version=1.0")
# Answers from this status on are errors, counted by their code.
HTTP_ERROR = 400
# What Go's net/http sniffs for a plain-text body nsqd writes without a Content-Type.
TEXT_TYPE = "text/plain; charset=utf-8"
HTML_TYPE = "text/html; charset=utf-8"

# nsqd's boolParams: the only spellings /stats and /mpub?binary= understand.
BOOL_PARAMS = {"true": True, "1": True, "false": False, "0": False}

NS_PER_MS = 1_000_000
NS_PER_S = 1_000_000_000

# Go's runtime keeps the last 256 GC pauses (runtime.MemStats.PauseNs); we keep as many.
GC_PAUSE_HISTORY = 256

# nsqd options.go defaults that ServerLimits does not carry (shown by GET /config/<opt>).
DEFAULT_LOG_LEVEL = 2  # lg.INFO; lg.LogLevel is an int and encodes as a JSON number
LOG_LEVELS = {"debug": 1, "info": 2, "warn": 3, "error": 4, "fatal": 5}  # lg.ParseLogLevel
TLS_NOT_REQUIRED = 0  # nsqd TLSNotRequired
TLS_REQUIRED_EXCEPT_HTTP = 1  # nsqd TLSRequiredExceptHTTP ("tcp-https"): what polymq enforces
TLS_VERSION_10 = 0x0301  # crypto/tls.VersionTLS10, nsqd's default --tls-min-version
HTTPS_PORT = 4152  # nsqd's default --https-address port
MEM_QUEUE_SIZE = 10_000  # --mem-queue-size
MAX_BYTES_PER_FILE = 100 * 1024 * 1024  # --max-bytes-per-file
SYNC_EVERY = 2500  # --sync-every
SYNC_TIMEOUT_NS = 2 * NS_PER_S  # --sync-timeout
QUEUE_SCAN_SELECTION_COUNT = 20  # --queue-scan-selection-count
QUEUE_SCAN_WORKER_POOL_MAX = 4  # --queue-scan-worker-pool-max
HTTP_CLIENT_CONNECT_TIMEOUT_NS = 2 * NS_PER_S  # --http-client-connect-timeout
HTTP_CLIENT_REQUEST_TIMEOUT_NS = 5 * NS_PER_S  # --http-client-request-timeout
STATSD_INTERVAL_NS = 60 * NS_PER_S  # --statsd-interval
STATSD_UDP_PACKET_SIZE = 508  # --statsd-udp-packet-size
E2E_WINDOW_NS = 10 * 60 * NS_PER_S  # --e2e-processing-latency-window-time

# Order of nsqd's ClientV2Stats JSON fields; the omitempty ones vanish when empty.
CLIENT_KEYS = (
    "client_id", "hostname", "version", "remote_address", "state", "ready_count", "in_flight_count",
    "message_count", "finish_count", "requeue_count", "connect_ts", "sample_rate", "deflate", "snappy",
    "user_agent", "authed", "auth_identity", "auth_identity_url", "pub_counts", "tls", "tls_cipher_suite",
    "tls_version", "tls_negotiated_protocol", "tls_negotiated_protocol_is_mutual",
)
CLIENT_OMITEMPTY = frozenset({"authed", "auth_identity", "auth_identity_url", "pub_counts"})

MEMORY_KEYS = (
    "heap_objects", "heap_idle_bytes", "heap_in_use_bytes", "heap_released_bytes", "gc_pause_usec_100",
    "gc_pause_usec_99", "gc_pause_usec_95", "next_gc_bytes", "gc_total_runs",
)

# An HTTP publisher's name in traces: HTTP has no IDENTIFY.
HTTP_CLIENT_NAME = "http"
_GO_INT = re.compile(r"[+-]?[0-9]+")
_INT64_MAX = (1 << 63) - 1


class NSQInfo(Protocol):
    """What the API needs from the NSQ side (adapters/nsq/tcp.py NSQServer)."""

    limits: ServerLimits
    tcp_port: int
    http_port: int
    start_time: int
    hostname: str

    @property
    def auth_enabled(self) -> bool: ...

    def client_stats(self) -> list[dict[str, Any]]: ...


class Lookupds(Protocol):
    """The lookupds the node registers with (adapters/nsq/lookupd.py LookupdRegistrar)."""

    addresses: list[str] | None

    def set_addresses(self, addresses: list[str] | None) -> None: ...


# ---------------------------------------------------------------------------------------------
# Requests and responses


def error(status: int, message: str) -> Response:
    """nsqd's V1 error shape: `{"message":"CODE"}` as JSON."""
    return Response(status, go_json({"message": message}), JSON_TYPE)


def ok_text(text: str = "OK") -> Response:
    return Response(200, text.encode(), TEXT_TYPE)


# The answer to an accepted /pub or /mpub, sent after the storage sync like NSQ's TCP `OK`.
PUBLISHED = Response(200, b"OK", TEXT_TYPE, after_sync=True)


def ok_json(value: Any) -> Response:
    return Response(200, go_json(value), JSON_TYPE)


# A V1 handler that returns nil: 200 with an empty body and no Content-Type (Go sniffs nothing). Every
# such handler changes topics or channels: sent once the change holds for every client (a shared engine's
# other nodes included), as a publish's `OK` once stored.
CHANGED = Response(200, after_sync=True)


# ---------------------------------------------------------------------------------------------
# Go compatibility helpers


def _client(request: Request) -> Client:
    """An HTTP publisher as traces show it (core/trace.py)."""
    return Client(NSQ_ORIGIN, request.peer, HTTP_CLIENT_NAME)


def _first(params: dict[bytes, list[bytes]], key: bytes) -> bytes | None:
    found = params.get(key)
    return None if found is None else found[0]


def _text(raw: bytes) -> str:
    return raw.decode("utf-8", "surrogateescape")


def go_duration(ns: int) -> str:
    """time.Duration.String(): "1h2m3.5s", "1.5ms", "0s"."""
    if ns == 0:
        return "0s"
    sign = "-" if ns < 0 else ""
    u = abs(ns)
    if u < NS_PER_S:
        for unit, size in (("ns", 1), ("µs", 1_000), ("ms", 1_000_000)):
            if u < size * 1000:
                return sign + _fraction(u, size) + unit
    hours, rest = divmod(u, 3600 * NS_PER_S)
    minutes, rest = divmod(rest, 60 * NS_PER_S)
    out = _fraction(rest, NS_PER_S) + "s"
    if hours:
        return f"{sign}{hours}h{minutes}m{out}"
    if minutes:
        return f"{sign}{minutes}m{out}"
    return sign + out


def _fraction(value: int, unit: int) -> str:
    whole, frac = divmod(value, unit)
    if not frac:
        return str(whole)
    digits = len(str(unit)) - 1
    return f"{whole}.{frac:0{digits}d}".rstrip("0")


def go_rfc3339(unix_seconds: float) -> str:
    """time.Format(time.RFC3339) in local time: "2006-01-02T15:04:05Z07:00" ("Z" for UTC)."""
    moment = datetime.fromtimestamp(int(unix_seconds)).astimezone()
    text = moment.strftime("%Y-%m-%dT%H:%M:%S")
    offset = moment.utcoffset()
    seconds = int(offset.total_seconds()) if offset is not None else 0
    if seconds == 0:
        return text + "Z"
    sign = "+" if seconds > 0 else "-"
    hours, minutes = divmod(abs(seconds) // 60, 60)
    return f"{text}{sign}{hours:02d}:{minutes:02d}"


def _go_split_port(address: str) -> str:
    """The port of net.SplitHostPort ("" when the address has none)."""
    if address.startswith("["):
        _, _, rest = address.partition("]")
        return rest[1:] if rest.startswith(":") else ""
    if address.count(":") != 1:
        return ""
    return address.rsplit(":", 1)[1]


def node_id(hostname: str) -> int:
    """nsqd's default --node-id: crc32(md5(hostname)) % 1024."""
    return zlib.crc32(hashlib.md5(hostname.encode()).digest()) % 1024


# ---------------------------------------------------------------------------------------------
# Memory stats (nsqd reports Go's runtime.MemStats; these are CPython's closest figures)


class GcPauses:
    """Times CPython's collections through `gc.callbacks`, keeping the last 256 like Go's PauseNs."""

    def __init__(self, clock: Callable[[], int] = time.perf_counter_ns) -> None:
        self.pauses_ns: deque[int] = deque(maxlen=GC_PAUSE_HISTORY)
        self._clock = clock
        self._started = 0

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = self._clock()
        elif self._started:
            self.pauses_ns.append(self._clock() - self._started)
            self._started = 0

    def install(self) -> None:
        if self._callback not in gc.callbacks:
            gc.callbacks.append(self._callback)

    def uninstall(self) -> None:
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)


def _percentile(percent: float, ordered: list[int]) -> int:
    """nsqd's percentile(): index floor(p/100 * n + 0.5), capped at n - 1."""
    if not ordered:
        return 0
    index = min(int(percent / 100.0 * len(ordered) + 0.5), len(ordered) - 1)
    return ordered[index]


def _resident_bytes() -> int:
    try:
        with open("/proc/self/statm", "rb") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        import resource

        # ru_maxrss is the peak, in KiB on Linux: the best figure left.
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def memory_stats(pauses: GcPauses | None) -> dict[str, int]:
    ordered = sorted(pauses.pauses_ns) if pauses is not None else []
    return {
        # pymalloc's live blocks: CPython's count of heap objects, cheap to read.
        "heap_objects": sys.getallocatedblocks(),
        # CPython does not report idle or released heap: 0, as a Go heap with nothing idle.
        "heap_idle_bytes": 0,
        "heap_in_use_bytes": _resident_bytes(),
        "heap_released_bytes": 0,
        "gc_pause_usec_100": _percentile(100.0, ordered) // 1000,
        "gc_pause_usec_99": _percentile(99.0, ordered) // 1000,
        "gc_pause_usec_95": _percentile(95.0, ordered) // 1000,
        # CPython collects by allocation count, not heap size: there is no byte goal.
        "next_gc_bytes": 0,
        "gc_total_runs": sum(generation["collections"] for generation in gc.get_stats()) & 0xFFFFFFFF,
    }


# ---------------------------------------------------------------------------------------------
# The API


Handler = Callable[[Request, str], Response | NeedBody]


class NsqHttpApi:
    def __init__(
        self,
        engine: Engine,
        nsq: NSQInfo,
        *,
        bind_host: str = "127.0.0.1",  # only reported (/config addresses); the listener binds elsewhere
        now: Callable[[], float] = time.time,
        gc_pauses: GcPauses | None = None,
        python_version: str | None = None,
        info_extra: dict[str, str] | None = None,  # polymq's own /info keys (the gateway's HTTP address)
        lookupd: Lookupds | None = None,  # who PUT /config/nsqlookupd_tcp_addresses changes (else only stored)
    ) -> None:
        self.engine = engine
        self.nsq = nsq
        # Messages published and errors by code, for the metrics: the TCP listener's, when it has one.
        traffic = getattr(nsq, "traffic", None)
        self.traffic = traffic if isinstance(traffic, Traffic) else Traffic()
        self.bind_host = bind_host
        self.now = now
        self.gc_pauses = gc_pauses
        self.info_extra = info_extra or {}
        self.python_version = python_version or "python" + ".".join(map(str, sys.version_info[:3]))
        # Values set with PUT /config/<opt> (nsqd lets only these two change at run time).
        self.lookupd = lookupd
        self.nsqlookupd_tcp_addresses: list[str] | None = list(lookupd.addresses or []) if lookupd else []
        self.log_level = DEFAULT_LOG_LEVEL
        self._routes: dict[str, dict[str, Handler]] = {
            "/ping": {"GET": self._ping},
            "/info": {"GET": self._info},
            "/pub": {"POST": self._pub},
            "/mpub": {"POST": self._mpub},
            "/stats": {"GET": self._stats},
            "/topic/create": {"POST": self._topic_create},
            "/topic/delete": {"POST": self._topic_delete},
            "/topic/empty": {"POST": self._topic_empty},
            "/topic/pause": {"POST": self._topic_pause},
            "/topic/unpause": {"POST": self._topic_unpause},
            "/channel/create": {"POST": self._channel_create},
            "/channel/delete": {"POST": self._channel_delete},
            "/channel/empty": {"POST": self._channel_empty},
            "/channel/pause": {"POST": self._channel_pause},
            "/channel/unpause": {"POST": self._channel_unpause},
        }
        self._config_route: dict[str, Handler] = {"GET": self._config_get, "PUT": self._config_put}

    @property
    def limits(self) -> ServerLimits:
        return self.nsq.limits

    # -- routing (julienschmidt/httprouter v1.3.0 as nsqd configures it) ---------------------

    def _lookup(self, path: str) -> tuple[dict[str, Handler], str] | None:
        methods = self._routes.get(path)
        if methods is not None:
            return methods, ""
        if path.startswith("/config/"):
            option = path[len("/config/"):]
            if option and "/" not in option:
                return self._config_route, option
        return None

    def _methods(self) -> set[str]:
        found = {method for methods in self._routes.values() for method in methods}
        return found | set(self._config_route)

    def handle(self, request: Request) -> Response | NeedBody | Later:
        return then(self._route(request), self._counted)

    def _counted(self, response: Response) -> Response:
        """An error answer is counted by its nsqd code (`{"message":"TOPIC_NOT_FOUND"}`), for the metrics."""
        if response.status >= HTTP_ERROR:
            code = None
            if response.content_type == JSON_TYPE:
                with contextlib.suppress(ValueError, AttributeError):
                    code = json.loads(response.body).get("message")
            self.traffic.error(code if isinstance(code, str) else str(response.status))
        return response

    def _route(self, request: Request) -> Response | NeedBody:
        method, path = request.method, request.path
        found = self._lookup(path)
        if found is not None and method in found[0]:
            return found[0][method](request, found[1])
        if method in self._methods() and method != "CONNECT" and path != "/":
            redirect = self._redirect(request)
            if redirect is not None:
                return redirect
        allowed = [m for m in ("GET", "POST", "PUT") if found is not None and m in found[0] and m != method]
        if method == "OPTIONS":
            if allowed:
                return Response(200, headers=(("Allow", ", ".join([*allowed, "OPTIONS"])),))
        elif allowed:
            allow = ", ".join([*allowed, "OPTIONS"])
            return Response(405, go_json({"message": "METHOD_NOT_ALLOWED"}), JSON_TYPE, (("Allow", allow),))
        return error(404, "NOT_FOUND")

    def _redirect(self, request: Request) -> Response | None:
        """httprouter's RedirectTrailingSlash and RedirectFixedPath (case-insensitive) for this method."""
        method, path = request.method, request.path
        candidates = [path[:-1] if path.endswith("/") else path + "/"]
        lowered = path.lower().rstrip("/") or "/"
        candidates += [p for p in self._routes if p.lower() == lowered]
        if lowered.startswith("/config/") and lowered.count("/") == 2:
            candidates.append("/config/" + path.rstrip("/")[len("/config/"):])
        for candidate in candidates:
            found = self._lookup(candidate)
            if found is not None and method in found[0] and candidate != path:
                code = 301 if method == "GET" else 307  # httprouter v1.3.0 (no 308)
                location = candidate + ("?" + request.query.decode("latin-1") if request.query else "")
                if method in ("GET", "HEAD"):
                    # net/http.Redirect writes a short HTML body for GET and HEAD.
                    text = "Moved Permanently" if code == 301 else "Temporary Redirect"
                    body = f'<a href="{_html_escape(location)}">{text}</a>.\n\n'.encode()
                    return Response(code, body, HTML_TYPE, (("Location", location),))
                return Response(code, headers=(("Location", location),))
        return None

    # -- /ping, /info --------------------------------------------------------------------------

    def _health(self) -> str:
        health = getattr(self.nsq, "health", "OK")
        return health() if callable(health) else str(health)

    def _ping(self, request: Request, _: str) -> Response:
        health = self._health()
        # nsqd's PlainText decorator: the health text, 500 once storage has failed, and none of the
        # V1 decorator's headers (no X-NSQ-Content-Type).
        return Response(200 if health == "OK" else 500, health.encode(), TEXT_TYPE, plain=True)

    def _info(self, request: Request, _: str) -> Response:
        limits = self.limits
        return ok_json({
            "version": limits.version,
            "broadcast_address": self._broadcast_address(),
            "hostname": self.nsq.hostname,
            "http_port": self.nsq.http_port,
            "tcp_port": self.nsq.tcp_port,
            "start_time": self.nsq.start_time,
            "max_heartbeat_interval": limits.max_heartbeat_interval_ms * NS_PER_MS,
            "max_output_buffer_size": limits.max_output_buffer_size,
            "max_output_buffer_timeout": limits.max_output_buffer_timeout_ms * NS_PER_MS,
            "max_deflate_level": limits.max_deflate_level,
            **self.info_extra,
        })

    def _broadcast_address(self) -> str:
        # nsqd's --broadcast-address, which defaults to the host name.
        return str(getattr(self.nsq, "broadcast_address", None) or self.nsq.hostname)

    # -- publishing ----------------------------------------------------------------------------

    def _refuse_unauthenticated(self) -> Response | None:
        # nsqd lets anyone reaching the HTTP port publish even with --auth-http-address set
        # (docs/protocols/nsq.md). HTTP requests carry no AUTH secret, so polymq refuses them instead.
        if self.nsq.auth_enabled:
            return error(403, "UNAUTHORIZED")
        return None

    def _topic_param(self, request: Request) -> tuple[dict[bytes, list[bytes]], str] | Response:
        """getTopicFromQuery, without creating the topic yet (nsqd creates it before the checks)."""
        try:
            params = parse_query(request.query)
        except QueryError:
            return error(400, "INVALID_REQUEST")
        name = _first(params, b"topic")
        if name is None:
            return error(400, "MISSING_ARG_TOPIC")
        if not is_valid_name(name):
            return error(400, "INVALID_TOPIC")
        return params, name.decode()

    def _ensure_topic(self, name: str) -> Topic:
        return self.engine.ensure_topic(name, ephemeral=is_ephemeral(name), origin=NSQ_ORIGIN)

    def _pub(self, request: Request, _: str) -> Response | NeedBody:
        refused = self._refuse_unauthenticated()
        if refused is not None:
            return refused
        max_size = self.limits.max_msg_size
        if request.content_length is not None and request.content_length > max_size:
            return error(413, "MSG_TOO_BIG")

        def complete(body: bytes) -> Response:
            if len(body) > max_size:
                return error(413, "MSG_TOO_BIG")
            if not body:
                return error(400, "MSG_EMPTY")
            found = self._topic_param(request)
            if isinstance(found, Response):
                return found
            params, topic = found
            delay_ms = 0
            raw_defer = _first(params, b"defer")
            if raw_defer is not None:
                # strconv.ParseInt(s, 10, 64) then 0 <= defer <= --max-req-timeout.
                text = _text(raw_defer)
                if not _GO_INT.fullmatch(text) or abs(int(text)) > _INT64_MAX:
                    return error(400, "INVALID_DEFER")
                delay_ms = int(text)
                if delay_ms < 0 or delay_ms > self.limits.max_req_timeout_ms:
                    return error(400, "INVALID_DEFER")
            if self.engine.storage.failure is not None or self.engine.publish_refusal(topic) is not None:
                return STORAGE_FAILED  # nsqd answers any failed PutMessage so
            self._ensure_topic(topic)
            self.engine.publish(topic, body, delay=delay_ms / 1000, origin=NSQ_ORIGIN, client=_client(request))
            self.traffic.messages_in += 1
            return PUBLISHED

        # One byte over the limit tells "too big" from "exactly the limit" (nsqd's LimitReader).
        return NeedBody(max_size + 1, complete)

    def _mpub(self, request: Request, _: str) -> Response | NeedBody:
        refused = self._refuse_unauthenticated()
        if refused is not None:
            return refused
        limits = self.limits
        if request.content_length is not None and request.content_length > limits.max_body_size:
            return error(413, "BODY_TOO_BIG")
        found = self._topic_param(request)
        if isinstance(found, Response):
            return found
        params, topic = found
        raw_binary = _first(params, b"binary")
        # Text mode is the default; a value nsqd does not know counts as binary.
        binary = raw_binary is not None and BOOL_PARAMS.get(_text(raw_binary), True)
        read_max = limits.max_body_size + 1

        def complete(body: bytes) -> Response:
            bodies: list[bytes] | ProtocolError | Response
            if binary:
                if len(body) >= read_max:
                    # nsqd reads binary bodies unbounded when there is no Content-Length
                    # (a chunked upload); polymq holds them to --max-body-size too.
                    return error(413, "BODY_TOO_BIG")
                bodies = parse_mpub_body(body, limits)
                if isinstance(bodies, ProtocolError):
                    # readMPUB's code without its "E_" prefix: BAD_BODY or BAD_MESSAGE.
                    return error(413, bodies.code[2:])
            else:
                bodies = _split_text_mpub(body, read_max, limits.max_msg_size)
                if isinstance(bodies, Response):
                    return bodies
            if self.engine.storage.failure is not None or self.engine.publish_refusal(topic, len(bodies)) is not None:
                return STORAGE_FAILED
            # The topic is created only for a valid batch (nsqd creates it first).
            self._ensure_topic(topic)
            if bodies:
                self.engine.publish_many(topic, bodies, origin=NSQ_ORIGIN, client=_client(request))
                self.traffic.messages_in += len(bodies)
            return PUBLISHED

        return NeedBody(read_max, complete)

    # -- topics --------------------------------------------------------------------------------

    def _existing_topic(self, request: Request, *, check_name: bool) -> Topic | Response:
        try:
            params = parse_query(request.query)
        except QueryError:
            return error(400, "INVALID_REQUEST")
        name = _first(params, b"topic")
        if name is None:
            return error(400, "MISSING_ARG_TOPIC")
        # /topic/empty checks the name; delete, pause and unpause answer 404 for any unknown one.
        if check_name and not is_valid_name(name):
            return error(400, "INVALID_TOPIC")
        topic = self.engine.topic(_text(name))
        if topic is None:
            return error(404, "TOPIC_NOT_FOUND")
        return topic

    def _topic_create(self, request: Request, _: str) -> Response:
        found = self._topic_param(request)
        if isinstance(found, Response):
            return found
        self._ensure_topic(found[1])
        return CHANGED

    def _topic_delete(self, request: Request, _: str) -> Response:
        topic = self._existing_topic(request, check_name=False)
        if isinstance(topic, Response):
            return topic
        self.engine.delete_topic(topic.name)
        return CHANGED

    def _topic_empty(self, request: Request, _: str) -> Response:
        topic = self._existing_topic(request, check_name=True)
        if isinstance(topic, Response):
            return topic
        topic.empty()
        return CHANGED

    def _topic_pause(self, request: Request, _: str) -> Response:
        return self._set_topic_paused(request, True)

    def _topic_unpause(self, request: Request, _: str) -> Response:
        return self._set_topic_paused(request, False)

    def _set_topic_paused(self, request: Request, paused: bool) -> Response:
        topic = self._existing_topic(request, check_name=False)
        if isinstance(topic, Response):
            return topic
        topic.set_paused(paused)
        return CHANGED

    # -- channels ------------------------------------------------------------------------------

    def _topic_and_channel(self, request: Request) -> tuple[Topic, str] | Response:
        """getExistingTopicFromQuery: both names valid, the topic must exist."""
        try:
            params = parse_query(request.query)
        except QueryError:
            return error(400, "INVALID_REQUEST")
        topic_name = _first(params, b"topic")
        if topic_name is None:
            return error(400, "MISSING_ARG_TOPIC")
        if not is_valid_name(topic_name):
            return error(400, "INVALID_ARG_TOPIC")
        channel = _first(params, b"channel")
        if channel is None:
            return error(400, "MISSING_ARG_CHANNEL")
        if not is_valid_name(channel):
            return error(400, "INVALID_ARG_CHANNEL")
        topic = self.engine.topic(topic_name.decode())
        if topic is None:
            return error(404, "TOPIC_NOT_FOUND")
        return topic, channel.decode()

    def _existing_channel(self, request: Request) -> tuple[Topic, Queue] | Response:
        found = self._topic_and_channel(request)
        if isinstance(found, Response):
            return found
        topic, channel = found
        queue = find_channel(topic, channel)
        if queue is None:
            return error(404, "CHANNEL_NOT_FOUND")
        return topic, queue

    def _channel_create(self, request: Request, _: str) -> Response:
        found = self._topic_and_channel(request)
        if isinstance(found, Response):
            return found
        topic, channel = found
        if find_channel(topic, channel) is None:
            ensure_channel(self.engine, topic.name, channel)
        return CHANGED

    def _channel_delete(self, request: Request, _: str) -> Response:
        found = self._existing_channel(request)
        if isinstance(found, Response):
            return found
        topic, queue = found
        if queue.owner_topic == topic.name:
            self.engine.delete_queue(queue.name)
        else:
            # A queue of another protocol bound to this topic: leave it, just stop the copies.
            self.engine.unbind(queue.name, topic.name)
        return CHANGED

    def _channel_empty(self, request: Request, _: str) -> Response:
        found = self._existing_channel(request)
        if isinstance(found, Response):
            return found
        found[1].empty()
        return CHANGED

    def _channel_pause(self, request: Request, _: str) -> Response:
        return self._set_channel_paused(request, True)

    def _channel_unpause(self, request: Request, _: str) -> Response:
        return self._set_channel_paused(request, False)

    def _set_channel_paused(self, request: Request, paused: bool) -> Response:
        found = self._existing_channel(request)
        if isinstance(found, Response):
            return found
        found[1].set_paused(paused)
        return CHANGED

    # -- /config/<opt> -------------------------------------------------------------------------

    def options(self) -> dict[str, Any]:
        """nsqd's Options by their config names (getOptByCfgName), with polymq's values."""
        limits = self.limits
        nsq = self.nsq
        auth_address = getattr(nsq, "auth_http_address", None)
        return {
            "id": node_id(nsq.hostname),
            "log_level": self.log_level,
            "log_prefix": "[nsqd] ",
            "tcp_address": f"{self.bind_host}:{nsq.tcp_port}",
            "http_address": f"{self.bind_host}:{nsq.http_port}",
            "https_address": f"{self.bind_host}:{HTTPS_PORT}",
            "broadcast_address": self._broadcast_address(),
            # nsqd sets both to the ports it listens on when they are not given.
            "broadcast_tcp_port": getattr(nsq, "broadcast_tcp_port", 0) or nsq.tcp_port,
            "broadcast_http_port": getattr(nsq, "broadcast_http_port", 0) or nsq.http_port,
            "nsqlookupd_tcp_addresses": self.nsqlookupd_tcp_addresses,
            "auth_http_addresses": [auth_address] if auth_address else [],
            "auth_http_request_method": "get",
            "http_client_connect_timeout": HTTP_CLIENT_CONNECT_TIMEOUT_NS,
            "http_client_request_timeout": HTTP_CLIENT_REQUEST_TIMEOUT_NS,
            "data_path": str(getattr(nsq, "data_path", "") or ""),
            "mem_queue_size": MEM_QUEUE_SIZE,
            "max_bytes_per_file": MAX_BYTES_PER_FILE,
            "sync_every": SYNC_EVERY,
            "sync_timeout": SYNC_TIMEOUT_NS,
            "queue_scan_selection_count": QUEUE_SCAN_SELECTION_COUNT,
            "queue_scan_worker_pool_max": QUEUE_SCAN_WORKER_POOL_MAX,
            "msg_timeout": limits.msg_timeout_ms * NS_PER_MS,
            "max_msg_timeout": limits.max_msg_timeout_ms * NS_PER_MS,
            "max_msg_size": limits.max_msg_size,
            "max_body_size": limits.max_body_size,
            "max_req_timeout": limits.max_req_timeout_ms * NS_PER_MS,
            "max_heartbeat_interval": limits.max_heartbeat_interval_ms * NS_PER_MS,
            "max_rdy_count": limits.max_rdy_count,
            "max_output_buffer_size": limits.max_output_buffer_size,
            "max_output_buffer_timeout": limits.max_output_buffer_timeout_ms * NS_PER_MS,
            "min_output_buffer_timeout": limits.min_output_buffer_timeout_ms * NS_PER_MS,
            "output_buffer_timeout": limits.output_buffer_timeout_ms * NS_PER_MS,
            "max_channel_consumers": 0,
            "statsd_address": "",
            "statsd_prefix": "nsq.%s",
            "statsd_interval": STATSD_INTERVAL_NS,
            "statsd_mem_stats": True,
            "statsd_udp_packet_size": STATSD_UDP_PACKET_SIZE,
            "statsd_exclude_ephemeral": False,
            "e2e_processing_latency_window_time": E2E_WINDOW_NS,
            "e2e_processing_latency_percentiles": [],
            "tls_cert": "",
            "tls_key": "",
            "tls_client_auth_policy": "",
            "tls_root_ca_file": "",
            # polymq's --tls-required applies to the TCP protocol only: nsqd's "tcp-https".
            "tls_required": TLS_REQUIRED_EXCEPT_HTTP if limits.tls_required else TLS_NOT_REQUIRED,
            "tls_min_version": TLS_VERSION_10,
            "deflate": limits.deflate_enabled,
            "max_deflate_level": limits.max_deflate_level,
            "snappy": limits.snappy_enabled,
        }

    def _config_get(self, request: Request, option: str) -> Response:
        options = self.options()
        if option not in options:
            return error(400, "INVALID_OPTION")
        return ok_json(options[option])

    def _config_put(self, request: Request, option: str) -> NeedBody:
        read_max = self.limits.max_msg_size + 1

        def complete(body: bytes) -> Response:
            # nsqd reads the value before it looks at the option name.
            if len(body) >= read_max or not body:
                return error(413, "INVALID_VALUE")
            if option == "nsqlookupd_tcp_addresses":
                try:
                    value = json.loads(body)
                except ValueError:
                    return error(400, "INVALID_VALUE")
                if value is not None and not (isinstance(value, list) and all(isinstance(v, str) for v in value)):
                    return error(400, "INVALID_VALUE")
                self.nsqlookupd_tcp_addresses = value
                log.info("nsqlookupd_tcp_addresses set to %s", value)
                if self.lookupd is not None:
                    self.lookupd.set_addresses(value)
            elif option == "log_level":
                level = LOG_LEVELS.get(body.decode("utf-8", "replace").lower())
                if level is None:
                    return error(400, "INVALID_VALUE")
                self.log_level = level
                _apply_log_level(level)
            else:
                return error(400, "INVALID_OPTION")
            return self._config_get(request, option)

        return NeedBody(read_max, complete)

    # -- /stats --------------------------------------------------------------------------------

    def _stats(self, request: Request, _: str) -> Response:
        try:
            params = parse_query(request.query)
        except QueryError:
            return error(400, "INVALID_REQUEST")

        def param(key: bytes) -> str:
            raw = _first(params, key)
            return "" if raw is None else _text(raw)

        include_clients = BOOL_PARAMS.get(param(b"include_clients"), True)
        include_mem = BOOL_PARAMS.get(param(b"include_mem"), True)
        topics, producers = self.collect_stats(param(b"topic"), param(b"channel"), include_clients)
        memory = memory_stats(self.gc_pauses) if include_mem else None
        health = self._health()
        if param(b"format") != "json":
            return ok_text(self.format_stats_text(topics, producers, memory, health))
        body: dict[str, Any] = {
            "version": self.limits.version,
            "health": health,
            "start_time": self.nsq.start_time,
            "topics": topics,
        }
        if memory is not None:
            body["memory"] = memory
        body["producers"] = producers
        return ok_json(body)

    def collect_stats(
        self, topic_filter: str, channel_filter: str, include_clients: bool
    ) -> tuple[list[dict[str, Any]] | None, list[dict[str, Any]] | None]:
        """nsqd's GetStats: (topics, producers); both None when the topic filter matches nothing."""
        engine = self.engine
        if not topic_filter:
            topics = sorted(engine.topics.values(), key=lambda t: t.name)
        elif topic_filter in engine.topics:
            topics = [engine.topics[topic_filter]]
        else:
            return None, None
        clients = self.nsq.client_stats() if include_clients else []
        by_channel: dict[tuple[str | None, str | None], list[dict[str, Any]]] = {}
        for client in clients:
            by_channel.setdefault((client.get("_topic"), client.get("_channel")), []).append(client)
        out: list[dict[str, Any]] = []
        # On a cluster, the node's share: summed over the nodes (nsqadmin, nsq_stat), each message counts once.
        view = engine.cluster()
        for topic in topics:
            channels = sorted(((channel_name(topic, q), q) for q in topic.queues), key=lambda pair: pair[0])
            if channel_filter:
                channels = [pair for pair in channels if pair[0] == channel_filter]
                if not channels:
                    continue
            channel_stats = []
            for name, queue in channels:
                members = by_channel.get((topic.name, name), []) if include_clients else None
                share = queue_share(view, queue)
                channel_stats.append({
                    "channel_name": name,
                    "depth": share.depth,
                    "backend_depth": share.stored,  # on disk only (nsqd: in its diskqueue)
                    "in_flight_count": len(queue.in_flight),
                    "deferred_count": share.deferred,
                    "message_count": queue.message_count,
                    "requeue_count": queue.requeue_count,
                    "timeout_count": queue.timeout_count,
                    # polymq's own, beside nsqd's keys: TTLs that ran out, messages moved to `<queue>.dead`.
                    "expired_count": queue.expired_count,
                    "dead_letter_count": queue.dead_letter_count,
                    # Every consumer of the queue, whatever its protocol, competes for it.
                    "client_count": len(queue.consumers),
                    "clients": None if members is None else [clean_client(c, topic_filter) for c in members],
                    "paused": queue.paused,
                    "e2e_processing_latency": {"count": 0, "percentiles": None},
                })
            backlog = topic_share(view, topic)
            out.append({
                "topic_name": topic.name,
                "channels": channel_stats,
                "depth": backlog.depth,
                "backend_depth": backlog.stored,
                "message_count": topic.message_count,
                "message_bytes": topic.message_bytes,
                "paused": topic.paused,
                "e2e_processing_latency": {"count": 0, "percentiles": None},
            })
        producers = None
        if include_clients:
            # nsqd's typeProducer: any TCP client that has published, subscribed or not.
            found = [clean_client(c, topic_filter) for c in clients if c.get("pub_counts")]
            producers = found or None
        return out, producers

    def format_stats_text(
        self,
        topics: list[dict[str, Any]] | None,
        producers: list[dict[str, Any]] | None,
        memory: dict[str, int] | None,
        health: str,
    ) -> str:
        """nsqd's printStats, write for write (so blank lines fall where nsqd puts them)."""
        now = self.now()
        start = self.nsq.start_time
        out = [
            f"nsqd v{self.limits.version} (built w/{self.python_version})\n",
            f"start_time {go_rfc3339(start)}\n",
            f"uptime {go_duration(int((now - start) * NS_PER_S))}\n",
            f"\nHealth: {health}\n",
        ]
        if memory is not None:
            out.append("\nMemory:\n")
            out += [f"   {key:<25}\t{memory[key]}\n" for key in MEMORY_KEYS]
        # "Topics:" gets no newline of its own: every topic line starts with one.
        out.append("\nTopics:" if topics else "\nTopics: None\n")
        for topic in topics or ():
            prefix = "*P " if topic["paused"] else "   "
            out.append(f"\n{prefix}[{topic['topic_name']:<15}] depth: {topic['depth']:<5} "
                       f"be-depth: {topic['backend_depth']:<5} msgs: {topic['message_count']:<8} e2e%: \n")
            for channel in topic["channels"]:
                prefix = "   *P " if channel["paused"] else "      "
                out.append(
                    f"{prefix}[{channel['channel_name']:<25}] depth: {channel['depth']:<5} "
                    f"be-depth: {channel['backend_depth']:<5} inflt: {channel['in_flight_count']:<4} "
                    f"def: {channel['deferred_count']:<4} re-q: {channel['requeue_count']:<5} "
                    f"timeout: {channel['timeout_count']:<5} msgs: {channel['message_count']:<8} e2e%: \n"
                )
                out += [f"        {self.format_client(client, now)}\n" for client in channel["clients"] or ()]
        if not producers:
            out.append("\nProducers: None\n")
        else:
            out.append("\nProducers:\n")
            out += [f"   {self.format_client(client, now)}\n" for client in producers]
        return "".join(out)

    @staticmethod
    def format_client(client: dict[str, Any], now: float) -> str:
        """ClientV2Stats.String()."""
        connected = go_duration(max(0, int(now) - int(client.get("connect_ts", 0))) * NS_PER_S)
        ident = f"{client.get('hostname', '')}:{_go_split_port(client.get('remote_address', ''))} " \
                f"{client.get('user_agent', '')}"
        version = client.get("version", "V2")
        pub_counts = client.get("pub_counts") or []
        if pub_counts:
            total = sum(p["count"] for p in pub_counts)
            topics = ",".join(f"{p['topic']}={p['count']}" for p in pub_counts)
            return f"[{version} {ident:<21}] msgs: {total:<8} topics: {topics} connected: {connected}"
        return (f"[{version} {ident:<21}] state: {client.get('state', 0)} "
                f"inflt: {client.get('in_flight_count', 0):<4} rdy: {client.get('ready_count', 0):<4} "
                f"fin: {client.get('finish_count', 0):<8} re-q: {client.get('requeue_count', 0):<8} "
                f"msgs: {client.get('message_count', 0):<8} connected: {connected}")


# ---------------------------------------------------------------------------------------------
# Helpers shared with the server module and the tests


def channel_name(topic: Topic, queue: Queue) -> str:
    """A bound queue as an NSQ channel: its name without the `t/` prefix (other queues as they are)."""
    prefix = topic.name + "/"
    return queue.name[len(prefix):] if queue.name.startswith(prefix) else queue.name


def find_channel(topic: Topic, channel: str) -> Queue | None:
    for queue in topic.queues:
        if channel_name(topic, queue) == channel:
            return queue
    return None


def clean_client(client: dict[str, Any], topic_filter: str = "") -> dict[str, Any]:
    """A client as nsqd's JSON shows it: its key order, omitempty fields dropped, routing keys gone.

    With a topic filter, pub_counts keep only that topic (ClientV2Stats.Stats(topicName)).
    """
    out: dict[str, Any] = {}
    for key in CLIENT_KEYS:
        if key not in client:
            continue
        value = client[key]
        if key == "pub_counts" and value and topic_filter:
            value = [p for p in value if p.get("topic") == topic_filter]
        if key in CLIENT_OMITEMPTY and not value:
            continue
        out[key] = value
    for key, value in client.items():
        if key not in out and key not in CLIENT_KEYS and not key.startswith("_"):
            out[key] = value
    return out


def _split_text_mpub(body: bytes, read_max: int, max_msg_size: int) -> list[bytes] | Response:
    """doMPUB text mode: one message per line, empty lines skipped, checks in nsqd's order."""
    bodies: list[bytes] = []
    total = 0
    start = 0
    end = len(body)
    while start < end:
        newline = body.find(b"\n", start)
        stop = end if newline < 0 else newline + 1
        total += stop - start
        if total >= read_max:
            return error(413, "BODY_TOO_BIG")
        line = body[start : stop - 1] if newline >= 0 else body[start:stop]
        start = stop
        if not line:
            continue
        if len(line) > max_msg_size:
            return error(413, "MSG_TOO_BIG")
        bodies.append(line)
    return bodies


def _html_escape(text: str) -> str:
    return (text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
            .replace('"', "&#34;").replace("'", "&#39;"))


def _apply_log_level(level: int) -> None:
    python_level = {1: logging.DEBUG, 2: logging.INFO, 3: logging.WARNING, 4: logging.ERROR,
                    5: logging.CRITICAL}[level]
    logging.getLogger("polymq").setLevel(python_level)

# nsqd answers a publish its storage could not take with 503 EXITING (http.go doPUB).
STORAGE_FAILED = error(503, "EXITING")
