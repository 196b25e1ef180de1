"""Stream compression negotiated by NSQ IDENTIFY: raw DEFLATE and the snappy framing format (docs/protocols/nsq.md)."""

from __future__ import annotations

import contextlib
import itertools
import struct
import zlib

import cramjam
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from polymq.codecs.compression import (
    SNAPPY_MAX_CHUNK,
    SNAPPY_STREAM_IDENTIFIER,
    DecompressionError,
    DeflateCompressor,
    DeflateDecompressor,
    SnappyCompressor,
    SnappyDecompressor,
)
from polymq.codecs.nsq import FRAME_OK

BIG = 10 * 1024 * 1024

writes_strategy = st.lists(
    st.one_of(
        st.binary(max_size=300),
        st.builds(lambda b, n: b * n, st.binary(min_size=1, max_size=4), st.integers(1, 5000)),
    ),
    max_size=8,
)


def split(data: bytes, cuts: list[int]) -> list[bytes]:
    points = [0, *sorted({c % (len(data) + 1) for c in cuts}), len(data)]
    return [data[a:b] for a, b in itertools.pairwise(points)]


def _crc32c(data: bytes) -> int:
    crc = 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
    return crc ^ 0xFFFFFFFF


def _masked_crc(data: bytes) -> int:
    crc = _crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def snappy_chunk(chunk_type: int, payload: bytes) -> bytes:
    return bytes([chunk_type]) + len(payload).to_bytes(3, "little") + payload


def uncompressed_chunk(data: bytes, crc: int | None = None) -> bytes:
    return snappy_chunk(0x01, struct.pack("<I", _masked_crc(data) if crc is None else crc) + data)


# ---------------------------------------------------------------------------------------------
# deflate


def test_deflate_ok_frame_is_raw_and_sync_flushed() -> None:
    out = DeflateCompressor(6).compress(FRAME_OK)
    assert out.endswith(b"\x00\x00\xff\xff")
    assert out[:2] != b"\x78\x9c"  # no zlib header
    assert zlib.decompressobj(-15).decompress(out) == FRAME_OK


@settings(max_examples=100)
@given(writes_strategy, st.integers(1, 9), st.lists(st.integers(0, 10**6), max_size=10))
def test_deflate_round_trip_any_chunking(writes: list[bytes], level: int, cuts: list[int]) -> None:
    compressor = DeflateCompressor(level)
    outputs = [compressor.compress(w) for w in writes]
    for write, out in zip(writes, outputs, strict=True):
        if write:
            assert out.endswith(b"\x00\x00\xff\xff")  # the peer can decode each write at once
    stream = b"".join(outputs)
    expected = b"".join(writes)
    assert zlib.decompressobj(-15).decompress(stream) == expected  # independent decoder
    decompressor = DeflateDecompressor(BIG)
    assert b"".join(decompressor.decompress(c) for c in split(stream, cuts)) == expected


@settings(max_examples=50)
@given(writes_strategy, st.lists(st.integers(0, 10**6), max_size=10))
def test_deflate_decompressor_reads_each_write_as_it_arrives(writes: list[bytes], cuts: list[int]) -> None:
    compressor = DeflateCompressor(6)
    decompressor = DeflateDecompressor(BIG)
    for write in writes:
        assert decompressor.decompress(compressor.compress(write)) == write


@settings(max_examples=50)
@given(writes_strategy, st.lists(st.integers(0, 10**6), max_size=10))
def test_deflate_decompressor_reads_zlib_output(writes: list[bytes], cuts: list[int]) -> None:
    # what a Go or Python client sends: raw deflate with a sync flush per write
    other = zlib.compressobj(9, zlib.DEFLATED, -15)
    stream = b"".join(other.compress(w) + other.flush(zlib.Z_SYNC_FLUSH) for w in writes)
    decompressor = DeflateDecompressor(BIG)
    assert b"".join(decompressor.decompress(c) for c in split(stream, cuts)) == b"".join(writes)


def test_deflate_expansion_limit() -> None:
    stream = DeflateCompressor(6).compress(b"\x00" * 1_000_000)
    assert len(stream) < 5000
    with pytest.raises(DecompressionError):
        DeflateDecompressor(1000).decompress(stream)


def test_deflate_limit_is_inclusive() -> None:
    stream = DeflateCompressor(6).compress(b"a" * 1000)
    assert DeflateDecompressor(1000).decompress(stream) == b"a" * 1000
    with pytest.raises(DecompressionError):
        DeflateDecompressor(999).decompress(stream)


@settings(max_examples=50)
@given(st.integers(1, 200_000), st.integers(1, 50_000))
def test_deflate_expansion_beyond_limit_raises(size: int, limit: int) -> None:
    stream = DeflateCompressor(6).compress(b"z" * size)
    decompressor = DeflateDecompressor(limit)
    if size > limit:
        with pytest.raises(DecompressionError):
            decompressor.decompress(stream)
    else:
        assert decompressor.decompress(stream) == b"z" * size


@pytest.mark.parametrize("garbage", [b"\xff", b"\xff\xff\xff\xff", b"\x07" + b"\x00" * 10, b"\x00\x05\x00\x00\x00"])
def test_deflate_corrupt_input(garbage: bytes) -> None:
    with pytest.raises(DecompressionError):
        DeflateDecompressor(BIG).decompress(garbage)


@settings(max_examples=200)
@given(st.lists(st.binary(max_size=100), max_size=6))
def test_deflate_garbage_only_raises_decompression_error(chunks: list[bytes]) -> None:
    decompressor = DeflateDecompressor(100_000)
    try:
        for chunk in chunks:
            assert isinstance(decompressor.decompress(chunk), bytes)
    except DecompressionError:
        pass


@settings(max_examples=100)
@given(st.binary(min_size=1, max_size=500), st.integers(0, 10**6), st.integers(0, 7))
def test_deflate_bit_flip_only_raises_decompression_error(data: bytes, position: int, bit: int) -> None:
    stream = bytearray(DeflateCompressor(6).compress(data))
    stream[position % len(stream)] ^= 1 << bit
    with contextlib.suppress(DecompressionError):
        DeflateDecompressor(100_000).decompress(bytes(stream))


# ---------------------------------------------------------------------------------------------
# snappy framing


def test_snappy_ok_frame_starts_with_stream_identifier() -> None:
    out = SnappyCompressor().compress(FRAME_OK)
    assert SNAPPY_STREAM_IDENTIFIER == b"\xff\x06\x00\x00sNaPpY"
    assert out.startswith(SNAPPY_STREAM_IDENTIFIER)
    assert bytes(cramjam.snappy.decompress(out)) == FRAME_OK


def test_snappy_identifier_sent_even_after_an_empty_first_write() -> None:
    compressor = SnappyCompressor()
    assert compressor.compress(b"") == b""
    assert compressor.compress(FRAME_OK).startswith(SNAPPY_STREAM_IDENTIFIER)


def test_snappy_identifier_only_once() -> None:
    compressor = SnappyCompressor()
    first = compressor.compress(b"one")
    second = compressor.compress(b"two")
    assert first.startswith(SNAPPY_STREAM_IDENTIFIER)
    assert SNAPPY_STREAM_IDENTIFIER not in second
    assert bytes(cramjam.snappy.decompress(first + second)) == b"onetwo"


@settings(max_examples=100)
@given(writes_strategy, st.lists(st.integers(0, 10**6), max_size=10))
def test_snappy_round_trip_any_chunking(writes: list[bytes], cuts: list[int]) -> None:
    compressor = SnappyCompressor()
    stream = b"".join(compressor.compress(w) for w in writes)
    expected = b"".join(writes)
    if stream:
        assert stream.startswith(SNAPPY_STREAM_IDENTIFIER)
        assert bytes(cramjam.snappy.decompress(stream)) == expected  # independent decoder
    decompressor = SnappyDecompressor()
    assert b"".join(decompressor.decompress(c) for c in split(stream, cuts)) == expected


@settings(max_examples=20)
@given(st.integers(SNAPPY_MAX_CHUNK - 2, 3 * SNAPPY_MAX_CHUNK + 7), st.binary(min_size=1, max_size=7))
def test_snappy_large_writes(size: int, pattern: bytes) -> None:
    data = (pattern * (size // len(pattern) + 1))[:size]
    stream = SnappyCompressor().compress(data)
    assert bytes(cramjam.snappy.decompress(stream)) == data
    decompressor = SnappyDecompressor()
    assert b"".join(decompressor.decompress(stream[i : i + 4096]) for i in range(0, len(stream), 4096)) == data


@settings(max_examples=50)
@given(writes_strategy)
def test_snappy_decompressor_reads_cramjam_output(writes: list[bytes]) -> None:
    # another encoder (one stream per write, identifier repeated): the format allows repeats
    stream = b"".join(bytes(cramjam.snappy.compress(w)) for w in writes)
    decompressor = SnappyDecompressor()
    assert b"".join(decompressor.decompress(stream[i : i + 7]) for i in range(0, len(stream), 7)) == b"".join(writes)


def test_snappy_uncompressed_and_skippable_chunks() -> None:
    stream = (
        SNAPPY_STREAM_IDENTIFIER
        + uncompressed_chunk(b"hello ")
        + snappy_chunk(0xFE, b"\x00" * 5)  # padding
        + snappy_chunk(0x80, b"skippable")
        + uncompressed_chunk(b"world")
    )
    assert SnappyDecompressor().decompress(stream) == b"hello world"
    assert bytes(cramjam.snappy.decompress(stream)) == b"hello world"


@pytest.mark.parametrize(
    "stream",
    [
        SNAPPY_STREAM_IDENTIFIER + uncompressed_chunk(b"data", crc=0),  # bad checksum
        SNAPPY_STREAM_IDENTIFIER + snappy_chunk(0x02, b"x"),  # reserved unskippable
        SNAPPY_STREAM_IDENTIFIER + snappy_chunk(0x7F, b""),
        b"\xff\x06\x00\x00sNaPpX",  # bad stream identifier
        b"\xff\x03\x00\x00abc",
        SNAPPY_STREAM_IDENTIFIER + snappy_chunk(0x00, b"\x00\x00\x00\x00garbage-garbage"),
        SNAPPY_STREAM_IDENTIFIER + snappy_chunk(0x00, b"\x01"),  # shorter than its checksum
        SNAPPY_STREAM_IDENTIFIER + snappy_chunk(0x01, b""),
        b"\x00\xff\xff\xff",  # a chunk far longer than the format allows
    ],
)
def test_snappy_corrupt_input(stream: bytes) -> None:
    with pytest.raises(DecompressionError):
        SnappyDecompressor().decompress(stream)


def test_snappy_uncompressed_chunk_over_limit() -> None:
    data = b"x" * (SNAPPY_MAX_CHUNK + 1)
    with pytest.raises(DecompressionError):
        SnappyDecompressor().decompress(SNAPPY_STREAM_IDENTIFIER + uncompressed_chunk(data))


@settings(max_examples=200)
@given(st.lists(st.binary(max_size=100), max_size=6), st.booleans())
def test_snappy_garbage_only_raises_decompression_error(chunks: list[bytes], prefix: bool) -> None:
    decompressor = SnappyDecompressor()
    try:
        if prefix:
            decompressor.decompress(SNAPPY_STREAM_IDENTIFIER)
        for chunk in chunks:
            assert isinstance(decompressor.decompress(chunk), bytes)
    except DecompressionError:
        pass


@settings(max_examples=150)
@given(writes_strategy, st.integers(0, 10**6), st.integers(0, 255), st.lists(st.integers(0, 10**6), max_size=5))
def test_snappy_mutation_only_raises_decompression_error(
    writes: list[bytes], position: int, value: int, cuts: list[int]
) -> None:
    compressor = SnappyCompressor()
    stream = bytearray(b"".join(compressor.compress(w) for w in writes) or SNAPPY_STREAM_IDENTIFIER)
    stream[position % len(stream)] = value
    decompressor = SnappyDecompressor()
    try:
        for chunk in split(bytes(stream), cuts):
            decompressor.decompress(chunk)
    except DecompressionError:
        pass
