"""Blocking PZQ clients of the three sockets, as the reference PHP client uses them: a DEALER
producer, a ROUTER consumer, a REQ monitor. Frames are the codec's (`polymq.codecs.pzq`); every
receive has a deadline. The trio clients are `polymq.clients.pzq`.

    with Producer(context, "127.0.0.1:11131") as producer:
        answer = producer.produce(b"hello")          # [id, b"1", b""] once stored
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from typing import ClassVar, Self

import zmq

from polymq.clients import zmq_socket
from polymq.codecs import pzq

DEFAULT_TIMEOUT_S = 3.0
_ids = itertools.count()


class Peer:
    """One socket of a PZQ client."""

    kind: ClassVar[int]

    def __init__(self, context: zmq.Context, address: str, timeout: float = DEFAULT_TIMEOUT_S) -> None:
        self.sock = zmq_socket.open_socket(context, self.kind, address, timeout=timeout)
        self.timeout = timeout

    def send(self, frames: Sequence[bytes]) -> None:
        zmq_socket.send(self.sock, frames)

    def receive(self, timeout: float | None = None) -> list[bytes]:
        """The next message; TimeoutError when none comes within `timeout` (the peer's when not given)."""
        wait = self.timeout if timeout is None else timeout
        frames = zmq_socket.receive_before(self.sock, time.monotonic() + wait)
        if frames is None:
            raise TimeoutError(f"nothing within {wait} s")
        return frames

    def quiet(self, seconds: float) -> bool:
        """True when no message comes within `seconds` (one that came stays to be received)."""
        return not self.sock.poll(int(seconds * 1000), zmq.POLLIN)

    def close(self) -> None:
        self.sock.close(linger=0)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Producer(Peer):
    kind = zmq.DEALER

    def produce(self, *bodies: bytes, producer_id: bytes | None = None) -> list[bytes]:
        """Send one message and wait for its answer: `[id, status, '', reason?]`."""
        producer_id = producer_id if producer_id is not None else b"p%d" % next(_ids)
        self.send([producer_id, pzq.DELIMITER, *bodies])
        return self.receive()


class Consumer(Peer):
    kind = zmq.ROUTER

    def ack(self, delivery: list[bytes], status: bytes = pzq.ACK_OK) -> None:
        """Answer a delivery (`[pzq_peer, key, sent_us, timeout_us, '', body…]` as received)."""
        self.send([delivery[0], delivery[1], status])


class Monitor(Peer):
    kind = zmq.REQ

    def stats(self) -> dict[str, int]:
        """The server's monitor values, by key (ValueError for text that is not `key: value` lines)."""
        self.send([pzq.MONITOR])
        return pzq.parse_monitor_text(self.receive()[-1])
