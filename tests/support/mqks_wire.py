"""A blocking raw MQKS client for integration tests: exact lines, explicit deadlines.

`barrier()` is the "nothing more came" test: it sends a ping with a fresh id and returns every
line that arrived before its pong, so a test never sleeps to prove an absence.
"""

from __future__ import annotations

import itertools
import socket
import time

from polymq.codecs.mqks_client import Delivery, LineReader, parse_delivery, parse_response

DEFAULT_TIMEOUT = 3.0
_ping_ids = itertools.count()


class Closed(Exception):
    """The server closed the connection."""


class MQKSWire:
    def __init__(self, host_port: tuple[str, int], timeout: float = DEFAULT_TIMEOUT) -> None:
        self.sock = socket.create_connection(host_port, timeout=timeout)
        self.timeout = timeout
        self._reader = LineReader()
        self._lines: list[bytes] = []

    def send(self, data: bytes) -> None:
        self.sock.sendall(data if data.endswith(b"\n") else data + b"\n")

    def line(self, timeout: float | None = None) -> bytes:
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        while not self._lines:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError("no line from the server")
            self.sock.settimeout(remaining)
            data = self.sock.recv(65536)
            if not data:
                raise Closed
            self._lines.extend(self._reader.feed(data))
        return self._lines.pop(0)

    def lines(self, count: int) -> list[bytes]:
        return [self.line() for _ in range(count)]

    def barrier(self) -> list[bytes]:
        """Lines received before the pong of a fresh ping."""
        ping_id = f"barrier{next(_ping_ids)}"
        self.send(f"{ping_id} ping sync".encode())
        pong = f"{ping_id} ok sync".encode()
        before = []
        while (line := self.line()) != pong:
            before.append(line)
        return before

    def deliveries(self, count: int) -> list[Delivery]:
        return [parse_delivery(parse_response(self.line()).data) for _ in range(count)]

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> MQKSWire:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
