"""PHPMQ wire codec, sans-IO: bytes in, typed messages out; typed messages in, bytes out.

A message is an 8-byte header, `H` + version `01` + type (3 digits) + packet count (2 digits),
followed by that many packets, each a 32-byte packet header, `P` + packet type (2 digits) +
content length (29 digits), and the raw content (any bytes). No delimiters, no replies: the server
only ever sends deliveries (003). See docs/protocols/phpmq.md.

Two generations of the protocol are in use: the one the published server and client pin (001
with queue and content, 003 with queue, content and id, header `H0100303`) and the current one
(001 may carry a TTL packet, 003 always does, and 005 requeue / 006 dead letter exist). The reader
takes the packet count its header announces, so it reads both; `delivery` writes either.

Where the original reads blindly, this codec refuses clearly (`ProtocolError`, after which the
connection is closed): a header that is not `H01…` or `P…` with digits, an unknown message or
packet type, a client-sent 003, a packet count that does not fit the type, a missing or foreign
packet, a length over the limit (checked before anything is allocated for it), a queue name that
is empty, too long or not UTF-8.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Iterable

import attrs

MESSAGE_HEADER_SIZE = 8
PACKET_HEADER_SIZE = 32
LENGTH_DIGITS = 29  # the packet header's content length: 32 bytes = `P` + 2 + 29
VERSION = 1
# Content bytes one packet may carry unless configured otherwise (the original has no limit; nsqd's
# default message size is 1 MiB, PHP services often send larger documents).
MAX_CONTENT = 16 * 1024 * 1024
# Bytes of a queue name: names are engine topic and queue names, kept in the store's journal.
MAX_QUEUE_NAME = 1024
MESSAGE_ID_SIZE = 32  # `bin2hex(random_bytes(16))` in the original: 32 lowercase hex characters


class MessageType(enum.IntEnum):
    SEND = 1  # client to server: a new message
    CONSUME = 2  # client to server: the connection's consume window
    DELIVERY = 3  # server to client
    ACK = 4  # client to server
    REQUEUE = 5  # client to server: back at the tail with a new TTL (current generation)
    DEAD_LETTER = 6  # client to server: to the queue's dead letters (current generation)


class PacketType(enum.IntEnum):
    QUEUE = 1
    CONTENT = 2
    MESSAGE_ID = 3
    COUNT = 4
    TTL = 5


# Packets each client message must carry, and those it may carry besides.
_REQUIRED: dict[int, frozenset[int]] = {
    MessageType.SEND: frozenset({PacketType.QUEUE, PacketType.CONTENT}),
    MessageType.CONSUME: frozenset({PacketType.QUEUE, PacketType.COUNT}),
    MessageType.ACK: frozenset({PacketType.QUEUE, PacketType.MESSAGE_ID}),
    MessageType.REQUEUE: frozenset({PacketType.QUEUE, PacketType.MESSAGE_ID, PacketType.TTL}),
    MessageType.DEAD_LETTER: frozenset({PacketType.QUEUE, PacketType.MESSAGE_ID}),
}
_OPTIONAL: dict[int, frozenset[int]] = {MessageType.SEND: frozenset({PacketType.TTL})}
# (fewest, most) packets of each message type.
_CLIENT_COUNTS = {kind: (len(needed), len(needed | _OPTIONAL.get(kind, frozenset())))
                  for kind, needed in _REQUIRED.items()}
_DELIVERY_COUNTS = {MessageType.DELIVERY: (3, 4)}


@attrs.define(slots=True)
class Send:
    queue: str
    content: bytes
    ttl: int | None  # seconds; None when no TTL packet came (or it said 0)


@attrs.define(slots=True)
class Consume:
    queue: str
    count: int  # the window; <= 0 delivers nothing (as the original)


@attrs.define(slots=True)
class Ack:
    queue: str
    message_id: bytes


@attrs.define(slots=True)
class Requeue:
    queue: str
    message_id: bytes
    ttl: int | None


@attrs.define(slots=True)
class DeadLetter:
    queue: str
    message_id: bytes


@attrs.define(slots=True)
class Delivery:
    """A 003, as a client reads it."""

    queue: str
    content: bytes
    message_id: bytes
    ttl: int | None  # None from the pinned generation (3 packets)


@attrs.define(slots=True)
class ProtocolError:
    """The peer broke the framing; nothing after it can be trusted, so the connection ends."""

    reason: str


Request = Send | Consume | Ack | Requeue | DeadLetter


class _NeedData:
    def __repr__(self) -> str:
        return "NEED_DATA"


NEED_DATA = _NeedData()

_PHP_INT = re.compile(rb"[ \t\n\r\v\f]*([+-]?[0-9]+)")


def php_int(content: bytes) -> int:
    """PHP's `(int)` of a string, as the original casts counts and TTLs: leading digits, else 0."""
    match = _PHP_INT.match(content)
    return int(match[1]) if match else 0


def format_message_id(engine_id: int) -> bytes:
    """An engine id as PHPMQ shows message ids: 32 lowercase hex characters."""
    return b"%032x" % engine_id


def parse_message_id(raw: bytes) -> int | None:
    """The engine id of a 32-character lowercase hex id; None for anything else."""
    if len(raw) != MESSAGE_ID_SIZE or raw.strip(b"0123456789abcdef"):
        return None
    return int(raw, 16)


class _Reader:
    """The framing both sides share: headers, packets, limits, checked before allocating."""

    def __init__(self, max_content: int, *, accepted: dict[int, tuple[int, int]]) -> None:
        self.max_content = max_content
        self._accepted = accepted  # message type -> (fewest, most) packets it can carry
        self._buffer = bytearray()
        self._offset = 0  # parsed up to here; compacted once per `receive_data`
        self._type: int | None = None  # the message being read
        self._left = 0  # its packets still to read
        self._packets: dict[int, bytes] = {}
        self.failed: ProtocolError | None = None

    def receive_data(self, data: bytes) -> None:
        if self.failed is not None:
            return  # after an error nothing is parsed (nor kept)
        if self._offset:
            del self._buffer[: self._offset]
            self._offset = 0
        self._buffer += data

    @property
    def pending(self) -> bool:
        """Part of a message is buffered (a connection ending now ends in the middle of one)."""
        return self._type is not None or len(self._buffer) > self._offset

    def _fail(self, reason: str) -> ProtocolError:
        self.failed = ProtocolError(reason)
        self._buffer = bytearray()
        self._offset = 0
        return self.failed

    def _next_message(self) -> tuple[int, dict[int, bytes]] | _NeedData | ProtocolError:
        """The next whole message as (type, packets by type)."""
        if self.failed is not None:
            return self.failed
        buffer = self._buffer
        while True:
            offset = self._offset
            if self._type is None:
                if len(buffer) - offset < MESSAGE_HEADER_SIZE:
                    return NEED_DATA
                header = bytes(buffer[offset : offset + MESSAGE_HEADER_SIZE])
                if header[:1] != b"H" or not header[1:].isdigit():
                    return self._fail(f"not a message header: {header!r}")
                version, message_type, count = int(header[1:3]), int(header[3:6]), int(header[6:8])
                if version != VERSION:
                    return self._fail(f"unsupported protocol version {version:02d} in {header!r}")
                counts = self._accepted.get(message_type)
                if counts is None:
                    known = message_type in MessageType.__members__.values()
                    why = "is not sent by this side" if known else "is not a PHPMQ message type"
                    return self._fail(f"message type {message_type:03d} {why}")
                if not counts[0] <= count <= counts[1]:
                    carries = f"{counts[0]} or {counts[1]}" if counts[1] > counts[0] else f"{counts[0]}"
                    return self._fail(f"message {message_type:03d} announces {count} packets (it carries {carries})")
                self._offset = offset + MESSAGE_HEADER_SIZE
                self._type, self._left, self._packets = message_type, count, {}
                continue
            if not self._left:
                message_type, packets = self._type, self._packets
                self._type, self._packets = None, {}
                return message_type, packets
            if len(buffer) - offset < PACKET_HEADER_SIZE:
                return NEED_DATA
            header = bytes(buffer[offset : offset + PACKET_HEADER_SIZE])
            if header[:1] != b"P" or not header[1:].isdigit():
                return self._fail(f"not a packet header: {header!r}")
            packet_type, length = int(header[1:3]), int(header[3:])
            if packet_type not in PacketType.__members__.values():
                return self._fail(f"packet type {packet_type:02d} is not a PHPMQ packet type")
            if length > self.max_content:
                return self._fail(f"packet {packet_type:02d} of {length} bytes is over the limit of "
                                  f"{self.max_content} bytes")
            start = offset + PACKET_HEADER_SIZE
            if len(buffer) - start < length:
                return NEED_DATA
            # Readers key packets by type, as the original's do: a repeated type replaces the first.
            self._packets[packet_type] = bytes(buffer[start : start + length])
            self._offset = start + length
            self._left -= 1


def _queue_name(raw: bytes) -> str | ProtocolError:
    if not raw or len(raw) > MAX_QUEUE_NAME:
        return ProtocolError(f"a queue name of {len(raw)} bytes (1 to {MAX_QUEUE_NAME})")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return ProtocolError(f"a queue name that is not UTF-8: {raw[:64]!r}")


def _ttl(raw: bytes | None) -> int | None:
    if raw is None:
        return None
    seconds = php_int(raw)
    return seconds if seconds > 0 else None  # 0 (or less): no TTL, as a 003 without one says


class ServerConnection:
    """The server side of one connection: client messages in (`next_event`)."""

    def __init__(self, max_content: int = MAX_CONTENT) -> None:
        self._reader = _Reader(max_content, accepted=_CLIENT_COUNTS)
        # The client showed it speaks the current generation (a TTL packet, 005 or 006).
        self.current_generation = False

    def receive_data(self, data: bytes) -> None:
        self._reader.receive_data(data)

    @property
    def pending(self) -> bool:
        return self._reader.pending

    def next_event(self) -> Request | ProtocolError | _NeedData:
        got = self._reader._next_message()
        if not isinstance(got, tuple):
            return got
        message_type, packets = got
        required = _REQUIRED[message_type]
        allowed = required | _OPTIONAL.get(message_type, frozenset())
        missing = required - packets.keys()
        foreign = packets.keys() - allowed
        if missing or foreign:
            problem = (f"without packet {min(missing):02d}" if missing
                       else f"with packet {min(foreign):02d}, which it does not carry")
            return self._reader._fail(f"message {message_type:03d} {problem}")
        queue = _queue_name(packets[PacketType.QUEUE])
        if isinstance(queue, ProtocolError):
            return self._reader._fail(queue.reason)
        if message_type == MessageType.SEND:
            raw_ttl = packets.get(PacketType.TTL)
            if raw_ttl is not None:
                self.current_generation = True
            return Send(queue, packets[PacketType.CONTENT], _ttl(raw_ttl))
        if message_type == MessageType.CONSUME:
            return Consume(queue, php_int(packets[PacketType.COUNT]))
        message_id = packets[PacketType.MESSAGE_ID]
        if message_type == MessageType.ACK:
            return Ack(queue, message_id)
        self.current_generation = True
        if message_type == MessageType.REQUEUE:
            return Requeue(queue, message_id, _ttl(packets[PacketType.TTL]))
        return DeadLetter(queue, message_id)


class ClientConnection:
    """The client side: deliveries (003) in, with or without the TTL packet."""

    def __init__(self, max_content: int = MAX_CONTENT) -> None:
        self._reader = _Reader(max_content, accepted=_DELIVERY_COUNTS)

    def receive_data(self, data: bytes) -> None:
        self._reader.receive_data(data)

    def next_event(self) -> Delivery | ProtocolError | _NeedData:
        got = self._reader._next_message()
        if not isinstance(got, tuple):
            return got
        _, packets = got
        missing = {PacketType.QUEUE, PacketType.CONTENT, PacketType.MESSAGE_ID} - packets.keys()
        if missing:
            return self._reader._fail(f"message 003 without packet {min(missing):02d}")
        raw_ttl = packets.get(PacketType.TTL)
        return Delivery(packets[PacketType.QUEUE].decode("utf-8", "replace"), packets[PacketType.CONTENT],
                        packets[PacketType.MESSAGE_ID], None if raw_ttl is None else php_int(raw_ttl))


# -- writing ---------------------------------------------------------------------------------------


def _packet(packet_type: int, content: bytes) -> bytes:
    return b"P%02d%029d" % (packet_type, len(content))


def message(message_type: int, packets: Iterable[tuple[int, bytes]]) -> bytes:
    """Any message: its header with the packet count, then each packet as given (in that order)."""
    listed = list(packets)
    parts = [b"H%02d%03d%02d" % (VERSION, message_type, len(listed))]
    for packet_type, content in listed:
        parts.append(_packet(packet_type, content))
        parts.append(content)
    return b"".join(parts)


def delivery(queue: bytes, content: bytes, message_id: bytes, ttl: int | None) -> bytes:
    """A 003: queue, content, id (`H0100303`, the pinned generation) and, with `ttl`, the remaining
    TTL in seconds (`H0100304`, the current generation; 0 = the message has none)."""
    if ttl is None:
        return b"".join((b"H0100303", _packet(1, queue), queue, _packet(2, content), content,
                         _packet(3, message_id), message_id))
    seconds = b"%d" % ttl
    return b"".join((b"H0100304", _packet(1, queue), queue, _packet(2, content), content,
                     _packet(3, message_id), message_id, _packet(5, seconds), seconds))


def send(queue: bytes, content: bytes, ttl: int | None = None) -> bytes:
    """A 001; with `ttl`, the current generation's 3-packet form."""
    packets = [(PacketType.QUEUE, queue), (PacketType.CONTENT, content)]
    if ttl is not None:
        packets.append((PacketType.TTL, b"%d" % ttl))
    return message(MessageType.SEND, packets)


def consume(queue: bytes, count: int) -> bytes:
    return message(MessageType.CONSUME, [(PacketType.QUEUE, queue), (PacketType.COUNT, b"%d" % count)])


def ack(queue: bytes, message_id: bytes) -> bytes:
    return message(MessageType.ACK, [(PacketType.QUEUE, queue), (PacketType.MESSAGE_ID, message_id)])


def requeue(queue: bytes, message_id: bytes, ttl: int) -> bytes:
    return message(MessageType.REQUEUE, [(PacketType.QUEUE, queue), (PacketType.MESSAGE_ID, message_id),
                                         (PacketType.TTL, b"%d" % ttl)])


def dead_letter(queue: bytes, message_id: bytes) -> bytes:
    return message(MessageType.DEAD_LETTER, [(PacketType.QUEUE, queue), (PacketType.MESSAGE_ID, message_id)])
