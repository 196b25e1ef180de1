"""ZeroMQ sockets inside trio, without threads: one pump task per socket, driven by its `zmq.FD`.

`zmq.FD` is edge-triggered: it becomes readable when the socket's state *changed*, not while a
message waits. So the pump never waits on it without first reading `zmq.EVENTS`: it receives
while `EVENTS & POLLIN`, sends queued messages while `EVENTS & POLLOUT`, and reads `EVENTS` again
after every send (a send can consume the edge that announced incoming messages). Only when
neither direction can progress does it wait for the descriptor, or for `send` to queue more.

Incoming messages go to the `on_messages` callback as a list (all that were waiting), on the
loop, synchronously, so a protocol adapter handles a burst as one batch. What the pump does not
do: interpret frames (that is the codec's job) or decide what to send (the adapter's).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence

import trio
import zmq

Frames = list[bytes]

# Messages taken off the socket before the pump lets other tasks run (one client must not own
# the loop) and hands them to `on_messages` as one batch.
RECEIVE_BATCH = 1024


class ZmqPump:
    def __init__(self, sock: zmq.Socket, on_messages: Callable[[list[Frames]], None]) -> None:
        self.sock = sock
        self.fd = sock.getsockopt(zmq.FD)
        self.on_messages = on_messages
        self.outgoing: deque[Sequence[bytes]] = deque()
        self._waiting: trio.CancelScope | None = None
        self.received = 0
        self.sent = 0
        self.unroutable = 0  # messages for a peer that had gone (ROUTER_MANDATORY)

    def send(self, frames: Sequence[bytes]) -> None:
        """Queue a multipart message; the pump sends it as soon as the socket takes it (in order)."""
        self.outgoing.append(frames)
        if self._waiting is not None:
            self._waiting.cancel()

    def _receive(self) -> bool:
        sock = self.sock
        batch: list[Frames] = []
        while len(batch) < RECEIVE_BATCH and sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            try:
                batch.append(sock.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                break
        if batch:
            self.received += len(batch)
            self.on_messages(batch)
        return bool(batch)

    def _send(self) -> bool:
        sock = self.sock
        outgoing = self.outgoing
        sent = False
        while outgoing and sock.getsockopt(zmq.EVENTS) & zmq.POLLOUT:
            try:
                sock.send_multipart(outgoing[0], zmq.NOBLOCK)
            except zmq.Again:
                break
            except zmq.ZMQError as error:
                if error.errno != zmq.EHOSTUNREACH:
                    raise
                self.unroutable += 1  # a ROUTER_MANDATORY socket's peer is gone: nobody to tell
            outgoing.popleft()
            self.sent += 1
            sent = True
        return sent

    async def run(self) -> None:
        """Forever (until cancelled): receive, send, and wait only when neither can progress."""
        while True:
            received = self._receive()
            sent = self._send()
            if received or sent:
                await trio.lowlevel.checkpoint()  # let the rest of the loop run between bursts
                continue
            with trio.CancelScope() as self._waiting:
                # EVENTS was read after the last send above: whatever changes from here signals the fd.
                try:
                    await trio.lowlevel.wait_readable(self.fd)
                except trio.ClosedResourceError:
                    return  # `close`
            self._waiting = None

    def close(self) -> None:
        trio.lowlevel.notify_closing(self.fd)
        self.sock.close(linger=0)
