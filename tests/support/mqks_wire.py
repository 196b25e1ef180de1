"""MQKS for integration tests: the blocking client (`polymq.clients.mqks_blocking`), lines in,
lines out, every read with a deadline. `barrier()` is the "nothing more came" test, so a test never
sleeps to prove an absence.
"""

from __future__ import annotations

from polymq.clients.mqks_blocking import DEFAULT_TIMEOUT_S as DEFAULT_TIMEOUT
from polymq.clients.mqks_blocking import Connection
from polymq.clients.tcp import Closed
from polymq.codecs.mqks_client import Delivery, parse_delivery, parse_response

__all__ = ["DEFAULT_TIMEOUT", "Closed", "MQKSWire"]


class MQKSWire(Connection):
    def send(self, data: bytes) -> None:
        super().send(data if data.endswith(b"\n") else data + b"\n")

    def line(self, timeout: float | None = None) -> bytes:
        line = self.next_line(timeout)
        if line is None:
            raise TimeoutError("no line from the server")
        return line

    def lines(self, count: int) -> list[bytes]:
        return [self.line() for _ in range(count)]

    def deliveries(self, count: int) -> list[Delivery]:
        return [parse_delivery(parse_response(self.line()).data) for _ in range(count)]
