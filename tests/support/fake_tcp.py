"""Tiny TCP servers on 127.0.0.1 for tests of client-side code (conformance suites, benches):
a fake that answers every chunk, and the accept loop proxies build on."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Callable, Iterator

Reply = Callable[[bytes], bytes]

# The servers poll their sockets this often for the stop flag.
POLL_S = 0.2


@contextlib.contextmanager
def serving(handle: Callable[[socket.socket, threading.Event], None]) -> Iterator[str]:
    """Accept connections on 127.0.0.1 and run `handle(conn, stop)` for each in a thread."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(POLL_S)
    stop = threading.Event()

    def accept_loop() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            threading.Thread(target=handle, args=(conn, stop), daemon=True).start()

    thread = threading.Thread(target=accept_loop, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{listener.getsockname()[1]}"
    finally:
        stop.set()
        thread.join()
        listener.close()


@contextlib.contextmanager
def fake_server(reply: Reply) -> Iterator[str]:
    """A TCP server answering every chunk it reads with `reply(chunk)`; never closes first."""

    def serve_conn(conn: socket.socket, stop: threading.Event) -> None:
        with conn:
            conn.settimeout(POLL_S)
            while not stop.is_set():
                try:
                    data = conn.recv(65536)
                except TimeoutError:
                    continue
                except OSError:
                    return
                if not data:
                    return
                with contextlib.suppress(OSError):
                    conn.sendall(reply(data))

    with serving(serve_conn) as address:
        yield address
