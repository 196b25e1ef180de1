"""A blocking raw NSQ V2 client for integration tests: exact bytes, explicit timeouts.

Built on the client codec (`polymq.codecs.nsq_client`) and the stream compression classes.
It reads frame by frame (never past the frame asked for is *parsed*), so the bytes that follow an
upgrade point (TLS handshake, compressed `OK`) stay in the buffer and are switched over correctly.
Every read has a deadline: a test never hangs, it fails with `TimeoutError`.
"""

from __future__ import annotations

import contextlib
import json
import socket
import ssl
import struct
import time
from typing import Any

from polymq.codecs import nsq_client as client
from polymq.codecs.compression import (
    DeflateCompressor,
    DeflateDecompressor,
    SnappyCompressor,
    SnappyDecompressor,
)

DEFAULT_TIMEOUT = 3.0
OK_FRAME = b"\x00\x00\x00\x06\x00\x00\x00\x00OK"
HEARTBEAT = b"_heartbeat_"

_SIZE = struct.Struct(">i")


class Closed(Exception):
    """The server closed the connection."""


def split_address(address: str) -> tuple[str, int]:
    host, port = address.rsplit(":", 1)
    return host, int(port)


class RawClient:
    def __init__(self, address: str, *, magic: bool = True, timeout: float = DEFAULT_TIMEOUT) -> None:
        self.sock: socket.socket | ssl.SSLSocket = socket.create_connection(split_address(address), timeout=timeout)
        self.timeout = timeout
        self._raw = bytearray()  # bytes read from the transport, not yet decompressed / parsed
        self._plain = bytearray()  # decompressed bytes, not yet parsed (compression on)
        self._compressor: DeflateCompressor | SnappyCompressor | None = None
        self._decompressor: DeflateDecompressor | SnappyDecompressor | None = None
        self.compressed_received = bytearray()  # raw compressed bytes seen, for byte-level checks
        self.heartbeats = 0
        if magic:
            self.send(client.magic())

    # -- output ------------------------------------------------------------------------------

    def send(self, data: bytes) -> None:
        if self._compressor is not None:
            data = self._compressor.compress(data)
        self.sock.sendall(data)

    # -- input -------------------------------------------------------------------------------

    def _recv(self, deadline: float) -> None:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError("no complete frame before the deadline")
        self.sock.settimeout(remaining)
        try:
            data = self.sock.recv(65536)
        except TimeoutError as exc:
            raise TimeoutError("no complete frame before the deadline") from exc
        except (ConnectionResetError, BrokenPipeError) as exc:
            raise Closed(str(exc)) from exc
        if not data:
            raise Closed("server closed the connection")
        if self._decompressor is not None:
            self.compressed_received += data
            self._plain += self._decompressor.decompress(data)
        else:
            self._raw += data

    def _buffer(self) -> bytearray:
        return self._plain if self._decompressor is not None else self._raw

    def _fill(self, n: int, deadline: float) -> None:
        while len(self._buffer()) < n:
            self._recv(deadline)

    def _read_exact(self, n: int, deadline: float) -> bytes:
        self._fill(n, deadline)
        buffer = self._buffer()
        data = bytes(buffer[:n])
        del buffer[:n]
        return data

    def read_frame(self, timeout: float | None = None, *, skip_heartbeats: bool = True) -> client.Frame:
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        while True:
            # Nothing is taken from the buffer until the whole frame is there, so a timeout
            # leaves the stream intact for the next read.
            self._fill(4, deadline)
            size = _SIZE.unpack_from(self._buffer())[0]
            assert 4 <= size <= client.MAX_FRAME_SIZE, f"bad frame size {size}"
            self._fill(4 + size, deadline)
            payload = self._read_exact(4 + size, deadline)[4:]
            frame = client.Frame(_SIZE.unpack_from(payload)[0], payload[4:])
            if frame.is_response and frame.data == HEARTBEAT:
                self.heartbeats += 1
                if skip_heartbeats:
                    continue
            return frame

    def expect_response(self, data: bytes = b"OK", timeout: float | None = None) -> None:
        frame = self.read_frame(timeout)
        assert (frame.frame_type, frame.data) == (0, data), frame

    def expect_error(self, text: bytes, timeout: float | None = None) -> None:
        frame = self.read_frame(timeout)
        assert (frame.frame_type, frame.data) == (1, text), frame

    def read_message(self, timeout: float | None = None) -> client.Message:
        frame = self.read_frame(timeout)
        assert frame.is_message, frame
        return client.decode_message(frame.data)

    def expect_nothing(self, seconds: float) -> None:
        """No frame but heartbeats for `seconds` (the connection may stay open)."""
        try:
            frame = self.read_frame(seconds)
        except TimeoutError:
            return
        raise AssertionError(f"unexpected frame {frame}")

    def expect_closed(self, timeout: float | None = None) -> None:
        """Nothing but heartbeats until the server closes the connection."""
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        try:
            while True:
                frame = self.read_frame(max(0.01, deadline - time.monotonic()))
                raise AssertionError(f"expected the connection to close, got {frame}")
        except Closed:
            return

    # -- handshakes --------------------------------------------------------------------------

    def identify(self, **fields: Any) -> dict[str, Any]:
        """IDENTIFY with feature negotiation; returns the JSON reply (upgrades are up to the caller)."""
        self.send(client.identify({"feature_negotiation": True, **fields}))
        frame = self.read_frame()
        assert frame.is_response, frame
        return json.loads(frame.data)

    def start_tls(self, context: ssl.SSLContext, server_hostname: str = "localhost") -> None:
        """Handshake right after the IDENTIFY reply, then read the `OK` sent inside TLS."""
        assert not self._raw, f"plain bytes after the IDENTIFY reply: {bytes(self._raw)!r}"
        self.sock.settimeout(self.timeout)
        self.sock = context.wrap_socket(self.sock, server_hostname=server_hostname)
        self.expect_response(b"OK")

    def start_compression(self, kind: str, level: int = 6) -> None:
        """Switch both directions to `kind` ("deflate" or "snappy") and read the compressed `OK`."""
        leftover = bytes(self._raw)
        self._raw.clear()
        if kind == "deflate":
            self._compressor = DeflateCompressor(level)
            self._decompressor = DeflateDecompressor(64 * 1024 * 1024)
        else:
            self._compressor = SnappyCompressor()
            self._decompressor = SnappyDecompressor()
        if leftover:
            self.compressed_received += leftover
            self._plain += self._decompressor.decompress(leftover)
        self.expect_response(b"OK")

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()

    def __enter__(self) -> RawClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def publisher(address: str, **kwargs: Any) -> RawClient:
    return RawClient(address, **kwargs)


def consumer(address: str, topic: str, channel: str, rdy: int | None = None, **identify: Any) -> RawClient:
    """A connected, subscribed client (IDENTIFY first when fields are given); RDY if asked."""
    conn = RawClient(address)
    if identify:
        conn.identify(**identify)
    conn.send(client.sub(topic, channel))
    conn.expect_response(b"OK")
    if rdy is not None:
        conn.send(client.rdy(rdy))
    return conn


def publish(address: str, topic: str, bodies: list[bytes]) -> None:
    with RawClient(address) as conn:
        for body in bodies:
            conn.send(client.pub(topic, body))
            conn.expect_response(b"OK")
