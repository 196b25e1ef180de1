"""The row batches of the stream endpoints (codecs/stream_rows.py): exact bytes, round trips of any
rows, and any bytes decoded to rows or one clear problem, never an exception."""

from __future__ import annotations

import json
import struct

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from polymq.codecs import stream_rows
from polymq.codecs.stream_rows import Invalid, PublishBatch, ReadRow, RowExtras

MAX_BODY = 1024

texts = st.text(st.characters(exclude_categories=("Cs",)), max_size=20)
header_maps = st.dictionaries(st.text(max_size=5), st.integers() | st.text(max_size=5), max_size=3)


def test_the_documented_bytes() -> None:
    assert stream_rows.encode_read_row(7, 9, 11, 2, b"t", b"{}", b"body", b"nsq") == (
        (7).to_bytes(8, "little") + (9).to_bytes(8, "little") + (11).to_bytes(8, "little") + b"\x02\x00"
        + b"\x01\x00" + b"\x02\x00\x00\x00" + b"\x04\x00\x00\x00" + b"\x03" + b"tnsq{}body")
    assert stream_rows.encode_publish_row(b"b", message_id="i", topic="tt", headers={"k": 1}) == (
        b"\x01\x00\x02\x00\x07\x00\x00\x00\x01\x00\x00\x00" + b"itt" + b'{"k":1}' + b"b")


@given(st.lists(st.tuples(st.integers(-(2**63), 2**63 - 1), st.integers(0, 2**64 - 1),
                          st.integers(-(2**63), 2**63 - 1), st.integers(0, 65535), texts, st.binary(max_size=30),
                          st.binary(max_size=50), st.sampled_from(["", "nsq", "mqks", "emqp"])), max_size=10))
def test_read_rows_round_trip(rows: list[tuple[int, int, int, int, str, bytes, bytes, str]]) -> None:
    data = b"".join(stream_rows.encode_read_row(p, i, t, a, topic.encode(), h, b, o.encode())
                    for p, i, t, a, topic, h, b, o in rows)
    assert list(stream_rows.decode_read_rows(data)) == [ReadRow(*row) for row in rows]
    columns = stream_rows.decode_read_columns(data)
    assert list(zip(columns.positions, columns.ids, columns.timestamps_ns, columns.attempts,
                    [topic.decode() for topic in columns.topics], columns.headers, columns.bodies,
                    [origin.decode() for origin in columns.origins], strict=True)) == rows


def test_a_read_batch_cut_anywhere_is_an_error_not_garbage() -> None:
    whole = stream_rows.encode_read_row(1, 2, 3, 4, b"topic", b"", b"body")
    for cut in range(1, len(whole)):
        with pytest.raises(ValueError, match="cut short"):
            list(stream_rows.decode_read_rows(whole[:cut]))
        with pytest.raises(ValueError, match="cut short"):
            stream_rows.decode_read_columns(whole[:cut])


@given(st.lists(st.tuples(st.none() | texts.filter(bool), st.none() | texts.filter(bool),
                          st.none() | header_maps.filter(bool), st.binary(min_size=1, max_size=MAX_BODY)),
                max_size=10))
def test_publish_rows_round_trip(rows: list[tuple[str | None, str | None, dict[str, object] | None, bytes]]) -> None:
    data = b"".join(stream_rows.encode_publish_row(body, message_id=i, topic=t, headers=h) for i, t, h, body in rows)
    assert stream_rows.decode_publish_rows(data, MAX_BODY) == PublishBatch(
        [body for *_, body in rows],
        {number: RowExtras(i, t, h) for number, (i, t, h, _) in enumerate(rows) if i or t or h})


@given(st.binary(max_size=300))
def test_any_publish_bytes_give_rows_or_one_problem(data: bytes) -> None:
    decoded = stream_rows.decode_publish_rows(data, MAX_BODY)
    assert isinstance(decoded, Invalid) or all(0 < len(body) <= MAX_BODY for body in decoded.bodies)


def test_publish_problems_name_the_row() -> None:
    good = stream_rows.encode_publish_row(b"x")
    assert stream_rows.decode_publish_rows(good + stream_rows.encode_publish_row(b"y" * 5), 4) == Invalid(
        1, "body of 5 bytes is over the limit of 4")
    assert stream_rows.decode_publish_rows(good + good[:-1], 4) == Invalid(1, "row cut short")
    empty = stream_rows.PUBLISH_HEAD.pack(0, 0, 0, 0)
    assert stream_rows.decode_publish_rows(empty, 4) == Invalid(0, "empty body")
    assert stream_rows.decode_publish_rows(stream_rows.encode_publish_row(b"x", headers=None)[:-1] + b"", 4) \
        == Invalid(0, "row cut short")
    not_object = stream_rows.PUBLISH_HEAD.pack(0, 0, 2, 1) + b"[]x"
    assert stream_rows.decode_publish_rows(not_object, 4) == Invalid(0, "headers are not a JSON object")
    bad_text = stream_rows.PUBLISH_HEAD.pack(1, 0, 0, 1) + b"\xffx"
    assert stream_rows.decode_publish_rows(bad_text, 4) == Invalid(0, "id or topic is not UTF-8")


# -- the column layout -------------------------------------------------------------------------

Row = tuple[int, int, int, int, bytes, bytes, bytes, bytes]


def _columns_of(rows: list[Row]) -> bytes:
    writer = stream_rows.ColumnsWriter()
    for row in rows:
        assert writer.add(*row)
    return writer.encode()


def _rows_of(buffers: stream_rows.ColumnBuffers) -> list[Row]:
    """Rows back from the column views, as a reader of the layout would read them."""
    count = buffers.rows
    positions = struct.unpack(f"<{count}q", buffers.positions)
    ids = struct.unpack(f"<{count}Q", buffers.ids)
    stamps = struct.unpack(f"<{count}q", buffers.timestamps_ns)
    attempts = struct.unpack(f"<{count}i", buffers.attempts)
    body_at = struct.unpack(f"<{count + 1}i", buffers.body_offsets)
    headers_at = struct.unpack(f"<{count + 1}i", buffers.headers_offsets)
    topics = [buffers.topics[n] for n in struct.unpack(f"<{count}H", buffers.topic_numbers)]
    origins = [b"" if n == 0 else buffers.origins[n - 1] for n in bytes(buffers.origin_numbers)]
    return [(positions[n], ids[n], stamps[n], attempts[n], topics[n],
             bytes(buffers.headers[headers_at[n]:headers_at[n + 1]]), bytes(buffers.bodies[body_at[n]:body_at[n + 1]]),
             origins[n]) for n in range(count)]


def test_the_documented_bytes_of_the_column_layout() -> None:
    data = _columns_of([(7, 9, 11, 2, b"t", b"{}", b"ab", b"nsq"), (8, 10, 12, 1, b"t", b"", b"c", b"")])
    assert data == (
        b"\x02\x00\x00\x00" + b"\x01\x00" + b"\x01" + b"\x00"  # 2 rows, 1 topic, 1 origin
        + struct.pack("<2q", 7, 8) + struct.pack("<2Q", 9, 10) + struct.pack("<2q", 11, 12)
        + struct.pack("<2i", 2, 1) + struct.pack("<2i", 2, 3) + struct.pack("<2i", 2, 2)  # attempts, ends
        + b"\x00\x00\x00\x00" + b"\x01\x00"  # topic numbers, origin numbers
        + b"\x01\x00t" + b"\x03nsq" + b"{}" + b"abc")


@given(st.lists(st.tuples(st.integers(-(2**63), 2**63 - 1), st.integers(0, 2**64 - 1),
                          st.integers(-(2**63), 2**63 - 1), st.integers(0, 65535), st.binary(max_size=8),
                          st.binary(max_size=30), st.binary(max_size=50),
                          st.sampled_from([b"", b"nsq", b"mqks", b"emqp"])), max_size=10))
def test_column_layout_round_trip(rows: list[Row]) -> None:
    buffers = stream_rows.decode_read_column_buffers(_columns_of(rows))
    assert buffers.rows == len(rows) and _rows_of(buffers) == rows
    assert buffers.last_position == (rows[-1][0] if rows else -1)


def test_a_column_batch_cut_anywhere_or_padded_is_an_error() -> None:
    whole = _columns_of([(1, 2, 3, 4, b"topic", b'{"k":"v"}', b"body", b"nsq")])
    for cut in range(len(whole)):
        with pytest.raises(ValueError, match="cut short"):
            stream_rows.decode_read_column_buffers(whole[:cut])
    with pytest.raises(ValueError, match="past its bodies"):
        stream_rows.decode_read_column_buffers(whole + b"x")


@given(st.binary(max_size=300))
def test_any_bytes_give_columns_or_value_error(data: bytes) -> None:
    try:
        buffers = stream_rows.decode_read_column_buffers(data)
    except ValueError:
        return
    count = buffers.rows  # what decodes is whole: every column has its rows' worth of bytes
    assert (len(buffers.positions), len(buffers.attempts), len(buffers.origin_numbers)) == (8 * count, 4 * count,
                                                                                             count)
    assert len(buffers.body_offsets) == len(buffers.headers_offsets) == 4 * (count + 1)


def test_a_batch_names_at_most_so_many_origins() -> None:
    writer = stream_rows.ColumnsWriter()
    for number in range(stream_rows.MAX_COLUMN_ORIGINS):
        assert writer.add(number, 0, 0, 1, b"t", b"", b"x", b"o%d" % number)
    assert not writer.add(999, 0, 0, 1, b"t", b"", b"x", b"one-too-many")
    assert writer.add(999, 0, 0, 1, b"t", b"", b"x", b"o0")  # a known one still goes in
    assert len(stream_rows.decode_read_column_buffers(writer.encode()).origins) == stream_rows.MAX_COLUMN_ORIGINS


# -- a read's messages added a column at a time ------------------------------------------------


@attrs.frozen
class Held:
    """What the engine's `Message` offers a read."""

    id: int
    timestamp_ns: int
    attempts: int
    topic: str | None
    headers: dict[str, object] | None
    body: bytes
    origin: str | None


def _row_by_row(writer: stream_rows.ColumnsWriter, messages: list[Held], positions: list[int], default_topic: str,
                max_bytes: int) -> None:
    """The reference: each message through `add`, checking the bound before each row."""
    for message, position in zip(messages, positions, strict=False):
        raw_headers = json.dumps(message.headers, separators=(",", ":")).encode() if message.headers else b""
        if writer.size and writer.size + len(message.body) + len(raw_headers) > max_bytes:
            return
        if not writer.add(position, message.id, message.timestamp_ns, message.attempts,
                          (message.topic or default_topic).encode("utf-8", "surrogateescape"), raw_headers,
                          message.body, (message.origin or "").encode("ascii", "replace")):
            return


held = st.builds(Held, st.integers(0, 2**64 - 1), st.integers(-(2**63), 2**63 - 1), st.integers(0, 65535),
                 st.sampled_from([None, "", "t", "other", "t\udcff", "é"]),
                 st.sampled_from([None, {}, {"k": "v"}, {"n": 1, "l": [1, 2]}]), st.binary(max_size=40),
                 st.sampled_from([None, "", "nsq", "mqks", "é", "è"]))


@given(st.lists(held, max_size=30), st.data(), st.integers(0, 400), st.lists(held, max_size=3))
def test_columns_added_at_once_are_the_rows_added_one_by_one(messages: list[Held], data: st.DataObject,
                                                             max_bytes: int, earlier: list[Held]) -> None:
    positions = data.draw(st.lists(st.integers(0, 2**62), min_size=max(0, len(messages) - 2),
                                   max_size=len(messages) + 2))
    at_once, one_by_one = stream_rows.ColumnsWriter(), stream_rows.ColumnsWriter()
    for writer in (at_once, one_by_one):  # a batch that already holds rows
        _row_by_row(writer, earlier, list(range(len(earlier))), "q", 10**6)
    at_once.add_messages(messages, positions, "q", {}, max_bytes)
    _row_by_row(one_by_one, messages, positions, "q", max_bytes)
    assert at_once.encode() == one_by_one.encode()


@pytest.mark.parametrize("limit", ["origins", "topics"])
def test_columns_added_at_once_stop_where_a_row_names_one_name_too_many(limit: str) -> None:
    many = stream_rows.MAX_COLUMN_ORIGINS + 5 if limit == "origins" else stream_rows.MAX_COLUMN_TOPICS + 5
    messages = [Held(n, 0, 1, f"t{n}" if limit == "topics" else "t", None, b"x",
                     f"o{n}" if limit == "origins" else "nsq") for n in range(many)]
    at_once, one_by_one = stream_rows.ColumnsWriter(), stream_rows.ColumnsWriter()
    at_once.add_messages(messages, list(range(many)), "q", {}, 10**9)
    _row_by_row(one_by_one, messages, list(range(many)), "q", 10**9)
    assert at_once.encode() == one_by_one.encode()
    assert len(at_once.positions) < many
