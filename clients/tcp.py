"""Blocking TCP plumbing of the clients: address, connect, one read with a deadline, close.

What every blocking client of a TCP protocol needs before it knows a byte of the protocol, so that
the conformance suites, the benchmarks and the tests' helpers connect, read and close one way:
every read has a deadline (a broken server makes the caller fail, never hang), and the end of a
connection, by EOF or by a reset, is one exception, `Closed`.
"""

from __future__ import annotations

import contextlib
import socket
import struct
import time
from typing import Self

# Bytes one read asks for (any value works: the clients reassemble their frames and lines).
RECV_BYTES = 65536


class Closed(Exception):
    """The server closed (or reset) the connection."""


def split_address(text: str, default_host: str | None = None) -> tuple[str, int]:
    """`HOST:PORT` (an IPv6 host in brackets); `:PORT` too when a default host is given."""
    host, separator, port = text.rpartition(":")
    host = host.strip("[]") or (default_host or "")
    if not separator or not host or not port.isdigit():
        raise ValueError(f"expected HOST:PORT, got {text!r}")
    return host, int(port)


def connect(address: tuple[str, int] | str, timeout: float) -> socket.socket:
    """A connected socket with Nagle off (requests are small and each waits for its answer);
    `timeout` bounds the connect and every blocking call after it."""
    sock = socket.create_connection(split_address(address) if isinstance(address, str) else address,
                                    timeout=timeout)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def set_read_timeout(sock: socket.socket, seconds: float) -> None:
    """Blocking reads that give up after `seconds` (a BlockingIOError): a kernel timeout, where
    Python's settimeout() would add a poll() to every read of a benchmark's hot loop."""
    sock.settimeout(None)
    whole = int(seconds)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", whole, int((seconds - whole) * 1e6)))


def receive_before(sock: socket.socket, deadline: float, max_bytes: int = RECV_BYTES) -> bytes | None:
    """One read: its bytes, or None when the deadline (time.monotonic) passed first. The end of the
    connection (EOF or a reset) raises Closed."""
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        return None
    sock.settimeout(remaining)
    try:
        data = sock.recv(max_bytes)
    except TimeoutError:
        return None
    except (ConnectionResetError, BrokenPipeError) as error:
        raise Closed(str(error)) from error
    if not data:
        raise Closed("server closed the connection")
    return data


class Connection:
    """One blocking TCP connection whose reads have deadlines."""

    def __init__(self, address: tuple[str, int] | str, timeout: float) -> None:
        self.address = split_address(address) if isinstance(address, str) else address
        self.sock = connect(self.address, timeout)
        self.timeout = timeout

    def send(self, data: bytes) -> None:
        self.sock.settimeout(self.timeout)  # not what the last read had left of its deadline
        self.sock.sendall(data)

    def receive(self, deadline: float) -> bytes | None:
        """One read (see `receive_before`)."""
        return receive_before(self.sock, deadline)

    def deadline(self, timeout: float | None = None) -> float:
        """The monotonic time `timeout` from now (the connection's timeout when not given)."""
        return time.monotonic() + (self.timeout if timeout is None else timeout)

    def close(self) -> None:
        with contextlib.suppress(OSError):  # closing anyway
            self.sock.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
