"""Free loopback ports for the servers a bench, a runner or a test starts."""

from __future__ import annotations

import contextlib
import socket


def free_ports(count: int) -> list[int]:
    """`count` different ports nothing listens on now, chosen by the system on 127.0.0.1.

    Every socket stays bound until all are chosen, so the ports differ from one another; they are
    closed before returning, for the server to bind.
    """
    with contextlib.ExitStack() as sockets:
        ports = []
        for _ in range(count):
            sock = sockets.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            sock.bind(("127.0.0.1", 0))
            ports.append(int(sock.getsockname()[1]))
        return ports


def free_port() -> int:
    """A port nothing listens on now (see free_ports)."""
    return free_ports(1)[0]
