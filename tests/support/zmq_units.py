"""The ZeroMQ sockets of a protocol unit, for tests that run its server in their own process."""

from __future__ import annotations

import attrs

from polymq.adapters.emqp import PROTOCOL as EMQP
from polymq.adapters.protocol import Protocol
from polymq.adapters.pzq import PROTOCOL as PZQ
from polymq.adapters.zmq_sockets import SocketSpec


def _specs(unit: Protocol, ports: dict[str, int], max_message: int) -> dict[str, SocketSpec]:
    """The unit's ZeroMQ sockets named in `ports`, their messages bounded at `max_message`."""
    return unit.socket_specs(attrs.evolve(unit.defaults(), max_message=max_message), ports)


def pzq_specs(ports: dict[str, int], max_message: int) -> dict[str, SocketSpec]:
    return _specs(PZQ, ports, max_message)


def emqp_specs(ports: dict[str, int], max_message: int, *_: str) -> dict[str, SocketSpec]:
    """eMQP's broker and pub/sub sockets (the admin socket's own address is the bind's in tests)."""
    return _specs(EMQP, ports, max_message)
