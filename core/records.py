"""The on-disk record format of the embedded store: framing, checksums, payloads. No I/O.

Every record is `magic u8 | type u8 | length u32 | crc32 u32 | payload`, little-endian; the
CRC covers the first six header bytes and the payload, so a torn or bit-flipped record is
detected whichever part was hit. The magic byte lets a reader find the next record after a
damaged one (`scan`): it tries each later magic byte until a record's checksum matches.

Positions: a message copy's place in its owner's log is `segment << 32 | index`; ADD records
carry their first index explicitly, so skipping a damaged record never shifts another
message's position.
"""

from __future__ import annotations

import json
import struct
import zlib
from array import array
from collections.abc import Iterator, Sequence
from json.encoder import encode_basestring_ascii
from typing import Final

import attrs

MAGIC: Final = 0xA7
HEADER: Final = struct.Struct("<BBII")  # magic, type, payload length, crc32
# The largest payload a reader accepts: the biggest MPUB nsqd allows (5 MiB body) plus per-message
# headers; anything larger in a length field is damage, not data.
MAX_PAYLOAD: Final = 64 * 1024 * 1024

# Record types.
ADD: Final = 1  # message copies appended to an owner (queue or topic backlog)
DONE: Final = 2  # copies gone: finished, expired, dropped
STATE: Final = 3  # copies delivered or returned: (position, attempts, due wall ns) triples, the last one counts
META: Final = 4  # a metadata change (JSON), in the meta journal

ADD_HEAD: Final = struct.Struct("<IIB")  # first index, count, flags
ADD_HAS_DEFERRED: Final = 1  # some message of the record has a due time
# Every message of the record was published to one topic, named after the head (`u16 length, UTF-8`):
# a queue bound to several topics (an MQKS queue of several events) shows each message's own.
ADD_HAS_TOPIC: Final = 4
TOPIC_LENGTH: Final = struct.Struct("<H")
MAX_TOPIC_BYTES: Final = 0xFFFF
# Every message of the record came in by one protocol (its origin, `u8 length, ASCII`), after the topic.
ADD_HAS_ORIGIN: Final = 8
ORIGIN_LENGTH: Final = struct.Struct("<B")
MAX_ORIGIN_BYTES: Final = 0xFF
# A run: consecutive ids, one timestamp, no attempts, headers, TTL or due time (an MPUB batch). Its
# payload after the head is `first id u64, timestamp u64, body lengths u32 x count, bodies`, so it is
# written and read without per-message Python work.
ADD_RUN: Final = 2
RUN_HEAD: Final = struct.Struct("<QQ")
# id, timestamp ns, attempts, expires (wall ns, 0 = never), due (wall ns, 0 = now), headers len, body len
ADD_ENTRY: Final = struct.Struct("<QQHqqII")
# An entry's headers that start with this byte are not JSON but the id its publisher chose
# (`Message.publisher_id`, an MQKS msg_id), as it came: JSON text never starts with a control character.
PUBLISHER_ID_MARK: Final = 0x01
PUBLISHER_ID_PREFIX: Final = b"\x01"

SEGMENT_SHIFT: Final = 32
INDEX_MASK: Final = (1 << SEGMENT_SHIFT) - 1


def frame(record_type: int, payload: bytes | bytearray | memoryview) -> bytes:
    head = struct.pack("<BBI", MAGIC, record_type, len(payload))
    crc = zlib.crc32(payload, zlib.crc32(head))
    return head + struct.pack("<I", crc) + payload


@attrs.frozen(slots=True)
class Damage:
    """Bytes a reader could not use: where, how many, why."""

    offset: int
    length: int
    reason: str


def intact_length(data: bytes | memoryview, offset: int) -> int:
    """Length of the whole record at `offset` if it is intact, else 0."""
    end = len(data)
    if end - offset < HEADER.size:
        return 0
    magic, _, length, crc = HEADER.unpack_from(data, offset)
    if magic != MAGIC or length > MAX_PAYLOAD or offset + HEADER.size + length > end:
        return 0
    body_start = offset + HEADER.size
    if zlib.crc32(data[body_start : body_start + length], zlib.crc32(data[offset : offset + 6])) != crc:
        return 0
    return HEADER.size + length


def scan(data: bytes, start: int = 0, damage: list[Damage] | None = None) -> Iterator[tuple[int, int, memoryview]]:
    """Yield `(offset, type, payload)` for every intact record; report what was skipped in `damage`."""
    view = memoryview(data)
    offset = start
    end = len(data)
    while offset < end:
        size = intact_length(view, offset)
        if size:
            yield offset, data[offset + 1], view[offset + HEADER.size : offset + size]
            offset += size
            continue
        # Damaged here: find the next offset where an intact record starts.
        bad = offset
        reason = _why(view, offset)
        offset = data.find(MAGIC.to_bytes(1, "little"), offset + 1)
        while offset != -1 and not intact_length(view, offset):
            offset = data.find(MAGIC.to_bytes(1, "little"), offset + 1)
        if offset == -1:
            offset = end
        if damage is not None:
            damage.append(Damage(bad, offset - bad, reason if offset < end else f"{reason} (tail)"))


def _why(data: memoryview, offset: int) -> str:
    if len(data) - offset < HEADER.size:
        return "torn header"
    magic, _, length, _ = HEADER.unpack_from(data, offset)
    if magic != MAGIC:
        return "bad magic"
    if length > MAX_PAYLOAD:
        return "bad length"
    if offset + HEADER.size + length > len(data):
        return "truncated record"
    return "bad checksum"


# -- payloads ------------------------------------------------------------------------------------


@attrs.define(slots=True)
class StoredEntry:
    """One message of an ADD record, as read back."""

    index: int
    id: int
    timestamp_ns: int
    attempts: int
    expires_wall_ns: int  # 0 = never
    due_wall_ns: int  # 0 = ready
    headers: bytes
    body: bytes
    topic: str | None = None
    origin: str | None = None


# One message of an ADD record: id, timestamp ns, attempts, expires wall ns, due wall ns, headers, body.
AddEntry = tuple[int, int, int, int, int, bytes, bytes]


def topic_part(topic: str | None) -> bytes:
    """What an ADD record carries after its head for `topic` (nothing when unknown or too long)."""
    if topic is None:
        return b""
    raw = topic.encode()
    return TOPIC_LENGTH.pack(len(raw)) + raw if len(raw) <= MAX_TOPIC_BYTES else b""


def origin_part(origin: str | None) -> bytes:
    """What an ADD record carries after the topic for `origin` (nothing when unknown or too long)."""
    if origin is None:
        return b""
    raw = origin.encode("ascii", "replace")
    return ORIGIN_LENGTH.pack(len(raw)) + raw if len(raw) <= MAX_ORIGIN_BYTES else b""


def encode_add(first_index: int, entries: Sequence[AddEntry], topic: bytes = b"", origin: bytes = b"") -> bytes:
    """`entries`: (id, timestamp ns, attempts, expires wall ns, due wall ns, headers json, body);
    `topic`: `topic_part()` of the topic every entry was published to, or empty; `origin`:
    `origin_part()` of the protocol they all came in by, or empty."""
    flags = ADD_HAS_DEFERRED if any(entry[4] for entry in entries) else 0
    if topic:
        flags |= ADD_HAS_TOPIC
    if origin:
        flags |= ADD_HAS_ORIGIN
    parts = [ADD_HEAD.pack(first_index, len(entries), flags), topic, origin]
    pack = ADD_ENTRY.pack
    for message_id, timestamp, attempts, expires, due, headers, body in entries:
        parts.append(pack(message_id, timestamp, attempts, expires, due, len(headers), len(body)))
        if headers:
            parts.append(headers)
        parts.append(body)
    return frame(ADD, b"".join(parts))


def encode_run(first_index: int, first_id: int, timestamp_ns: int, bodies: Sequence[bytes],
               topic: bytes = b"", origin: bytes = b"") -> bytes:
    lengths = array("I", map(len, bodies))
    flags = ADD_RUN | ADD_HAS_TOPIC if topic else ADD_RUN
    if origin:
        flags |= ADD_HAS_ORIGIN
    return frame(ADD, b"".join((ADD_HEAD.pack(first_index, len(bodies), flags), topic, origin,
                                RUN_HEAD.pack(first_id, timestamp_ns), lengths.tobytes(), *bodies)))


def add_source(payload: bytes | memoryview, flags: int) -> tuple[str | None, str | None, int]:
    """The record's topic and origin (when it names them) and the offset right after them."""
    offset = ADD_HEAD.size
    topic = origin = None
    if flags & ADD_HAS_TOPIC:
        (length,) = TOPIC_LENGTH.unpack_from(payload, offset)
        offset += TOPIC_LENGTH.size
        topic = bytes(payload[offset : offset + length]).decode("utf-8", "replace")
        offset += length
    if flags & ADD_HAS_ORIGIN:
        (length,) = ORIGIN_LENGTH.unpack_from(payload, offset)
        offset += ORIGIN_LENGTH.size
        origin = bytes(payload[offset : offset + length]).decode("ascii", "replace")
        offset += length
    return topic, origin, offset


def add_head(payload: bytes | memoryview) -> tuple[int, int, int]:
    """(first index, count, flags) of an ADD payload."""
    return ADD_HEAD.unpack_from(payload, 0)


def decode_add(payload: memoryview, skip: int = 0) -> Iterator[StoredEntry]:
    """The entries of an ADD payload, from entry number `skip` on."""
    first, count, flags = ADD_HEAD.unpack_from(payload, 0)
    topic, origin, offset = add_source(payload, flags)
    if flags & ADD_RUN:
        yield from _decode_run(payload, first, count, skip, offset, topic, origin)
        return
    unpack = ADD_ENTRY.unpack_from
    entry_size = ADD_ENTRY.size
    for number in range(count):
        message_id, timestamp, attempts, expires, due, headers_len, body_len = unpack(payload, offset)
        offset += entry_size
        if number >= skip:
            headers = bytes(payload[offset : offset + headers_len])
            body = bytes(payload[offset + headers_len : offset + headers_len + body_len])
            yield StoredEntry(first + number, message_id, timestamp, attempts, expires, due, headers, body, topic,
                              origin)
        offset += headers_len + body_len


def run_layout(payload: bytes | memoryview, flags: int) -> tuple[str | None, str | None, int, int, array, int]:
    """A run record's topic, origin, first id, timestamp, body lengths and the offset of its first
    body: what a reader needs to take its messages without an entry object each."""
    topic, origin, offset = add_source(payload, flags)
    first_id, timestamp = RUN_HEAD.unpack_from(payload, offset)
    count = ADD_HEAD.unpack_from(payload, 0)[1]
    lengths = array("I")
    start = offset + RUN_HEAD.size
    lengths.frombytes(payload[start : start + 4 * count])
    return topic, origin, first_id, timestamp, lengths, start + 4 * count


def _decode_run(payload: memoryview, first: int, count: int, skip: int, head_end: int,
                topic: str | None, origin: str | None) -> Iterator[StoredEntry]:
    first_id, timestamp = RUN_HEAD.unpack_from(payload, head_end)
    lengths = array("I")
    start = head_end + RUN_HEAD.size
    lengths.frombytes(payload[start : start + 4 * count])
    offset = start + 4 * count + sum(lengths[:skip])
    for number in range(skip, count):
        end = offset + lengths[number]
        yield StoredEntry(first + number, first_id + number, timestamp, 0, 0, 0, b"", bytes(payload[offset:end]), topic,
                          origin)
        offset = end


def encode_positions(positions: array) -> bytes:
    """A DONE record: an array of u64 positions."""
    return frame(DONE, positions.tobytes())


def decode_positions(payload: memoryview) -> array:
    positions = array("Q")
    positions.frombytes(payload[: len(payload) - len(payload) % 8])
    return positions


def encode_states(states: array) -> bytes:
    """A STATE record: an array('q') of (position, attempts, due wall ns) triples."""
    return frame(STATE, states.tobytes())


def decode_states(payload: memoryview) -> Iterator[tuple[int, int, int]]:
    values = array("q")
    values.frombytes(payload[: len(payload) - len(payload) % 24])
    return zip(values[0::3], values[1::3], values[2::3], strict=True)


def encode_meta(change: dict) -> bytes:
    return frame(META, json.dumps(change, separators=(",", ":")).encode())


def decode_meta(payload: memoryview) -> dict:
    return json.loads(bytes(payload))


_HEADERS_ENCODER: Final = json.JSONEncoder(separators=(",", ":"))
_QUOTE: Final = encode_basestring_ascii  # bound once: compiled, an imported name is looked up at every use


# Header names quoted for JSON, by name: a protocol uses a few (an MQKS publisher's `msg_id` on every
# message). Emptied when full, since a client may choose names (eMQP's, a stream writer's).
_QUOTED_NAMES: Final[dict[str, str]] = {}
QUOTED_NAMES_KEPT: Final = 256


def encode_headers(headers: object) -> bytes:
    if headers is None:
        return b""
    if type(headers) is dict:
        # The common shape (string keys and values, e.g. an MQKS publisher's msg_id) is
        # joined from the C string encoder: a quarter of the time of a full JSON encode per message.
        parts = []
        for key, value in headers.items():
            if type(key) is not str or type(value) is not str:
                break
            name = _QUOTED_NAMES.get(key)
            if name is None:
                if len(_QUOTED_NAMES) >= QUOTED_NAMES_KEPT:
                    _QUOTED_NAMES.clear()
                name = _QUOTED_NAMES[key] = _QUOTE(key)
            parts.append(f"{name}:{_QUOTE(value)}")
        else:
            return (f"{{{parts[0]}}}" if len(parts) == 1 else "{" + ",".join(parts) + "}").encode()
    return _HEADERS_ENCODER.encode(headers).encode()


# The decoder's C scanner, called directly: `raw_decode` is a Python function around it (a frame per
# message read back: 650-700 ns against 430-450 compiled, an MQKS msg_id header). No encoding
# sniffing, no trailing whitespace scan either: the bytes are our own, checked by the record's CRC.
_SCAN_JSON: Final = json.JSONDecoder().scan_once  # type: ignore[attr-defined]


def decode_headers(data: bytes) -> object:
    if not data:
        return None
    try:
        return _SCAN_JSON(data.decode(), 0)[0]
    except StopIteration:  # the scanner's way to say "no JSON value here"
        raise ValueError(f"stored headers that are not JSON: {data[:40]!r}") from None


def decode_entry_headers(data: bytes) -> tuple[object, bytes | None]:
    """An entry's headers: (the JSON headers, None), or (None, the publisher's id) when it is one."""
    if data[:1] == PUBLISHER_ID_PREFIX:
        return None, data[1:]
    return decode_headers(data), None


def decode_headers_at(payload: bytes | memoryview, offset: int, length: int) -> object:
    """`decode_headers` of the `length` bytes at `offset`, read from the record without a copy first."""
    if not length:
        return None
    try:
        return _SCAN_JSON(str(payload[offset : offset + length], "utf-8"), 0)[0]
    except StopIteration:
        shown = bytes(payload[offset : offset + min(length, 40)])
        raise ValueError(f"stored headers that are not JSON: {shown!r}") from None
