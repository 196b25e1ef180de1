"""NSQ V2 wire codec, server side: sans-IO, in the manner of h11.

Feed bytes with `receive_data`, pull typed commands (or protocol errors) with `next_event`,
and build server frames with the `frame_*` functions. The parser tracks the client state
(init, subscribed, closing) because nsqd checks the state *before* it reads a command's body,
and the error a client sees depends on that order. The adapter tells the parser when a SUB or
CLS succeeded. Texts, codes and check order follow nsqd v1.3.0 `protocol_v2.go` as recorded in
docs/protocols/nsq.md
"""

from __future__ import annotations

import binascii
import dataclasses
import enum
import json
import re
import struct
import sys
from array import array
from typing import Any, Final

import attrs

MAGIC_V2: Final = b"  V2"

FRAME_TYPE_RESPONSE: Final = 0
FRAME_TYPE_ERROR: Final = 1
FRAME_TYPE_MESSAGE: Final = 2

MSG_ID_LENGTH: Final = 16
_HEX_DIGITS: Final = b"0123456789abcdef"
# `FIN <id>\n`: a consumer's FINs come in runs of such lines, parsed as one event (`Fins`).
FIN_LINE_LENGTH: Final = 4 + MSG_ID_LENGTH + 1
# What a run of FIN lines holds besides its ids' characters, which are ASCII letters and digits.
_FIN_LINE_BYTES: Final = b"FIN \n"
_FIN_RUN_BYTES: Final = b"0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ \n"
_BIG_ENDIAN_HOST: Final = sys.byteorder == "big"
# Message frame data: int64 ns timestamp, uint16 attempts, 16-byte id, then the body.
MESSAGE_HEADER: Final = struct.Struct(">iiqH")  # frame size, frame type, timestamp, attempts
# The same with the id's 16 hex digits: a delivery's header in one allocation.
MESSAGE_HEADER_WITH_ID: Final = struct.Struct(f">iiqH{MSG_ID_LENGTH}s")
# Engine ids are 64-bit (core/ids.py): 8 bytes, shown as 16 hex digits.
ID_BYTES: Final = 8
MESSAGE_OVERHEAD: Final = 8 + 2 + MSG_ID_LENGTH  # bytes of message data before the body

OK: Final = b"OK"
CLOSE_WAIT: Final = b"CLOSE_WAIT"
HEARTBEAT: Final = b"_heartbeat_"

# nsqd reads commands through a 16 KiB bufio.Reader; a longer line ends the connection
# with no error frame (docs/protocols/nsq.md).
MAX_LINE_LENGTH: Final = 16 * 1024

# Name rule of nsqd internal/protocol/names.go, with the 64-byte limit of v1.3.0 (docs/protocols/nsq.md).
MAX_NAME_LENGTH: Final = 64
EPHEMERAL_SUFFIX: Final = "#ephemeral"
# `\Z`, not `$`: Python's `$` also matches before a trailing newline, Go's does not.
_NAME_RE: Final = re.compile(rb"^[.a-zA-Z0-9_-]+(#ephemeral)?\Z")

_SIZE: Final = struct.Struct(">i")


# Names already found valid: a publisher repeats the same few topics, so most checks are one
# set lookup instead of a regex. Bounded; cleared when full.
_KNOWN_VALID_NAMES: Final[set[bytes]] = set()
_KNOWN_VALID_NAMES_MAX: Final = 10_000


def is_valid_name(name: bytes) -> bool:
    """nsqd's topic/channel name rule: `[.a-zA-Z0-9_-]+` plus optional `#ephemeral`, 1..64 bytes."""
    if name in _KNOWN_VALID_NAMES:
        return True
    if 0 < len(name) <= MAX_NAME_LENGTH and _NAME_RE.match(name) is not None:
        if len(_KNOWN_VALID_NAMES) >= _KNOWN_VALID_NAMES_MAX:
            _KNOWN_VALID_NAMES.clear()
        _KNOWN_VALID_NAMES.add(bytes(name))
        return True
    return False


def is_ephemeral(name: str) -> bool:
    return name.endswith(EPHEMERAL_SUFFIX)


@attrs.frozen
class ServerLimits:
    """What the server allows; defaults are nsqd v1.3.0's (nsqio/nsq:nsqd/options.go)."""

    max_msg_size: int = 1048576  # --max-msg-size
    max_body_size: int = 5242880  # --max-body-size
    max_rdy_count: int = 2500  # --max-rdy-count
    msg_timeout_ms: int = 60_000  # --msg-timeout
    max_msg_timeout_ms: int = 900_000  # --max-msg-timeout (15 min)
    max_req_timeout_ms: int = 3_600_000  # --max-req-timeout (1 h), also the DPUB limit
    heartbeat_interval_ms: int = 30_000  # client timeout 60 s / 2
    max_heartbeat_interval_ms: int = 60_000  # --max-heartbeat-interval
    output_buffer_size: int = 16 * 1024  # client default
    max_output_buffer_size: int = 64 * 1024  # --max-output-buffer-size
    output_buffer_timeout_ms: int = 250  # client default
    min_output_buffer_timeout_ms: int = 25  # --min-output-buffer-timeout
    max_output_buffer_timeout_ms: int = 30_000  # --max-output-buffer-timeout
    deflate_enabled: bool = True  # --deflate
    max_deflate_level: int = 6  # --max-deflate-level
    snappy_enabled: bool = True  # --snappy
    tls_available: bool = False  # a certificate is configured
    tls_required: bool = False  # --tls-required
    auth_enabled: bool = False  # --auth-http-address given
    version: str = "1.3.0"  # the nsqd version polymq is wire-compatible with


class ClientState(enum.Enum):
    MAGIC = "magic"
    INIT = "init"
    SUBSCRIBED = "subscribed"
    CLOSING = "closing"
    CLOSED = "closed"


# ---------------------------------------------------------------------------------------------
# Events: what the parser hands to the adapter


@attrs.frozen(slots=True)
class Identify:
    """A validated IDENTIFY. Values are the client's effective settings (0 already means default)."""

    raw: dict[str, Any]
    client_id: str
    hostname: str
    user_agent: str
    feature_negotiation: bool
    heartbeat_interval_ms: int  # -1 = disabled
    output_buffer_size: int  # 1 with timeout 0 = unbuffered
    output_buffer_timeout_ms: int  # 0 = no periodic flush
    tls_v1: bool
    deflate: bool
    deflate_level: int
    snappy: bool
    sample_rate: int
    msg_timeout_ms: int


@attrs.frozen(slots=True)
class Auth:
    secret: bytes


@attrs.frozen(slots=True)
class Sub:
    topic: str
    channel: str


# The commands of every message (a publish, a FIN, a RDY) are dataclasses with an `__init__` of their
# own: mypyc compiles those as native classes, built and read without a lookup, where an attrs class
# stays an interpreted one (measured: 133 ns to build one against 29 ns).


@dataclasses.dataclass(init=False)
class Pub:
    topic: str
    body: bytes

    def __init__(self, topic: str, body: bytes) -> None:
        self.topic = topic
        self.body = body


@dataclasses.dataclass(init=False)
class Mpub:
    topic: str
    bodies: list[bytes]

    def __init__(self, topic: str, bodies: list[bytes]) -> None:
        self.topic = topic
        self.bodies = bodies


@attrs.frozen(slots=True)
class Dpub:
    topic: str
    defer_ms: int
    body: bytes


@dataclasses.dataclass(init=False)
class Rdy:
    count: int

    def __init__(self, count: int) -> None:
        self.count = count


@dataclasses.dataclass(init=False)
class Fin:
    msg_id: bytes

    def __init__(self, msg_id: bytes) -> None:
        self.msg_id = msg_id


@dataclasses.dataclass(init=False)
class Fins:
    """Consecutive plain `FIN <id>` lines (two or more), in order: each as a `Fin` would be. `lines`
    are their bytes as they came, `FIN_LINE_LENGTH` each: the ids are read from them in bulk
    (`fin_numbers`), not one object per FIN."""

    lines: bytes

    def __init__(self, lines: bytes) -> None:
        self.lines = lines

    @property
    def msg_ids(self) -> list[bytes]:
        return [self.msg_id(index) for index in range(len(self.lines) // FIN_LINE_LENGTH)]

    def msg_id(self, index: int) -> bytes:
        start = index * FIN_LINE_LENGTH + 4
        return self.lines[start : start + MSG_ID_LENGTH]


@attrs.frozen(slots=True)
class Req:
    msg_id: bytes
    timeout_ms: int  # already clamped to 0..max_req_timeout_ms, as nsqd does


@attrs.frozen(slots=True)
class Touch:
    msg_id: bytes


@attrs.frozen(slots=True)
class Cls:
    pass


@attrs.frozen(slots=True)
class Nop:
    pass


@attrs.frozen(slots=True)
class ProtocolError:
    """An error frame to send. When `fatal`, the connection must be closed after sending it."""

    code: str
    description: bytes
    fatal: bool = True

    @property
    def frame_text(self) -> bytes:
        if not self.description:
            return self.code.encode()
        return self.code.encode() + b" " + self.description


@attrs.frozen(slots=True)
class CloseSilently:
    """Close with no error frame (nsqd does this for a command line over its read buffer)."""

    reason: str


class _NeedData:
    def __repr__(self) -> str:
        return "NEED_DATA"


NEED_DATA: Final = _NeedData()

Command = Identify | Auth | Sub | Pub | Mpub | Dpub | Rdy | Fin | Fins | Req | Touch | Cls | Nop
Event = Command | ProtocolError | CloseSilently | _NeedData

# The only error codes after which nsqd keeps the connection (docs/protocols/nsq.md).
NON_FATAL_CODES: Final = frozenset({"E_FIN_FAILED", "E_REQ_FAILED", "E_TOUCH_FAILED"})


def fatal(code: str, text: str | bytes) -> ProtocolError:
    return ProtocolError(code, text.encode() if isinstance(text, str) else text, True)


def non_fatal(code: str, text: str | bytes) -> ProtocolError:
    return ProtocolError(code, text.encode() if isinstance(text, str) else text, False)


def go_quote(raw: bytes) -> str:
    """Go's %q of a byte string (strconv.Quote), as nsqd prints invalid names."""
    out = ['"']
    text = raw.decode("utf-8", "surrogateescape")
    escapes = {'"': '\\"', "\\": "\\\\", "\a": "\\a", "\b": "\\b", "\f": "\\f", "\n": "\\n",
               "\r": "\\r", "\t": "\\t", "\v": "\\v"}
    for ch in text:
        code = ord(ch)
        if ch in escapes:
            out.append(escapes[ch])
        elif 0xDC80 <= code <= 0xDCFF:  # an undecodable byte
            out.append(f"\\x{code - 0xDC00:02x}")
        elif ch.isprintable():
            out.append(ch)
        elif code < 0x80:
            out.append(f"\\x{code:02x}")
        elif code <= 0xFFFF:
            out.append(f"\\u{code:04x}")
        else:
            out.append(f"\\U{code:08x}")
    out.append('"')
    return "".join(out)


def _base10(raw: bytes) -> int | None:
    """nsqd's ByteToBase10: digits only (no sign); the empty string is 0; wraps like Go's uint64."""
    if raw and not raw.isdigit():
        return None
    if len(raw) <= 19:
        return int(raw) if raw else 0
    value = 0  # int() refuses more than 4300 digits, and Go wraps anyway
    for digit in raw:
        value = (value * 10 + digit - 48) & 0xFFFFFFFFFFFFFFFF
    return value


# ---------------------------------------------------------------------------------------------
# Frame encoders


def frame(frame_type: int, data: bytes) -> bytes:
    return _SIZE.pack(len(data) + 4) + _SIZE.pack(frame_type) + data


def frame_response(data: bytes) -> bytes:
    return frame(FRAME_TYPE_RESPONSE, data)


def frame_error(error: ProtocolError) -> bytes:
    return frame(FRAME_TYPE_ERROR, error.frame_text)


FRAME_OK: Final = frame_response(OK)
FRAME_HEARTBEAT: Final = frame_response(HEARTBEAT)
FRAME_CLOSE_WAIT: Final = frame_response(CLOSE_WAIT)


def frame_message_header(timestamp_ns: int, attempts: int, msg_id: bytes, body_len: int) -> bytes:
    """Everything of a message frame before its body (so the writer can avoid copying bodies)."""
    return (
        MESSAGE_HEADER.pack(body_len + MESSAGE_OVERHEAD + 4, FRAME_TYPE_MESSAGE, timestamp_ns, attempts)
        + msg_id
    )


def frame_message_header_of(timestamp_ns: int, attempts: int, message_id: int, body_len: int) -> bytes:
    """`frame_message_header` for a numeric id (0 to 2**64 - 1), shown as NSQ shows ids: 16 lowercase
    hex digits. Once per delivery: hexlify and one pack cost a third less than `%016x` and a join."""
    return MESSAGE_HEADER_WITH_ID.pack(body_len + MESSAGE_OVERHEAD + 4, FRAME_TYPE_MESSAGE, timestamp_ns, attempts,
                                       binascii.hexlify(message_id.to_bytes(ID_BYTES, "big")))


def message_id_of(message_id: int) -> bytes:
    """The 16 hex digits a client sees for a message id (the inverse of `message_id_number`)."""
    return binascii.hexlify(message_id.to_bytes(ID_BYTES, "big"))


def message_id_number(raw: bytes) -> int:
    """The number a 16-character lowercase hex id names (as `frame_message_header_of` writes ids);
    -1 for anything else, which names no message."""
    if len(raw) != MSG_ID_LENGTH or raw.strip(_HEX_DIGITS):
        return -1
    return int(raw, 16)


def fin_numbers(lines: bytes) -> list[int]:
    """The numbers of a run of FIN lines' ids (`Fins.lines`), -1 for one that names no message (as
    `message_id_number`): when every id is 16 lowercase hex digits, as the ids this codec writes,
    in a few passes over the run's bytes instead of a parse per id."""
    count = len(lines) // FIN_LINE_LENGTH
    digits = lines.translate(None, _FIN_LINE_BYTES)
    if len(digits) == count * MSG_ID_LENGTH and not digits.translate(None, _HEX_DIGITS):
        numbers = array("Q", binascii.unhexlify(digits))
        if not _BIG_ENDIAN_HOST:
            numbers.byteswap()
        return numbers.tolist()
    return [message_id_number(lines[start : start + MSG_ID_LENGTH])
            for start in range(4, len(lines), FIN_LINE_LENGTH)]


def _all_fin_lines(lines: bytes, count: int) -> bool:
    """Whether `lines` are `count` plain FIN lines (`FIN `, 16 ASCII letters or digits, `\n`), checked
    in a few passes over the bytes: a newline at the end of each line and nowhere else, `FIN `
    after each, no other space, nothing but letters and digits in the ids."""
    return (count > 0 and lines.startswith(b"FIN ")
            and lines[FIN_LINE_LENGTH - 1 :: FIN_LINE_LENGTH] == b"\n" * count and lines.count(b"\n") == count
            and lines.count(b"\nFIN ") == count - 1 and lines.count(b" ") == count
            and not lines.translate(None, _FIN_RUN_BYTES))


def frame_message(timestamp_ns: int, attempts: int, msg_id: bytes, body: bytes) -> bytes:
    return frame_message_header(timestamp_ns, attempts, msg_id, len(body)) + body


def identify_response(identify: Identify, limits: ServerLimits, *, tls: bool) -> bytes:
    """The feature-negotiation JSON, keys in nsqd's order (docs/protocols/nsq.md)."""
    body = {
        "max_rdy_count": limits.max_rdy_count,
        "version": limits.version,
        "max_msg_timeout": limits.max_msg_timeout_ms,
        "msg_timeout": identify.msg_timeout_ms,
        "tls_v1": tls,
        "deflate": identify.deflate,
        "deflate_level": identify.deflate_level,
        "max_deflate_level": limits.max_deflate_level,
        "snappy": identify.snappy,
        "sample_rate": identify.sample_rate,
        "auth_required": limits.auth_enabled,
        "output_buffer_size": identify.output_buffer_size,
        "output_buffer_timeout": identify.output_buffer_timeout_ms,
    }
    return json.dumps(body, separators=(",", ":")).encode()


# ---------------------------------------------------------------------------------------------
# The parser


@attrs.define(slots=True)
class _PendingBody:
    """A command line was read; its size-prefixed body is still to come."""

    name: bytes
    params: list[bytes]
    size: int | None = None


class ServerConnection:
    """The server side of one NSQ V2 connection, without I/O."""

    def __init__(self, limits: ServerLimits | None = None) -> None:
        self.limits = limits or ServerLimits()
        self.state = ClientState.MAGIC
        self.heartbeats_disabled = False
        self.tls_active = False
        self._buffer = bytearray()
        self._pos = 0  # bytes of `_buffer` already parsed
        self._pending: _PendingBody | None = None

    # -- state transitions the adapter reports -------------------------------------------------

    def subscribed(self) -> None:
        self.state = ClientState.SUBSCRIBED

    def closing(self) -> None:
        self.state = ClientState.CLOSING

    def closed(self) -> None:
        self.state = ClientState.CLOSED

    # -- input ---------------------------------------------------------------------------------

    def receive_data(self, data: bytes) -> None:
        if self.state is ClientState.CLOSED:  # after a fatal error nothing more is parsed
            return
        if self._pos:
            # Parsed bytes are dropped once per read, not once per command (no O(n^2) memmove).
            del self._buffer[: self._pos]
            self._pos = 0
        self._buffer += data

    @property
    def buffered(self) -> int:
        return len(self._buffer) - self._pos

    def take_buffered(self) -> bytes:
        """Remove and return unparsed input (bytes that arrived before a TLS or compression upgrade)."""
        data = bytes(self._buffer[self._pos :])
        self._buffer.clear()
        self._pos = 0
        return data

    def next_event(self) -> Event:
        if self.state is ClientState.CLOSED:
            return NEED_DATA
        buffer = self._buffer
        if self.state is ClientState.MAGIC:
            if len(buffer) - self._pos < 4:
                return NEED_DATA
            magic = bytes(buffer[self._pos : self._pos + 4])
            self._pos += 4
            if magic != MAGIC_V2:
                return self._fail(ProtocolError("E_BAD_PROTOCOL", b""))
            self.state = ClientState.INIT
        if self._pending is not None:
            return self._continue_body()
        pos = self._pos
        if (buffer.startswith(b"FIN ", pos) and self.state in (ClientState.SUBSCRIBED, ClientState.CLOSING)
                and not (self.limits.tls_required and not self.tls_active)):
            fins = self._fins(buffer, pos)
            if fins is not None:
                return fins
        newline = buffer.find(b"\n", pos)
        if newline < 0:
            if len(buffer) - pos >= MAX_LINE_LENGTH:
                return self._close_silently()
            return NEED_DATA
        if newline - pos >= MAX_LINE_LENGTH:
            return self._close_silently()
        line = bytes(buffer[pos:newline])
        self._pos = newline + 1
        if line.endswith(b"\r"):
            line = line[:-1]
        event = self._command(line.split(b" "))
        if isinstance(event, ProtocolError) and event.fatal:
            return self._fail(event)
        return event

    def _fins(self, buffer: bytearray, pos: int) -> Fin | Fins | None:
        """The run of plain FIN lines at `pos` without splitting each (a consumer sends one per
        message). A line with anything else (`\r`, spaces, more params) is left to the general path."""
        count = (len(buffer) - pos) // FIN_LINE_LENGTH
        run_end = pos + count * FIN_LINE_LENGTH
        lines = bytes(buffer[pos:run_end])
        if not _all_fin_lines(lines, count):
            # Something else among them: the run ends at the first line that is not a plain FIN.
            newline = FIN_LINE_LENGTH - 1
            run_end = pos
            while run_end + FIN_LINE_LENGTH <= len(buffer) and buffer[run_end + newline] == 10 \
                    and buffer.startswith(b"FIN ", run_end) \
                    and buffer[run_end + 4 : run_end + newline].isalnum():
                run_end += FIN_LINE_LENGTH
            count = (run_end - pos) // FIN_LINE_LENGTH
            lines = lines[: run_end - pos]
        if not count:
            return None
        self._pos = run_end
        return Fin(lines[4 : 4 + MSG_ID_LENGTH]) if count == 1 else Fins(lines)

    def _fail(self, error: ProtocolError) -> ProtocolError:
        self.state = ClientState.CLOSED
        self._buffer.clear()
        self._pos = 0
        self._pending = None
        return error

    def _close_silently(self) -> CloseSilently:
        self.state = ClientState.CLOSED
        self._buffer.clear()
        self._pos = 0
        return CloseSilently(f"command line longer than {MAX_LINE_LENGTH} bytes")

    # -- commands ------------------------------------------------------------------------------

    def _command(self, params: list[bytes]) -> Event:
        name = params[0]
        if self.limits.tls_required and not self.tls_active and name != b"IDENTIFY":
            return fatal("E_INVALID", b"cannot " + name + b" in current state (TLS required)")
        handler = _LINE_COMMANDS.get(name)
        if handler is not None:
            return handler(self, params)
        if name in _BODY_COMMANDS:
            error = _BODY_COMMANDS[name][0](self, params)
            if error is not None:
                return error
            self._pending = _PendingBody(name, params)
            return self._continue_body()
        return fatal("E_INVALID", b"invalid command " + name)

    def _continue_body(self) -> Event:
        pending = self._pending
        assert pending is not None
        buffer = self._buffer
        if pending.size is None:
            if len(buffer) - self._pos < 4:
                return NEED_DATA
            size = _SIZE.unpack_from(buffer, self._pos)[0]
            self._pos += 4
            error = _BODY_COMMANDS[pending.name][1](self, size)
            if error is not None:
                return self._fail(error)
            pending.size = size
        size = pending.size
        pos = self._pos
        if len(buffer) - pos < size:
            return NEED_DATA
        body = bytes(buffer[pos : pos + size])
        self._pos = pos + size
        self._pending = None
        event = _BODY_COMMANDS[pending.name][2](self, pending.params, body)
        if isinstance(event, ProtocolError) and event.fatal:
            return self._fail(event)
        return event

    # line-only commands

    def _nop(self, params: list[bytes]) -> Event:
        return Nop()

    def _rdy(self, params: list[bytes]) -> Event:
        if self.state is ClientState.CLOSING:
            return Nop()  # nsqd ignores RDY after CLS
        if self.state is not ClientState.SUBSCRIBED:
            return fatal("E_INVALID", "cannot RDY in current state")
        count = 1
        if len(params) > 1:
            parsed = _base10(params[1])
            if parsed is None:
                return fatal("E_INVALID", b"RDY could not parse count " + params[1])
            count = parsed - (1 << 64) if parsed >= 1 << 63 else parsed  # nsqd: int64(b10)
        if count < 0 or count > self.limits.max_rdy_count:
            return fatal("E_INVALID", f"RDY count {count} out of range 0-{self.limits.max_rdy_count}")
        return Rdy(count)

    def _message_id(self, params: list[bytes], name: str, min_params: int) -> bytes | ProtocolError:
        if self.state not in (ClientState.SUBSCRIBED, ClientState.CLOSING):
            return fatal("E_INVALID", f"cannot {name} in current state")
        if len(params) < min_params:
            return fatal("E_INVALID", f"{name} insufficient number of params")
        if len(params[1]) != MSG_ID_LENGTH:
            return fatal("E_INVALID", "invalid message ID")
        return params[1]

    def _fin(self, params: list[bytes]) -> Event:
        msg_id = self._message_id(params, "FIN", 2)
        return msg_id if isinstance(msg_id, ProtocolError) else Fin(msg_id)

    def _touch(self, params: list[bytes]) -> Event:
        msg_id = self._message_id(params, "TOUCH", 2)
        return msg_id if isinstance(msg_id, ProtocolError) else Touch(msg_id)

    def _req(self, params: list[bytes]) -> Event:
        msg_id = self._message_id(params, "REQ", 3)
        if isinstance(msg_id, ProtocolError):
            return msg_id
        timeout = _base10(params[2])
        if timeout is None:
            return fatal("E_INVALID", b"REQ could not parse timeout " + params[2])
        # nsqd clamps (and only logs) a timeout above --max-req-timeout.
        return Req(msg_id, min(timeout, self.limits.max_req_timeout_ms))

    def _sub(self, params: list[bytes]) -> Event:
        if self.state is not ClientState.INIT:
            return fatal("E_INVALID", "cannot SUB in current state")
        if self.heartbeats_disabled:
            return fatal("E_INVALID", "cannot SUB with heartbeats disabled")
        if len(params) < 3:
            return fatal("E_INVALID", "SUB insufficient number of parameters")
        if not is_valid_name(params[1]):
            return fatal("E_BAD_TOPIC", f"SUB topic name {go_quote(params[1])} is not valid")
        if not is_valid_name(params[2]):
            return fatal("E_BAD_CHANNEL", f"SUB channel name {go_quote(params[2])} is not valid")
        return Sub(params[1].decode(), params[2].decode())

    def _cls(self, params: list[bytes]) -> Event:
        if self.state is not ClientState.SUBSCRIBED:
            return fatal("E_INVALID", "cannot CLS in current state")
        return Cls()

    # body commands: (check the line, check the size, build from the body)

    def _identify_line(self, params: list[bytes]) -> ProtocolError | None:
        if self.state is not ClientState.INIT:
            return fatal("E_INVALID", "cannot IDENTIFY in current state")
        return None

    def _identify_size(self, size: int) -> ProtocolError | None:
        return self._body_size("IDENTIFY", size, "E_BAD_BODY", "body", self.limits.max_body_size)

    def _identify_body(self, params: list[bytes], body: bytes) -> Event:
        try:
            data = json.loads(body)
        except (ValueError, RecursionError):
            return fatal("E_BAD_BODY", "IDENTIFY failed to decode JSON body")
        if data is None:  # Go's json.Unmarshal of null leaves the struct alone
            data = {}
        if not isinstance(data, dict) or not _identify_types_ok(data):
            return fatal("E_BAD_BODY", "IDENTIFY failed to decode JSON body")
        result = negotiate_identify(data, self.limits)
        if isinstance(result, Identify):
            self.heartbeats_disabled = result.heartbeat_interval_ms == -1
        return result

    def _auth_line(self, params: list[bytes]) -> ProtocolError | None:
        if self.state is not ClientState.INIT:
            return fatal("E_INVALID", "cannot AUTH in current state")
        if len(params) != 1:
            return fatal("E_INVALID", "AUTH invalid number of parameters")
        return None

    def _auth_size(self, size: int) -> ProtocolError | None:
        return self._body_size("AUTH", size, "E_BAD_BODY", "body", self.limits.max_body_size)

    def _auth_body(self, params: list[bytes], body: bytes) -> Event:
        return Auth(body)

    def _topic_line(self, params: list[bytes], name: str, min_params: int) -> ProtocolError | None:
        if len(params) < min_params:
            return fatal("E_INVALID", f"{name} insufficient number of parameters")
        if not is_valid_name(params[1]):
            return fatal("E_BAD_TOPIC", f"{name} topic name {go_quote(params[1])} is not valid")
        return None

    def _body_size(self, name: str, size: int, code: str, what: str, limit: int) -> ProtocolError | None:
        if size <= 0:
            return fatal(code, f"{name} invalid {what} size {size}")
        if size > limit:
            big = "message" if what == "message body" else what
            return fatal(code, f"{name} {big} too big {size} > {limit}")
        return None

    def _pub_line(self, params: list[bytes]) -> ProtocolError | None:
        return self._topic_line(params, "PUB", 2)

    def _pub_size(self, size: int) -> ProtocolError | None:
        return self._body_size("PUB", size, "E_BAD_MESSAGE", "message body", self.limits.max_msg_size)

    def _pub_body(self, params: list[bytes], body: bytes) -> Event:
        return Pub(params[1].decode(), body)

    def _dpub_line(self, params: list[bytes]) -> ProtocolError | None:
        error = self._topic_line(params, "DPUB", 3)
        if error is not None:
            return error
        defer = _base10(params[2])
        if defer is None:
            return fatal("E_INVALID", b"DPUB could not parse timeout " + params[2])
        if defer > self.limits.max_req_timeout_ms:
            return fatal("E_INVALID", f"DPUB timeout {defer} out of range 0-{self.limits.max_req_timeout_ms}")
        return None

    def _dpub_size(self, size: int) -> ProtocolError | None:
        return self._body_size("DPUB", size, "E_BAD_MESSAGE", "message body", self.limits.max_msg_size)

    def _dpub_body(self, params: list[bytes], body: bytes) -> Event:
        return Dpub(params[1].decode(), int(params[2] or b"0"), body)

    def _mpub_line(self, params: list[bytes]) -> ProtocolError | None:
        return self._topic_line(params, "MPUB", 2)

    def _mpub_size(self, size: int) -> ProtocolError | None:
        return self._body_size("MPUB", size, "E_BAD_BODY", "body", self.limits.max_body_size)

    def _mpub_body(self, params: list[bytes], body: bytes) -> Event:
        bodies = parse_mpub_body(body, self.limits)
        if isinstance(bodies, ProtocolError):
            return bodies
        return Mpub(params[1].decode(), bodies)


def parse_mpub_body(body: bytes, limits: ServerLimits, name: str = "MPUB") -> list[bytes] | ProtocolError:
    """`[int32 n]([int32 len][bytes])*n`, validated all-or-nothing as nsqd's readMPUB does."""
    if len(body) < 4:
        return fatal("E_BAD_BODY", f"{name} failed to read message count")
    count = _SIZE.unpack_from(body)[0]
    max_messages = (limits.max_body_size - 4) // 5
    if count <= 0 or count > max_messages:
        return fatal("E_BAD_BODY", f"{name} invalid message count {count}")
    end = len(body)
    unpack = _SIZE.unpack_from
    max_size = limits.max_msg_size
    if count == 1 and end > 8:
        # One message (nsq's bench_writer and many clients send each PUB as an MPUB of one): when it
        # is whole and valid, one slice; else the loop below finds and names what is wrong.
        size = unpack(body, 4)[0]
        if 0 < size <= max_size and size == end - 8:
            return [body[8:]]
    view = memoryview(body)
    offset = 4
    bodies: list[bytes] = []
    for index in range(count):
        if offset + 4 > end:
            return fatal("E_BAD_MESSAGE", f"{name} failed to read message({index}) body size")
        size = unpack(body, offset)[0]
        offset += 4
        if size <= 0:
            return fatal("E_BAD_MESSAGE", f"{name} invalid message({index}) body size {size}")
        if size > max_size:
            return fatal("E_BAD_MESSAGE", f"{name} message too big {size} > {max_size}")
        if offset + size > end:
            return fatal("E_BAD_MESSAGE", f"{name} failed to read message({index}) body")
        bodies.append(bytes(view[offset : offset + size]))
        offset += size
    if offset != end:
        return fatal("E_BAD_BODY", f"{name} invalid body size {end}")
    return bodies


def negotiate_identify(data: dict[str, Any], limits: ServerLimits) -> Identify | ProtocolError:
    """Validate IDENTIFY keys with nsqd's rules (docs/protocols/nsq.md) and compute the effective values."""

    def integer(key: str) -> int | None:
        value = data.get(key)
        if value is None:  # absent or null: Go leaves the field at 0
            return 0
        if isinstance(value, bool) or not isinstance(value, int):
            return None
        return value

    def flag(key: str) -> bool:
        return data.get(key) is True

    def text(key: str) -> str:
        value = data.get(key, "")
        return value if isinstance(value, str) else ""

    heartbeat = integer("heartbeat_interval")
    if heartbeat is None:
        return fatal("E_BAD_BODY", "IDENTIFY failed to decode JSON body")
    if heartbeat == -1:
        pass
    elif heartbeat == 0:
        heartbeat = limits.heartbeat_interval_ms
    elif heartbeat < 1000 or heartbeat > limits.max_heartbeat_interval_ms:
        return fatal("E_BAD_BODY", f"IDENTIFY heartbeat interval ({heartbeat}) is invalid")

    buffer_size = integer("output_buffer_size")
    buffer_timeout = integer("output_buffer_timeout")
    if buffer_size is None or buffer_timeout is None:
        return fatal("E_BAD_BODY", "IDENTIFY failed to decode JSON body")
    if buffer_timeout == -1:
        buffer_timeout = 0
    elif buffer_timeout == 0:
        buffer_timeout = limits.output_buffer_timeout_ms
    elif (
        buffer_timeout < limits.min_output_buffer_timeout_ms
        or buffer_timeout > limits.max_output_buffer_timeout_ms
    ):
        return fatal("E_BAD_BODY", f"IDENTIFY output buffer timeout ({buffer_timeout}) is invalid")
    if buffer_size == -1:
        buffer_size, buffer_timeout = 1, 0
    elif buffer_size == 0:
        buffer_size = limits.output_buffer_size
    elif buffer_size < 64 or buffer_size > limits.max_output_buffer_size:
        return fatal("E_BAD_BODY", f"IDENTIFY output buffer size ({buffer_size}) is invalid")

    sample_rate = integer("sample_rate")
    if sample_rate is None or sample_rate < 0 or sample_rate > 99:
        return fatal("E_BAD_BODY", f"IDENTIFY sample rate ({data.get('sample_rate')}) is invalid")

    msg_timeout = integer("msg_timeout")
    if msg_timeout is None:
        return fatal("E_BAD_BODY", "IDENTIFY failed to decode JSON body")
    if msg_timeout == 0:
        msg_timeout = limits.msg_timeout_ms
    elif msg_timeout < 1000 or msg_timeout > limits.max_msg_timeout_ms:
        return fatal("E_BAD_BODY", f"IDENTIFY msg timeout ({msg_timeout}) is invalid")

    # nsqd only looks at deflate/snappy when negotiating features (else it answers OK, uncompressed).
    negotiation = flag("feature_negotiation")
    deflate = flag("deflate") and limits.deflate_enabled and negotiation
    snappy = flag("snappy") and limits.snappy_enabled and negotiation
    if deflate and snappy:
        return fatal("E_IDENTIFY_FAILED", "cannot enable both deflate and snappy compression")
    deflate_level = integer("deflate_level")
    if deflate_level is None:
        return fatal("E_BAD_BODY", "IDENTIFY failed to decode JSON body")
    if deflate_level <= 0 or not deflate:
        deflate_level = 6
    deflate_level = min(deflate_level, limits.max_deflate_level)

    return Identify(
        raw=data,
        client_id=text("client_id"),
        hostname=text("hostname"),
        user_agent=text("user_agent"),
        feature_negotiation=negotiation,
        heartbeat_interval_ms=heartbeat,
        output_buffer_size=buffer_size,
        output_buffer_timeout_ms=buffer_timeout,
        tls_v1=flag("tls_v1"),
        deflate=deflate,
        deflate_level=deflate_level,
        snappy=snappy,
        sample_rate=sample_rate,
        msg_timeout_ms=msg_timeout,
    )


# IDENTIFY keys with their Go types in nsqd's identifyDataV2: a mismatch (or an int overflow) makes
# json.Unmarshal fail, so nsqd answers "failed to decode JSON body"; null is accepted.
_IDENTIFY_STRINGS: Final = frozenset({"client_id", "hostname", "user_agent"})
_IDENTIFY_FLAGS: Final = frozenset({"feature_negotiation", "tls_v1", "deflate", "snappy"})
_IDENTIFY_INT_BITS: Final = {"heartbeat_interval": 64, "output_buffer_size": 64, "output_buffer_timeout": 64,
                      "deflate_level": 64, "msg_timeout": 64, "sample_rate": 32}


def _identify_types_ok(data: dict[str, Any]) -> bool:
    for key, value in data.items():
        if value is None:
            continue
        if key in _IDENTIFY_STRINGS:
            ok = isinstance(value, str)
        elif key in _IDENTIFY_FLAGS:
            ok = isinstance(value, bool)
        elif key in _IDENTIFY_INT_BITS:
            bits = _IDENTIFY_INT_BITS[key] - 1
            ok = type(value) is int and -(1 << bits) <= value < (1 << bits)
        else:
            continue
        if not ok:
            return False
    return True


_LINE_COMMANDS: Final = {
    b"NOP": ServerConnection._nop,
    b"RDY": ServerConnection._rdy,
    b"FIN": ServerConnection._fin,
    b"REQ": ServerConnection._req,
    b"TOUCH": ServerConnection._touch,
    b"SUB": ServerConnection._sub,
    b"CLS": ServerConnection._cls,
}

_BODY_COMMANDS: Final = {
    b"PUB": (ServerConnection._pub_line, ServerConnection._pub_size, ServerConnection._pub_body),
    b"MPUB": (ServerConnection._mpub_line, ServerConnection._mpub_size, ServerConnection._mpub_body),
    b"DPUB": (ServerConnection._dpub_line, ServerConnection._dpub_size, ServerConnection._dpub_body),
    b"IDENTIFY": (
        ServerConnection._identify_line,
        ServerConnection._identify_size,
        ServerConnection._identify_body,
    ),
    b"AUTH": (ServerConnection._auth_line, ServerConnection._auth_size, ServerConnection._auth_body),
}
