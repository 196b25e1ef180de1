"""Free loopback ports for the servers a bench, a runner or a test starts."""

from __future__ import annotations

import contextlib
import random
import socket
from pathlib import Path

_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
# Linux's default start of the ephemeral range, where the system does not say.
DEFAULT_EPHEMERAL_START = 32_768
# The lowest port `restartable_ports` picks: above the ports services commonly listen on.
LOWEST_RESTARTABLE = 10_000
# Every port `restartable_ports` gave in this process: a server not started yet leaves its ports
# free, and another one must not be given them.
_handed_out: set[int] = set()


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


def restartable_ports(count: int) -> list[int]:
    """`count` different free ports below the system's ephemeral range, for a server that stops and
    starts again on the same address.

    A port the system chooses lies in that range, which it also hands to every outgoing connection
    and every other bind to 0 on the machine: while the server is down, a client's connection may be
    given its port, and the server coming back cannot listen ("address already in use"). A port
    below the range is never handed out that way. None is given twice in one process.
    """
    try:
        start = int(_EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        start = DEFAULT_EPHEMERAL_START
    candidates = list(range(LOWEST_RESTARTABLE, max(start, LOWEST_RESTARTABLE + count)))
    random.shuffle(candidates)
    with contextlib.ExitStack() as sockets:
        ports: list[int] = []
        for port in candidates:
            if port in _handed_out:
                continue
            sock = sockets.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            ports.append(port)
            if len(ports) == count:
                _handed_out.update(ports)
                return ports
    raise RuntimeError(f"fewer than {count} free ports between {LOWEST_RESTARTABLE} and {start}")


def restartable_port() -> int:
    """A port for a server that comes back on it (see restartable_ports)."""
    return restartable_ports(1)[0]
