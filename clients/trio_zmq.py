"""ZeroMQ sockets for the trio clients, without threads: one pump task per socket, woken by its `zmq.FD`.

The descriptor is edge-triggered: it says that the socket's state changed, not that a message
waits. So the task reads `zmq.EVENTS` before every step, takes one message or sends one while
EVENTS says it can, and waits for the descriptor (or for `send` to queue something) only when
EVENTS says neither. Each message goes to the `on_message` callback as it comes, synchronously.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Callable, Sequence

import trio
import zmq

Frames = list[bytes]


class SocketPump:
    def __init__(self, sock: zmq.Socket, on_message: Callable[[Frames], None]) -> None:
        self.sock = sock
        self.on_message = on_message
        self.outgoing: deque[Sequence[bytes]] = deque()  # queued by `send`, in order
        self.closed = False
        self._fd = sock.getsockopt(zmq.FD)
        self._idle: trio.CancelScope | None = None  # the wait for the descriptor, while there is one

    def send(self, frames: Sequence[bytes]) -> None:
        """Queue a message; the task sends it as soon as the socket takes it."""
        self.outgoing.append(frames)
        if self._idle is not None:
            self._idle.cancel()

    def _step(self) -> bool:
        """One message received or sent; False when the socket can do neither now."""
        events = self.sock.getsockopt(zmq.EVENTS)
        try:
            if events & zmq.POLLIN:
                self.on_message(self.sock.recv_multipart(zmq.NOBLOCK))
                return True
            if self.outgoing and events & zmq.POLLOUT:
                self.sock.send_multipart(self.outgoing[0], zmq.NOBLOCK)
                self.outgoing.popleft()
                return True
        except zmq.Again:
            pass  # EVENTS spoke too soon: wait for the descriptor
        return False

    async def run(self) -> None:
        """Until `close`: step while there is something to do, else wait."""
        while not self.closed:
            if self._step():
                await trio.lowlevel.checkpoint()
                continue
            with trio.CancelScope() as self._idle:
                try:
                    await trio.lowlevel.wait_readable(self._fd)
                except trio.ClosedResourceError:
                    return  # `close`
            self._idle = None

    def close(self, linger_ms: int = 0) -> None:
        """Close the socket (the task ends); what is queued goes to ZeroMQ first, as far as it takes
        it without waiting, and ZeroMQ keeps trying to send it for `linger_ms`."""
        if self.closed:
            return
        with contextlib.suppress(zmq.ZMQError):  # closing anyway
            while self.outgoing:
                self.sock.send_multipart(self.outgoing[0], zmq.NOBLOCK)
                self.outgoing.popleft()
        self.closed = True
        trio.lowlevel.notify_closing(self._fd)
        self.sock.close(linger=linger_ms)
