"""`polymq conformance nsq`: black-box checks of any nsqd-compatible server (TCP V2 and HTTP API).

Every check is written from how nsqd v1.3.0 behaves on the wire, so the suite passes against
the original nsqd with default options as well as against polymq (docs/protocols/nsq.md). Where
polymq deliberately differs from a defect of nsqd, both forms are accepted.

Each check opens its own connections (the blocking client of `polymq.clients.nsq`, every read with
a deadline, so a broken server makes a check fail rather than hang), uses topic names unique to the
run, and deletes its topics through the HTTP API afterwards. Only `polymq.clients`, `polymq.codecs`
and the shared runner are imported (docs/architecture.md).
"""

from __future__ import annotations

import contextlib
import http.client
import json
import re
import secrets
import socket
import struct
import time
import urllib.parse
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import attrs
import click

from polymq.clients import nsq
from polymq.clients.tcp import Closed
from polymq.codecs import nsq_client as nc
from polymq.codecs.compression import SNAPPY_STREAM_IDENTIFIER, DecompressionError
from polymq.codecs.nsq import (
    CLOSE_WAIT,
    FRAME_TYPE_ERROR,
    FRAME_TYPE_MESSAGE,
    FRAME_TYPE_RESPONSE,
    HEARTBEAT,
    MAX_LINE_LENGTH,
    MAX_NAME_LENGTH,
    MESSAGE_OVERHEAD,
    MSG_ID_LENGTH,
    OK,
)
from polymq.conformance import runner
from polymq.conformance.runner import CheckFailed, Registry, expect_equal

# ---------------------------------------------------------------------------------------------
# What nsqd v1.3.0 does with default options (docs/protocols/nsq.md)

MAX_RDY_COUNT = 2500  # --max-rdy-count
MAX_MSG_SIZE = 1048576  # --max-msg-size (PUB, DPUB, each MPUB part)
MAX_BODY_SIZE = 5242880  # --max-body-size (MPUB, IDENTIFY, AUTH)
MAX_REQ_TIMEOUT_MS = 3_600_000  # --max-req-timeout (also the DPUB limit)
MAX_MSG_TIMEOUT_MS = 900_000  # --max-msg-timeout
DEFAULT_MSG_TIMEOUT_MS = 60_000  # --msg-timeout
DEFAULT_OUTPUT_BUFFER_SIZE = 16384  # client default output buffer
DEFAULT_OUTPUT_BUFFER_TIMEOUT_MS = 250  # client default output buffer timeout
MAX_DEFLATE_LEVEL = 6  # --max-deflate-level
# MPUB message count limit: (max_body_size - 4) / 5 (docs/protocols/nsq.md).
MAX_MPUB_COUNT = (MAX_BODY_SIZE - 4) // 5
# Feature-negotiation reply keys, in nsqd's order (docs/protocols/nsq.md, observed).
IDENTIFY_KEYS = (
    "max_rdy_count", "version", "max_msg_timeout", "msg_timeout", "tls_v1", "deflate", "deflate_level",
    "max_deflate_level", "snappy", "sample_rate", "auth_required", "output_buffer_size", "output_buffer_timeout",
)
# /info keys (docs/protocols/nsq.md).
INFO_KEYS = (
    "version", "broadcast_address", "hostname", "http_port", "tcp_port", "start_time", "max_heartbeat_interval",
    "max_output_buffer_size", "max_output_buffer_timeout", "max_deflate_level",
)
# /stats?format=json keys (docs/protocols/nsq.md, observed).
STATS_KEYS = ("version", "health", "start_time", "topics", "memory", "producers")
STATS_TOPIC_KEYS = (
    "topic_name", "channels", "depth", "backend_depth", "message_count", "message_bytes", "paused",
    "e2e_processing_latency",
)
STATS_CHANNEL_KEYS = (
    "channel_name", "depth", "backend_depth", "in_flight_count", "deferred_count", "message_count",
    "requeue_count", "timeout_count", "client_count", "clients", "paused", "e2e_processing_latency",
)
STATS_CLIENT_KEYS = (
    "client_id", "hostname", "version", "remote_address", "state", "ready_count", "in_flight_count",
    "message_count", "finish_count", "requeue_count", "connect_ts", "sample_rate", "deflate", "snappy",
    "user_agent", "tls", "tls_cipher_suite", "tls_version", "tls_negotiated_protocol",
    "tls_negotiated_protocol_is_mutual",
)
STATS_MEMORY_KEYS = (
    "heap_objects", "heap_idle_bytes", "heap_in_use_bytes", "heap_released_bytes", "gc_pause_usec_100",
    "gc_pause_usec_99", "gc_pause_usec_95", "next_gc_bytes", "gc_total_runs",
)
CLIENT_STATE_SUBSCRIBED = 3  # client states in stats (docs/protocols/nsq.md)
# /info values in nanoseconds / bytes from the defaults (docs/protocols/nsq.md).
MAX_HEARTBEAT_INTERVAL_NS = 60 * 10**9  # --max-heartbeat-interval 60 s
MAX_OUTPUT_BUFFER_SIZE = 65536  # --max-output-buffer-size 64 KiB
MAX_OUTPUT_BUFFER_TIMEOUT_NS = 30 * 10**9  # --max-output-buffer-timeout 30 s
NSQ_CONTENT_TYPE_HEADER = "X-NSQ-Content-Type"
NSQ_CONTENT_TYPE = "nsq; version=1.0"  # on every HTTP response but /ping's (nsqd's PlainText decorator)

# ---------------------------------------------------------------------------------------------
# Timing: the smallest values nsqd accepts, so timing checks stay short

FAST_HEARTBEAT_MS = 1000  # heartbeat_interval minimum (docs/protocols/nsq.md)
FAST_MSG_TIMEOUT_MS = 1000  # msg_timeout minimum (docs/protocols/nsq.md)
# How long a check watches for "nothing arrives" (a RDY cap, a deferral). Well above loopback
# latency and nsqd's 250 ms output-buffer flush, well below the 1 s delays it is checked against.
QUIET_S = 0.6
# nsqd closes a silent client at 2 x heartbeat interval (observed 2.0 s at 1000 ms); accept
# anything clearly later than one interval and not much later than two.
SILENT_CLOSE_MIN_S = 1.5
SILENT_CLOSE_SLACK_S = 1.5
# Deferral checks: DPUB / REQ / HTTP defer by this much; nothing may arrive in the first QUIET_S.
DEFER_MS = 1000
# Accepted difference between the message timestamp and this machine's clock.
CLOCK_SKEW_S = 60.0
# Cleanup must not make a run slow when the HTTP side is broken.
CLEANUP_TIMEOUT_S = 2.0

_HEX_ID = re.compile(rb"^[0-9a-f]{16}$")
_UNKNOWN_ID = b"0123456789abcdef"  # a well-formed id that no server has in flight
_SIZE = struct.Struct(">i")


# ---------------------------------------------------------------------------------------------
# Frames, described for failure lines


def frame_bytes(frame: nc.Frame) -> bytes:
    return _SIZE.pack(len(frame.data) + 4) + _SIZE.pack(frame.frame_type) + frame.data


def describe(frame: nc.Frame | None) -> str:
    if frame is None:
        return "nothing"
    if frame.frame_type == FRAME_TYPE_RESPONSE:
        return f"response frame {frame.data[:200]!r}"
    if frame.frame_type == FRAME_TYPE_ERROR:
        return f"error frame {frame.data[:200]!r}"
    if frame.frame_type == FRAME_TYPE_MESSAGE and len(frame.data) >= MESSAGE_OVERHEAD:
        msg = nc.decode_message(frame.data)
        return f"message frame (attempts {msg.attempts}, id {msg.msg_id!r}, body {msg.body[:60]!r})"
    return f"frame type {frame.frame_type} {frame.data[:60]!r}"


# ---------------------------------------------------------------------------------------------
# One TCP connection


class Conn(runner.CheckedConnection, nsq.Connection):
    """The NSQ client, its failures told as CheckFailed."""

    def send(self, data: bytes) -> None:
        try:
            nsq.Connection.send(self, data)
        except OSError as exc:
            # The server may close while we write (it errors early on a size). Reading tells
            # what it said before closing, so a send failure is not itself a verdict.
            if isinstance(exc, TimeoutError):
                raise CheckFailed("server stopped reading", got=str(exc)) from exc

    def poll(self, seconds: float, *, heartbeats: bool = False) -> nc.Frame | None:
        """The next frame within `seconds`, or None. Raises Closed. Heartbeats are skipped unless asked."""
        try:
            return self.next_frame(seconds, heartbeats=heartbeats)
        except DecompressionError as exc:
            raise CheckFailed("server's compressed stream does not decode", got=str(exc)) from exc
        except nc.FrameError as exc:
            raise CheckFailed("server sent bytes that are not NSQ frames", got=str(exc)) from exc

    # -- expectations --------------------------------------------------------------------------

    def expect_frame(self, what: str, expected: str, *, heartbeats: bool = False) -> nc.Frame:
        try:
            frame = self.poll(self.timeout, heartbeats=heartbeats)
        except Closed as exc:
            raise CheckFailed(what, expected, f"connection closed ({exc})") from exc
        if frame is None:
            raise CheckFailed(what, expected, f"nothing within {self.timeout} s")
        return frame

    def expect_response(self, what: str, data: bytes = OK) -> None:
        expected = f"response frame {data!r}"
        frame = self.expect_frame(what, expected)
        if frame.frame_type != FRAME_TYPE_RESPONSE or frame.data != data:
            raise CheckFailed(what, expected, describe(frame))

    def expect_ok(self, what: str) -> None:
        self.expect_response(what, OK)

    def expect_error(self, what: str, *texts: str | bytes, fatal: bool = True) -> None:
        """An error frame with one of `texts`; when fatal, the server must then close."""
        wanted = [t.encode() if isinstance(t, str) else t for t in texts]
        expected = " or ".join(f"error frame {t!r}" for t in wanted)
        frame = self.expect_frame(what, expected)
        if frame.frame_type != FRAME_TYPE_ERROR or frame.data not in wanted:
            raise CheckFailed(what, expected, describe(frame))
        if fatal:
            self.expect_closed(f"{what}: fatal error {frame.data!r} must close the connection")

    def expect_closed(self, what: str, within: float | None = None) -> float:
        """Wait for the server to close; returns how long it took. Heartbeats are ignored."""
        start = time.monotonic()
        limit = self.timeout if within is None else within
        try:
            frame = self.poll(limit)
        except Closed:
            return time.monotonic() - start
        got = f"still open after {limit:.1f} s" if frame is None else describe(frame)
        raise CheckFailed(what, "connection closed", got)

    def expect_quiet(self, what: str, seconds: float = QUIET_S, *, answer_heartbeats: bool = False) -> None:
        """Nothing but heartbeats arrives for `seconds`, and the connection stays open."""
        deadline = time.monotonic() + seconds
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            try:
                frame = self.poll(remaining, heartbeats=True)
            except Closed as exc:
                raise CheckFailed(what, f"nothing for {seconds} s, connection open", "connection closed") from exc
            if frame is None:
                return
            if frame.frame_type == FRAME_TYPE_RESPONSE and frame.data == HEARTBEAT:
                if answer_heartbeats:
                    self.send(nc.nop())
                continue
            raise CheckFailed(what, f"nothing for {seconds} s", describe(frame))

    def expect_message(self, what: str) -> nc.Message:
        frame = self.expect_frame(what, "a message frame")
        if frame.frame_type != FRAME_TYPE_MESSAGE or len(frame.data) < MESSAGE_OVERHEAD:
            raise CheckFailed(what, "a message frame", describe(frame))
        return nc.decode_message(frame.data)

    def identify(self, data: dict[str, Any], what: str = "IDENTIFY") -> dict[str, Any] | None:
        """Send IDENTIFY; return the negotiation reply (or None after a plain OK)."""
        self.send(nc.identify(data))
        if not data.get("feature_negotiation"):
            self.expect_ok(what)
            return None
        frame = self.expect_frame(what, "a JSON response frame")
        return parse_identify_reply(what, frame)


def parse_identify_reply(what: str, frame: nc.Frame) -> dict[str, Any]:
    if frame.frame_type != FRAME_TYPE_RESPONSE:
        raise CheckFailed(what, "a JSON response frame", describe(frame))
    try:
        reply = json.loads(frame.data)
    except ValueError as exc:
        raise CheckFailed(what, "a JSON response frame", describe(frame)) from exc
    if not isinstance(reply, dict):
        raise CheckFailed(what, "a JSON object", describe(frame))
    return reply


# ---------------------------------------------------------------------------------------------
# HTTP


@attrs.frozen(slots=True)
class HTTPReply:
    status: int
    headers: dict[str, str]  # lower-cased names
    body: bytes

    def header(self, name: str) -> str | None:
        return self.headers.get(name.lower())

    def json(self, what: str) -> Any:
        try:
            return json.loads(self.body)
        except ValueError as exc:
            raise CheckFailed(what, "a JSON body", f"{self.status} {self.body[:200]!r}") from exc

    def show(self) -> str:
        return f"{self.status} {self.body[:200]!r}"


# ---------------------------------------------------------------------------------------------
# The per-check context


@attrs.define(slots=True)
class Target:
    """What a check gets: the server's addresses, the timeout, unique names and cleanup."""

    tcp: tuple[str, int]
    http: tuple[str, int]
    timeout: float
    check_name: str
    run: runner.RunState = attrs.Factory(lambda: runner.RunState())
    topics: list[str] = attrs.Factory(list)
    conns: list[Conn] = attrs.Factory(list)

    # -- names ---------------------------------------------------------------------------------

    def topic(self, suffix: str = "") -> str:
        """A topic name no other check or run uses; it is deleted when the check ends."""
        stem = runner.name_stem(self.check_name, 30)
        name = f"cf-{stem}-{secrets.token_hex(4)}{suffix}"
        self.topics.append(name)
        return name

    @staticmethod
    def channel(label: str = "c") -> str:
        return f"{label}-{secrets.token_hex(3)}"

    # -- TCP -----------------------------------------------------------------------------------

    def connect(self, *, magic: bool = True) -> Conn:
        conn = Conn(self.tcp, self.timeout, magic=magic)
        self.conns.append(conn)
        return conn

    def refused(self, command: bytes, what: str, *texts: str | bytes, fatal: bool = True) -> Conn:
        """A new connection sends `command` and gets an error frame with one of `texts` (fatal: then it is closed)."""
        conn = self.connect()
        conn.send(command)
        conn.expect_error(what, *texts, fatal=fatal)
        return conn

    def consumer(
        self, topic: str, channel: str, rdy: int | None = 1, identify: dict[str, Any] | None = None
    ) -> Conn:
        conn = self.connect()
        if identify is not None:
            conn.identify(identify)
        conn.send(nc.sub(topic, channel))
        conn.expect_ok(f"SUB {topic} {channel}")
        if rdy is not None:
            conn.send(nc.rdy(rdy))
        return conn

    def publish(self, topic: str, *bodies: bytes) -> None:
        conn = self.connect()
        for body in bodies:
            conn.send(nc.pub(topic, body))
            conn.expect_ok(f"PUB {topic} ({len(body)} bytes)")
        conn.close()

    # -- HTTP ----------------------------------------------------------------------------------

    def request(
        self, method: str, path: str, params: dict[str, str] | None = None, body: bytes | None = None,
        *, timeout: float | None = None,
    ) -> HTTPReply:
        if params:
            path = f"{path}?{urllib.parse.urlencode(params)}"
        body = body or b""
        # A hand-written request rather than http.client's: a server may answer (413) and close
        # before reading a large body, and the answer must still be read after the send fails.
        head = (f"{method} {path} HTTP/1.1\r\nHost: {self.http[0]}:{self.http[1]}\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
        try:
            sock = socket.create_connection(self.http, timeout=timeout or self.timeout)
        except OSError as exc:
            raise CheckFailed(f"HTTP {method} {path}", "an HTTP response", f"{type(exc).__name__}: {exc}") from exc
        try:
            with contextlib.suppress(OSError):
                sock.sendall(head + body)
            response = http.client.HTTPResponse(sock, method=method)
            response.begin()
            data = response.read()
            headers = {k.lower(): v for k, v in response.getheaders()}
            return HTTPReply(response.status, headers, data)
        except (OSError, http.client.HTTPException) as exc:
            raise CheckFailed(f"HTTP {method} {path}", "an HTTP response", f"{type(exc).__name__}: {exc}") from exc
        finally:
            sock.close()

    def expect_http(self, method: str, path: str, params: dict[str, str] | None = None,
                    body: bytes | None = None, *, status: int = 200, text: bytes | None = None) -> HTTPReply:
        reply = self.request(method, path, params, body)
        what = f"HTTP {method} {path} {params or ''}".rstrip()
        if reply.status != status or (text is not None and reply.body != text):
            expected = f"{status} {text!r}" if text is not None else f"status {status}"
            raise CheckFailed(what, expected, reply.show())
        return reply

    def expect_http_error(self, method: str, path: str, params: dict[str, str] | None, status: int,
                          message: str, body: bytes | None = None) -> HTTPReply:
        reply = self.request(method, path, params, body)
        what = f"HTTP {method} {path} {params or ''}".rstrip()
        expected = f'{status} {{"message":"{message}"}}'
        try:
            parsed = json.loads(reply.body)
        except ValueError:
            parsed = None
        if reply.status != status or parsed != {"message": message}:
            raise CheckFailed(what, expected, reply.show())
        content_type = reply.header("Content-Type") or ""
        if not content_type.startswith("application/json"):
            raise CheckFailed(f"{what}: error Content-Type", "application/json; charset=utf-8", content_type)
        return reply

    def stats(self, **params: str) -> dict[str, Any]:
        reply = self.expect_http("GET", "/stats", {"format": "json", **params})
        stats = reply.json("GET /stats?format=json")
        if not isinstance(stats, dict):
            raise CheckFailed("GET /stats?format=json", "a JSON object", reply.show())
        return stats

    def topic_stats(self, topic: str) -> dict[str, Any] | None:
        for entry in self.stats().get("topics") or []:
            if entry.get("topic_name") == topic:
                return entry
        return None

    def channel_stats(self, topic: str, channel: str) -> dict[str, Any] | None:
        entry = self.topic_stats(topic)
        for chan in (entry or {}).get("channels") or []:
            if chan.get("channel_name") == channel:
                return chan
        return None

    def wait_for(self, what: str, expected: str, probe: Callable[[], Any]) -> Any:
        """Poll `probe` (every 50 ms, up to the timeout) until it returns something truthy."""
        deadline = time.monotonic() + self.timeout
        while True:
            value = probe()
            if value:
                return value
            if time.monotonic() > deadline:
                raise CheckFailed(what, expected, f"not within {self.timeout} s")
            time.sleep(0.05)

    # -- cleanup -------------------------------------------------------------------------------

    def cleanup(self) -> None:
        for conn in self.conns:
            conn.close()
        for topic in self.topics:
            if self.run.cleanup_failed:
                return
            try:
                self.request("POST", "/topic/delete", {"topic": topic}, timeout=CLEANUP_TIMEOUT_S)
            except CheckFailed:
                self.run.cleanup_failed = True


checks: Registry[Target] = Registry()
check = checks.check


def expect_keys(what: str, obj: Any, keys: tuple[str, ...]) -> None:
    if not isinstance(obj, dict):
        raise CheckFailed(what, "a JSON object", repr(obj)[:200])
    missing = [k for k in keys if k not in obj]
    if missing:
        raise CheckFailed(f"{what}: keys missing", list(keys), f"missing {missing}")


def check_message_shape(what: str, msg: nc.Message, body: bytes, attempts: int = 1) -> None:
    if not _HEX_ID.match(msg.msg_id):
        raise CheckFailed(f"{what}: message id", "16 lowercase hex characters", msg.msg_id)
    expect_equal(f"{what}: attempts", attempts, msg.attempts)
    expect_equal(f"{what}: body", body, msg.body)


# =============================================================================================
# TCP framing


@check("magic-bad")
def _magic_bad(t: Target) -> None:
    """A connection opening with a magic other than '  V2' gets E_BAD_PROTOCOL and is closed."""
    conn = t.connect(magic=False)
    conn.send(b"  V1")
    expected = _SIZE.pack(4 + 14) + _SIZE.pack(FRAME_TYPE_ERROR) + b"E_BAD_PROTOCOL"
    got, closed = conn.read_until_closed()
    if not closed:
        raise CheckFailed("magic '  V1': E_BAD_PROTOCOL frame then close", f"{expected!r} then close",
                          f"{got!r}, connection still open after {t.timeout} s")
    expect_equal("magic '  V1': bytes before close", expected, got)


@check("ok-frame-bytes")
def _ok_frame_bytes(t: Target) -> None:
    """A PUB is answered by the OK response frame, byte for byte."""
    conn = t.connect()
    conn.send(nc.pub(t.topic(), b"x"))
    frame = conn.expect_frame("PUB", "OK frame")
    expect_equal("PUB reply bytes", b"\x00\x00\x00\x06\x00\x00\x00\x00OK", frame_bytes(frame))


@check("command-case-sensitive")
def _case_sensitive(t: Target) -> None:
    """Commands are case-sensitive: 'nop' and 'pub' are E_INVALID invalid commands."""
    t.refused(b"nop\n", "'nop' (lower case)", "E_INVALID invalid command nop")
    t.refused(b"pub " + t.topic().encode() + b"\n", "'pub t' (lower case)", "E_INVALID invalid command pub")


@check("command-invalid")
def _command_invalid(t: Target) -> None:
    """An unknown command gets E_INVALID invalid command and closes the connection."""
    t.refused(b"FOO bar\n", "'FOO bar'", "E_INVALID invalid command FOO")


@check("crlf-accepted")
def _crlf(t: Target) -> None:
    """A command line ending in \\r\\n is read as one ending in \\n (the \\r is stripped)."""
    topic = t.topic()
    conn = t.connect()
    conn.send(b"NOP\r\n")
    conn.send(b"PUB " + topic.encode() + b"\r\n" + _SIZE.pack(4) + b"crlf")
    conn.expect_ok("'PUB t\\r\\n' (the \\r is stripped)")
    consumer = t.consumer(topic, t.channel())
    check_message_shape("message published with \\r\\n", consumer.expect_message("SUB + RDY 1"), b"crlf")


@check("extra-params-ignored")
def _extra_params(t: Target) -> None:
    """Parameters beyond those a command takes are ignored (PUB, NOP)."""
    topic = t.topic()
    conn = t.connect()
    conn.send(b"PUB " + topic.encode() + b" extra\n" + _SIZE.pack(5) + b"extra")
    conn.expect_ok("'PUB t extra'")
    conn.send(b"NOP extra\n")
    conn.send(nc.pub(topic, b"after"))
    conn.expect_ok("'NOP extra' then PUB")
    consumer = t.consumer(topic, t.channel(), rdy=2)
    seen = sorted(consumer.expect_message("consumer of 'PUB t extra'").body for _ in range(2))
    expect_equal("bodies published with extra params", [b"after", b"extra"], seen)


@check("line-too-long")
def _line_too_long(t: Target) -> None:
    """A command line longer than nsqd's 16 KiB read buffer closes the connection without a frame."""
    # nsqd reads lines through a 16 KiB buffer; a longer line ends the connection without a frame.
    conn = t.connect()
    conn.send(b"A" * (MAX_LINE_LENGTH + 4096))
    conn.expect_closed(f"a {MAX_LINE_LENGTH + 4096}-byte line without newline")


# =============================================================================================
# IDENTIFY


@check("identify-plain-ok")
def _identify_plain(t: Target) -> None:
    """IDENTIFY without feature_negotiation is answered OK."""
    conn = t.connect()
    conn.send(nc.identify({"client_id": "conformance", "hostname": "conformance"}))
    frame = conn.expect_frame("IDENTIFY without feature_negotiation", "OK frame")
    expect_equal("IDENTIFY without feature_negotiation: reply bytes",
                 b"\x00\x00\x00\x06\x00\x00\x00\x00OK", frame_bytes(frame))


@check("identify-negotiation-defaults")
def _identify_defaults(t: Target) -> None:
    """IDENTIFY with feature_negotiation is answered nsqd's JSON of defaults, key order and bytes as Go writes them."""
    conn = t.connect()
    conn.send(nc.identify({"feature_negotiation": True}))
    frame = conn.expect_frame("IDENTIFY feature_negotiation", "a JSON response frame")
    reply = parse_identify_reply("IDENTIFY feature_negotiation", frame)
    expect_equal("IDENTIFY reply key order", list(IDENTIFY_KEYS), list(reply))
    version = reply["version"]
    if not isinstance(version, str) or not version:
        raise CheckFailed("IDENTIFY reply version", "a version string", version)
    expected = {
        "max_rdy_count": MAX_RDY_COUNT, "version": version, "max_msg_timeout": MAX_MSG_TIMEOUT_MS,
        "msg_timeout": DEFAULT_MSG_TIMEOUT_MS, "tls_v1": False, "deflate": False, "deflate_level": MAX_DEFLATE_LEVEL,
        "max_deflate_level": MAX_DEFLATE_LEVEL, "snappy": False, "sample_rate": 0, "auth_required": False,
        "output_buffer_size": DEFAULT_OUTPUT_BUFFER_SIZE, "output_buffer_timeout": DEFAULT_OUTPUT_BUFFER_TIMEOUT_MS,
    }
    # Compact JSON as Go's encoding/json writes it, byte for byte.
    expect_equal("IDENTIFY reply bytes", json.dumps(expected, separators=(",", ":")).encode(), frame.data)


@check("identify-negotiation-echo")
def _identify_echo(t: Target) -> None:
    """IDENTIFY echoes the negotiated timeouts, buffers (-1 forms too) and sample rate, repeated before SUB too."""
    conn = t.connect()
    asked = {"feature_negotiation": True, "msg_timeout": 5000, "output_buffer_size": 8192,
             "output_buffer_timeout": 100, "sample_rate": 0, "heartbeat_interval": 20000,
             "client_id": "conformance", "hostname": "conformance", "user_agent": "polymq-conformance",
             "some_unknown_key": 1}
    reply = conn.identify(asked)
    assert reply is not None
    expect_equal("IDENTIFY reply key order", list(IDENTIFY_KEYS), list(reply))
    for key in ("msg_timeout", "output_buffer_size", "output_buffer_timeout", "sample_rate"):
        expect_equal(f"IDENTIFY {key}={asked[key]}: echoed {key}", asked[key], reply[key])
    expect_equal("IDENTIFY reply max_rdy_count", MAX_RDY_COUNT, reply["max_rdy_count"])
    # output_buffer_size -1 means unbuffered: size 1, timeout 0 (docs/protocols/nsq.md).
    conn = t.connect()
    reply = conn.identify({"feature_negotiation": True, "output_buffer_size": -1})
    assert reply is not None
    expect_equal("IDENTIFY output_buffer_size=-1: echoed (size, timeout)", (1, 0),
                 (reply["output_buffer_size"], reply["output_buffer_timeout"]))
    # output_buffer_timeout -1 means no periodic flush: timeout 0; sample_rate is echoed.
    reply = t.connect().identify({"feature_negotiation": True, "output_buffer_timeout": -1, "sample_rate": 50})
    assert reply is not None
    expect_equal("IDENTIFY output_buffer_timeout=-1, sample_rate=50: echoed (size, timeout, sample_rate)",
                 (DEFAULT_OUTPUT_BUFFER_SIZE, 0, 50),
                 (reply["output_buffer_size"], reply["output_buffer_timeout"], reply["sample_rate"]))
    # May be repeated before SUB, answered each time (docs/protocols/nsq.md, observed).
    reply = conn.identify({"feature_negotiation": True, "msg_timeout": 2000}, "second IDENTIFY")
    assert reply is not None
    expect_equal("second IDENTIFY msg_timeout=2000: echoed", 2000, reply["msg_timeout"])


@check("identify-bad-json")
def _identify_bad_json(t: Target) -> None:
    """An IDENTIFY body that is not JSON gets E_BAD_BODY failed to decode JSON body."""
    t.refused(b"IDENTIFY\n" + _SIZE.pack(9) + b"{not json", "IDENTIFY body '{not json'",
              "E_BAD_BODY IDENTIFY failed to decode JSON body")


@check("identify-body-size")
def _identify_body_size(t: Target) -> None:
    """An IDENTIFY body of size 0, or past --max-body-size, gets E_BAD_BODY before any body is read."""
    t.refused(b"IDENTIFY\n" + _SIZE.pack(0), "IDENTIFY with body size 0", "E_BAD_BODY IDENTIFY invalid body size 0")
    conn = t.connect()
    # Only the size: nsqd refuses it before reading any body.
    conn.send(b"IDENTIFY\n" + _SIZE.pack(MAX_BODY_SIZE + 1))
    conn.expect_error(f"IDENTIFY with body size {MAX_BODY_SIZE + 1}",
                      f"E_BAD_BODY IDENTIFY body too big {MAX_BODY_SIZE + 1} > {MAX_BODY_SIZE}")


@check("identify-bad-fields")
def _identify_bad_fields(t: Target) -> None:
    """IDENTIFY values out of nsqd's ranges get E_BAD_BODY naming the field and the value."""
    cases = [
        ({"heartbeat_interval": 500}, "heartbeat interval (500) is invalid"),
        ({"heartbeat_interval": 60001}, "heartbeat interval (60001) is invalid"),
        ({"msg_timeout": 999}, "msg timeout (999) is invalid"),
        ({"output_buffer_size": 63}, "output buffer size (63) is invalid"),
        ({"output_buffer_timeout": 24}, "output buffer timeout (24) is invalid"),
        ({"sample_rate": 100}, "sample rate (100) is invalid"),
        ({"msg_timeout": MAX_MSG_TIMEOUT_MS + 1}, f"msg timeout ({MAX_MSG_TIMEOUT_MS + 1}) is invalid"),
        ({"output_buffer_size": MAX_OUTPUT_BUFFER_SIZE + 1},
         f"output buffer size ({MAX_OUTPUT_BUFFER_SIZE + 1}) is invalid"),
        ({"output_buffer_timeout": 30001}, "output buffer timeout (30001) is invalid"),
    ]
    for fields, text in cases:
        t.refused(nc.identify({"feature_negotiation": True, **fields}), f"IDENTIFY {json.dumps(fields)}",
                  f"E_BAD_BODY IDENTIFY {text}")


@check("identify-deflate-and-snappy")
def _identify_both(t: Target) -> None:
    """IDENTIFY asking for both deflate and snappy gets E_IDENTIFY_FAILED."""
    t.refused(nc.identify({"feature_negotiation": True, "deflate": True, "snappy": True}), "IDENTIFY deflate+snappy",
              "E_IDENTIFY_FAILED cannot enable both deflate and snappy compression")


@check("identify-after-sub")
def _identify_after_sub(t: Target) -> None:
    """IDENTIFY after SUB gets E_INVALID cannot IDENTIFY in current state."""
    conn = t.consumer(t.topic(), t.channel(), rdy=None)
    conn.send(nc.identify({"feature_negotiation": True}))
    conn.expect_error("IDENTIFY after SUB", "E_INVALID cannot IDENTIFY in current state")


@check("sub-heartbeats-disabled")
def _sub_no_heartbeats(t: Target) -> None:
    """SUB after IDENTIFY with heartbeat_interval -1 gets E_INVALID cannot SUB with heartbeats disabled."""
    conn = t.connect()
    conn.identify({"feature_negotiation": True, "heartbeat_interval": -1})
    conn.send(nc.sub(t.topic(), t.channel()))
    conn.expect_error("SUB after IDENTIFY heartbeat_interval=-1", "E_INVALID cannot SUB with heartbeats disabled")


@check("auth-disabled")
def _auth_disabled(t: Target) -> None:
    """AUTH on a server without an auth server gets E_AUTH_DISABLED."""
    t.refused(nc.auth(b"secret"), "AUTH on a server without an auth server", "E_AUTH_DISABLED AUTH disabled")


# =============================================================================================
# Heartbeats


def _fast_heartbeat_conn(t: Target) -> Conn:
    conn = t.connect()
    conn.identify({"feature_negotiation": True, "heartbeat_interval": FAST_HEARTBEAT_MS})
    return conn


@check("heartbeat-frame")
def _heartbeat_frame(t: Target) -> None:
    """With heartbeat_interval 1000 a _heartbeat_ frame comes after about a second, before and after SUB."""
    conn = _fast_heartbeat_conn(t)
    start = time.monotonic()
    try:
        frame = conn.poll(FAST_HEARTBEAT_MS / 1000 + t.timeout, heartbeats=True)
    except Closed as exc:
        raise CheckFailed("heartbeat_interval 1000", "a _heartbeat_ frame", "connection closed") from exc
    elapsed = time.monotonic() - start
    if frame is None:
        raise CheckFailed("heartbeat_interval 1000", "a _heartbeat_ frame", "nothing")
    expect_equal("heartbeat bytes", b"\x00\x00\x00\x0f\x00\x00\x00\x00_heartbeat_", frame_bytes(frame))
    if elapsed < FAST_HEARTBEAT_MS / 1000 / 2:
        raise CheckFailed("heartbeat_interval 1000: first heartbeat", "after about 1 s", f"after {elapsed:.2f} s")
    # Heartbeats continue after SUB, in every state (docs/protocols/nsq.md).
    conn.send(nc.sub(t.topic(), t.channel()))
    conn.expect_ok("SUB after a heartbeat")
    frame = conn.expect_frame("heartbeat_interval 1000, subscribed", "a _heartbeat_ frame", heartbeats=True)
    expect_equal("heartbeat after SUB", b"\x00\x00\x00\x0f\x00\x00\x00\x00_heartbeat_", frame_bytes(frame))


@check("heartbeat-silent-close")
def _heartbeat_silent(t: Target) -> None:
    """A client that answers no heartbeat is closed after about two intervals."""
    conn = _fast_heartbeat_conn(t)
    start = time.monotonic()
    beats = 0
    limit = 2 * FAST_HEARTBEAT_MS / 1000 + SILENT_CLOSE_SLACK_S
    while True:
        try:
            frame = conn.poll(max(0.0, start + limit - time.monotonic()), heartbeats=True)
        except Closed:
            break
        if frame is None:
            raise CheckFailed("silent client, heartbeat_interval 1000", "closed after ~2 s",
                              f"still open after {limit:.1f} s ({beats} heartbeats)")
        if frame.data == HEARTBEAT:
            beats += 1
        else:
            raise CheckFailed("silent client, heartbeat_interval 1000", "only heartbeats", describe(frame))
    elapsed = time.monotonic() - start
    if elapsed < SILENT_CLOSE_MIN_S:
        raise CheckFailed("silent client, heartbeat_interval 1000: close time", "about 2.0 s",
                          f"{elapsed:.2f} s")
    if beats < 1:
        raise CheckFailed("silent client: heartbeats before close", "at least 1", beats)


@check("heartbeat-nop-keeps-open")
def _heartbeat_nop(t: Target) -> None:
    """A client answering each heartbeat with NOP stays connected."""
    conn = _fast_heartbeat_conn(t)
    conn.expect_quiet("answering each heartbeat with NOP for 3.5 s", 3.5, answer_heartbeats=True)
    conn.send(nc.pub(t.topic(), b"still here"))
    conn.expect_ok("PUB after 3.5 s of NOP answers")


# =============================================================================================
# Errors: names, sizes, states


@check("names-length")
def _names_length(t: Target) -> None:
    """Names of [.a-zA-Z0-9_-] up to 64 characters (#ephemeral too) are valid; 65 are E_BAD_TOPIC/E_BAD_CHANNEL."""
    base = t.topic()
    conn = t.connect()
    for name in (t.topic(".under_score-dash.")[-40:], t.topic("A1")):
        t.topics.append(name)
        conn.send(nc.pub(name, b"x"))
        conn.expect_ok(f"PUB to topic {name!r} ([.a-zA-Z0-9_-] are all valid)")
    ok64 = (base + "x" * MAX_NAME_LENGTH)[:MAX_NAME_LENGTH]
    t.topics.append(ok64)
    conn.send(nc.pub(ok64, b"x"))
    conn.expect_ok(f"PUB to a {MAX_NAME_LENGTH}-character topic")
    eph = (base + "y" * MAX_NAME_LENGTH)[: MAX_NAME_LENGTH - len("#ephemeral")] + "#ephemeral"
    t.topics.append(eph)
    conn.send(nc.pub(eph, b"x"))
    conn.expect_ok(f"PUB to a {MAX_NAME_LENGTH}-character '#ephemeral' topic")
    channel64 = ("ch" + "z" * MAX_NAME_LENGTH)[:MAX_NAME_LENGTH]
    t.consumer(base, channel64, rdy=None)
    bad65 = ok64 + "x"
    conn.send(nc.pub(bad65, b"x"))
    conn.expect_error(f"PUB to a {MAX_NAME_LENGTH + 1}-character topic",
                      f'E_BAD_TOPIC PUB topic name "{bad65}" is not valid')
    conn = t.connect()
    eph65 = "w" + eph
    conn.send(nc.pub(eph65, b"x"))
    conn.expect_error(f"PUB to a {MAX_NAME_LENGTH + 1}-character '#ephemeral' topic",
                      f'E_BAD_TOPIC PUB topic name "{eph65}" is not valid')
    t.refused(nc.sub(base, channel64 + "z"), f"SUB with a {MAX_NAME_LENGTH + 1}-character channel",
              f'E_BAD_CHANNEL SUB channel name "{channel64}z" is not valid')


@check("names-invalid")
def _names_invalid(t: Target) -> None:
    """Invalid topic and channel names get E_BAD_TOPIC / E_BAD_CHANNEL with nsqd's texts."""
    topic = t.topic()
    cases: list[tuple[bytes, tuple[str, ...]]] = [
        (nc.pub("bad*", b"x"), ('E_BAD_TOPIC PUB topic name "bad*" is not valid',)),
        (nc.pub("t#eph", b"x"), ('E_BAD_TOPIC PUB topic name "t#eph" is not valid',)),
        (nc.dpub("bad*", 0, b"x"), ('E_BAD_TOPIC DPUB topic name "bad*" is not valid',)),
        # nsqd doubles the code for MPUB (a defect, docs/protocols/nsq.md): accept both forms.
        (nc.mpub("bad*", [b"x"]), ('E_BAD_TOPIC E_BAD_TOPIC MPUB topic name "bad*" is not valid',
                                  'E_BAD_TOPIC MPUB topic name "bad*" is not valid')),
        (nc.sub("bad*", "c"), ('E_BAD_TOPIC SUB topic name "bad*" is not valid',)),
        (nc.sub(topic, "c*"), ('E_BAD_CHANNEL SUB channel name "c*" is not valid',)),
        (nc.sub(topic, "c#ephemeralx"), ('E_BAD_CHANNEL SUB channel name "c#ephemeralx" is not valid',)),
    ]
    for command, texts in cases:
        t.refused(command, repr(command.split(b"\n")[0].decode()), *texts)


@check("sub-insufficient-params")
def _sub_params(t: Target) -> None:
    """SUB without a channel gets E_INVALID insufficient number of parameters."""
    t.refused(b"SUB " + t.topic().encode() + b"\n", "'SUB t' (no channel)",
              "E_INVALID SUB insufficient number of parameters")


@check("sub-twice")
def _sub_twice(t: Target) -> None:
    """A second SUB on one connection gets E_INVALID cannot SUB in current state."""
    topic = t.topic()
    conn = t.consumer(topic, t.channel(), rdy=None)
    conn.send(nc.sub(topic, t.channel()))
    conn.expect_error("second SUB", "E_INVALID cannot SUB in current state")


@check("pub-body-size")
def _pub_size(t: Target) -> None:
    """PUB/DPUB bodies of size 0 or past --max-msg-size are E_BAD_MESSAGE; the largest size is delivered whole."""
    topic = t.topic()
    for name in ("PUB", "DPUB"):
        line = f"PUB {topic}\n" if name == "PUB" else f"DPUB {topic} 0\n"
        t.refused(line.encode() + _SIZE.pack(0), f"{name} with body size 0",
                  f"E_BAD_MESSAGE {name} invalid message body size 0")
        conn = t.connect()
        # Only the size: nsqd refuses it before reading the body.
        conn.send(line.encode() + _SIZE.pack(MAX_MSG_SIZE + 1))
        conn.expect_error(f"{name} with body size {MAX_MSG_SIZE + 1}",
                          f"E_BAD_MESSAGE {name} message too big {MAX_MSG_SIZE + 1} > {MAX_MSG_SIZE}")
    # The largest allowed message goes through.
    conn = t.connect()
    conn.send(nc.pub(topic, b"m" * MAX_MSG_SIZE))
    conn.expect_ok(f"PUB with body size {MAX_MSG_SIZE}")
    msg = t.consumer(topic, t.channel()).expect_message(f"consumer of the {MAX_MSG_SIZE}-byte message")
    expect_equal(f"{MAX_MSG_SIZE}-byte message delivered whole", b"m" * MAX_MSG_SIZE, msg.body)


@check("mpub-errors")
def _mpub_errors(t: Target) -> None:
    """MPUB's body size, message count and message size errors get nsqd's E_BAD_BODY / E_BAD_MESSAGE texts."""
    topic = t.topic()
    line = f"MPUB {topic}\n".encode()
    cases: list[tuple[str, bytes, str]] = [
        ("body size 0", line + _SIZE.pack(0), "E_BAD_BODY MPUB invalid body size 0"),
        (f"body size {MAX_BODY_SIZE + 1}", line + _SIZE.pack(MAX_BODY_SIZE + 1),
         f"E_BAD_BODY MPUB body too big {MAX_BODY_SIZE + 1} > {MAX_BODY_SIZE}"),
        ("message count 0", line + _SIZE.pack(4) + _SIZE.pack(0), "E_BAD_BODY MPUB invalid message count 0"),
        (f"message count {MAX_MPUB_COUNT + 1}", line + _SIZE.pack(4) + _SIZE.pack(MAX_MPUB_COUNT + 1),
         f"E_BAD_BODY MPUB invalid message count {MAX_MPUB_COUNT + 1}"),
        ("a message of size 0", line + _SIZE.pack(8) + _SIZE.pack(1) + _SIZE.pack(0),
         "E_BAD_MESSAGE MPUB invalid message(0) body size 0"),
        (f"a message of size {MAX_MSG_SIZE + 1}",
         line + _SIZE.pack(8 + MAX_MSG_SIZE + 1) + _SIZE.pack(1) + _SIZE.pack(MAX_MSG_SIZE + 1)
         + b"m" * (MAX_MSG_SIZE + 1),
         f"E_BAD_MESSAGE MPUB message too big {MAX_MSG_SIZE + 1} > {MAX_MSG_SIZE}"),
    ]
    for label, data, text in cases:
        t.refused(data, f"MPUB with {label}", text)


@check("dpub-timeout")
def _dpub_timeout(t: Target) -> None:
    """DPUB's defer time must parse and lie in 0..--max-req-timeout; both ends are accepted."""
    topic = t.topic()
    t.refused(f"DPUB {topic} -1\n".encode(), "'DPUB t -1'", "E_INVALID DPUB could not parse timeout -1")
    t.refused(f"DPUB {topic} {MAX_REQ_TIMEOUT_MS + 1}\n".encode(), f"'DPUB t {MAX_REQ_TIMEOUT_MS + 1}'",
              f"E_INVALID DPUB timeout {MAX_REQ_TIMEOUT_MS + 1} out of range 0-{MAX_REQ_TIMEOUT_MS}")
    conn = t.connect()
    conn.send(nc.dpub(topic, MAX_REQ_TIMEOUT_MS, b"late"))
    conn.expect_ok(f"'DPUB t {MAX_REQ_TIMEOUT_MS}'")
    conn.send(nc.dpub(topic, 0, b"now"))
    conn.expect_ok("'DPUB t 0'")


@check("rdy-state")
def _rdy_state(t: Target) -> None:
    """RDY before SUB gets E_INVALID cannot RDY in current state."""
    t.refused(nc.rdy(1), "RDY before SUB", "E_INVALID cannot RDY in current state")


@check("rdy-range")
def _rdy_range(t: Target) -> None:
    """RDY up to max_rdy_count is accepted; above it, negative or unparsable gets E_INVALID."""
    topic = t.topic()
    conn = t.consumer(topic, t.channel(), rdy=MAX_RDY_COUNT)
    conn.expect_quiet(f"RDY {MAX_RDY_COUNT}")
    conn.send(nc.rdy(MAX_RDY_COUNT + 1))
    conn.expect_error(f"RDY {MAX_RDY_COUNT + 1}",
                      f"E_INVALID RDY count {MAX_RDY_COUNT + 1} out of range 0-{MAX_RDY_COUNT}")
    for arg in ("x", "-1"):
        conn = t.consumer(topic, t.channel(), rdy=None)
        conn.send(f"RDY {arg}\n".encode())
        conn.expect_error(f"'RDY {arg}'", f"E_INVALID RDY could not parse count {arg}")


@check("rdy-no-arg-is-one")
def _rdy_default(t: Target) -> None:
    """RDY without a count means RDY 1."""
    topic = t.topic()
    conn = t.consumer(topic, t.channel(), rdy=None)
    t.publish(topic, b"one", b"two")
    conn.send(b"RDY\n")
    msg = conn.expect_message("'RDY' without a count, 2 messages published")
    conn.expect_quiet("'RDY' means RDY 1: no second message before FIN")
    conn.send(nc.fin(msg.msg_id))
    conn.expect_message("after FIN")


@check("fin-req-touch-state")
def _fin_state(t: Target) -> None:
    """FIN, REQ and TOUCH before SUB get E_INVALID cannot <command> in current state."""
    for command, name in ((nc.fin(_UNKNOWN_ID), "FIN"), (nc.req(_UNKNOWN_ID, 0), "REQ"),
                          (nc.touch(_UNKNOWN_ID), "TOUCH")):
        t.refused(command, f"{name} before SUB", f"E_INVALID cannot {name} in current state")


@check("fin-req-touch-invalid-id")
def _fin_invalid_id(t: Target) -> None:
    """FIN, REQ and TOUCH with a message id not 16 bytes long get E_INVALID invalid message ID."""
    topic = t.topic()
    for command in (b"FIN 0123\n", b"REQ 0123 0\n", b"TOUCH 0123456789abcdef0\n"):
        conn = t.consumer(topic, t.channel(), rdy=None)
        conn.send(command)
        conn.expect_error(repr(command.decode().strip()), "E_INVALID invalid message ID")


@check("req-bad-timeout")
def _req_bad_timeout(t: Target) -> None:
    """REQ with a negative timeout gets E_INVALID could not parse timeout."""
    conn = t.consumer(t.topic(), t.channel(), rdy=None)
    conn.send(b"REQ " + _UNKNOWN_ID + b" -5\n")
    conn.expect_error("'REQ <id> -5'", "E_INVALID REQ could not parse timeout -5")


@check("fin-unknown-non-fatal")
def _fin_unknown(t: Target) -> None:
    """FIN, REQ and TOUCH of an id not in flight get non-fatal E_*_FAILED errors and the connection keeps working."""
    topic = t.topic()
    conn = t.consumer(topic, t.channel(), rdy=None)
    unknown = _UNKNOWN_ID.decode()
    conn.send(nc.fin(_UNKNOWN_ID))
    conn.expect_error("FIN of an unknown id", f"E_FIN_FAILED FIN {unknown} failed ID not in flight", fatal=False)
    conn.send(nc.req(_UNKNOWN_ID, 0))
    conn.expect_error("REQ of an unknown id", f"E_REQ_FAILED REQ {unknown} failed ID not in flight", fatal=False)
    conn.send(nc.touch(_UNKNOWN_ID))
    conn.expect_error("TOUCH of an unknown id", f"E_TOUCH_FAILED TOUCH {unknown} failed ID not in flight",
                      fatal=False)
    # The connection keeps working: publish, receive, finish.
    conn.send(nc.pub(topic, b"alive"))
    conn.expect_ok("PUB after E_FIN_FAILED / E_REQ_FAILED / E_TOUCH_FAILED")
    conn.send(nc.rdy(1))
    msg = conn.expect_message("RDY 1 after the non-fatal errors")
    check_message_shape("message after the non-fatal errors", msg, b"alive")
    conn.send(nc.fin(msg.msg_id))
    conn.expect_quiet("FIN of the delivered message")
    conn.send(nc.fin(msg.msg_id))
    conn.expect_error("second FIN of the same id",
                      f"E_FIN_FAILED FIN {msg.msg_id.decode()} failed ID not in flight", fatal=False)


@check("fin-not-owner")
def _fin_not_owner(t: Target) -> None:
    """FIN of a message another consumer of the channel holds is a non-fatal E_FIN_FAILED."""
    topic, channel = t.topic(), t.channel()
    owner = t.consumer(topic, channel, rdy=1)
    other = t.consumer(topic, channel, rdy=0)
    t.publish(topic, b"owned")
    msg = owner.expect_message("RDY 1 consumer")
    other.send(nc.fin(msg.msg_id))
    other.expect_error("FIN from another consumer of the channel",
                       f"E_FIN_FAILED FIN {msg.msg_id.decode()} failed client does not own message", fatal=False)
    owner.send(nc.fin(msg.msg_id))
    owner.expect_quiet("FIN by the owner")
    other.send(nc.nop())
    other.expect_quiet("the other consumer after E_FIN_FAILED")


@check("cls")
def _cls(t: Target) -> None:
    """CLS answers CLOSE_WAIT; then TOUCH and FIN work, RDY is ignored, SUB refused; CLS before SUB is E_INVALID."""
    topic = t.topic()
    conn = t.consumer(topic, t.channel(), rdy=1)
    t.publish(topic, b"in-flight")
    msg = conn.expect_message("RDY 1, one message")
    conn.send(nc.cls())
    frame = conn.expect_frame("CLS", "CLOSE_WAIT frame")
    expect_equal("CLS reply bytes", b"\x00\x00\x00\x0e\x00\x00\x00\x00" + CLOSE_WAIT, frame_bytes(frame))
    # TOUCH and FIN still work while closing (docs/protocols/nsq.md: "subscribed or closing").
    conn.send(nc.touch(msg.msg_id))
    conn.send(nc.fin(msg.msg_id))
    conn.expect_quiet("TOUCH and FIN of the in-flight message after CLS")
    conn.send(nc.rdy(5))  # silently ignored after CLS
    t.publish(topic, b"after-cls")
    conn.expect_quiet("after CLOSE_WAIT and RDY 5 (ignored): socket open, nothing delivered")
    conn.send(nc.sub(topic, t.channel()))
    conn.expect_error("SUB after CLS", "E_INVALID cannot SUB in current state")
    t.refused(nc.cls(), "CLS before SUB", "E_INVALID cannot CLS in current state")


# =============================================================================================
# Publishing and delivery ()


@check("pub-mpub-dpub-ok")
def _pub_ok(t: Target) -> None:
    """PUB, MPUB and DPUB 0 are answered OK and each message is delivered."""
    topic = t.topic()
    conn = t.connect()
    conn.send(nc.pub(topic, b"p"))
    conn.expect_ok("PUB")
    conn.send(nc.mpub(topic, [b"m1", b"m2", b"m3"]))
    conn.expect_ok("MPUB of 3")
    conn.send(nc.dpub(topic, 0, b"d"))
    conn.expect_ok("DPUB 0")
    consumer = t.consumer(topic, t.channel(), rdy=10)
    bodies = set()
    for _ in range(5):
        msg = consumer.expect_message("consumer of PUB+MPUB+DPUB")
        bodies.add(msg.body)
        consumer.send(nc.fin(msg.msg_id))
    expect_equal("bodies delivered", {b"p", b"m1", b"m2", b"m3", b"d"}, bodies)


@check("message-frame")
def _message_frame(t: Target) -> None:
    """A message frame holds the timestamp (ns, now), attempts 1, a 16-hex id and the body, byte for byte."""
    topic = t.topic()
    consumer = t.consumer(topic, t.channel())
    body = b"\x00\xff binary \n body"
    before = time.time()
    t.publish(topic, body)
    after = time.time()
    frame = consumer.expect_frame("RDY 1 after one PUB", "a message frame")
    if frame.frame_type != FRAME_TYPE_MESSAGE:
        raise CheckFailed("RDY 1 after one PUB", "frame type 2 (message)", describe(frame))
    expect_equal("message frame size", 4 + MESSAGE_OVERHEAD + len(body), len(frame.data) + 4)
    msg = nc.decode_message(frame.data)
    check_message_shape("message", msg, body)
    if not (before - CLOCK_SKEW_S) * 1e9 <= msg.timestamp_ns <= (after + CLOCK_SKEW_S) * 1e9:
        raise CheckFailed("message timestamp", f"nanoseconds near {int(before * 1e9)}", msg.timestamp_ns)
    if len(msg.msg_id) != MSG_ID_LENGTH:
        raise CheckFailed("message id length", MSG_ID_LENGTH, len(msg.msg_id))


@check("rdy-caps-in-flight")
def _rdy_caps(t: Target) -> None:
    """With RDY 1 a consumer holds one message at a time: the next comes only after the FIN."""
    topic = t.topic()
    consumer = t.consumer(topic, t.channel(), rdy=1)
    t.publish(topic, b"a", b"b", b"c")
    seen = []
    for index in range(3):
        msg = consumer.expect_message(f"RDY 1, message {index + 1} of 3")
        seen.append(msg.body)
        consumer.expect_quiet(f"RDY 1 with message {index + 1} in flight: nothing more before FIN")
        consumer.send(nc.fin(msg.msg_id))
    expect_equal("bodies delivered one at a time", [b"a", b"b", b"c"], sorted(seen))
    consumer.expect_quiet("all finished")


@check("rdy-zero-pauses")
def _rdy_zero(t: Target) -> None:
    """RDY starts at 0 after SUB, and RDY 0 stops deliveries until the next RDY."""
    topic = t.topic()
    consumer = t.consumer(topic, t.channel(), rdy=None)
    t.publish(topic, b"first")
    consumer.expect_quiet("after SUB without any RDY (RDY starts at 0), one message published")
    consumer.send(nc.rdy(1))
    msg = consumer.expect_message("RDY 1")
    check_message_shape("after RDY 1", msg, b"first")
    consumer.send(nc.rdy(0))
    consumer.send(nc.fin(msg.msg_id))
    t.publish(topic, b"held")
    consumer.expect_quiet("RDY 0 with one message published")
    consumer.send(nc.rdy(1))
    check_message_shape("after RDY 0 then RDY 1", consumer.expect_message("RDY 1"), b"held")


@check("req-requeue")
def _req_requeue(t: Target) -> None:
    """REQ 0 sends the message again with its id and timestamp and one more attempt; /stats counts the requeues."""
    topic, channel = t.topic(), t.channel()
    consumer = t.consumer(topic, channel)
    t.publish(topic, b"again")
    first = consumer.expect_message("first delivery")
    check_message_shape("first delivery", first, b"again", attempts=1)
    consumer.send(nc.req(first.msg_id, 0))
    second = consumer.expect_message("after 'REQ id 0'")
    check_message_shape("redelivery after REQ 0", second, b"again", attempts=2)
    expect_equal("redelivery after REQ 0: id", first.msg_id, second.msg_id)
    expect_equal("redelivery after REQ 0: timestamp kept", first.timestamp_ns, second.timestamp_ns)
    consumer.send(nc.req(second.msg_id, 0))
    third = consumer.expect_message("after a second 'REQ id 0'")
    check_message_shape("redelivery after two REQ 0", third, b"again", attempts=3)
    consumer.send(nc.fin(third.msg_id))
    consumer.expect_quiet("FIN of the redelivered message")
    chan = t.channel_stats(topic, channel) or {}
    expect_equal("stats after 2 REQ then FIN: channel (requeue_count, message_count, in_flight_count)",
                 (2, 1, 0), (chan.get("requeue_count"), chan.get("message_count"), chan.get("in_flight_count")))
    client = (chan.get("clients") or [{}])[0]
    expect_equal("stats after 2 REQ then FIN: client (requeue_count, finish_count, message_count)",
                 (2, 1, 3), (client.get("requeue_count"), client.get("finish_count"), client.get("message_count")))


@check("req-deferred")
def _req_deferred(t: Target) -> None:
    """REQ with a timeout sends the message again only after it; one past --max-req-timeout is clamped."""
    topic = t.topic()
    consumer = t.consumer(topic, t.channel())
    t.publish(topic, b"later")
    first = consumer.expect_message("first delivery")
    consumer.send(nc.req(first.msg_id, DEFER_MS))
    consumer.expect_quiet(f"'REQ id {DEFER_MS}': nothing in the first {QUIET_S} s")
    second = consumer.expect_message(f"after 'REQ id {DEFER_MS}'")
    check_message_shape(f"redelivery after REQ {DEFER_MS}", second, b"later", attempts=2)
    # A REQ timeout above --max-req-timeout is clamped, not refused (docs/protocols/nsq.md).
    consumer.send(nc.req(second.msg_id, MAX_REQ_TIMEOUT_MS + 1))
    consumer.expect_quiet(f"'REQ id {MAX_REQ_TIMEOUT_MS + 1}' (clamped, no error)")


@check("dpub-deferred")
def _dpub_deferred(t: Target) -> None:
    """A DPUB message is delivered only after its defer time."""
    topic, channel = t.topic(), t.channel()
    consumer = t.consumer(topic, channel)
    conn = t.connect()
    conn.send(nc.dpub(topic, DEFER_MS, b"deferred"))
    conn.expect_ok(f"DPUB {DEFER_MS}")
    published = time.monotonic()
    # nsqd hands a message from topic to channels in a task of its own: poll.
    t.wait_for(f"stats deferred_count after 'DPUB t {DEFER_MS}'", "deferred_count 1",
               lambda: (t.channel_stats(topic, channel) or {}).get("deferred_count") == 1)
    quiet = published + QUIET_S - time.monotonic()
    if quiet > 0:
        consumer.expect_quiet(f"'DPUB t {DEFER_MS}': nothing in the first {QUIET_S} s", quiet)
    check_message_shape(f"DPUB {DEFER_MS}", consumer.expect_message(f"after DPUB {DEFER_MS}"), b"deferred")


@check("touch")
def _touch(t: Target) -> None:
    """TOUCH resets a message's timeout: touched every half timeout, it stays in flight past several timeouts."""
    topic = t.topic()
    consumer = t.consumer(topic, t.channel(), identify={"msg_timeout": FAST_MSG_TIMEOUT_MS})
    t.publish(topic, b"touched")
    msg = consumer.expect_message("msg_timeout 1000, RDY 1")
    # TOUCH every half timeout for 2.5 timeouts: without it the message would time out.
    for _ in range(5):
        consumer.expect_quiet("TOUCH every 0.5 s with msg_timeout 1000", FAST_MSG_TIMEOUT_MS / 2000)
        consumer.send(nc.touch(msg.msg_id))
    consumer.send(nc.fin(msg.msg_id))
    consumer.expect_quiet("FIN after 2.5 s of TOUCH (still in flight, no E_FIN_FAILED)")


@check("msg-timeout-redelivery")
def _msg_timeout(t: Target) -> None:
    """A message not finished within msg_timeout comes again with its id; /stats counts the timeout."""
    topic, channel = t.topic(), t.channel()
    consumer = t.consumer(topic, channel, identify={"msg_timeout": FAST_MSG_TIMEOUT_MS})
    t.publish(topic, b"slow")
    first = consumer.expect_message("msg_timeout 1000, RDY 1")
    start = time.monotonic()
    second = consumer.expect_message("redelivery after msg_timeout 1000")
    elapsed = time.monotonic() - start
    check_message_shape("redelivery after timeout", second, b"slow", attempts=2)
    expect_equal("redelivery after timeout: id", first.msg_id, second.msg_id)
    if elapsed < FAST_MSG_TIMEOUT_MS / 1000 * 0.9:
        raise CheckFailed("redelivery after msg_timeout 1000", "after about 1 s", f"after {elapsed:.2f} s")
    consumer.send(nc.fin(second.msg_id))
    consumer.expect_quiet("FIN of the redelivered message")
    expect_equal("stats timeout_count after one timeout", 1,
                 (t.channel_stats(topic, channel) or {}).get("timeout_count"))


@check("two-channels-each-get-a-copy")
def _two_channels(t: Target) -> None:
    """Each channel of a topic gets a copy of every message."""
    topic = t.topic()
    first = t.consumer(topic, t.channel("a"))
    second = t.consumer(topic, t.channel("b"))
    t.publish(topic, b"copy")
    check_message_shape("channel a", first.expect_message("channel a"), b"copy")
    check_message_shape("channel b", second.expect_message("channel b"), b"copy")


@check("one-channel-competing-consumers")
def _competing(t: Target) -> None:
    """Consumers of one channel share its messages: each message goes to exactly one of them."""
    topic, channel = t.topic(), t.channel()
    consumers = [t.consumer(topic, channel, rdy=10), t.consumer(topic, channel, rdy=10)]
    bodies = [b"m%d" % i for i in range(20)]
    conn = t.connect()
    conn.send(nc.mpub(topic, bodies))
    conn.expect_ok("MPUB of 20")
    seen: list[bytes] = []
    deadline = time.monotonic() + t.timeout
    while len(seen) < len(bodies) and time.monotonic() < deadline:
        for consumer in consumers:
            try:
                frame = consumer.poll(0.05)
            except Closed as exc:
                raise CheckFailed("two consumers of one channel", "open connections", "connection closed") from exc
            if frame is None:
                continue
            if frame.frame_type != FRAME_TYPE_MESSAGE:
                raise CheckFailed("two consumers of one channel", "message frames", describe(frame))
            msg = nc.decode_message(frame.data)
            seen.append(msg.body)
            consumer.send(nc.fin(msg.msg_id))
    for consumer in consumers:
        consumer.expect_quiet("after all 20 messages: no duplicates")
    expect_equal("20 messages split over 2 consumers, each exactly once", sorted(bodies), sorted(seen))


@check("backlog-without-channel")
def _backlog(t: Target) -> None:
    """A topic without a channel keeps its messages (stats depth), and the first channel receives them."""
    topic = t.topic()
    t.publish(topic, b"b1", b"b2", b"b3")
    entry = t.topic_stats(topic)
    depth = None if entry is None else entry.get("depth")
    expect_equal("topic depth with no channel (stats)", 3, depth)
    consumer = t.consumer(topic, t.channel(), rdy=3)
    seen = sorted(consumer.expect_message("first channel receives the backlog").body for _ in range(3))
    expect_equal("backlog received by the first channel", [b"b1", b"b2", b"b3"], seen)


@check("ephemeral-channel-deleted")
def _ephemeral(t: Target) -> None:
    """An #ephemeral channel goes with its last client, and an #ephemeral topic with its last channel."""
    topic, channel = t.topic(), t.channel() + "#ephemeral"
    consumer = t.consumer(topic, channel, rdy=None)
    if t.channel_stats(topic, channel) is None:
        raise CheckFailed("stats while subscribed", f"channel {channel!r} listed", "not listed")
    consumer.close()
    t.wait_for("ephemeral channel after its last client left", "channel gone from /stats",
               lambda: t.channel_stats(topic, channel) is None)
    if t.topic_stats(topic) is None:
        raise CheckFailed("a normal topic after its ephemeral channel went", "topic still listed", "topic gone")
    # An ephemeral topic goes with its last channel.
    topic = t.topic("#ephemeral")
    consumer = t.consumer(topic, t.channel() + "#ephemeral", rdy=None)
    if t.topic_stats(topic) is None:
        raise CheckFailed("stats while subscribed", f"topic {topic!r} listed", "not listed")
    consumer.close()
    t.wait_for("ephemeral topic after its last (ephemeral) channel went", "topic gone from /stats",
               lambda: t.topic_stats(topic) is None)


# =============================================================================================
# Stream compression


def _compressed_round_trip(t: Target, kind: str) -> None:
    topic = t.topic()
    conn = t.connect()
    asked: dict[str, Any] = {"feature_negotiation": True, kind: True}
    if kind == "deflate":
        asked["deflate_level"] = 9
    conn.send(nc.identify(asked))
    reply = parse_identify_reply(f"IDENTIFY {kind}", conn.expect_frame(f"IDENTIFY {kind}", "a frame"))
    expect_equal(f"IDENTIFY {kind}: reply {kind}", True, reply.get(kind))
    if kind == "deflate":
        expect_equal("IDENTIFY deflate_level 9: clamped to max_deflate_level", MAX_DEFLATE_LEVEL,
                     reply.get("deflate_level"))
    conn.start_compression(kind)
    conn.expect_ok(f"the OK after the IDENTIFY reply, {kind}-compressed")
    raw = bytes(conn.compressed_received)
    if kind == "snappy" and not raw.startswith(SNAPPY_STREAM_IDENTIFIER):
        raise CheckFailed("snappy stream start", SNAPPY_STREAM_IDENTIFIER, raw[:10])
    if kind == "deflate" and not raw.endswith(b"\x00\x00\xff\xff"):
        raise CheckFailed("deflate OK: sync-flushed raw DEFLATE", "bytes ending 00 00 ff ff", raw)
    conn.send(nc.pub(topic, b"compressed " * 20))
    conn.expect_ok(f"PUB through the {kind} stream")
    conn.send(nc.sub(topic, t.channel()))
    conn.expect_ok(f"SUB through the {kind} stream")
    conn.send(nc.rdy(1))
    check_message_shape(f"message through the {kind} stream", conn.expect_message("RDY 1"), b"compressed " * 20)


@check("deflate")
def _deflate(t: Target) -> None:
    """IDENTIFY deflate (level 9, clamped to the maximum) switches the stream to sync-flushed raw DEFLATE, both ways."""
    _compressed_round_trip(t, "deflate")


@check("snappy")
def _snappy(t: Target) -> None:
    """IDENTIFY snappy switches the stream to the snappy framing format, both ways."""
    _compressed_round_trip(t, "snappy")


# =============================================================================================
# HTTP API


@check("http-ping")
def _http_ping(t: Target) -> None:
    """GET /ping answers 200 OK."""
    t.expect_http("GET", "/ping", text=b"OK")


@check("http-content-type-header")
def _http_header(t: Target) -> None:
    """Every HTTP answer, errors included, carries nsqd's X-NSQ-Content-Type header."""
    replies = {
        "GET /ping": t.request("GET", "/ping"),
        "POST /pub": t.request("POST", "/pub", {"topic": t.topic()}, b"x"),
        "GET /stats?format=json": t.request("GET", "/stats", {"format": "json"}),
        "POST /pub (no topic)": t.request("POST", "/pub", None, b"x"),
        "GET /no-such-path": t.request("GET", "/no-such-path"),
    }
    for what, reply in replies.items():
        expected = None if what == "GET /ping" else NSQ_CONTENT_TYPE
        expect_equal(f"{what}: {NSQ_CONTENT_TYPE_HEADER} header", expected, reply.header(NSQ_CONTENT_TYPE_HEADER))


@check("http-info")
def _http_info(t: Target) -> None:
    """GET /info names the ports, the version and nsqd's limits."""
    info = t.expect_http("GET", "/info").json("GET /info")
    expect_keys("GET /info", info, INFO_KEYS)
    expect_equal("GET /info tcp_port", t.tcp[1], info["tcp_port"])
    expect_equal("GET /info http_port", t.http[1], info["http_port"])
    expect_equal("GET /info max_deflate_level", MAX_DEFLATE_LEVEL, info["max_deflate_level"])
    expect_equal("GET /info max_heartbeat_interval (ns)", MAX_HEARTBEAT_INTERVAL_NS, info["max_heartbeat_interval"])
    expect_equal("GET /info max_output_buffer_size", MAX_OUTPUT_BUFFER_SIZE, info["max_output_buffer_size"])
    expect_equal("GET /info max_output_buffer_timeout (ns)", MAX_OUTPUT_BUFFER_TIMEOUT_NS,
                 info["max_output_buffer_timeout"])
    if not isinstance(info["version"], str):
        raise CheckFailed("GET /info version", "a string", info["version"])


@check("http-pub")
def _http_pub(t: Target) -> None:
    """POST /pub publishes the body as it is and creates a topic that did not exist."""
    topic = t.topic()
    consumer = t.consumer(topic, t.channel())
    body = b"via http \x00\x01"
    t.expect_http("POST", "/pub", {"topic": topic}, body, text=b"OK")
    check_message_shape("message published over HTTP", consumer.expect_message("after POST /pub"), body)
    fresh = t.topic()
    t.expect_http("POST", "/pub", {"topic": fresh}, b"creates", text=b"OK")
    entry = t.topic_stats(fresh) or {}
    expect_equal("POST /pub to a new topic creates it: stats depth", 1, entry.get("depth"))


@check("http-pub-defer")
def _http_pub_defer(t: Target) -> None:
    """POST /pub?defer=ms delivers only after that long; a negative defer is 400 INVALID_DEFER."""
    topic = t.topic()
    consumer = t.consumer(topic, t.channel())
    t.expect_http("POST", "/pub", {"topic": topic, "defer": str(DEFER_MS)}, b"deferred", text=b"OK")
    consumer.expect_quiet(f"POST /pub defer={DEFER_MS}: nothing in the first {QUIET_S} s")
    check_message_shape("deferred HTTP publish", consumer.expect_message(f"after defer={DEFER_MS}"), b"deferred")
    t.expect_http_error("POST", "/pub", {"topic": topic, "defer": "-1"}, 400, "INVALID_DEFER", b"x")


@check("http-mpub-text")
def _http_mpub_text(t: Target) -> None:
    """POST /mpub in text mode publishes one message per line, empty lines skipped."""
    topic = t.topic()
    consumer = t.consumer(topic, t.channel(), rdy=10)
    t.expect_http("POST", "/mpub", {"topic": topic}, b"one\ntwo\n\nthree\n", text=b"OK")
    seen = sorted(consumer.expect_message("after POST /mpub").body for _ in range(3))
    expect_equal("text /mpub (empty lines skipped)", [b"one", b"three", b"two"], seen)
    consumer.expect_quiet("no message for the empty line")


@check("http-mpub-binary")
def _http_mpub_binary(t: Target) -> None:
    """POST /mpub?binary=true publishes the messages of the binary MPUB body."""
    topic = t.topic()
    consumer = t.consumer(topic, t.channel(), rdy=10)
    bodies = [b"bin\none", b"\x00two"]
    t.expect_http("POST", "/mpub", {"topic": topic, "binary": "true"}, nc.mpub_body(bodies), text=b"OK")
    seen = sorted(consumer.expect_message("after POST /mpub?binary=true").body for _ in range(2))
    expect_equal("binary /mpub", sorted(bodies), seen)


@check("http-topic-ops")
def _http_topic_ops(t: Target) -> None:
    """POST /topic/create, pause, unpause, empty and delete act on the topic as /stats then shows."""
    topic = t.topic()
    params = {"topic": topic}
    t.expect_http("POST", "/topic/create", params, text=b"")
    t.expect_http("POST", "/topic/create", params, text=b"")  # idempotent
    if t.topic_stats(topic) is None:
        raise CheckFailed("after /topic/create", f"topic {topic!r} in /stats", "not listed")
    t.expect_http("POST", "/topic/pause", params, text=b"")
    expect_equal("stats paused after /topic/pause", True, (t.topic_stats(topic) or {}).get("paused"))
    t.expect_http("POST", "/topic/unpause", params, text=b"")
    expect_equal("stats paused after /topic/unpause", False, (t.topic_stats(topic) or {}).get("paused"))
    t.publish(topic, b"e1", b"e2")
    expect_equal("topic depth after 2 PUB, no channel", 2, (t.topic_stats(topic) or {}).get("depth"))
    t.expect_http("POST", "/topic/empty", params, text=b"")
    expect_equal("topic depth after /topic/empty", 0, (t.topic_stats(topic) or {}).get("depth"))
    t.expect_http("POST", "/topic/delete", params, text=b"")
    if t.topic_stats(topic) is not None:
        raise CheckFailed("after /topic/delete", "topic gone from /stats", "still listed")
    t.expect_http_error("POST", "/topic/delete", params, 404, "TOPIC_NOT_FOUND")
    for op in ("empty", "pause", "unpause"):
        t.expect_http_error("POST", f"/topic/{op}", params, 404, "TOPIC_NOT_FOUND")
    t.expect_http_error("POST", "/topic/create", None, 400, "MISSING_ARG_TOPIC")
    t.expect_http_error("POST", "/topic/create", {"topic": "bad*"}, 400, "INVALID_TOPIC")


@check("http-channel-ops")
def _http_channel_ops(t: Target) -> None:
    """POST /channel/create, empty, pause, unpause and delete act on the channel; a paused channel delivers nothing."""
    topic, channel = t.topic(), t.channel()
    params = {"topic": topic, "channel": channel}
    t.expect_http_error("POST", "/channel/create", params, 404, "TOPIC_NOT_FOUND")
    t.expect_http("POST", "/topic/create", {"topic": topic})
    t.expect_http("POST", "/channel/create", params, text=b"")
    t.expect_http("POST", "/channel/create", params, text=b"")  # idempotent
    if t.channel_stats(topic, channel) is None:
        raise CheckFailed("after /channel/create", f"channel {channel!r} in /stats", "not listed")
    t.publish(topic, b"c1", b"c2")
    t.wait_for("channel depth after 2 PUB", "depth 2",
               lambda: (t.channel_stats(topic, channel) or {}).get("depth") == 2)
    t.expect_http("POST", "/channel/empty", params, text=b"")
    expect_equal("channel depth after /channel/empty", 0, (t.channel_stats(topic, channel) or {}).get("depth"))
    # A paused channel delivers nothing (docs/protocols/nsq.md).
    t.expect_http("POST", "/channel/pause", params, text=b"")
    expect_equal("stats paused after /channel/pause", True, (t.channel_stats(topic, channel) or {}).get("paused"))
    consumer = t.consumer(topic, channel)
    t.publish(topic, b"paused")
    consumer.expect_quiet("consumer of a paused channel")
    t.expect_http("POST", "/channel/unpause", params, text=b"")
    check_message_shape("after /channel/unpause", consumer.expect_message("after /channel/unpause"), b"paused")
    consumer.close()
    t.expect_http("POST", "/channel/delete", params, text=b"")
    if t.channel_stats(topic, channel) is not None:
        raise CheckFailed("after /channel/delete", "channel gone from /stats", "still listed")
    for op in ("delete", "empty", "pause", "unpause"):
        t.expect_http_error("POST", f"/channel/{op}", params, 404, "CHANNEL_NOT_FOUND")
    t.expect_http_error("POST", "/channel/create", {"topic": topic}, 400, "MISSING_ARG_CHANNEL")
    t.expect_http_error("POST", "/channel/create", {"topic": topic, "channel": "c*"}, 400, "INVALID_ARG_CHANNEL")


@check("http-stats-json")
def _http_stats(t: Target) -> None:
    """GET /stats?format=json shows topics, channels, clients and producers with nsqd's keys and the expected counts."""
    topic, channel = t.topic(), t.channel()
    consumer = t.consumer(topic, channel, rdy=7,
                          identify={"client_id": "conformance-client", "hostname": "conformance-host"})
    # A TCP producer that stays connected is listed under producers with its pub_counts.
    producer = t.connect()
    producer.send(nc.pub(topic, b"s1"))
    producer.expect_ok("PUB")
    producer.send(nc.pub(topic, b"s2"))
    producer.expect_ok("PUB")
    consumer.expect_message("RDY 7, 2 published")
    consumer.expect_message("RDY 7, 2 published")
    stats = t.stats()
    expect_keys("GET /stats?format=json", stats, STATS_KEYS)
    expect_equal("/stats health", "OK", stats["health"])
    expect_keys("/stats memory", stats["memory"], STATS_MEMORY_KEYS)
    if stats["producers"] is not None and not isinstance(stats["producers"], list):
        raise CheckFailed("/stats producers", "a list or null", stats["producers"])
    entry = next((e for e in stats["topics"] or [] if e.get("topic_name") == topic), None)
    if entry is None:
        raise CheckFailed("/stats topics", f"topic {topic!r} listed", "not listed")
    expect_keys("/stats topic", entry, STATS_TOPIC_KEYS)
    chan = next((c for c in entry["channels"] or [] if c.get("channel_name") == channel), None)
    if chan is None:
        raise CheckFailed("/stats channels", f"channel {channel!r} listed", "not listed")
    expect_keys("/stats channel", chan, STATS_CHANNEL_KEYS)
    expect_equal("/stats channel client_count", 1, chan["client_count"])
    expect_equal("/stats channel (depth, in_flight_count, message_count) with 2 unfinished", (0, 2, 2),
                 (chan["depth"], chan["in_flight_count"], chan["message_count"]))
    expect_equal("/stats channel e2e_processing_latency", {"count": 0, "percentiles": None},
                 chan["e2e_processing_latency"])
    expect_equal("/stats topic (depth, message_count)", (0, 2), (entry["depth"], entry["message_count"]))
    client = (chan["clients"] or [{}])[0]
    expect_keys("/stats client", client, STATS_CLIENT_KEYS)
    expect_equal("/stats client version", "V2", client["version"])
    expect_equal("/stats client state (subscribed)", CLIENT_STATE_SUBSCRIBED, client["state"])
    expect_equal("/stats client ready_count", 7, client["ready_count"])
    expect_equal("/stats client client_id", "conformance-client", client["client_id"])
    expect_equal("/stats client hostname", "conformance-host", client["hostname"])
    expect_equal("/stats client (in_flight_count, message_count)", (2, 2),
                 (client["in_flight_count"], client["message_count"]))
    counts = [p.get("pub_counts") for p in stats["producers"] or []]
    if [{"topic": topic, "count": 2}] not in counts:
        raise CheckFailed("/stats producers: the open TCP producer", f'pub_counts [{{"topic":"{topic}","count":2}}]',
                          counts)


@check("http-stats-filters")
def _http_stats_filters(t: Target) -> None:
    """GET /stats filters by topic and channel (null topics for an unknown one) and honours include_mem=false."""
    topic, other = t.topic(), t.topic()
    c1, c2 = t.channel(), t.channel()
    for name in (topic, other):
        t.expect_http("POST", "/topic/create", {"topic": name})
    for name in (c1, c2):
        t.expect_http("POST", "/channel/create", {"topic": topic, "channel": name})
    stats = t.stats(topic=topic)
    names = [e.get("topic_name") for e in stats.get("topics") or []]
    expect_equal(f"/stats?topic={topic}: topics", [topic], names)
    stats = t.stats(topic=topic, channel=c1)
    channels = [c.get("channel_name") for e in stats.get("topics") or [] for c in e.get("channels") or []]
    expect_equal(f"/stats?topic=…&channel={c1}: channels", [c1], channels)
    stats = t.stats(topic="cf-no-such-topic-" + secrets.token_hex(4))
    if stats.get("topics", "absent") is not None:
        raise CheckFailed("/stats?topic=<unknown>: topics", "null", stats.get("topics", "absent"))
    stats = t.stats(include_mem="false")
    if "memory" in stats:
        raise CheckFailed("/stats?include_mem=false", "no memory key", "memory present")


@check("http-errors")
def _http_errors(t: Target) -> None:
    """HTTP errors carry nsqd's status and text: topic missing or invalid, body empty or too big, unknown paths."""
    topic = t.topic()
    t.expect_http_error("POST", "/pub", None, 400, "MISSING_ARG_TOPIC", b"x")
    t.expect_http_error("POST", "/pub", {"topic": "bad*"}, 400, "INVALID_TOPIC", b"x")
    t.expect_http_error("POST", "/pub", {"topic": topic}, 400, "MSG_EMPTY", b"")
    t.expect_http_error("POST", "/pub", {"topic": topic}, 413, "MSG_TOO_BIG", b"m" * (MAX_MSG_SIZE + 1))
    t.expect_http_error("POST", "/topic/pause", {"topic": topic}, 404, "TOPIC_NOT_FOUND")
    t.expect_http_error("GET", "/no-such-path", None, 404, "NOT_FOUND")


@check("http-method-not-allowed")
def _http_405(t: Target) -> None:
    """A wrong method is 405 METHOD_NOT_ALLOWED with an Allow header."""
    reply = t.expect_http_error("GET", "/pub", {"topic": t.topic()}, 405, "METHOD_NOT_ALLOWED")
    allow = reply.header("Allow") or ""
    if "POST" not in allow:
        raise CheckFailed("GET /pub: Allow header", "an Allow header listing POST", allow or "no Allow header")
    reply = t.expect_http_error("POST", "/ping", None, 405, "METHOD_NOT_ALLOWED")
    allow = reply.header("Allow") or ""
    if "GET" not in allow:
        raise CheckFailed("POST /ping: Allow header", "an Allow header listing GET", allow or "no Allow header")


@check("http-mpub-errors")
def _http_mpub_errors(t: Target) -> None:
    """POST /mpub body errors are 413 with the TCP code without its E_ (binary and text mode), a missing topic 400."""
    topic = t.topic()
    binary = {"topic": topic, "binary": "true"}
    # Binary-mode body errors are 413 with the TCP code minus its "E_" (docs/protocols/nsq.md).
    t.expect_http_error("POST", "/mpub", binary, 413, "BAD_BODY", _SIZE.pack(0))
    t.expect_http_error("POST", "/mpub", binary, 413, "BAD_MESSAGE", _SIZE.pack(1) + _SIZE.pack(0))
    t.expect_http_error("POST", "/mpub", {"topic": topic}, 413, "MSG_TOO_BIG",
                        b"ok\n" + b"m" * (MAX_MSG_SIZE + 1) + b"\n")
    t.expect_http_error("POST", "/mpub", None, 400, "MISSING_ARG_TOPIC", b"x\n")


@check("http-config")
def _http_config(t: Target) -> None:
    """GET /config/<option> answers the option's value as JSON; PUT of a read-only option is 400 INVALID_OPTION."""
    reply = t.expect_http("GET", "/config/max_rdy_count")
    expect_equal("GET /config/max_rdy_count", MAX_RDY_COUNT, reply.json("GET /config/max_rdy_count"))
    reply = t.expect_http("GET", "/config/msg_timeout")
    expect_equal("GET /config/msg_timeout (ns)", DEFAULT_MSG_TIMEOUT_MS * 10**6, reply.json("GET /config/msg_timeout"))
    t.expect_http_error("PUT", "/config/max_rdy_count", None, 400, "INVALID_OPTION", b"10")


@check("http-stats-text")
def _http_stats_text(t: Target) -> None:
    """GET /stats without a format answers nsqd's text report (version line, health, topics)."""
    topic = t.topic()
    t.expect_http("POST", "/topic/create", {"topic": topic})
    text = t.expect_http("GET", "/stats").body
    lines = text.split(b"\n")
    if not lines[0].startswith(b"nsqd v"):
        raise CheckFailed("GET /stats (text): first line", "nsqd v<version> (built w/…)", lines[0])
    for wanted in (b"Health: OK", f"[{topic}".encode()):
        if not any(wanted in line for line in lines):
            raise CheckFailed("GET /stats (text)", f"a line with {wanted!r}", text[:300])


# =============================================================================================
# The command


def make_context_factory(
    tcp: tuple[str, int], http_address: tuple[str, int], timeout: float
) -> Callable[[str], AbstractContextManager[Target]]:
    run = runner.RunState()
    return runner.contexts(lambda name: Target(tcp, http_address, timeout, name, run), Target.cleanup)


@click.command()
@click.option("--tcp", "tcp", default="127.0.0.1:4150", show_default=True, help="nsqd TCP address HOST:PORT")
@click.option("--http", "http_address", default="127.0.0.1:4151", show_default=True,
              help="nsqd HTTP API address HOST:PORT")
@runner.selection_options()
@runner.timeout_option("reply")
def command(tcp: str, http_address: str, timeout: float) -> None:
    """Check that an nsqd-compatible server behaves like nsqd v1.3.0 (TCP V2 and HTTP API).

    Prints `PASS name` or `FAIL name: reason` per check, then `N passed, M failed`;
    exits 0 only if every check passed.
    """
    contexts = make_context_factory(runner.parse_address(tcp), runner.parse_address(http_address), timeout)
    runner.run_command(checks, contexts, address=("--tcp", tcp))
