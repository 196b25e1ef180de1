"""A blocking NSQ V2 client that speaks exact bytes: commands are the codec's
(`polymq.codecs.nsq_client`), frames come back one at a time within a deadline.

It parses one frame per call and never one past it, so the bytes that follow an upgrade point
(the TLS handshake, the first compressed frame after IDENTIFY's reply) stay in the buffer and are
switched over as they should. Heartbeats are counted, and skipped unless asked for.

    with Connection("127.0.0.1:4150") as conn:
        conn.send(nsq_client.pub("topic", b"hello"))
        frame = conn.next_frame()            # None when nothing came within the timeout
"""

from __future__ import annotations

import socket
import ssl

from polymq.clients import tcp
from polymq.codecs import nsq_client
from polymq.codecs.compression import (
    DeflateCompressor,
    DeflateDecompressor,
    SnappyCompressor,
    SnappyDecompressor,
)
from polymq.codecs.nsq import HEARTBEAT, OK

DEFAULT_TIMEOUT_S = 3.0
# nsqd's --max-deflate-level: the level a client asks for by default.
DEFAULT_DEFLATE_LEVEL = 6
# What one read's compressed bytes may expand to: deflate's best ratio is about 1032:1, and a
# read takes at most tcp.RECV_BYTES.
MAX_INFLATED_BYTES = 1032 * tcp.RECV_BYTES


class ErrorFrame(Exception):
    """The server answered with an error frame (its text is the message's end)."""


class Connection(tcp.Connection):
    def __init__(self, address: tuple[str, int] | str, timeout: float = DEFAULT_TIMEOUT_S, *,
                 magic: bool = True) -> None:
        super().__init__(address, timeout)
        self.sock: socket.socket | ssl.SSLSocket
        self._raw = bytearray()  # received, not yet decompressed or framed
        self._plain = bytearray()  # decompressed, not yet framed (compression on)
        self._compressor: DeflateCompressor | SnappyCompressor | None = None
        self._decompressor: DeflateDecompressor | SnappyDecompressor | None = None
        self.compressed_received = bytearray()  # every compressed byte received, for byte-level checks
        self.heartbeats = 0
        if magic:
            self.send(nsq_client.magic())

    def send(self, data: bytes) -> None:
        super().send(data if self._compressor is None else self._compressor.compress(data))

    def _read(self, deadline: float) -> bool:
        """One read into the buffers; False when the deadline passed first. Raises tcp.Closed and
        the decompressor's DecompressionError."""
        data = self.receive(deadline)
        if data is None:
            return False
        if self._decompressor is not None:
            self.compressed_received += data
            self._plain += self._decompressor.decompress(data)
        else:
            self._raw += data
        return True

    def next_frame(self, timeout: float | None = None, *, heartbeats: bool = False) -> nsq_client.Frame | None:
        """The next frame within `timeout` (the connection's when not given), or None. Nothing is taken
        from the buffer until the whole frame is there, so a timeout leaves the stream intact.
        Raises tcp.Closed, nsq_client.FrameError."""
        deadline = self.deadline(timeout)
        while True:
            buffer = self._plain if self._decompressor is not None else self._raw
            found = nsq_client.frame_at(buffer)
            if found is None:
                if not self._read(deadline):
                    return None
                continue
            frame, end = found
            del buffer[:end]
            if frame.is_response and frame.data == HEARTBEAT:
                self.heartbeats += 1
                if not heartbeats:
                    continue
            return frame

    def wait_for_ok(self, what: str) -> None:
        """Read up to a plain `OK`, answering heartbeats: one step of a handshake (IDENTIFY without
        feature negotiation, SUB). Raises ErrorFrame, TimeoutError, tcp.Closed, nsq_client.FrameError."""
        while True:
            frame = self.next_frame(heartbeats=True)
            if frame is None:
                raise TimeoutError(f"no answer to {what} within {self.timeout} s")
            if frame.is_error:
                raise ErrorFrame(f"{what}: {frame.data.decode(errors='replace')}")
            if frame.is_response and frame.data == OK:
                return
            if not (frame.is_response and frame.data == HEARTBEAT):
                raise nsq_client.FrameError(f"{what}: unexpected frame {frame!r}")
            self.send(nsq_client.nop())

    def detach(self) -> tuple[socket.socket | ssl.SSLSocket, bytes]:
        """The socket and the bytes read past the last frame taken, for a caller that reads on its
        own from here (a benchmark's hot loop); this connection must not be used again."""
        rest = bytes(self._raw)
        self._raw.clear()
        return self.sock, rest

    def read_until_closed(self, timeout: float | None = None) -> tuple[bytes, bool]:
        """The raw bytes not yet framed, read until the server closes (True) or `timeout` passes (False)."""
        deadline = self.deadline(timeout)
        try:
            while self._read(deadline):
                pass
        except tcp.Closed:
            return bytes(self._raw), True
        return bytes(self._raw), False

    def start_tls(self, context: ssl.SSLContext, server_hostname: str = "localhost") -> None:
        """The TLS handshake, right after IDENTIFY's reply (nothing after it may be buffered)."""
        if self._raw:
            raise nsq_client.FrameError(f"plain bytes after the IDENTIFY reply: {bytes(self._raw)!r}")
        self.sock.settimeout(self.timeout)
        self.sock = context.wrap_socket(self.sock, server_hostname=server_hostname)

    def start_compression(self, kind: str, level: int = DEFAULT_DEFLATE_LEVEL) -> None:
        """Both directions in `kind` ("deflate" or "snappy") from here; what was read past IDENTIFY's
        reply is decompressed too."""
        if kind == "deflate":
            self._compressor = DeflateCompressor(level)
            self._decompressor = DeflateDecompressor(MAX_INFLATED_BYTES)
        else:
            self._compressor = SnappyCompressor()
            self._decompressor = SnappyDecompressor()
        leftover = bytes(self._raw)
        self._raw.clear()
        if leftover:
            self.compressed_received += leftover
            self._plain += self._decompressor.decompress(leftover)
