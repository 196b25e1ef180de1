"""NATS client protocol codec, client side, sans-IO: encode what a client sends, decode what a server sends.

The protocol is text control lines ended by CRLF, some followed by a payload of a size the line declares
(https://docs.nats.io/reference/reference-protocols/nats-protocol). A client sends CONNECT, PUB, HPUB,
SUB, UNSUB, PING and PONG; a server sends INFO, MSG, HMSG, PING, PONG, +OK and -ERR. Operation names
are case-insensitive on the wire.

Text on the wire (subjects, reply subjects, queue groups, header names and values) is UTF-8; bytes that
are not UTF-8 are decoded with `surrogateescape` and encoded back the same way, so a subject another
client published with stray bytes can still be replied to, and never breaks this side's decoding.

Used by the NATS driver on trio (`polymq.jetstream.nats_connection`).
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Mapping
from typing import Any

import attrs

# The longest control line a client accepts, CRLF excluded: nats-server's MAX_CONTROL_LINE_SIZE
# (server/const.go), which nats.go and nats.py use for the server's lines too.
MAX_CONTROL_LINE_SIZE = 4096
# nats-server's default max_payload (MAX_PAYLOAD_SIZE, server/const.go: 1 MiB); a server announces
# its own in INFO, which replaces this.
DEFAULT_MAX_PAYLOAD = 1024 * 1024
# Room above max_payload for the headers a server adds to a message it sends itself: a JetStream direct
# get or republish of a max_payload-sized message carries Nats-Stream, Nats-Sequence, … on top.
PAYLOAD_HEADROOM = 64 * 1024

HEADER_VERSION = b"NATS/1.0"
PING = b"PING\r\n"
PONG = b"PONG\r\n"
_CRLF = b"\r\n"
_ENCODING = "utf-8"
_ERRORS = "surrogateescape"
# A size or sid longer than this is refused before it is turned into an int (no size is that long).
_MAX_DIGITS = 18

# A subject, reply subject or queue group is one token of a control line: no whitespace of any kind,
# no ASCII control character.
_NOT_A_TOKEN = re.compile(r"[\s\x00-\x1f\x7f]")
# A header name is printable ASCII except the colon (ADR-4, NATS headers); a value has no CR or LF.
_BAD_HEADER_NAME = re.compile(r"[^\x21-\x39\x3b-\x7e]")


class ProtocolError(ValueError):
    """The server sent something that is not the NATS protocol, or more than a limit allows."""


# --- encoders ---------------------------------------------------------------------------------------


def _token(kind: str, text: str) -> bytes:
    """A subject, reply subject or queue group as it goes on the wire."""
    if not text or _NOT_A_TOKEN.search(text):
        raise ValueError(f"bad {kind} {text!r}: empty, or with whitespace or a control character")
    return text.encode(_ENCODING, _ERRORS)


@functools.lru_cache(maxsize=4096)
def _subject(subject: str) -> bytes:
    """Cached: publishers repeat their subjects (reply subjects, one per request, are not cached)."""
    return _token("subject", subject)


def _sid(sid: int) -> int:
    if sid < 0:
        raise ValueError(f"bad sid {sid!r}: negative")
    return sid


def connect(options: Mapping[str, Any]) -> bytes:
    """`CONNECT {json}`; JSON escapes CR and LF in strings, so the line cannot be broken by a value."""
    return b"CONNECT " + json.dumps(dict(options), separators=(",", ":")).encode() + _CRLF


def pub(subject: str, payload: bytes, reply: str | None = None) -> bytes:
    head = _subject(subject)
    if reply is not None:
        head += b" " + _token("reply subject", reply)
    return b"PUB %s %d\r\n%s\r\n" % (head, len(payload), payload)


def encode_headers(headers: Mapping[str, str]) -> bytes:
    """The header block: `NATS/1.0`, one `Name: value` line each, an empty line; all CRLF-ended. Made as one
    text and encoded once (a node writes a block per message it publishes)."""
    lines = ["NATS/1.0\r\n"]
    for name, value in headers.items():
        if not _good_header_name(name):
            raise ValueError(f"bad header name {name!r}: empty, or not printable ASCII without ':'")
        if "\r" in value or "\n" in value:
            raise ValueError(f"bad value for header {name!r}: CR or LF in {value!r}")
        lines.append(f"{name}: {value}\r\n")
    lines.append("\r\n")
    return "".join(lines).encode(_ENCODING, _ERRORS)


@functools.lru_cache(maxsize=1024)
def _good_header_name(name: str) -> bool:
    """Cached: a publisher names the same few headers on every message."""
    return bool(name) and _BAD_HEADER_NAME.search(name) is None


def hpub(subject: str, headers: Mapping[str, str], payload: bytes, reply: str | None = None) -> bytes:
    head = _subject(subject)
    if reply is not None:
        head += b" " + _token("reply subject", reply)
    block = encode_headers(headers)
    return b"HPUB %s %d %d\r\n%s%s\r\n" % (head, len(block), len(block) + len(payload), block, payload)


def sub(subject: str, sid: int, queue: str | None = None) -> bytes:
    if queue is None:
        return b"SUB %s %d\r\n" % (_subject(subject), _sid(sid))
    return b"SUB %s %s %d\r\n" % (_subject(subject), _token("queue group", queue), _sid(sid))


def unsub(sid: int, max_msgs: int | None = None) -> bytes:
    if max_msgs is None:
        return b"UNSUB %d\r\n" % _sid(sid)
    if max_msgs < 0:
        raise ValueError(f"bad max_msgs {max_msgs!r}: negative")
    return b"UNSUB %d %d\r\n" % (_sid(sid), max_msgs)


# --- events -----------------------------------------------------------------------------------------


@attrs.frozen(slots=True)
class Info:
    data: dict[str, Any]


@attrs.frozen(slots=True)
class Msg:
    subject: str
    sid: int
    reply: str | None
    payload: bytes
    headers: dict[str, str] | None = None  # None for MSG; an HMSG's headers, maybe empty
    status: int | None = None  # the inline status of `NATS/1.0 503`; None without one
    description: str = ""  # the text after the status: `No Messages` of `NATS/1.0 404 No Messages`


@attrs.frozen(slots=True)
class Ping:
    pass


@attrs.frozen(slots=True)
class Pong:
    pass


@attrs.frozen(slots=True)
class Ok:
    pass


@attrs.frozen(slots=True)
class Err:
    message: str  # without the quotes the server puts around it


Event = Info | Msg | Ping | Pong | Ok | Err

_PING, _PONG, _OK = Ping(), Pong(), Ok()


# --- decoding ---------------------------------------------------------------------------------------


def _text(data: bytes) -> str:
    return data.decode(_ENCODING, _ERRORS)


def _number(kind: str, token: bytes) -> int:
    # bytes.isdigit is ASCII digits only: no sign, no underscore, no other script's digits.
    if not token.isdigit() or len(token) > _MAX_DIGITS:
        raise ProtocolError(f"bad {kind} {token[:40]!r}")
    return int(token)


def _unquoted(text: str) -> str:
    return text[1:-1] if len(text) >= 2 and text[0] == text[-1] == "'" else text


def parse_headers(block: bytes) -> tuple[int | None, str, dict[str, str]]:
    """(status, description, headers) of a header block: `NATS/1.0[ status[ description]]`, then
    `Name: value` lines, then an empty line, all CRLF-ended.

    Values lose their surrounding spaces and tabs. A name given twice keeps its last value: the
    messages polymq reads carry one value per name, and a dict is what its callers look up. Names are
    taken as they are (any bytes but the colon): a name another client got wrong is not worth this
    connection; a block without its version line, a bad status or a line without a colon is."""
    if not block.endswith(b"\r\n\r\n"):
        raise ProtocolError(f"header block not ended by an empty line: {block[-40:]!r}")
    first, _, rest = block[:-4].partition(_CRLF)
    status, description = _status_line(first)
    headers: dict[str, str] = {}
    if rest:
        for line in _text(rest).split("\r\n"):  # one decode for the block: its separators are ASCII
            name, colon, value = line.partition(":")
            if not colon or not name:
                raise ProtocolError(f"bad header line {line[:80].encode(_ENCODING, _ERRORS)!r}")
            headers[name] = value.strip(" \t")
    return status, description, headers


def _status_line(line: bytes) -> tuple[int | None, str]:
    version, _, rest = line.partition(b" ")
    if not version.startswith(b"NATS/"):
        raise ProtocolError(f"header block without a NATS/ version line: {line[:80]!r}")
    code, _, description = rest.strip(b" ").partition(b" ")
    if not code:
        return None, ""
    if len(code) != 3 or not code.isdigit():
        raise ProtocolError(f"bad status in header line {line[:80]!r}")
    return int(code), _text(description.strip(b" \t"))


@attrs.define(slots=True)
class _Head:
    """A MSG/HMSG whose control line is read and whose payload is still coming."""

    subject: str
    sid: int
    reply: str | None
    header_size: int  # -1 for MSG
    total_size: int


class ClientConnection:
    """Split the byte stream from a NATS server into events; feed it with `receive_data`.

    After a ProtocolError the stream cannot be followed any more: the connection is to be dropped."""

    def __init__(self, max_payload: int = DEFAULT_MAX_PAYLOAD,
                 max_control_line: int = MAX_CONTROL_LINE_SIZE) -> None:
        self._buffer = bytearray()
        self._offset = 0  # where the next unread byte is; the buffer is compacted after each next_events
        self._head: _Head | None = None
        self._max_line = max_control_line
        self.max_payload = max_payload  # replaced by the max_payload of each INFO

    def receive_data(self, data: bytes) -> None:
        self._buffer += data

    def next_events(self) -> list[Event]:
        """Every complete event in the buffer, in order; an empty list while more bytes are needed."""
        events: list[Event] = []
        buffer = self._buffer
        with memoryview(buffer) as view:
            while True:
                if self._head is None:
                    end = buffer.find(b"\n", self._offset)
                    if end < 0:
                        # A line may end in CR whose LF is still coming: the limit plus that CR.
                        if len(buffer) - self._offset > self._max_line + 1:
                            raise ProtocolError(f"control line longer than {self._max_line} bytes")
                        break
                    line = bytes(view[self._offset : end])
                    self._offset = end + 1
                    event = self._control_line(line)
                    if event is not None:
                        events.append(event)
                    continue
                message = self._payload(view)
                if message is None:
                    break
                events.append(message)
        if self._offset:
            del buffer[: self._offset]
            self._offset = 0
        return events

    def _control_line(self, line: bytes) -> Event | None:
        """The event of a line without payload; None after a MSG/HMSG line, whose payload is awaited."""
        if line.endswith(b"\r"):
            line = line[:-1]
        if len(line) > self._max_line:
            raise ProtocolError(f"control line longer than {self._max_line} bytes")
        parts = line.split(None, 1)  # the operation, then its arguments after any spaces or tabs
        op = parts[0].upper() if parts else b""
        rest = parts[1] if len(parts) > 1 else b""
        if op == b"MSG":
            self._head = self._message_head(rest.split(), headers=False)
            return None
        if op == b"HMSG":
            self._head = self._message_head(rest.split(), headers=True)
            return None
        if not rest:
            if op == b"PING":
                return _PING
            if op == b"PONG":
                return _PONG
            if op == b"+OK":
                return _OK
        if op == b"-ERR":
            return Err(_unquoted(_text(rest.strip())))
        if op == b"INFO":
            return self._info(rest)
        raise ProtocolError(f"unknown operation in {line[:80]!r}")

    def _message_head(self, args: list[bytes], *, headers: bool) -> _Head:
        # MSG <subject> <sid> [reply] <size>; HMSG <subject> <sid> [reply] <header size> <total size>
        sizes = 2 if headers else 1
        if len(args) not in (2 + sizes, 3 + sizes):
            raise ProtocolError(f"{'HMSG' if headers else 'MSG'} with {len(args)} arguments")
        reply = _text(args[2]) if len(args) == 3 + sizes else None
        total = _number("size", args[-1])
        header_size = _number("header size", args[-2]) if headers else -1
        if header_size > total:
            raise ProtocolError(f"header size {header_size} larger than the total size {total}")
        if total > self.max_payload + PAYLOAD_HEADROOM:
            raise ProtocolError(f"message of {total} bytes, over the max_payload of {self.max_payload}")
        return _Head(_text(args[0]), _number("sid", args[1]), reply, header_size, total)

    def _payload(self, view: memoryview) -> Msg | None:
        head = self._head
        assert head is not None
        start = self._offset
        end = start + head.total_size
        if len(view) < end + 2:
            return None
        if view[end : end + 2] != _CRLF:
            raise ProtocolError(f"payload of {head.total_size} bytes not followed by CRLF")
        self._offset = end + 2
        self._head = None
        if head.header_size < 0:
            return Msg(head.subject, head.sid, head.reply, bytes(view[start:end]))
        split = start + head.header_size
        status, description, headers = parse_headers(bytes(view[start:split]))
        return Msg(head.subject, head.sid, head.reply, bytes(view[split:end]), headers, status, description)

    def _info(self, rest: bytes) -> Info:
        try:
            data = json.loads(rest)
        except (ValueError, RecursionError) as error:  # RecursionError: deeply nested arrays
            raise ProtocolError(f"INFO that is not JSON: {rest[:80]!r}") from error
        if not isinstance(data, dict):
            raise ProtocolError(f"INFO that is not a JSON object: {rest[:80]!r}")
        max_payload = data.get("max_payload")
        if isinstance(max_payload, int) and not isinstance(max_payload, bool) and max_payload > 0:
            self.max_payload = max_payload
        return Info(data)
