"""Who holds a TCP port a listener could not bind: a listening socket (another server), or only connections —
an outgoing connection of some program given the port as its ephemeral local port (Linux hands those out
from `net.ipv4.ip_local_port_range`, 32768-60999 by default, where eMQP's ports 47290-47299 lie).

Read from /proc/net/tcp and /proc/net/tcp6 (Linux); elsewhere nothing is known."""

from __future__ import annotations

import enum
from pathlib import Path
from typing import Final

# /proc/net/tcp's state column: 0A is LISTEN (the kernel's TCP_LISTEN).
_LISTEN: Final = "0A"
TABLES: Final = (Path("/proc/net/tcp"), Path("/proc/net/tcp6"))


class Holder(enum.Enum):
    LISTENER = "listener"
    CONNECTION = "connection"
    UNKNOWN = "unknown"


def holder_of(port: int, tables: tuple[Path, ...] = TABLES) -> Holder:
    """What holds local TCP port `port` on this machine, whatever the address."""
    found_connection = False
    for table in tables:
        try:
            lines = table.read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) < 4 or ":" not in fields[1]:
                continue
            try:
                local_port = int(fields[1].rsplit(":", 1)[1], 16)
            except ValueError:
                continue
            if local_port != port:
                continue
            if fields[3] == _LISTEN:
                return Holder.LISTENER
            found_connection = True
    return Holder.CONNECTION if found_connection else Holder.UNKNOWN


def in_use_hint(port: int, flag: str, name: str) -> str:
    """What to do about a port in use, by what holds it."""
    if holder_of(port) is Holder.CONNECTION:
        return (f"no server listens there: a connection holds it (an outgoing connection given it as its "
                f"ephemeral port); reserve polymq's ports with the sysctl net.ipv4.ip_local_reserved_ports "
                f"(docs/operations.md), or choose another port with {flag}")
    return f"stop the process using it, or choose another port with {flag} (-1 turns {name} off)"
