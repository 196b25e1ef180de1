"""The Spark source's Arrow batches (spark/pyspark_polymq/source.py) built from the column layout
of a read answer: every column exact, and an answer whose offsets do not add up is a clear error."""

from __future__ import annotations

import datetime
import struct

import pytest
from pyspark_polymq import source

from polymq.codecs import stream_rows


def _answer(*rows: tuple[int, int, int, int, bytes, bytes, bytes, bytes]) -> bytes:
    writer = stream_rows.ColumnsWriter()
    for row in rows:
        assert writer.add(*row)
    return writer.encode()


def test_every_column_of_a_batch() -> None:
    raw = _answer((5, 0xAB, 1_700_000_000_123_456_789, 2, b"orders", b'{"k":"v","n":1}', b"\x00\xff", b"mqks"),
                  (6, 2**64 - 1, 0, 1, "zä".encode(), b"", b"", b""))
    batch = source._record_batch(stream_rows.decode_read_column_buffers(raw), "127.0.0.1:4181")
    assert batch.schema.names == source.COLUMNS
    utc = datetime.UTC
    assert batch.to_pylist() == [
        {"position": 5, "topic": "orders", "id": "00000000000000ab", "body": b"\x00\xff", "attempts": 2,
         "timestamp": datetime.datetime(2023, 11, 14, 22, 13, 20, 123456, tzinfo=utc),
         "headers": [("k", "v"), ("n", "1")], "protocol": "mqks"},
        {"position": 6, "topic": "zä", "id": "ffffffffffffffff", "body": b"", "attempts": 1,
         "timestamp": datetime.datetime(1970, 1, 1, tzinfo=utc), "headers": None, "protocol": None},
    ]


def test_an_answer_whose_offsets_do_not_add_up_is_a_source_error() -> None:
    raw = bytearray(_answer((1, 1, 1, 1, b"t", b"", b"ab", b""), (2, 2, 2, 1, b"t", b"", b"c", b"")))
    body_ends = stream_rows.COLUMNS_HEAD.size + 2 * (8 + 8 + 8 + 4)
    struct.pack_into("<i", raw, body_ends, 4)  # the first body ends past the second, past the data
    with pytest.raises(source.PolymqSourceError, match=r"gateway at 127\.0\.0\.1:4181: a broken read answer"):
        source._record_batch(stream_rows.decode_read_column_buffers(bytes(raw)), "127.0.0.1:4181")
