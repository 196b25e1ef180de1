"""eMQP for integration tests: EventMQ's peers as the blocking clients (`polymq.clients.emqp`) make
them, with timeouts in milliseconds, as ZeroMQ counts them."""

from __future__ import annotations

import json

import zmq

from polymq.clients import emqp as emqp_client
from polymq.codecs import emqp

DEFAULT_TIMEOUT_MS = 3000


class Peer(emqp_client.Peer):
    """A DEALER with its own identity (a uuid4 text unless given bytes)."""

    def __init__(self, context: zmq.Context, address: str, identity: bytes | None = None,
                 timeout_ms: int = DEFAULT_TIMEOUT_MS) -> None:
        super().__init__(context, address, identity, timeout_ms / 1000)

    def receive(self, timeout: float | None = None, *, skip_heartbeats: bool = True) -> list[bytes]:
        return super().receive(timeout, heartbeats=not skip_heartbeats)

    def nothing_within(self, ms: int) -> bool:
        """True when no message but heartbeats comes within `ms`."""
        return self.next_message(ms / 1000) is None


class Worker(Peer, emqp_client.Worker):
    pass


class Client(Peer, emqp_client.Client):
    pass


def admin(context: zmq.Context, address: str, command: bytes) -> list[bytes]:
    return emqp_client.admin(context, address, command, DEFAULT_TIMEOUT_MS / 1000)


def admin_json(context: zmq.Context, address: str, command: bytes) -> dict[str, object]:
    frames = admin(context, address, command)
    assert frames[2] == emqp.REPLY, frames
    return json.loads(frames[4])
