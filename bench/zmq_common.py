"""Multipart send and receive for the benchmarks' ZeroMQ peers, at the cost of the frames only.

pyzmq's send_multipart/recv_multipart pay an enum operation per frame (flags, RCVMORE); on a
2-core machine the load generator's own CPU is taken from the broker it measures, so its peers
use plain int flags and `Frame.more`, as the gateway's pump does.
"""

from __future__ import annotations

from collections.abc import Sequence

import zmq

NOBLOCK = int(zmq.NOBLOCK)
_SNDMORE = int(zmq.SNDMORE)


def send(sock: zmq.Socket, frames: Sequence[bytes]) -> None:
    """Send a multipart message (blocking, as send_multipart)."""
    last = len(frames) - 1
    for index, frame in enumerate(frames):
        sock.send(frame, _SNDMORE if index < last else 0)


def receive(sock: zmq.Socket, flags: int = 0) -> list[bytes]:
    """Receive a multipart message; with NOBLOCK, zmq.Again when none waits."""
    frame = sock.recv(flags, copy=False)
    frames = [frame.bytes]
    while frame.more:
        frame = sock.recv(0, copy=False)
        frames.append(frame.bytes)
    return frames
