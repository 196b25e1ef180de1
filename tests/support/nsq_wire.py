"""NSQ V2 for integration tests: the blocking client (`polymq.clients.nsq`) with assertions.

Every read has a deadline: a test never hangs, it fails with `TimeoutError`.
"""

from __future__ import annotations

import json
import socket
import ssl
import time
from typing import Any

from polymq.clients.nsq import DEFAULT_TIMEOUT_S as DEFAULT_TIMEOUT
from polymq.clients.nsq import Connection
from polymq.clients.tcp import Closed, split_address
from polymq.codecs import nsq_client as client
from polymq.codecs.nsq import HEARTBEAT

OK_FRAME = b"\x00\x00\x00\x06\x00\x00\x00\x00OK"

__all__ = ["DEFAULT_TIMEOUT", "HEARTBEAT", "OK_FRAME", "Closed", "RawClient", "consumer", "holding", "publish",
           "publisher", "split_address", "subscribed_socket"]


class RawClient(Connection):
    def read_frame(self, timeout: float | None = None, *, skip_heartbeats: bool = True) -> client.Frame:
        frame = self.next_frame(timeout, heartbeats=not skip_heartbeats)
        if frame is None:
            raise TimeoutError("no complete frame before the deadline")
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
        frame = self.next_frame(seconds)
        assert frame is None, f"unexpected frame {frame}"

    def expect_closed(self, timeout: float | None = None) -> None:
        """Nothing but heartbeats until the server closes the connection."""
        deadline = self.deadline(timeout)
        try:
            while True:
                frame = self.read_frame(max(0.01, deadline - time.monotonic()))
                raise AssertionError(f"expected the connection to close, got {frame}")
        except Closed:
            return

    def identify(self, **fields: Any) -> dict[str, Any]:
        """IDENTIFY with feature negotiation; returns the JSON reply (upgrades are up to the caller)."""
        self.send(client.identify({"feature_negotiation": True, **fields}))
        frame = self.read_frame()
        assert frame.is_response, frame
        return json.loads(frame.data)

    def start_tls(self, context: ssl.SSLContext, server_hostname: str = "localhost") -> None:
        """Handshake right after the IDENTIFY reply, then read the `OK` sent inside TLS."""
        super().start_tls(context, server_hostname)
        self.expect_response(b"OK")

    def start_compression(self, kind: str, level: int = 6) -> None:
        """Switch both directions to `kind` ("deflate" or "snappy") and read the compressed `OK`."""
        super().start_compression(kind, level)
        self.expect_response(b"OK")


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


def holding(address: str, topic: str, channel: str, count: int, timeout: float = DEFAULT_TIMEOUT) -> RawClient:
    """A consumer of the channel holding `count` deliveries, unfinished (RDY `count`)."""
    conn = consumer(address, topic, channel, rdy=count)
    for _ in range(count):
        conn.read_message(timeout)
    return conn


def publish(address: str, topic: str, bodies: list[bytes]) -> None:
    with RawClient(address) as conn:
        for body in bodies:
            conn.send(client.pub(topic, body))
            conn.expect_response(b"OK")


def subscribed_socket(address: tuple[str, int], topic: str, channel: str) -> socket.socket:
    """A plain socket subscribed to `topic`/`channel` (RDY 0: it holds the channel's consumer only)."""
    sock = socket.create_connection(address, timeout=10)
    sock.sendall(client.magic() + client.sub(topic, channel))
    reader = client.FrameReader()
    while not (frames := reader.frames()):
        reader.receive_data(sock.recv(65536))
    assert frames[0].data == b"OK"
    return sock
