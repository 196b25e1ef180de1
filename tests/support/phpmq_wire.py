"""A blocking raw PHPMQ client for integration tests: exact frames, explicit deadlines.

PHPMQ never answers, so "the gateway has handled what this connection sent" is proven with
`barrier`: the connection sends a message to a fresh queue that a watcher connection consumes;
once the watcher has it, everything sent before it was handled (a connection is read in order).
"""

from __future__ import annotations

import json
import socket
import time
import urllib.request
import uuid
from typing import Any

from polymq.codecs import phpmq

DEFAULT_TIMEOUT = 3.0


class Closed(Exception):
    """The server closed the connection."""


class PHPMQWire:
    def __init__(self, host_port: tuple[str, int], timeout: float = DEFAULT_TIMEOUT) -> None:
        self.host_port = host_port
        self.sock = socket.create_connection(host_port, timeout=timeout)
        self.timeout = timeout
        self.raw = bytearray()  # every byte received, for exact-bytes assertions
        self._codec = phpmq.ClientConnection()
        self._deliveries: list[phpmq.Delivery] = []

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def publish(self, queue: str, content: bytes, ttl: int | None = None) -> None:
        self.send(phpmq.send(queue.encode(), content, ttl))

    def consume(self, queue: str, count: int) -> None:
        self.send(phpmq.consume(queue.encode(), count))

    def ack(self, queue: str, message_id: bytes) -> None:
        self.send(phpmq.ack(queue.encode(), message_id))

    def requeue(self, queue: str, message_id: bytes, ttl: int) -> None:
        self.send(phpmq.requeue(queue.encode(), message_id, ttl))

    def dead_letter(self, queue: str, message_id: bytes) -> None:
        self.send(phpmq.dead_letter(queue.encode(), message_id))

    def _receive(self, deadline: float) -> bytes:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError("nothing more from the server")
        self.sock.settimeout(remaining)
        data = self.sock.recv(65536)
        if not data:
            raise Closed
        self.raw += data
        return data

    def deliveries(self, count: int, timeout: float | None = None) -> list[phpmq.Delivery]:
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        while len(self._deliveries) < count:
            self._codec.receive_data(self._receive(deadline))
            while True:
                event = self._codec.next_event()
                if event is phpmq.NEED_DATA:
                    break
                assert isinstance(event, phpmq.Delivery), event
                self._deliveries.append(event)
        taken, self._deliveries = self._deliveries[:count], self._deliveries[count:]
        return taken

    def nothing_more(self, wait: float = 0.2) -> bool:
        """True if no delivery arrives within `wait` (use after the gateway's state proved none is due)."""
        try:
            self.deliveries(1, timeout=wait)
        except TimeoutError:
            return True
        return False

    def closed_by_server(self, timeout: float | None = None) -> bool:
        """Waits for the server to close the connection; True if it did (by EOF or a reset)."""
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        try:
            while True:
                self._receive(deadline)
        except (Closed, ConnectionResetError):
            return True
        except TimeoutError:
            return False

    def barrier(self) -> None:
        """Returns once the gateway has handled everything this connection sent so far."""
        queue = f"barrier-{uuid.uuid4().hex}"
        with PHPMQWire(self.host_port, self.timeout) as watcher:
            watcher.consume(queue, 1)
            self.publish(queue, b"barrier")
            [delivery] = watcher.deliveries(1)
            watcher.ack(queue, delivery.message_id)

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> PHPMQWire:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def queue_stats(http: str, queue: str) -> dict[str, Any]:
    """The /stats entry of engine queue `queue` (a PHPMQ queue shows as a channel of its topic)."""
    with urllib.request.urlopen(f"http://{http}/stats?format=json", timeout=DEFAULT_TIMEOUT) as reply:
        stats = json.load(reply)
    for topic in stats["topics"]:
        for channel in topic["channels"]:
            if channel["channel_name"] in (queue, queue.partition("/")[2]) and (
                    topic["topic_name"] == queue or f"{topic['topic_name']}/{channel['channel_name']}" == queue):
                return channel
    raise KeyError(f"no queue {queue!r} in /stats")


def wait_until_handed_back(http: str, queue: str, timeout: float = DEFAULT_TIMEOUT) -> None:
    """PHPMQ never answers: after a consumer's disconnect, /stats shows when its messages are back."""
    deadline = time.monotonic() + timeout
    while queue_stats(http, queue)["in_flight_count"]:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{queue}: messages still in flight")
        time.sleep(0.01)
