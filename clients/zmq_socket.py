"""Blocking ZeroMQ plumbing of the clients: a connected socket, multipart messages at the cost of
their frames only, one receive within a deadline.

A load generator on the gateway's machine takes its CPU from the broker it measures, so a message
costs a call, not a call per frame: the frame loops in C (`native/zmq_loops.py`) where they are
built, as the gateway's pump uses them, else Python loops with plain int flags and `Frame.more`
(pyzmq's send_multipart/recv_multipart pay an enum operation per frame).
"""

from __future__ import annotations

import contextlib
import errno
import time
from collections.abc import Iterator, Sequence
from typing import Any

import zmq

from polymq.native import zmq_loops

NOBLOCK = int(zmq.NOBLOCK)
_SNDMORE = int(zmq.SNDMORE)
# The most messages one `waiting` call takes off a socket: a flood still leaves room for the
# caller's own sends between reads.
WAITING_LIMIT = 1000


def endpoint(address: str) -> str:
    """The ZeroMQ endpoint of `HOST:PORT` (TCP), or `address` itself when it names its transport
    (`ipc:///tmp/pzq-monitor`, PZQ's default monitor)."""
    return address if "://" in address else f"tcp://{address}"


def open_socket(context: zmq.Context, kind: int, address: str, *, timeout: float | None = None,
                identity: bytes | None = None, linger_ms: int = 0) -> zmq.Socket:
    """A socket of `kind` connected to `HOST:PORT` or an endpoint (`endpoint`); with `timeout`, a
    blocking send or receive gives up after that long (zmq.Again)."""
    sock = context.socket(kind)
    sock.setsockopt(zmq.LINGER, linger_ms)
    if identity is not None:
        sock.setsockopt(zmq.IDENTITY, identity)
    if timeout is not None:
        sock.setsockopt(zmq.RCVTIMEO, int(timeout * 1000))
        sock.setsockopt(zmq.SNDTIMEO, int(timeout * 1000))
    sock.connect(endpoint(address))
    return sock


@contextlib.contextmanager
def own_socket(kind: int, address: str, **options: Any) -> Iterator[zmq.Socket]:
    """A socket (`open_socket`'s options) in a context of its own, for a process that has no other
    ZeroMQ use; on leaving, the socket is closed (it gets its linger) and the context ended."""
    with zmq.Context() as context:
        sock = open_socket(context, kind, address, **options)
        try:
            yield sock
        finally:
            sock.close()


def send(sock: zmq.Socket, frames: Sequence[bytes]) -> None:
    """Send a multipart message (blocking, as send_multipart: zmq.Again once SNDTIMEO passed)."""
    loops = zmq_loops.native_loops(sock)
    if loops is not None:
        outcome = loops[1](sock, sock.underlying, frames)
        if outcome == zmq_loops.SENT:
            return
        if outcome == zmq_loops.UNROUTABLE:
            raise zmq.ZMQError(errno.EHOSTUNREACH)  # what pyzmq's send says
        # not taken without waiting: the blocking loop below waits for room
    last = len(frames) - 1
    sock.send(frames[0], _SNDMORE if last else 0)
    try:
        for index in range(1, last + 1):
            sock.send(frames[index], _SNDMORE if index < last else 0)
    except TypeError:
        # A frame that is not a buffer: end the message libzmq holds open, or the next message
        # sent would complete this one.
        sock.send(b"")
        raise


def receive(sock: zmq.Socket, flags: int = 0) -> list[bytes]:
    """Receive a multipart message; with NOBLOCK, zmq.Again when none waits."""
    frame = sock.recv(flags, copy=False)
    frames = [frame.bytes]
    while frame.more:
        frame = sock.recv(0, copy=False)
        frames.append(frame.bytes)
    return frames


def waiting(sock: zmq.Socket) -> list[list[bytes]]:
    """The messages waiting on the socket, at most `WAITING_LIMIT`, without waiting."""
    loops = zmq_loops.native_loops(sock)
    if loops is not None:
        return loops[0](sock, sock.underlying, WAITING_LIMIT)
    messages: list[list[bytes]] = []
    while len(messages) < WAITING_LIMIT:
        try:
            messages.append(receive(sock, NOBLOCK))
        except zmq.Again:
            break
    return messages


def receive_before(sock: zmq.Socket, deadline: float) -> list[bytes] | None:
    """The next message, or None when the deadline (time.monotonic) passed first."""
    remaining_ms = int((deadline - time.monotonic()) * 1000)
    if remaining_ms < 0 or not sock.poll(remaining_ms, zmq.POLLIN):
        return None
    return receive(sock)
