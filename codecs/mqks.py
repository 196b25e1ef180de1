"""MQKS wire codec, server side: sans-IO, in the manner of h11.

Feed bytes with `ServerConnection.receive_data`, take the typed requests of every complete line
with `next_events`, and build response lines with the `ok_line`, `error_line`, `delivery_line` and
`update_line` functions. Parsing follows MQKS v0.4.3 (`server/lib/clients.py` and
`server/actions/*.py`) as recorded in docs/protocols/mqks.md, minus the original's defects:
a TAB answers `{id} error …` instead of dropping the connection, and a line longer than the
configured limit is answered and skipped instead of growing the buffer without end.

Ids, queue and event names are `str` (UTF-8); publish and ping data stay `bytes`, a slice of the
line, so a body is never decoded or copied twice.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import dataclasses
import datetime
import math
import random
import re
import string
from collections.abc import Callable, Iterable, Sequence
from typing import Final

import attrs

# The original reads lines with no limit (docs/protocols/mqks.md); polymq answers and skips longer lines.
# 1 MiB is nsqd's --max-msg-size default, so a body any polymq protocol accepts by default fits.
MAX_LINE_LENGTH: Final = 1024 * 1024
# Length of the original's ids (`config.id_length`, docs/protocols/mqks.md).
ID_LENGTH: Final = 24
# The request id the original answers a line with fewer than three fields with (docs/protocols/mqks.md).
NO_ID: Final = "None"
CONFIRM_PREFIX: Final = b"--confirm "
WHEN_UNUSED_FLAG: Final = "--delete-queue-when-unused"
MANUAL_ACK_FLAG: Final = "--manual-ack"
ALL_FLAG: Final = "--all"

# The reversible encoding of bodies an MQKS line cannot carry verbatim (docs/protocols/mqks.md): a
# newline, a TAB or another control character, bytes that are not UTF-8, an empty body, trailing
# whitespace (the original strips it), or a body that itself starts with this prefix.
ENCODED_PREFIX: Final = b"polymq:base64:"
# C0 controls and DEL, which a `bytes.translate` by this table turns into NUL, found then by memchr
# (a regex search of this class, or of it and the line breaks below, costs 2-10x as much; deleting
# them with `translate(None, ...)` and comparing lengths 1.8x), and the Unicode line breaks that
# `str.splitlines` splits on besides them (NEL, LS, PS), in UTF-8.
_CONTROLS_TO_NUL: Final = bytes(0 if byte < 0x20 or byte == 0x7F else byte for byte in range(256))
NUL: Final = 0
_LINE_BREAKS: Final = (b"\xc2\x85", b"\xe2\x80\xa8", b"\xe2\x80\xa9")
# Single bytes looked for with `in` by their value: in CPython 3.11 `b"\t" in line` first tries the
# needle as an int and builds (then drops) a TypeError with its message every time.
TAB: Final = ord("\t")
SPACE: Final = ord(" ")

_BASE62: Final = string.digits + string.ascii_letters


# ---------------------------------------------------------------------------------------------
# Requests: what the parser hands to the adapter. `request_id` doubles as msg_id / consumer_id.


# The requests of every message (a publish, an ack, a run of acks) are dataclasses with an `__init__`
# of their own: mypyc compiles those as native classes, built and read without a lookup, where an
# attrs class stays an interpreted one (measured: 133 ns to build one against 29 ns).


@dataclasses.dataclass(init=False)
class Publish:
    request_id: str
    event: str
    data: bytes  # the body the engine stores (`ENCODED_PREFIX` data already decoded)
    confirm: bool

    def __init__(self, request_id: str, event: str, data: bytes, confirm: bool) -> None:
        self.request_id = request_id
        self.event = event
        self.data = data
        self.confirm = confirm


@attrs.define(slots=True)
class Consume:
    request_id: str  # the consumer id
    queue: str
    replace: tuple[str, ...]  # events before `--add`; empty = keep the bindings
    add: tuple[str, ...]
    # None = flag absent (the queue's setting stays); True = delete at once; float = seconds to wait
    delete_when_unused: bool | float | None
    manual_ack: bool
    confirm: bool


@attrs.define(slots=True)
class Rebind:
    request_id: str
    queue: str
    replace: tuple[str, ...]
    remove: tuple[str, ...]
    remove_masks: tuple[str, ...]
    add: tuple[str, ...]
    confirm: bool


@dataclasses.dataclass(init=False)
class Ack:
    request_id: str
    consumer_id: str
    msg_id: str | None  # None = `--all`
    confirm: bool

    def __init__(self, request_id: str, consumer_id: str, msg_id: str | None, confirm: bool) -> None:
        self.request_id = request_id
        self.consumer_id = consumer_id
        self.msg_id = msg_id
        self.confirm = confirm


@dataclasses.dataclass(init=False)
class Acks:
    """A run of plain acks in one read (`{id} ack {consumer_id} {msg_id}`: no `--confirm`, no `--all`),
    each line the `Ack` `each()` gives: a manual-ack consumer acks a read's deliveries in one write,
    and the adapter finishes them in one engine call."""

    request_ids: list[str]
    consumer_ids: list[str]
    msg_ids: list[str]

    def __init__(self, request_ids: list[str], consumer_ids: list[str], msg_ids: list[str]) -> None:
        self.request_ids = request_ids
        self.consumer_ids = consumer_ids
        self.msg_ids = msg_ids

    def each(self) -> list[Ack]:
        return [Ack(request_id, consumer_id, msg_id, False)
                for request_id, consumer_id, msg_id in zip(self.request_ids, self.consumer_ids, self.msg_ids,
                                                           strict=True)]


@attrs.define(slots=True)
class Reject:
    request_id: str
    consumer_id: str
    msg_id: str | None  # None = `--all`
    confirm: bool


@attrs.define(slots=True)
class DeleteConsumer:
    request_id: str
    consumer_id: str
    confirm: bool


@attrs.define(slots=True)
class DeleteQueue:
    request_id: str
    queue: str
    confirm: bool


@attrs.define(slots=True)
class Ping:
    request_id: str
    data: bytes


@attrs.define(slots=True)
class Eval:
    request_id: str
    worker: int | None
    code: str
    confirm: bool


@attrs.define(slots=True)
class BadRequest:
    """A line the original answers with `{request_id} error {error_id}`; `reason` goes to the log."""

    request_id: str
    reason: str
    line: bytes  # the request, cut to `MAX_LOGGED_LINE` bytes, for the log


Request = Publish | Consume | Rebind | Ack | Acks | Reject | DeleteConsumer | DeleteQueue | Ping | Eval | BadRequest

# How much of a bad line the log shows.
MAX_LOGGED_LINE: Final = 512

ACTIONS: Final = frozenset({"publish", "consume", "rebind", "ack", "reject", "delete_consumer", "delete_queue",
                     "ping", "_eval"})


class _Invalid(Exception):
    pass


def _text(raw: bytes) -> str:
    try:
        return raw.decode()
    except UnicodeDecodeError:
        raise _Invalid("not UTF-8") from None


def _names(raw: bytes) -> list[str]:
    # The original splits on single spaces; an empty part (a double space) names nothing.
    return [_text(part) for part in raw.split(b" ") if part]


def _parse_when_unused(value: str) -> bool | float:
    if value == WHEN_UNUSED_FLAG:
        return True
    try:
        seconds = float(value[len(WHEN_UNUSED_FLAG) + 1 :])
    except ValueError:
        raise _Invalid(f"bad {WHEN_UNUSED_FLAG} value") from None
    if not math.isfinite(seconds):
        raise _Invalid(f"bad {WHEN_UNUSED_FLAG} value")
    return max(0.0, seconds)


def _consume(request_id: str, data: bytes, confirm: bool) -> Consume:
    queue: str | None = None
    replace: list[str] = []
    add: list[str] = []
    target = replace
    delete_when_unused: bool | float | None = None
    manual_ack = False
    for part in _names(data):
        if part.startswith("--"):
            if part == "--add":
                target = add
            elif part == WHEN_UNUSED_FLAG or part.startswith(WHEN_UNUSED_FLAG + "="):
                delete_when_unused = _parse_when_unused(part)
            elif part == MANUAL_ACK_FLAG:
                manual_ack = True
            else:
                raise _Invalid(f"unknown consume flag {part}")
        elif queue is None:
            queue = part
        else:
            target.append(part)
    if queue is None:
        raise _Invalid("consume needs a queue")
    return Consume(request_id, queue, tuple(replace), tuple(add), delete_when_unused, manual_ack, confirm)


# The original looks a section up by the flag's name, so `--replace` names the default section explicitly.
_REBIND_SECTIONS: Final = {"--replace": 0, "--remove": 1, "--remove-mask": 2, "--add": 3}


def _rebind(request_id: str, data: bytes, confirm: bool) -> Rebind:
    queue_raw, space, rest = data.partition(b" ")
    if not space or not queue_raw:
        raise _Invalid("rebind needs a queue and at least one argument")
    sections: tuple[list[str], ...] = ([], [], [], [])
    target = sections[0]
    for part in _names(rest):
        if part.startswith("--"):
            index = _REBIND_SECTIONS.get(part)
            if index is None:
                raise _Invalid(f"unknown rebind flag {part}")
            target = sections[index]
        else:
            target.append(part)
    replace, remove, masks, add = (tuple(section) for section in sections)
    return Rebind(request_id, _text(queue_raw), replace, remove, masks, add, confirm)


def _ack_args(data: bytes) -> tuple[str, str | None]:
    # As the original: the rest of the line is the msg_id (one with a space simply matches nothing).
    consumer_raw, space, msg_raw = data.partition(b" ")
    if not space or not consumer_raw or not msg_raw:
        raise _Invalid("needs {consumer_id} {msg_id}|--all")
    msg_id = _text(msg_raw)
    return _text(consumer_raw), None if msg_id == ALL_FLAG else msg_id


def _single_name(data: bytes, what: str) -> str:
    # The original takes the whole rest of the line as the name.
    if not data:
        raise _Invalid(f"needs a {what}")
    return _text(data)


def _eval(request_id: str, data: bytes, confirm: bool) -> Eval:
    worker = None
    code = _text(data)
    if code.startswith("--worker="):
        head, _, code = code.partition(" ")
        try:
            worker = int(head[len("--worker=") :])
        except ValueError:
            raise _Invalid("bad --worker") from None
    if not code:
        raise _Invalid("_eval needs code")
    return Eval(request_id, worker, code, confirm)


def decode_data(data: bytes) -> bytes:
    """A publisher's data as the body to store: the reversible encoding is undone."""
    if data.startswith(ENCODED_PREFIX):
        try:
            return base64.b64decode(data[len(ENCODED_PREFIX) :], validate=True)
        except (binascii.Error, ValueError):
            raise _Invalid(f"data starting with {ENCODED_PREFIX.decode()} must be base64") from None
    return data


def _line_safe(value: bytes) -> bool:
    """No C0 control, DEL or Unicode line break: nothing that would end or split a line."""
    if NUL in value.translate(_CONTROLS_TO_NUL):
        return False
    return value.isascii() or not any(line_break in value for line_break in _LINE_BREAKS)


def carries_field(value: bytes) -> bool:
    """Whether a response line carries `value` unchanged as one of its fields (a msg_id another
    protocol chose): not empty, no space, and none of the characters a body is encoded for."""
    return bool(value) and SPACE not in value and _line_safe(value)


def encode_body(body: bytes) -> bytes:
    """A body as MQKS data: verbatim when a line can carry it unchanged, else the reversible encoding."""
    if body and body[-1] != 0x20 and not body.startswith(ENCODED_PREFIX) and _line_safe(body):
        if body.isascii():
            return body
        try:
            body.decode()
        except UnicodeDecodeError:
            pass
        else:
            return body
    return ENCODED_PREFIX + base64.b64encode(body)


def _publish(request_id: str, data: bytes, confirm: bool) -> Publish:
    event_raw, space, body = data.partition(b" ")
    # An empty event (a double space) is no error in the original: no queue can bind it, so it drops.
    if not space or not body:
        raise _Invalid("publish needs {event} {data}")
    return Publish(request_id, _text(event_raw), decode_data(body), confirm)


def _ack(request_id: str, data: bytes, confirm: bool) -> Ack:
    consumer_id, msg_id = _ack_args(data)
    return Ack(request_id, consumer_id, msg_id, confirm)


def _reject(request_id: str, data: bytes, confirm: bool) -> Reject:
    consumer_id, msg_id = _ack_args(data)
    return Reject(request_id, consumer_id, msg_id, confirm)


def _ping(request_id: str, data: bytes, confirm: bool) -> Ping:
    # The original strips a confirm here too and answers once, with the rest (docs/protocols/mqks.md).
    return Ping(request_id, data)


def _delete_consumer(request_id: str, data: bytes, confirm: bool) -> DeleteConsumer:
    return DeleteConsumer(request_id, _single_name(data, "consumer id"), confirm)


def _delete_queue(request_id: str, data: bytes, confirm: bool) -> DeleteQueue:
    return DeleteQueue(request_id, _single_name(data, "queue"), confirm)


# One parser per action: a dict lookup instead of a chain of comparisons on the hot path.
_PARSERS: Final[dict[bytes, Callable[[str, bytes, bool], Request]]] = {
    b"publish": _publish,
    b"ack": _ack,
    b"consume": _consume,
    b"reject": _reject,
    b"rebind": _rebind,
    b"ping": _ping,
    b"delete_consumer": _delete_consumer,
    b"delete_queue": _delete_queue,
    b"_eval": _eval,
}


def parse_line(line: bytes) -> Request:
    """One request line (without its `\\n`)."""
    # The original asserts on the line before its rstrip: a trailing TAB is an error too (docs/protocols/mqks.md).
    has_tab = TAB in line
    line = line.rstrip()  # as the original: CRLF works, trailing spaces of data are lost
    return _parse_fields(line, line.split(b" ", 2), has_tab)


def _parse_fields(line: bytes, fields: list[bytes], has_tab: bool) -> Request:
    """`parse_line` of a line already rstripped and split at its first two spaces; `has_tab`: whether
    it held a TAB before its rstrip."""
    if len(fields) < 3:
        return BadRequest(NO_ID, "fewer than three fields", line[:MAX_LOGGED_LINE])
    id_raw, action_raw, data = fields
    try:
        request_id = id_raw.decode()
    except UnicodeDecodeError:
        return BadRequest(NO_ID, "request id is not UTF-8", line[:MAX_LOGGED_LINE])
    try:
        if has_tab:
            if TAB in id_raw:
                request_id = NO_ID
            raise _Invalid("TAB in request")
        parser = _PARSERS.get(action_raw)
        if parser is None:
            raise _Invalid(f"unknown action {action_raw.decode('ascii', 'replace')!r}")
        if data.startswith(CONFIRM_PREFIX):
            return parser(request_id, data[len(CONFIRM_PREFIX) :], True)
        return parser(request_id, data, False)
    except _Invalid as error:
        return BadRequest(request_id, str(error), line[:MAX_LOGGED_LINE])


# What `bytes.rstrip()` strips: a line ending with one of these is not a plain ack (`plain_ack`).
_ASCII_WHITESPACE: Final = frozenset(b" \t\n\r\x0b\x0c")
_ACK_ACTION: Final = b"ack"
_CONFIRM_TEXT: Final = CONFIRM_PREFIX.rstrip().decode()


def plain_ack(line: bytes) -> tuple[str, str, str] | None:
    """(request id, consumer id, msg id) of `{id} ack {consumer_id} {msg_id}` with no `--confirm`, no
    `--all`, no TAB, no trailing whitespace and in UTF-8: the line `parse_line` makes that `Ack` of;
    None for any other line (then `parse_line` says what it is)."""
    return _plain_ack(line, line.split(b" ", 2), TAB in line, _ends_in_whitespace(line))


def _plain_ack(line: bytes, fields: list[bytes], has_tab: bool, stripped: bool) -> tuple[str, str, str] | None:
    """`plain_ack` of a line split at its first two spaces, knowing whether it holds a TAB and whether
    `rstrip` would change it (what the reader finds out for the parser anyway)."""
    if len(fields) != 3 or fields[1] != _ACK_ACTION or has_tab or stripped:
        return None
    return _plain_ack_fields(line)


def _ends_in_whitespace(line: bytes) -> bool:
    """Whether `rstrip` would change the line (the msg id of an ack ends it: its trailing whitespace is stripped)."""
    return bool(line) and line[-1] in _ASCII_WHITESPACE


def _plain_ack_fields(line: bytes) -> tuple[str, str, str] | None:
    """`plain_ack` of a line whose action is `ack`, with no TAB and no trailing whitespace."""
    try:
        text = line.decode()  # once for the three fields (a space never splits a UTF-8 character)
    except UnicodeDecodeError:
        return None
    fields = text.split(" ", 3)
    if len(fields) != 4:
        return None
    request_id, _, consumer_id, msg_id = fields
    if not consumer_id or not msg_id or consumer_id == _CONFIRM_TEXT or msg_id == ALL_FLAG:
        return None
    return request_id, consumer_id, msg_id


class ServerConnection:
    """The receive side of one MQKS connection: bytes in, requests out."""

    def __init__(self, max_line_length: int = MAX_LINE_LENGTH) -> None:
        self.max_line_length = max_line_length
        self._buffer = bytearray()
        self._skipping = False  # inside an over-long line: drop bytes up to its newline

    def receive_data(self, data: bytes) -> None:
        """Bytes from the socket; `b""` means the peer closed (a last line without `\\n` still counts)."""
        if data:
            self._buffer += data
        elif self._buffer and not self._buffer.endswith(b"\n"):
            # Only an unterminated last line needs it: an extra `\n` would be an empty line (`None error`).
            # While skipping, the buffer may hold the long line's end and then a last line.
            self._buffer += b"\n"

    def next_events(self) -> list[Request]:
        """Every request of the complete lines received so far, in order."""
        buffer = self._buffer
        events: list[Request] = []
        if self._skipping:
            end = buffer.find(b"\n")
            if end < 0:
                buffer.clear()
                return events
            del buffer[: end + 1]
            self._skipping = False
        end = buffer.rfind(b"\n")
        if end >= 0:
            lines = bytes(buffer[:end]).split(b"\n")
            del buffer[: end + 1]
            limit = self.max_line_length
            # A run of plain acks becomes one `Acks` (one line alone stays an `Ack`).
            request_ids: list[str] = []
            consumer_ids: list[str] = []
            msg_ids: list[str] = []
            for line in lines:
                if len(line) > limit:
                    request: Request = self._too_long(line)
                else:
                    # Split once, for the ack test and for the parser (`parse_line`, with its rstrip
                    # only when it strips something).
                    fields = line.split(b" ", 2)
                    has_tab = TAB in line
                    stripped = _ends_in_whitespace(line)
                    ack = _plain_ack(line, fields, has_tab, stripped)
                    if ack is not None:
                        request_ids.append(ack[0])
                        consumer_ids.append(ack[1])
                        msg_ids.append(ack[2])
                        continue
                    if stripped:
                        line = line.rstrip()
                        fields = line.split(b" ", 2)
                    request = _parse_fields(line, fields, has_tab)
                if request_ids:
                    events.append(_ack_run(request_ids, consumer_ids, msg_ids))
                    request_ids, consumer_ids, msg_ids = [], [], []
                events.append(request)
            if request_ids:
                events.append(_ack_run(request_ids, consumer_ids, msg_ids))
        if len(buffer) > self.max_line_length:
            events.append(self._too_long(bytes(buffer[: MAX_LOGGED_LINE])))
            buffer.clear()
            self._skipping = True
        return events

    def _too_long(self, head: bytes) -> BadRequest:
        # Look no further than a partial line that is just over the limit shows, so the answer does not depend
        # on whether the line arrived whole or in pieces.
        head = head[: min(MAX_LOGGED_LINE, self.max_line_length + 1)]
        id_raw, space, _ = head.partition(b" ")
        request_id = NO_ID
        if space and TAB not in id_raw:
            with contextlib.suppress(UnicodeDecodeError):
                request_id = id_raw.decode()
        return BadRequest(request_id, f"line longer than {self.max_line_length} bytes", head[:MAX_LOGGED_LINE])


def _ack_run(request_ids: list[str], consumer_ids: list[str], msg_ids: list[str]) -> Ack | Acks:
    if len(request_ids) == 1:
        return Ack(request_ids[0], consumer_ids[0], msg_ids[0], False)
    return Acks(request_ids, consumer_ids, msg_ids)


# ---------------------------------------------------------------------------------------------
# Responses


def ok_line(request_id: str | bytes, data: bytes = b"") -> bytes:
    """`{id} ok {data}`; an empty data (a confirm) keeps the trailing space, as the original does."""
    rid = request_id.encode() if isinstance(request_id, str) else request_id
    return b"%s ok %s\n" % (rid, data)


def error_line(request_id: str, error_id: str) -> bytes:
    return f"{request_id} error {error_id}\n".encode()


def delivery_line(consumer_id: bytes, msg_id: bytes, event: bytes, retry: int, body: bytes) -> bytes:
    """`{consumer_id} ok {msg_id} event={event}[,retry={n}] {data}` (docs/protocols/mqks.md)."""
    data = encode_body(body)
    if retry:
        return b"%s ok %s event=%s,retry=%d %s\n" % (consumer_id, msg_id, event, retry, data)
    return b"%s ok %s event=%s %s\n" % (consumer_id, msg_id, event, data)


def format_when_unused(value: bool | float | None) -> str:
    """The suffix the original prints: bare flag for True, Python's `str` of the float otherwise."""
    if value is None:
        return ""
    if value is True:
        return " " + WHEN_UNUSED_FLAG
    return f" {WHEN_UNUSED_FLAG}={float(value)!r}"


def update_line(consumer_id: str, queue: str, events: Iterable[str], delete_when_unused: bool | float | None,
                manual_ack: bool) -> bytes:
    """`{consumer_id} ok --update {queue}[ events sorted][ --delete-queue-when-unused[=f]][ --manual-ack]`."""
    parts = [f"{consumer_id} ok --update {queue}"]
    ordered = sorted(events)
    if ordered:
        parts.append(" " + " ".join(ordered))
    parts.append(format_when_unused(delete_when_unused))
    if manual_ack:
        parts.append(" " + MANUAL_ACK_FLAG)
    parts.append("\n")
    return "".join(parts).encode()


def error_id(utc: datetime.datetime, rng: random.Random) -> str:
    """An id of the original's shape: UTC `%Y%m%d%H%M%S%f` (20 digits) + 4 base62 characters."""
    return utc.strftime("%Y%m%d%H%M%S%f") + "".join(rng.choice(_BASE62) for _ in range(ID_LENGTH - 20))


# ---------------------------------------------------------------------------------------------
# `--remove-mask` (docs/protocols/mqks.md)


def mask_pattern(masks: Sequence[str]) -> re.Pattern[str]:
    """Pieces between `*` match literally, `*` is zero or more non-dot characters, anchored at both ends."""
    return re.compile("|".join("(?:" + "[^.]*".join(re.escape(piece) for piece in mask.split("*")) + r")\Z"
                               for mask in masks))


def masked(events: Iterable[str], masks: Sequence[str]) -> set[str]:
    """The events a `--remove-mask` removes: only events with a dot are candidates."""
    if not masks:
        return set()  # an empty pattern would match every event
    pattern = mask_pattern(masks)
    return {event for event in events if "." in event and pattern.match(event)}
