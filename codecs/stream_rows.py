"""The binary row batches of polymq's stream HTTP endpoints (docs/spark.md), sans-IO.

Read (gateway to reader), one record per message, little-endian:
`position i64 | id u64 | timestamp ns i64 | attempts u16 | topic len u16 | headers len u32 |
body len u32 | origin len u8`, then the topic (UTF-8), the origin (the protocol the message came
in by, ASCII; empty when not known), the headers (JSON object, UTF-8; empty when none) and the body.

Publish (writer to gateway), one record per row: `id len u16 | topic len u16 | headers len u32 |
body len u32`, then the id (UTF-8; empty: none), the topic (empty: the request's topic), the
headers (JSON object; empty: none) and the body.

Fixed-size heads so a reader slices instead of scanning, and a batch is one buffer: the gateway
joins a read's records in one `b"".join`, the writer sends a partition's rows in a few requests.
"""

from __future__ import annotations

import array
import itertools
import json
import operator
import struct
import sys
from collections.abc import Iterator, Sequence
from typing import Any

import attrs

# position, id, timestamp ns, attempts, then the lengths of topic, headers, body and origin
READ_HEAD = struct.Struct("<qQqHHIIB")
PUBLISH_HEAD = struct.Struct("<HHII")  # id, topic, headers, body lengths
CONTENT_TYPE = "application/x-polymq-rows"
# Longest id a writer may give (it travels with the message as its publisher id); MQKS's limit on
# names and ids is the tightest of the protocols'.
MAX_ID_BYTES = 1024


@attrs.frozen(slots=True)
class ReadRow:
    position: int
    id: int
    timestamp_ns: int
    attempts: int
    topic: str
    headers: bytes  # JSON text, b"" when none
    body: bytes
    origin: str = ""  # the protocol it came in by, "" when not known


@attrs.frozen(slots=True)
class RowExtras:
    """What a publish row carries besides its body (most rows carry nothing)."""

    id: str | None
    topic: str | None
    headers: dict[str, Any] | None


@attrs.define(slots=True)
class PublishBatch:
    """A decoded publish batch: every body, in order, and the extras of the rows that have any (by
    row number): the common batch of plain bodies costs one list append per row."""

    bodies: list[bytes] = attrs.Factory(list)
    extras: dict[int, RowExtras] = attrs.Factory(dict)


@attrs.frozen(slots=True)
class Invalid:
    """A batch that cannot be decoded: which row and why."""

    row: int
    reason: str


def encode_read_row(position: int, message_id: int, timestamp_ns: int, attempts: int, topic: bytes, headers: bytes,
                    body: bytes, origin: bytes = b"") -> bytes:
    return READ_HEAD.pack(position, message_id, timestamp_ns, attempts, len(topic), len(headers), len(body),
                          len(origin)) + topic + origin + headers + body


def decode_read_rows(data: bytes) -> Iterator[ReadRow]:
    """Every row of a read batch; ValueError on a batch cut short (a broken response)."""
    columns = decode_read_columns(data)
    for position, message_id, timestamp_ns, attempts, topic, headers, body, origin in zip(
            columns.positions, columns.ids, columns.timestamps_ns, columns.attempts, columns.topics, columns.headers,
            columns.bodies, columns.origins, strict=True):
        yield ReadRow(position, message_id, timestamp_ns, attempts, topic.decode("utf-8"), headers, body,
                      origin.decode("ascii"))


@attrs.define(slots=True)
class ReadColumns:
    """A read batch column by column (for Arrow), each a list with one item per row."""

    positions: list[int] = attrs.Factory(list)
    ids: list[int] = attrs.Factory(list)
    timestamps_ns: list[int] = attrs.Factory(list)
    attempts: list[int] = attrs.Factory(list)
    topics: list[bytes] = attrs.Factory(list)
    headers: list[bytes] = attrs.Factory(list)
    bodies: list[bytes] = attrs.Factory(list)
    origins: list[bytes] = attrs.Factory(list)


def decode_read_columns(data: bytes) -> ReadColumns:
    """A read batch as columns; ValueError on a batch cut short (a broken response)."""
    columns = ReadColumns()
    positions, ids, stamps, attempts = columns.positions, columns.ids, columns.timestamps_ns, columns.attempts
    topics, headers, bodies, origins = columns.topics, columns.headers, columns.bodies, columns.origins
    offset, end, head = 0, len(data), READ_HEAD.size
    unpack = READ_HEAD.unpack_from
    while offset < end:
        if end - offset < head:
            raise ValueError(f"a row head cut short at byte {offset}")
        position, message_id, timestamp_ns, tries, topic_len, headers_len, body_len, origin_len = unpack(data, offset)
        start = offset + head
        topic_end = start + topic_len
        origin_end = topic_end + origin_len
        headers_end = origin_end + headers_len
        offset = headers_end + body_len
        if offset > end:
            raise ValueError(f"row at position {position} cut short")
        positions.append(position)
        ids.append(message_id)
        stamps.append(timestamp_ns)
        attempts.append(tries)
        topics.append(data[start:topic_end])
        origins.append(data[topic_end:origin_end])
        headers.append(data[origin_end:headers_end])
        bodies.append(data[headers_end:offset])
    return columns


def encode_publish_row(body: bytes, *, message_id: str | None = None, topic: str | None = None,
                       headers: dict[str, Any] | None = None) -> bytes:
    id_bytes = message_id.encode() if message_id else b""
    topic_bytes = topic.encode() if topic else b""
    headers_bytes = json.dumps(headers, separators=(",", ":")).encode() if headers else b""
    return PUBLISH_HEAD.pack(len(id_bytes), len(topic_bytes), len(headers_bytes), len(body)) + id_bytes \
        + topic_bytes + headers_bytes + body


def decode_publish_rows(data: bytes, max_body: int) -> PublishBatch | Invalid:
    """Every row of a publish batch, or the first problem: a cut-short row, a body over `max_body`,
    an empty body, an id over MAX_ID_BYTES, text that is not UTF-8, headers that are not a JSON object."""
    batch = PublishBatch()
    bodies, extras = batch.bodies, batch.extras
    view = memoryview(data)
    offset, end, head = 0, len(view), PUBLISH_HEAD.size
    unpack = PUBLISH_HEAD.unpack_from
    while offset < end:
        number = len(bodies)
        if end - offset < head:
            return Invalid(number, "row head cut short")
        id_len, topic_len, headers_len, body_len = unpack(view, offset)
        if body_len > max_body:
            return Invalid(number, f"body of {body_len} bytes is over the limit of {max_body}")
        if body_len == 0:
            return Invalid(number, "empty body")
        if id_len > MAX_ID_BYTES:
            return Invalid(number, f"id of {id_len} bytes is over the limit of {MAX_ID_BYTES}")
        start = offset + head
        body_start = start + id_len + topic_len + headers_len
        offset = body_start + body_len
        if offset > end:
            return Invalid(number, "row cut short")
        bodies.append(data[body_start:offset])
        if body_start == start:
            continue
        topic_start = start + id_len
        headers_start = topic_start + topic_len
        try:
            message_id = str(view[start:topic_start], "utf-8") or None
            topic = str(view[topic_start:headers_start], "utf-8") or None
            headers = json.loads(bytes(view[headers_start:body_start])) if headers_len else None
        except UnicodeDecodeError:
            return Invalid(number, "id or topic is not UTF-8")
        except ValueError:
            return Invalid(number, "headers are not JSON")
        if headers is not None and not isinstance(headers, dict):
            return Invalid(number, "headers are not a JSON object")
        extras[number] = RowExtras(message_id, topic, headers)
    return batch


# -- the column layout of a read batch -----------------------------------------------------------
#
# Asked for with `layout=columns`: the same rows, column by column, so a reader hands each column
# to Arrow as one buffer instead of a Python object per row. Little-endian, every array aligned to
# its item size:
# `rows u32 | topics u16 | origins u8 | 0 u8`, then `positions i64[rows] | ids u64[rows] |
# timestamps ns i64[rows] | attempts i32[rows] | body ends i32[rows] | headers ends i32[rows] |
# topic numbers u16[rows] | origin numbers u8[rows]`, then the topics (`len u16` + UTF-8 each),
# the origins (`len u8` + ASCII each; number 0 is "not known"), the headers (JSON objects, one
# after another; empty: none) and the bodies, one after another.

COLUMNS_CONTENT_TYPE = "application/x-polymq-columns"
COLUMNS_HEAD = struct.Struct("<IHBx")
# A batch names at most this many topics and origins (the widths of their numbers); a row that
# would need one more starts the next batch.
MAX_COLUMN_TOPICS = 0xFFFF
MAX_COLUMN_ORIGINS = 0xFF
# Bodies and headers are addressed by i32 offsets (Arrow's binary type).
MAX_COLUMN_BYTES = 0x7FFF_FFFF
# The fixed columns' bytes of one row: position, id, timestamp (8 each), attempts, body and
# headers ends (4 each), topic number (2), origin number (1).
ROW_FIXED_BYTES = 39
# The fields of a message a row takes (the engine's `Message`; this codec does not import it).
_ID, _TIMESTAMP, _ATTEMPTS = (operator.attrgetter(name) for name in ("id", "timestamp_ns", "attempts"))
_TOPIC, _HEADERS, _BODY, _ORIGIN = (operator.attrgetter(name) for name in ("topic", "headers", "body", "origin"))


def _extend_numbers(column: array.array[int], numbers: dict[str, int], names: list[str]) -> None:
    """Each name's number onto `column`; one repeated number when the rows share one name (a
    stream of one topic, messages of one protocol)."""
    if len(numbers) == 1:
        column.extend(array.array(column.typecode, numbers.values()) * len(names))
    else:
        column.extend(map(numbers.__getitem__, names))


def _ends(parts: list[bytes], before: int) -> Iterator[int]:
    """Where each part ends, counted from `before`."""
    return itertools.islice(itertools.accumulate(map(len, parts), initial=before), 1, None)


@attrs.define(slots=True)
class ColumnsWriter:
    """Builds one column-layout batch row by row (the gateway's side)."""

    positions: array.array[int] = attrs.Factory(lambda: array.array("q"))
    ids: array.array[int] = attrs.Factory(lambda: array.array("Q"))
    timestamps_ns: array.array[int] = attrs.Factory(lambda: array.array("q"))
    attempts: array.array[int] = attrs.Factory(lambda: array.array("i"))
    body_ends: array.array[int] = attrs.Factory(lambda: array.array("i"))
    headers_ends: array.array[int] = attrs.Factory(lambda: array.array("i"))
    topic_numbers: array.array[int] = attrs.Factory(lambda: array.array("H"))
    origin_numbers: array.array[int] = attrs.Factory(lambda: array.array("B"))
    topics: dict[bytes, int] = attrs.Factory(dict)
    origins: dict[bytes, int] = attrs.Factory(lambda: {b"": 0})
    bodies: list[bytes] = attrs.Factory(list)
    headers: list[bytes] = attrs.Factory(list)
    body_bytes: int = 0
    headers_bytes: int = 0

    def add(self, position: int, message_id: int, timestamp_ns: int, attempts: int, topic: bytes, headers: bytes,
            body: bytes, origin: bytes) -> bool:
        """Add a row; False (nothing added) when the batch cannot name one more topic or origin."""
        topic_number = self.topics.get(topic)
        if topic_number is None:
            if len(self.topics) >= MAX_COLUMN_TOPICS:
                return False
            topic_number = self.topics[topic] = len(self.topics)
        origin_number = self.origins.get(origin)
        if origin_number is None:
            if len(self.origins) > MAX_COLUMN_ORIGINS:
                return False
            origin_number = self.origins[origin] = len(self.origins)
        self.positions.append(position)
        self.ids.append(message_id)
        self.timestamps_ns.append(timestamp_ns)
        self.attempts.append(attempts)
        self.topic_numbers.append(topic_number)
        self.origin_numbers.append(origin_number)
        self.body_bytes += len(body)
        self.body_ends.append(self.body_bytes)
        self.bodies.append(body)
        if headers:
            self.headers_bytes += len(headers)
            self.headers.append(headers)
        self.headers_ends.append(self.headers_bytes)
        return True

    def add_messages(self, messages: Sequence[Any], positions: Sequence[int], default_topic: str,
                     topic_bytes: dict[str, bytes], max_bytes: int) -> None:
        """Add a row for each message (an object with `id`, `timestamp_ns`, `attempts`, `topic`,
        `headers`, `body` and `origin`) under its position, until the batch would pass `max_bytes`
        (one row at least) or cannot name one more topic or origin. `topic_bytes` caches encoded
        topics across batches.

        A column at a time (one pass over the messages per field, into the arrays in C), not a row
        at a time: the bytes are the same as `add`'s row by row."""
        count = min(len(messages), len(positions))
        if count < len(messages):
            messages = messages[:count]
        bodies: list[bytes] = list(map(_BODY, messages))
        headers = [json.dumps(value, separators=(",", ":")).encode() if value else b""
                   for value in map(_HEADERS, messages)]
        rows_bytes = self.size + sum(map(len, bodies)) + sum(map(len, headers)) + ROW_FIXED_BYTES * count
        if rows_bytes > max_bytes:  # the rows that fit: those whose body and headers start under the bound
            count = self._rows_under(bodies, headers, max_bytes)
            messages, bodies, headers = messages[:count], bodies[:count], headers[:count]
        topics = [topic or default_topic for topic in map(_TOPIC, messages)]
        origins = [origin or "" for origin in map(_ORIGIN, messages)]
        topics_named = self._numbers(topics, self.topics, MAX_COLUMN_TOPICS, topic_bytes, "utf-8", "surrogateescape")
        origins_named = self._numbers(origins, self.origins, MAX_COLUMN_ORIGINS + 1, {}, "ascii", "replace")
        if topics_named is None or origins_named is None:  # a row would name one topic or origin too many
            self._add_rows(messages, positions, topics, origins, headers, topic_bytes)
            return
        (topic_numbers, new_topics), (origin_numbers, new_origins) = topics_named, origins_named
        for raw in new_topics:
            self.topics[raw] = len(self.topics)
        for raw in new_origins:
            self.origins[raw] = len(self.origins)
        self.positions.extend(positions[:count] if count < len(positions) else positions)
        self.ids.extend(map(_ID, messages))
        self.timestamps_ns.extend(map(_TIMESTAMP, messages))
        self.attempts.extend(map(_ATTEMPTS, messages))
        _extend_numbers(self.topic_numbers, topic_numbers, topics)
        _extend_numbers(self.origin_numbers, origin_numbers, origins)
        if not count:
            return
        self.body_ends.extend(_ends(bodies, self.body_bytes))
        self.body_bytes = self.body_ends[-1]
        self.bodies += bodies
        with_headers = list(filter(None, headers))
        if with_headers:
            self.headers_ends.extend(_ends(headers, self.headers_bytes))
            self.headers_bytes = self.headers_ends[-1]
            self.headers += with_headers
        else:  # the usual read: no row has headers, every end is the same
            self.headers_ends.extend(array.array("i", [self.headers_bytes]) * count)

    def _rows_under(self, bodies: list[bytes], headers: list[bytes], max_bytes: int) -> int:
        """How many of these rows `add_messages` takes under `max_bytes` (one at least in a batch)."""
        size = self.size
        for number, (body, raw_headers) in enumerate(zip(bodies, headers, strict=True)):
            if size and size + len(body) + len(raw_headers) > max_bytes:
                return number
            size += len(body) + len(raw_headers) + ROW_FIXED_BYTES
        return len(bodies)

    @staticmethod
    def _numbers(names: list[str], known: dict[bytes, int], most: int, encoded: dict[str, bytes], encoding: str,
                 errors: str) -> tuple[dict[str, int], list[bytes]] | None:
        """The number of each name in the batch and the names new to it, numbered in order of first
        appearance after the known ones; None when that would pass `most` names. Changes nothing."""
        numbers: dict[str, int] = {}
        new: dict[bytes, int] = {}
        for name in dict.fromkeys(names):
            raw = encoded.get(name)
            if raw is None:
                raw = encoded[name] = name.encode(encoding, errors)
            number = known.get(raw)
            if number is None:
                number = new.get(raw)
                if number is None:
                    if len(known) + len(new) >= most:
                        return None
                    number = new[raw] = len(known) + len(new)
            numbers[name] = number
        return numbers, list(new)

    def _add_rows(self, messages: Sequence[Any], positions: Sequence[int], topics: list[str], origins: list[str],
                  headers: list[bytes], topic_bytes: dict[str, bytes]) -> None:
        """Row by row, until a row would name one topic or origin too many."""
        for message, position, topic, origin, raw_headers in zip(messages, positions, topics, origins, headers,
                                                                  strict=False):
            raw_topic = topic_bytes.get(topic)
            if raw_topic is None:
                raw_topic = topic_bytes[topic] = topic.encode("utf-8", "surrogateescape")
            if not self.add(position, message.id, message.timestamp_ns, message.attempts, raw_topic, raw_headers,
                            message.body, origin.encode("ascii", "replace")):
                return

    @property
    def size(self) -> int:
        """Bytes of the rows so far (bodies and headers; the fixed columns are 39 bytes a row)."""
        return self.body_bytes + self.headers_bytes + ROW_FIXED_BYTES * len(self.positions)

    def encode(self) -> bytes:
        if sys.byteorder != "little":  # the arrays are in the machine's order; the layout is little-endian
            for column in (self.positions, self.ids, self.timestamps_ns, self.attempts, self.body_ends,
                           self.headers_ends, self.topic_numbers):
                column.byteswap()
        tables = [struct.pack("<H", len(topic)) + topic for topic in self.topics]
        tables += [struct.pack("<B", len(origin)) + origin for origin in list(self.origins)[1:]]
        return b"".join([COLUMNS_HEAD.pack(len(self.positions), len(self.topics), len(self.origins) - 1),
                         self.positions.tobytes(), self.ids.tobytes(), self.timestamps_ns.tobytes(),
                         self.attempts.tobytes(), self.body_ends.tobytes(), self.headers_ends.tobytes(),
                         self.topic_numbers.tobytes(), self.origin_numbers.tobytes(), *tables, *self.headers,
                         *self.bodies])


@attrs.frozen(slots=True)
class ColumnBuffers:
    """A column-layout batch as views of its buffer (the reader's side): `rows` items each."""

    rows: int
    positions: memoryview  # i64, little-endian
    ids: memoryview  # u64
    timestamps_ns: memoryview  # i64
    attempts: memoryview  # i32
    body_offsets: memoryview  # i32[rows + 1], from 0
    headers_offsets: memoryview  # i32[rows + 1], from 0
    topic_numbers: memoryview  # u16, into `topics`
    origin_numbers: memoryview  # u8; 0 = not known, n = origins[n - 1]
    topics: list[bytes]
    origins: list[bytes]
    headers: memoryview
    bodies: memoryview

    @property
    def last_position(self) -> int:
        return int(struct.unpack_from("<q", self.positions, 8 * (self.rows - 1))[0]) if self.rows else -1


_ZERO_OFFSET = b"\0\0\0\0"


def decode_read_column_buffers(data: bytes) -> ColumnBuffers:
    """A column-layout batch; ValueError on a batch cut short or whose ends do not add up."""
    view = memoryview(data)
    if len(view) < COLUMNS_HEAD.size:
        raise ValueError("column batch head cut short")
    rows, topic_count, origin_count = COLUMNS_HEAD.unpack_from(view)
    at = COLUMNS_HEAD.size

    def take(size: int) -> memoryview:
        nonlocal at
        if size < 0 or at + size > len(view):
            raise ValueError(f"column batch of {rows} rows cut short at byte {at}")
        part = view[at:at + size]
        at += size
        return part

    positions, ids, stamps = take(8 * rows), take(8 * rows), take(8 * rows)
    attempts, body_ends, headers_ends = take(4 * rows), take(4 * rows), take(4 * rows)
    topic_numbers, origin_numbers = take(2 * rows), take(rows)
    topics = []
    for _ in range(topic_count):
        (length,) = struct.unpack("<H", take(2))
        topics.append(bytes(take(length)))
    origins = []
    for _ in range(origin_count):
        length = take(1)[0]
        origins.append(bytes(take(length)))
    headers_total = struct.unpack_from("<i", headers_ends, 4 * (rows - 1))[0] if rows else 0
    body_total = struct.unpack_from("<i", body_ends, 4 * (rows - 1))[0] if rows else 0
    headers, bodies = take(headers_total), take(body_total)
    if at != len(view):
        raise ValueError(f"column batch of {rows} rows has {len(view) - at} bytes past its bodies")
    # Arrow's offsets start with the 0 before the first row: one copy of each ends column.
    return ColumnBuffers(rows, positions, ids, stamps, attempts, memoryview(_ZERO_OFFSET + body_ends),
                         memoryview(_ZERO_OFFSET + headers_ends), topic_numbers, origin_numbers, topics, origins,
                         headers, bodies)
