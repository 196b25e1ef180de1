"""PZQ for integration tests: the blocking clients of its three sockets (`polymq.clients.pzq_blocking`),
with timeouts in milliseconds, as ZeroMQ counts them."""

from __future__ import annotations

import zmq

from polymq.clients import pzq_blocking

DEFAULT_TIMEOUT_MS = 3000


def endpoint(address: str) -> str:
    return f"tcp://{address}"


class _Milliseconds(pzq_blocking.Peer):
    def __init__(self, context: zmq.Context, address: str, timeout_ms: int = DEFAULT_TIMEOUT_MS) -> None:
        super().__init__(context, address, timeout_ms / 1000)

    def nothing_within(self, ms: int) -> bool:
        return self.quiet(ms / 1000)


class Producer(_Milliseconds, pzq_blocking.Producer):
    pass


class Consumer(_Milliseconds, pzq_blocking.Consumer):
    pass


class Monitor(_Milliseconds, pzq_blocking.Monitor):
    pass
