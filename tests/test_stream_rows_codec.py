"""The row batches of the stream endpoints (codecs/stream_rows.py): exact bytes, round trips of any
rows, and any bytes decoded to rows or one clear problem, never an exception."""

from __future__ import annotations

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
