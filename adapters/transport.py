"""Byte transports for protocol sessions.

`SocketTransport` drives a connected, non-blocking TCP socket with plain syscalls and trio's
`wait_readable` / `wait_writable`, only parking when the kernel says so. That skips the
checkpoints and conflict detectors of `trio.SocketStream` on every read and write, which are
most of the CPU of a request/response round trip (profiled: NSQ PUB). A session that must
speak TLS hands the socket over to a trio stream with `to_stream` and continues on
`StreamTransport`. Both are `Transport`s: compiled (mypyc), a session's calls to them are
direct, not looked up by name.
"""

from __future__ import annotations

import socket
from collections.abc import Awaitable, Callable
from typing import Final

import trio


class Transport:
    """A connection's bytes, as a session uses them; `peer` is the client's host:port."""

    peer: str

    async def receive_some(self, max_bytes: int) -> bytes:
        raise NotImplementedError

    async def send_all(self, data: bytes) -> None:
        raise NotImplementedError

    def try_send(self, data: bytes) -> int:
        raise NotImplementedError

    async def aclose(self) -> None:
        raise NotImplementedError


def _format_peer(sock: socket.socket | trio.socket.SocketType) -> str:
    try:
        host, port = sock.getpeername()[:2]
    except OSError:
        return "unknown:0"
    return f"{host}:{port}"


class SocketTransport(Transport):
    def __init__(self, sock: socket.socket) -> None:
        sock.setblocking(False)
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock = sock
        self.peer = _format_peer(sock)
        self._yield_before_read = False
        self._drained = False
        self._closed = False

    async def receive_some(self, max_bytes: int) -> bytes:
        sock = self.sock
        if self._drained:
            # The last read emptied the socket (it returned less than asked): in request/response
            # traffic a read now would only say EAGAIN, so wait first and save that syscall.
            await trio.lowlevel.wait_readable(sock)
        elif self._yield_before_read:
            # The last read did not wait: let other tasks run before reading again (fairness).
            await trio.lowlevel.checkpoint()
        while True:
            try:
                data = sock.recv(max_bytes)
            except BlockingIOError:
                await trio.lowlevel.wait_readable(sock)
                continue
            self._drained = len(data) < max_bytes
            self._yield_before_read = not self._drained
            return data

    async def send_all(self, data: bytes) -> None:
        sock = self.sock
        try:
            sent = sock.send(data)
        except BlockingIOError:
            sent = 0
        if sent == len(data):
            return
        view = memoryview(data)
        while sent < len(data):
            await trio.lowlevel.wait_writable(sock)
            try:
                sent += sock.send(view[sent:])
            except BlockingIOError:
                continue

    def try_send(self, data: bytes) -> int:
        """Send what the kernel takes now, without waiting: bytes sent (0 when it would block)."""
        try:
            return self.sock.send(data)
        except OSError:
            return 0  # would block, or the connection is gone: the writer task finds out which

    def to_stream(self) -> trio.SocketStream:
        """Give the socket to trio (for `trio.SSLStream`); this transport must not be used again."""
        self._closed = True
        return trio.SocketStream(trio.socket.from_stdlib_socket(self.sock))

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        trio.lowlevel.notify_closing(self.sock)
        self.sock.close()
        await trio.lowlevel.checkpoint()


class StreamTransport(Transport):
    def __init__(self, stream: trio.abc.Stream, peer: str) -> None:
        self.stream = stream
        self.peer = peer

    async def receive_some(self, max_bytes: int) -> bytes:
        data = await self.stream.receive_some(max_bytes)
        # trio's streams may return a bytearray; compiled, `bytes` must be bytes (SSLStream's are).
        return data if isinstance(data, bytes) else bytes(data)

    async def send_all(self, data: bytes) -> None:
        await self.stream.send_all(data)

    def try_send(self, data: bytes) -> int:
        return 0  # a stream (TLS) sends only from a task

    async def aclose(self) -> None:
        await self.stream.aclose()


async def serve_tcp(
    handler: Callable[[SocketTransport], Awaitable[None]], sock: socket.socket, *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Accept connections on a bound, listening socket; run `handler(SocketTransport)` for each."""
    sock.setblocking(False)
    async with trio.open_nursery() as nursery:
        task_status.started()
        while True:
            try:
                conn, _ = sock.accept()
            except BlockingIOError:
                try:
                    await trio.lowlevel.wait_readable(sock)
                except trio.ClosedResourceError:
                    return  # `stop_listening`: no new connections; the ones running go on
                continue
            except OSError:
                # Out of file descriptors and the like: wait a little instead of spinning.
                await trio.sleep(ACCEPT_ERROR_BACKOFF_S)
                continue
            nursery.start_soon(handler, SocketTransport(conn))


# After a failed accept (EMFILE, ENFILE, ENOBUFS): how long to wait before trying again
# (trio.serve_listeners sleeps 0.1 s in the same case).
ACCEPT_ERROR_BACKOFF_S: Final = 0.1


def stop_listening(sock: socket.socket) -> None:
    """Close a listening socket `serve_tcp` serves: it accepts no more and returns once its
    connections have ended (a stopping gateway refuses new clients before closing the others)."""
    trio.lowlevel.notify_closing(sock)
    sock.close()
