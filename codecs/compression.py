"""Stream compression that NSQ negotiates in IDENTIFY: raw DEFLATE and the snappy framing format.

Each class holds one direction's state. Sans-IO: bytes in, bytes out. Decompression is bounded
so that a small compressed input cannot expand past the caller's limit.
"""

from __future__ import annotations

import zlib

import cramjam

SNAPPY_STREAM_IDENTIFIER = b"\xff\x06\x00\x00sNaPpY"
# The snappy framing format caps a chunk's uncompressed data at 65536 bytes (framing_format.txt).
SNAPPY_MAX_CHUNK = 65536
_SNAPPY_MAX_ENCODED_CHUNK = 16 + 65536 + 65536 // 6 + 32


class DecompressionError(Exception):
    """The peer's compressed stream is corrupt or expands past the limit."""


class DeflateCompressor:
    def __init__(self, level: int) -> None:
        self._compressor = zlib.compressobj(level, zlib.DEFLATED, -15)

    def compress(self, data: bytes) -> bytes:
        # A sync flush per write: the peer can decode everything sent so far (what nsqd does).
        return self._compressor.compress(data) + self._compressor.flush(zlib.Z_SYNC_FLUSH)


class DeflateDecompressor:
    def __init__(self, max_output: int) -> None:
        self._decompressor = zlib.decompressobj(-15)
        self._max_output = max_output

    def decompress(self, data: bytes) -> bytes:
        try:
            out = self._decompressor.decompress(data, self._max_output + 1)
        except zlib.error as exc:
            raise DecompressionError(str(exc)) from exc
        if len(out) > self._max_output:
            raise DecompressionError("deflate stream expands past the read limit")
        if self._decompressor.unconsumed_tail:
            raise DecompressionError("deflate stream expands past the read limit")
        return out


class SnappyCompressor:
    def __init__(self) -> None:
        self._started = False

    def compress(self, data: bytes) -> bytes:
        if not data:  # cramjam encodes b"" as b"" (no stream identifier): don't count it as the start
            return b""
        encoded = bytes(cramjam.snappy.compress(data))
        if self._started:
            # Every call emits a stream identifier; the format allows repeats, but one is enough.
            return encoded[len(SNAPPY_STREAM_IDENTIFIER) :]
        self._started = True
        return encoded


class SnappyDecompressor:
    """Incremental reader of the snappy framing format (chunks: 1-byte type, 3-byte LE length)."""

    def __init__(self) -> None:
        self._buffer = bytearray()

    def decompress(self, data: bytes) -> bytes:
        self._buffer += data
        buffer = self._buffer
        offset = 0
        chunks: list[bytes] = []
        while len(buffer) - offset >= 4:
            chunk_type = buffer[offset]
            length = int.from_bytes(buffer[offset + 1 : offset + 4], "little")
            if length > _SNAPPY_MAX_ENCODED_CHUNK:
                raise DecompressionError(f"snappy chunk of {length} bytes")
            if len(buffer) - offset - 4 < length:
                break
            if chunk_type in (0x00, 0x01):
                chunks.append(bytes(buffer[offset : offset + 4 + length]))
            elif chunk_type == 0xFF:
                if bytes(buffer[offset : offset + 4 + length]) != SNAPPY_STREAM_IDENTIFIER:
                    raise DecompressionError("bad snappy stream identifier")
            elif chunk_type < 0x80:
                raise DecompressionError(f"reserved unskippable snappy chunk type {chunk_type:#x}")
            offset += 4 + length
        del buffer[:offset]
        if not chunks:
            return b""
        try:
            # cramjam checks each chunk's masked CRC-32C.
            return bytes(cramjam.snappy.decompress(SNAPPY_STREAM_IDENTIFIER + b"".join(chunks)))
        except Exception as exc:  # cramjam raises its own DecompressionError type
            raise DecompressionError(str(exc)) from exc
