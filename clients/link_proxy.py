"""A network link a run can cut as a failing switch does: TCP connections from a port of its own to one
server, forwarded both ways until `cut()` (or `cut_after()` so many more bytes from clients), then held
silent (nothing forwarded, nothing closed: no FIN, no RST, as a dropped packet stream looks to both ends)
until `heal()` resets them, as a peer's kernel answers a segment of a connection it has forgotten.
Connections made while cut are accepted and held silent too. One thread per proxy, one selector over its
connections; plain sockets, so a trio test and the torture run's threads use it alike."""

from __future__ import annotations

import contextlib
import selectors
import socket
import struct
import threading

# What one read takes; a side's unsent bytes past this stop reads from the other (backpressure).
READ_BYTES = 65536
MAX_PENDING = 1 << 20
# The selector wakes this often to see `cut`, `heal` and `close`.
POLL_S = 0.05


class _Side:
    __slots__ = ("pending", "sock")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.pending = bytearray()  # read from the other side, not sent yet


class _Pair:
    __slots__ = ("client", "server")

    def __init__(self, client: _Side, server: _Side | None) -> None:
        self.client = client
        self.server = server  # None for a connection accepted while cut: never forwarded


class LinkProxy:
    """Forwards `127.0.0.1:<port>` to `target` until cut (see the module's text)."""

    def __init__(self, target: tuple[str, int], host: str = "127.0.0.1") -> None:
        self.target = target
        self._listener = socket.create_server((host, 0))
        self._listener.setblocking(False)
        self.address = self._listener.getsockname()[:2]
        self.port: int = self.address[1]
        self._pairs: list[_Pair] = []
        self._cut = False
        self._allowance: int | None = None  # bytes clients may still send the server before a cut (`cut_after`)
        self._draining = False  # the allowance read: what is read of it goes to the server, then the cut
        self._reset_all = False
        self._closing = False
        self.connections = 0  # accepted so far
        self.forwarded_up = 0  # bytes read from clients for the server so far
        self.resets = 0  # connections reset at heals
        self._thread = threading.Thread(target=self._run, name=f"link-proxy-{self.port}", daemon=True)
        self._thread.start()

    @classmethod
    def to(cls, url: str) -> LinkProxy:
        """A proxy to the server of a `nats://host:port` URL."""
        host, port = url.removeprefix("nats://").rsplit(":", 1)
        return cls((host, int(port)))

    @property
    def url(self) -> str:
        return f"nats://{self.address[0]}:{self.port}"

    @property
    def is_cut(self) -> bool:
        return self._cut

    def cut(self) -> None:
        self._cut = True

    def cut_after(self, upstream_bytes: int) -> None:
        """Forward `upstream_bytes` more bytes from clients to the server (what servers send still goes back), then
        cut: a link that fails in the middle of a client's write."""
        self._allowance = upstream_bytes

    def heal(self) -> None:
        """Every connection there is now is reset; from now on new ones are forwarded."""
        self._reset_all = True
        self._cut = False

    def close(self) -> None:
        self._closing = True
        self._thread.join()

    def __enter__(self) -> LinkProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the thread ------------------------------------------------------------------------------

    def _run(self) -> None:
        selector = selectors.DefaultSelector()
        try:
            while not self._closing:
                if self._reset_all:
                    self._reset_all = False  # before the resets: a heal asked meanwhile resets again
                    pairs, self._pairs = self._pairs, []
                    for pair in pairs:
                        self._reset(pair)
                    self.resets += len(pairs)
                self._register(selector)
                for key, events in selector.select(POLL_S):
                    if key.fileobj is self._listener:
                        self._accept()
                    else:
                        self._serve(key.data, key.fileobj, events)  # type: ignore[arg-type]
        finally:
            for pair in list(self._pairs):
                self._reset(pair)
            self._listener.close()
            selector.close()

    def _register(self, selector: selectors.BaseSelector) -> None:
        for key in list(selector.get_map().values()):
            selector.unregister(key.fileobj)
        selector.register(self._listener, selectors.EVENT_READ)
        if self._draining and not any(pair.server.pending for pair in self._pairs if pair.server is not None):
            self._draining, self._cut = False, True  # the allowance is at the server: silence from now on
        if self._cut:
            return  # nothing read, nothing written: silence both ways
        for pair in self._pairs:
            if pair.server is None:
                continue
            for side, other in ((pair.client, pair.server), (pair.server, pair.client)):
                events = 0
                if len(other.pending) < MAX_PENDING and not self._draining:
                    events |= selectors.EVENT_READ
                if side.pending and (side is pair.server or not self._draining):
                    events |= selectors.EVENT_WRITE
                if events:
                    selector.register(side.sock, events, pair)

    def _accept(self) -> None:
        try:
            sock, _ = self._listener.accept()
        except BlockingIOError:
            return
        sock.setblocking(False)
        self.connections += 1
        if self._cut:
            self._pairs.append(_Pair(_Side(sock), None))
            return
        try:
            upstream = socket.create_connection(self.target, timeout=5)
        except OSError:
            self._reset(_Pair(_Side(sock), None))
            return
        upstream.setblocking(False)
        self._pairs.append(_Pair(_Side(sock), _Side(upstream)))

    def _serve(self, pair: _Pair, sock: socket.socket, events: int) -> None:
        assert pair.server is not None
        side, other = (pair.client, pair.server) if sock is pair.client.sock else (pair.server, pair.client)
        try:
            if events & selectors.EVENT_WRITE and side.pending:
                sent = sock.send(side.pending)
                del side.pending[:sent]
            if events & selectors.EVENT_READ:
                data = sock.recv(READ_BYTES)
                if not data:  # an end closed: so does the other (FIN passed on as a close)
                    self._close(pair)
                    return
                if side is pair.client:
                    self.forwarded_up += len(data)
                if side is pair.client and self._allowance is not None:
                    data = data[:self._allowance]
                    self._allowance -= len(data)
                    if self._allowance == 0:
                        self._allowance, self._draining = None, True
                other.pending += data
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._reset(pair)

    def _close(self, pair: _Pair) -> None:
        for side in (pair.client, pair.server):
            if side is not None:
                with contextlib.suppress(OSError):
                    side.sock.setblocking(True)
                    side.sock.settimeout(1)
                    side.sock.sendall(side.pending)
                side.sock.close()
        if pair in self._pairs:
            self._pairs.remove(pair)

    def _reset(self, pair: _Pair) -> None:
        for side in (pair.client, pair.server):
            if side is not None:
                with contextlib.suppress(OSError):
                    side.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                side.sock.close()
        if pair in self._pairs:
            self._pairs.remove(pair)
