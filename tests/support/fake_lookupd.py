"""A small nsqlookupd for tests, written from nsqlookupd 1.3.0's sources (CI has no Go).

The TCP side speaks the nodes' protocol as `nsqlookupd/tcp.go` and `lookup_protocol_v1.go` do:
the `  V1` magic (else `E_BAD_PROTOCOL` and close), then lines `IDENTIFY` (a 4-byte size and a JSON
body with every field required), `REGISTER topic [channel]`, `UNREGISTER topic [channel]` and
`PING`; answers as a 4-byte big-endian size and the data (`OK`, IDENTIFY's JSON, or `E_<CODE> <text>`
after which it closes, every error being fatal there). A node's registrations go when its
connection closes. The registrations are `registration_db.go`'s: (category, key, subkey) → producers
by connection id.

The HTTP side answers what consumers and nsqadmin read, shaped as `nsqlookupd/http.go` shapes them:
`/ping`, `/info`, `/lookup?topic=`, `/topics`, `/channels?topic=`, `/nodes`, `/debug`, and the POSTs
`/topic/create|delete`, `/channel/create|delete`, `/topic/tombstone`. Threads, no trio: a test may
drive it from plain code while a gateway runs in another process. Everything binds loopback (127.0.0.1
unless told another loopback address).
"""

from __future__ import annotations

import contextlib
import json
import re
import signal
import socket
import socketserver
import struct
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import attrs

VERSION = "1.3.0"
# nsqlookupd's defaults: --inactive-producer-timeout 300 s, --tombstone-lifetime 45 s.
INACTIVE_PRODUCER_TIMEOUT_S = 300.0
TOMBSTONE_LIFETIME_S = 45.0
# protocol.IsValidTopicName / IsValidChannelName.
_NAME = re.compile(r"^[.a-zA-Z0-9_-]+(#ephemeral)?$")


def valid_name(name: str) -> bool:
    return 0 < len(name) <= 64 and _NAME.match(name) is not None


@attrs.define(eq=False)
class PeerInfo:
    id: str  # the connection's remote address
    remote_address: str
    hostname: str
    broadcast_address: str
    tcp_port: int
    http_port: int
    version: str
    last_update: float = attrs.field(factory=time.monotonic)

    def json(self) -> dict[str, Any]:
        # PeerInfo's exported fields in their order.
        return {"remote_address": self.remote_address, "hostname": self.hostname,
                "broadcast_address": self.broadcast_address, "tcp_port": self.tcp_port,
                "http_port": self.http_port, "version": self.version}


@attrs.define(eq=False)
class Producer:
    peer: PeerInfo
    tombstoned_at: float | None = None

    def tombstoned(self) -> bool:
        return self.tombstoned_at is not None and time.monotonic() - self.tombstoned_at < TOMBSTONE_LIFETIME_S


Registration = tuple[str, str, str]  # (category, key, subkey)


class ClientError(Exception):
    def __init__(self, code: str, text: str) -> None:
        super().__init__(f"{code} {text}")


class FakeLookupd:
    """The registration DB, its TCP and HTTP listeners, and a log of the commands nodes sent."""

    def __init__(self, port: int = 0, http_port: int = 0, broadcast_address: str = "127.0.0.1",
                 host: str = "127.0.0.1") -> None:
        self.broadcast_address = broadcast_address  # what IDENTIFY's answer names the lookupd by
        self.host = host  # a loopback address
        self.db: dict[Registration, dict[str, Producer]] = {}
        self.commands: list[tuple[str, str]] = []  # (connection id, the command line)
        self.connections = 0  # TCP connections accepted so far
        self.changed = threading.Condition()
        fake = self

        class TcpHandler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                fake._serve_node(self.request)

        class HttpHandler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:
                fake._http(self, "GET")

            def do_POST(self) -> None:
                fake._http(self, "POST")

            def log_message(self, format: str, *args: Any) -> None:
                pass

        socketserver.ThreadingTCPServer.allow_reuse_address = True
        self.tcp = socketserver.ThreadingTCPServer((host, port), TcpHandler)
        self.tcp.daemon_threads = True
        self.http = ThreadingHTTPServer((host, http_port), HttpHandler)
        self.http.daemon_threads = True
        self._open: set[socket.socket] = set()

    @property
    def tcp_address(self) -> str:
        return f"{self.host}:{self.tcp.server_address[1]}"

    @property
    def http_address(self) -> str:
        return f"{self.host}:{self.http.server_address[1]}"

    def start(self) -> None:
        for server in (self.tcp, self.http):
            # A short poll, so that `close` (shutdown waits for one) is quick.
            threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def close(self) -> None:
        for server in (self.tcp, self.http):
            server.shutdown()
            server.server_close()
        self.drop_connections()

    def drop_connections(self) -> None:
        """Closes every node's connection, as a restarted lookupd would have."""
        with self.changed:
            for conn in list(self._open):
                # shutdown, not close: it wakes the thread reading it, and the node sees the end.
                with contextlib.suppress(OSError):
                    conn.shutdown(socket.SHUT_RDWR)

    # -- what tests read -------------------------------------------------------------------------

    def wait_for(self, check: Callable[[], Any], timeout: float = 60.0) -> Any:
        """Waits until `check()` (called under the DB's lock at every change) is truthy; returns it."""
        deadline = time.monotonic() + timeout
        with self.changed:
            while True:
                result = check()
                if result:
                    return result
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"lookupd never got there; registrations: {self.registrations()}")
                self.changed.wait(left)

    def registrations(self) -> dict[Registration, list[str]]:
        """Every registration with the broadcast address:tcp port of its producers."""
        with self.changed:
            return {key: sorted(f"{p.peer.broadcast_address}:{p.peer.tcp_port}" for p in producers.values())
                    for key, producers in self.db.items()}

    def channels(self, topic: str) -> set[str]:
        with self.changed:
            return {sub for (category, key, sub) in self.db if category == "channel" and key == topic}

    def producers(self, topic: str) -> list[PeerInfo]:
        with self.changed:
            return [p.peer for p in self._active(self.db.get(("topic", topic, ""), {}).values())]

    def nodes(self) -> list[PeerInfo]:
        with self.changed:
            return [p.peer for p in self._active(self.db.get(("client", "", ""), {}).values(), tombstones=False)]

    # -- the registration DB (registration_db.go), under `changed` ----------------------------------

    def _add_producer(self, key: Registration, peer: PeerInfo) -> None:
        producers = self.db.setdefault(key, {})
        producers.setdefault(peer.id, Producer(peer))

    def _remove_producer(self, key: Registration, peer_id: str) -> int:
        producers = self.db.get(key)
        if producers is None:
            return 0
        producers.pop(peer_id, None)
        return len(producers)  # the key stays, even when empty

    def _find(self, category: str, key: str, subkey: str) -> list[Registration]:
        return [r for r in self.db if r[0] == category and key in ("*", r[1]) and subkey in ("*", r[2])]

    @staticmethod
    def _active(producers: Any, *, tombstones: bool = True) -> list[Producer]:
        now = time.monotonic()
        return [p for p in producers if now - p.peer.last_update <= INACTIVE_PRODUCER_TIMEOUT_S
                and not (tombstones and p.tombstoned())]

    # -- TCP: one node -----------------------------------------------------------------------------

    def _serve_node(self, conn: socket.socket) -> None:
        with self.changed:
            self._open.add(conn)
            self.connections += 1
            self.changed.notify_all()
        host, port = conn.getpeername()[:2]
        remote = f"{host}:{port}"
        reader = conn.makefile("rb")
        peer: PeerInfo | None = None
        try:
            if reader.read(4) != b"  V1":
                self._send(conn, b"E_BAD_PROTOCOL")
                return
            while True:
                line = reader.readline()
                if not line.endswith(b"\n"):
                    return
                params = line.decode("utf-8", "replace").strip().split(" ")
                with self.changed:
                    self.commands.append((remote, " ".join(params)))
                    self.changed.notify_all()
                try:
                    if params[0] == "IDENTIFY":
                        response, peer = self._identify(reader, remote, peer)
                    else:
                        response = self._command(params, peer)
                except ClientError as error:
                    self._send(conn, str(error).encode())
                    return  # every error nsqlookupd sends a node is fatal
                self._send(conn, response)
        except OSError:
            return
        finally:
            with self.changed:
                if peer is not None:  # the node's registrations go with its connection
                    for key in [key for key, producers in self.db.items() if peer.id in producers]:
                        self._remove_producer(key, peer.id)
                self._open.discard(conn)
                self.changed.notify_all()
            conn.close()

    @staticmethod
    def _send(conn: socket.socket, data: bytes) -> None:
        conn.sendall(struct.pack(">i", len(data)) + data)

    def _identify(self, reader: Any, remote: str, peer: PeerInfo | None) -> tuple[bytes, PeerInfo]:
        if peer is not None:
            raise ClientError("E_INVALID", "cannot IDENTIFY again")
        size = reader.read(4)
        if len(size) < 4:
            raise ClientError("E_BAD_BODY", "IDENTIFY failed to read body size")
        body = reader.read(struct.unpack(">i", size)[0])
        try:
            info = json.loads(body)
        except ValueError:
            raise ClientError("E_BAD_BODY", "IDENTIFY failed to decode JSON body") from None
        try:
            new = PeerInfo(remote, remote, str(info.get("hostname", "")), str(info.get("broadcast_address", "")),
                           int(info.get("tcp_port", 0)), int(info.get("http_port", 0)), str(info.get("version", "")))
        except (TypeError, ValueError, AttributeError):
            raise ClientError("E_BAD_BODY", "IDENTIFY failed to decode JSON body") from None
        if not new.broadcast_address or not new.tcp_port or not new.http_port or not new.version:
            raise ClientError("E_BAD_BODY", "IDENTIFY missing fields")
        with self.changed:
            self._add_producer(("client", "", ""), new)
            self.changed.notify_all()
        answer = {"broadcast_address": self.broadcast_address, "hostname": socket.gethostname(),
                  "http_port": self.http.server_address[1], "tcp_port": self.tcp.server_address[1],
                  "version": VERSION}
        return json.dumps(answer, separators=(",", ":")).encode(), new

    def _command(self, params: list[str], peer: PeerInfo | None) -> bytes:
        name = params[0]
        if name == "PING":
            if peer is not None:
                peer.last_update = time.monotonic()
            return b"OK"
        if name not in ("REGISTER", "UNREGISTER"):
            raise ClientError("E_INVALID", f"invalid command {name}")
        if peer is None:
            raise ClientError("E_INVALID", "client must IDENTIFY")
        if len(params) < 2:
            raise ClientError("E_INVALID", f"{name} insufficient number of params")
        topic, channel = params[1], params[2] if len(params) > 2 else ""
        if not valid_name(topic):
            raise ClientError("E_BAD_TOPIC", f"{name} topic name '{topic}' is not valid")
        if channel and not valid_name(channel):
            raise ClientError("E_BAD_CHANNEL", f"{name} channel name '{channel}' is not valid")
        with self.changed:
            if name == "REGISTER":
                if channel:
                    self._add_producer(("channel", topic, channel), peer)
                self._add_producer(("topic", topic, ""), peer)
            elif channel:
                left = self._remove_producer(("channel", topic, channel), peer.id)
                if left == 0 and channel.endswith("#ephemeral"):
                    self.db.pop(("channel", topic, channel), None)
            else:
                for key in self._find("channel", topic, "*"):
                    self._remove_producer(key, peer.id)
                left = self._remove_producer(("topic", topic, ""), peer.id)
                if left == 0 and topic.endswith("#ephemeral"):
                    self.db.pop(("topic", topic, ""), None)
            self.changed.notify_all()
        return b"OK"

    # -- HTTP (http.go) ----------------------------------------------------------------------------

    def _http(self, request: BaseHTTPRequestHandler, method: str) -> None:
        url = urlsplit(request.path)
        query = {key: values[0] for key, values in parse_qs(url.query, keep_blank_values=True).items()}
        length = int(request.headers.get("Content-Length") or 0)
        if length:
            request.rfile.read(length)
        routes: dict[tuple[str, str], Callable[[dict[str, str]], Any]] = {
            ("GET", "/info"): lambda q: {"version": VERSION},
            ("GET", "/topics"): self._http_topics,
            ("GET", "/channels"): self._http_channels,
            ("GET", "/lookup"): self._http_lookup,
            ("GET", "/nodes"): self._http_nodes,
            ("GET", "/debug"): self._http_debug,
            ("POST", "/topic/create"): self._http_topic_create,
            ("POST", "/topic/delete"): self._http_topic_delete,
            ("POST", "/channel/create"): self._http_channel_create,
            ("POST", "/channel/delete"): self._http_channel_delete,
            ("POST", "/topic/tombstone"): self._http_tombstone,
        }
        status, body, content_type = 200, b"", None
        if (method, url.path) == ("GET", "/ping"):
            body, content_type = b"OK", "text/plain; charset=utf-8"
        elif (method, url.path) in routes:
            try:
                with self.changed:
                    result = routes[(method, url.path)](query)
                    self.changed.notify_all()
                if result is not None:
                    body, content_type = json.dumps(result, separators=(",", ":")).encode(), "application/json"
            except HttpError as error:
                status, content_type = error.status, "application/json"
                body = json.dumps({"message": error.text}).encode()
        elif any(path == url.path for _, path in routes):
            status, body, content_type = 405, b'{"message":"METHOD_NOT_ALLOWED"}', "application/json"
        else:
            status, body, content_type = 404, b'{"message":"NOT_FOUND"}', "application/json"
        request.send_response_only(status)
        if content_type == "application/json":
            content_type += "; charset=utf-8"
        if content_type:
            request.send_header("Content-Type", content_type)
        request.send_header("X-NSQ-Content-Type", "nsq; version=1.0")
        request.send_header("Content-Length", str(len(body)))
        request.end_headers()
        request.wfile.write(body)

    @staticmethod
    def _topic(query: dict[str, str]) -> str:
        if "topic" not in query:
            raise HttpError(400, "MISSING_ARG_TOPIC")
        return query["topic"]

    def _topic_channel(self, query: dict[str, str]) -> tuple[str, str]:
        # http_api.GetTopicChannelArgs
        topic = self._topic(query)
        if not valid_name(topic):
            raise HttpError(400, "INVALID_ARG_TOPIC")
        if "channel" not in query:
            raise HttpError(400, "MISSING_ARG_CHANNEL")
        if not valid_name(query["channel"]):
            raise HttpError(400, "INVALID_ARG_CHANNEL")
        return topic, query["channel"]

    def _http_topics(self, query: dict[str, str]) -> dict[str, Any]:
        return {"topics": [key for _, key, _ in self._find("topic", "*", "")]}

    def _http_channels(self, query: dict[str, str]) -> dict[str, Any]:
        return {"channels": [sub for _, _, sub in self._find("channel", self._topic(query), "*")]}

    def _http_lookup(self, query: dict[str, str]) -> dict[str, Any]:
        topic = self._topic(query)
        if ("topic", topic, "") not in self.db:
            raise HttpError(404, "TOPIC_NOT_FOUND")
        producers = self._active(self.db[("topic", topic, "")].values())
        return {"channels": [sub for _, _, sub in self._find("channel", topic, "*")],
                "producers": [p.peer.json() for p in producers]}

    def _http_nodes(self, query: dict[str, str]) -> dict[str, Any]:
        nodes = []
        for producer in self._active(self.db.get(("client", "", ""), {}).values(), tombstones=False):
            peer = producer.peer
            topics = [key for (category, key, _), producers in self.db.items()
                      if category == "topic" and peer.id in producers]
            tombstones = [self.db[("topic", topic, "")][peer.id].tombstoned() for topic in topics]
            nodes.append({**peer.json(), "tombstones": tombstones, "topics": topics})
        return {"producers": nodes}

    def _http_debug(self, query: dict[str, str]) -> dict[str, Any]:
        # Every registration's producers, by "category:key:subkey"; one with none is not listed.
        data: dict[str, list[dict[str, Any]]] = {}
        for (category, key, subkey), producers in self.db.items():
            for producer in producers.values():
                peer = producer.peer
                data.setdefault(f"{category}:{key}:{subkey}", []).append({
                    "id": peer.id, "hostname": peer.hostname, "broadcast_address": peer.broadcast_address,
                    "tcp_port": peer.tcp_port, "http_port": peer.http_port, "version": peer.version,
                    "last_update": int(peer.last_update * 1e9), "tombstoned": producer.tombstoned_at is not None,
                    "tombstoned_at": int((producer.tombstoned_at or 0) * 1e9)})
        return data

    def _http_topic_create(self, query: dict[str, str]) -> None:
        topic = self._topic(query)
        if not valid_name(topic):
            raise HttpError(400, "INVALID_ARG_TOPIC")
        self.db.setdefault(("topic", topic, ""), {})

    def _http_topic_delete(self, query: dict[str, str]) -> None:
        topic = self._topic(query)
        for key in self._find("channel", topic, "*") + self._find("topic", topic, ""):
            del self.db[key]

    def _http_channel_create(self, query: dict[str, str]) -> None:
        topic, channel = self._topic_channel(query)
        self.db.setdefault(("channel", topic, channel), {})
        self.db.setdefault(("topic", topic, ""), {})

    def _http_channel_delete(self, query: dict[str, str]) -> None:
        topic, channel = self._topic_channel(query)
        if ("channel", topic, channel) not in self.db:
            raise HttpError(404, "CHANNEL_NOT_FOUND")
        del self.db[("channel", topic, channel)]

    def _http_tombstone(self, query: dict[str, str]) -> None:
        topic = self._topic(query)
        if "node" not in query:
            raise HttpError(400, "MISSING_ARG_NODE")
        for producer in self.db.get(("topic", topic, ""), {}).values():
            if f"{producer.peer.broadcast_address}:{producer.peer.http_port}" == query["node"]:
                producer.tombstoned_at = time.monotonic()


class HttpError(Exception):
    def __init__(self, status: int, text: str) -> None:
        super().__init__(text)
        self.status = status
        self.text = text


@contextmanager
def running_lookupd() -> Iterator[FakeLookupd]:
    lookupd = FakeLookupd()
    lookupd.start()
    try:
        yield lookupd
    finally:
        lookupd.close()


def main(argv: list[str]) -> None:
    """`nsqlookupd` as a program (its flags that the docs use), run as `python fake_lookupd.py`: listens on
    the loopback address of --tcp-address (else 127.0.0.1) at the ports of --tcp-address and --http-address
    (nsqlookupd's 4160 and 4161) until SIGINT or SIGTERM."""
    sys.path.insert(0, str(Path(__file__).parent))
    from fake_nsq_common import BOOL, STRING, catch_signals, exit_now, parse_flags

    values = parse_flags("nsqlookupd", argv, {
        "version": (BOOL, False), "broadcast-address": (STRING, socket.gethostname()),
        "tcp-address": (STRING, "0.0.0.0:4160"), "http-address": (STRING, "0.0.0.0:4161")})
    if values["version"]:
        print(f"nsqlookupd v{VERSION} (fake)")
        return
    stopped = catch_signals([signal.SIGINT, signal.SIGTERM])
    host = values["tcp-address"].rpartition(":")[0]
    lookupd = FakeLookupd(int(values["tcp-address"].rpartition(":")[2]), int(values["http-address"].rpartition(":")[2]),
                          values["broadcast-address"], host if host.startswith("127.") else "127.0.0.1")
    lookupd.start()
    print(f"[nsqlookupd] INFO: nsqlookupd v{VERSION} (fake)", flush=True)
    print(f"[nsqlookupd] INFO: TCP: listening on {lookupd.tcp_address}", flush=True)
    print(f"[nsqlookupd] INFO: HTTP: listening on {lookupd.http_address}", flush=True)
    stopped.wait()
    lookupd.close()
    exit_now(0)


if __name__ == "__main__":
    main(sys.argv[1:])
