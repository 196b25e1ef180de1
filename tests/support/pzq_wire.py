"""Blocking pyzmq clients of PZQ's three sockets for integration tests, as the reference PHP client
uses them: a DEALER producer, a ROUTER consumer, a REQ monitor; every receive has a deadline."""

from __future__ import annotations

import itertools

import zmq

from polymq.codecs import pzq

DEFAULT_TIMEOUT_MS = 3000
_ids = itertools.count()


def endpoint(address: str) -> str:
    return f"tcp://{address}"


class PZQClient:
    def __init__(self, context: zmq.Context, kind: int, address: str, timeout_ms: int = DEFAULT_TIMEOUT_MS) -> None:
        self.sock = context.socket(kind)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RCVTIMEO, timeout_ms)
        self.sock.setsockopt(zmq.SNDTIMEO, timeout_ms)
        self.sock.connect(endpoint(address))

    def close(self) -> None:
        self.sock.close(linger=0)

    def __enter__(self) -> PZQClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Producer(PZQClient):
    def __init__(self, context: zmq.Context, address: str, timeout_ms: int = DEFAULT_TIMEOUT_MS) -> None:
        super().__init__(context, zmq.DEALER, address, timeout_ms)

    def produce(self, *bodies: bytes, producer_id: bytes | None = None) -> list[bytes]:
        """Send one message and wait for its answer: `[id, status, '', reason?]`."""
        producer_id = producer_id if producer_id is not None else b"p%d" % next(_ids)
        self.sock.send_multipart([producer_id, pzq.DELIMITER, *bodies])
        return self.sock.recv_multipart()


class Consumer(PZQClient):
    def __init__(self, context: zmq.Context, address: str, timeout_ms: int = DEFAULT_TIMEOUT_MS) -> None:
        super().__init__(context, zmq.ROUTER, address, timeout_ms)

    def receive(self) -> list[bytes]:
        """`[pzq_peer, key, sent_us, timeout_us, '', body…]`."""
        return self.sock.recv_multipart()

    def ack(self, delivery: list[bytes], status: bytes = pzq.ACK_OK) -> None:
        self.sock.send_multipart([delivery[0], delivery[1], status])

    def nothing_within(self, ms: int) -> bool:
        return not self.sock.poll(ms, zmq.POLLIN)


class Monitor(PZQClient):
    def __init__(self, context: zmq.Context, address: str, timeout_ms: int = DEFAULT_TIMEOUT_MS) -> None:
        super().__init__(context, zmq.REQ, address, timeout_ms)

    def stats(self) -> dict[str, int]:
        self.sock.send(pzq.MONITOR)
        return pzq.parse_monitor_text(self.sock.recv())
