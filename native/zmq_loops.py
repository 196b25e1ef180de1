"""ZeroMQ's frame loops in C (`native/zmq_frames.c`), when they can be used: the gateway's pump
and the clients' sockets (`clients/zmq_socket.py`) receive every waiting message in one call and
send a multipart message in one.

`make install` builds the C module with the compiled hot modules (tools/mypyc_build.py); it takes
libzmq's functions from the copy pyzmq loaded, found in the process's memory maps. The pure-Python
loops stay the reference: they run when the module is not built, when its source is newer than the
build, under `POLYMQ_PURE_PYTHON=1` (polymq/__init__.py), off Linux, or for a socket that is not a
plain `zmq.Socket` (a test's stand-in).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import zmq

import polymq

# receive(sock, handle, limit): every message waiting, at most `limit`, each a list of bytes.
Receive = Callable[[Any, int, int], list[list[bytes]]]
# send(sock, handle, frames): one of the outcomes below.
Send = Callable[[Any, int, Sequence[bytes]], int]
SENT, NOT_TAKEN, UNROUTABLE = 0, 1, 2

_SOURCE = Path(__file__).resolve().parent / "zmq_frames.c"
_MAPS = Path("/proc/self/maps")


def _libzmq_candidates() -> list[str]:
    """Where the libzmq pyzmq uses may be: a shared libzmq it loaded, else its own extension (a
    libzmq linked into it)."""
    found: list[str] = []
    with contextlib.suppress(OSError):
        for line in _MAPS.read_text().splitlines():
            path = line.split(maxsplit=5)[-1] if line.count(" ") >= 5 else ""
            if "libzmq" in Path(path).name and path not in found:
                found.append(path)
    from zmq.backend.cython import _zmq  # the backend pyzmq itself uses

    backend = getattr(_zmq, "__file__", None)
    if backend:
        found.append(backend)
    return found


def _load() -> tuple[Receive, Send] | None:
    if not polymq.COMPILED:
        return None  # the pure-Python sources were asked for (or nothing was built)
    try:
        from polymq.native import zmq_frames  # type: ignore[attr-defined]
    except ImportError:
        return None  # not built
    built = Path(zmq_frames.__file__)
    if _SOURCE.exists() and _SOURCE.stat().st_mtime > built.stat().st_mtime:
        return None  # edited since its build: the reference runs until the next `make install`
    if zmq.zmq_version_info()[0] < 4:
        return None  # its message layout is libzmq 4's
    for path in _libzmq_candidates():
        try:
            zmq_frames.load(path)
        except OSError:
            continue
        return zmq_frames.receive, zmq_frames.send
    return None


_FUNCTIONS = _load()


def native_loops(sock: object) -> tuple[Receive, Send] | None:
    """The C loops for this socket, or None where the pure-Python ones must run."""
    if _FUNCTIONS is None or type(sock) is not zmq.Socket:
        return None
    return _FUNCTIONS


def in_use() -> bool:
    """Whether the C loops are loaded (a plain socket uses them)."""
    return _FUNCTIONS is not None
