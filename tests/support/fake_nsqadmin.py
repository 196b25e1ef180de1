"""A fake of nsq 1.3.0's nsqadmin for CI, which has no Go: the part of its JSON API that
test_nsq_cluster_tools.py uses, written from `nsqadmin/http.go` and `internal/clusterinfo`
(`data.go`, `types.go`) at v1.3.0.

Flags `--http-address` and `--lookupd-http-address` (repeatable); the log says `HTTP: listening on
HOST:PORT`, as nsqadmin's does. Served: `GET /api/nodes`, `/api/nodes/HOST:HTTPPORT`, `/api/topics`
(and `?inactive=true`), `/api/topics/T`, `/api/topics/T/C`; `POST /api/topics/T` and `/api/topics/T/C`
with `{"action": "pause"|"unpause"|"empty"}`; `DELETE /api/topics/T` and `/api/topics/T/C`. Each
request asks the lookupds (`/nodes`, `/topics`, `/lookup?topic=`, `/channels?topic=`, with nsq's v1
Accept header) and the nodes (`/stats?format=json…`) afresh, sums as clusterinfo does and answers
with nsqadmin's field names; an action is POSTed to each of the topic's producers and, for a
delete, to every lookupd first. A path nsqadmin does not have: 404 `{"message":"NOT_FOUND"}`; one
it has with another method: 405; one it has that this fake does not serve (the UI, graphite,
counters, tombstones, creating): 404 too, logged so. `--nsqd-http-address` is refused.

Run as `python path/to/fake_nsqadmin.py`; it imports fake_nsq_common.py as its sibling.
"""

from __future__ import annotations

import json
import re
import signal
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from fake_nsq_common import (
    ACCEPT_V1,
    BOOL,
    HTTP_REQUEST_TIMEOUT_S,
    HTTP_USER_AGENT,
    LIST,
    NSQ_VERSION,
    STRING,
    catch_signals,
    exit_now,
    parse_flags,
)

# nsqadmin's options.go default for --http-address.
DEFAULT_HTTP_ADDRESS = "0.0.0.0:4171"
# What `nsqadmin --version` says after the version: the Go nsq 1.3.0's release was built with.
GO_BUILD = "go1.19.8"
# internal/http_api api_response.go: the headers of every v1 answer.
JSON_CONTENT_TYPE = "application/json; charset=utf-8"
NSQ_CONTENT_TYPE = "nsq; version=1.0"
# nsqadmin/http.go's routes under /api: the methods nsqadmin has for each (its router answers 405
# for another), and those this fake serves.
_ROUTES: tuple[tuple[re.Pattern[str], frozenset[str], frozenset[str]], ...] = (
    (re.compile(r"/api/topics"), frozenset({"GET", "POST"}), frozenset({"GET"})),
    (re.compile(r"/api/topics/([^/]+)"), frozenset({"GET", "POST", "DELETE"}), frozenset({"GET", "POST", "DELETE"})),
    (re.compile(r"/api/topics/([^/]+)/([^/]+)"), frozenset({"GET", "POST", "DELETE"}),
     frozenset({"GET", "POST", "DELETE"})),
    (re.compile(r"/api/nodes"), frozenset({"GET"}), frozenset({"GET"})),
    (re.compile(r"/api/nodes/([^/]+)"), frozenset({"GET", "DELETE"}), frozenset({"GET"})),
    (re.compile(r"/api/counter"), frozenset({"GET"}), frozenset()),
    (re.compile(r"/api/graphite"), frozenset({"GET"}), frozenset()),
    (re.compile(r"/config/([^/]+)"), frozenset({"GET", "PUT"}), frozenset()),
    (re.compile(r"/(ping|topics|topics/[^/]+|topics/[^/]+/[^/]+|nodes|nodes/[^/]+|counter|lookup)?"),
     frozenset({"GET"}), frozenset()),
)
# The actions topicChannelAction knows: the nsqd endpoint each is POSTed to, after /topic or /channel.
ACTIONS = ("pause", "unpause", "empty")


def log(level: str, line: str) -> None:
    """nsqadmin's log line: `[nsqadmin] 2006/01/02 15:04:05.000000 LEVEL: …`, on stderr."""
    now = time.time()
    stamp = time.strftime("%Y/%m/%d %H:%M:%S", time.localtime(now)) + f".{int(now % 1 * 1e6):06d}"
    sys.stderr.write(f"[nsqadmin] {stamp} {level}: {line}\n")
    sys.stderr.flush()


class ApiError(Exception):
    """http_api.Err: the status and the message of the JSON answer."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


class Upstream(Exception):
    """No lookupd, or no nsqd, could be asked: `failed to query any …:` and ErrList's text, one error a line."""

    def __init__(self, errors: list[str], what: str) -> None:
        super().__init__(what + "\n".join(errors))


def _v1(method: str, url: str) -> Any:
    """http_api GETV1/POSTV1: nsq's Accept header; any status but 200 is `got response STATUS "BODY"`."""
    request = urllib.request.Request(url, method=method, data=b"" if method == "POST" else None,
                                     headers={"Accept": ACCEPT_V1, "User-Agent": HTTP_USER_AGENT})
    try:
        with urllib.request.urlopen(request, timeout=HTTP_REQUEST_TIMEOUT_S) as reply:
            body = reply.read()
    except urllib.error.HTTPError as error:
        body = error.read()
        raise OSError(f"got response {error.code} {error.reason} {json.dumps(body.decode(errors='replace'))}") \
            from None
    return json.loads(body) if method == "GET" else None


def _version_key(version: str) -> tuple[int, ...]:
    """A version comparable as semver's major.minor.patch; 0.0.0 when it is not one (as clusterinfo)."""
    match = re.match(r"(\d+)\.(\d+)\.(\d+)", version)
    return tuple(int(part) for part in match.groups()) if match else (0, 0, 0)


def _http_address(producer: dict[str, Any]) -> str:
    return f"{producer['broadcast_address']}:{producer['http_port']}"


def _e2e(raw: dict[str, Any] | None) -> dict[str, Any]:
    """quantile.E2eProcessingLatencyAggregate as decoded from nsqd's stats."""
    raw = raw or {}
    return {"count": raw.get("count", 0), "percentiles": raw.get("percentiles"), "topic": raw.get("topic", ""),
            "channel": raw.get("channel", ""), "host": raw.get("host", "")}


def _add_e2e(total: dict[str, Any], other: dict[str, Any]) -> None:
    """The aggregate's Add: the counts summed, each quantile's max and count merged, its average weighted."""
    total["host"] = "*"
    total["count"] += other["count"]
    for value in other["percentiles"] or []:
        mine = next((p for p in total["percentiles"] or [] if p.get("quantile") == value.get("quantile")), None)
        if mine is None:
            mine = {"quantile": value.get("quantile"), "max": 0.0, "min": 0.0, "count": 0.0, "average": 0.0}
            total["percentiles"] = [*(total["percentiles"] or []), mine]
        mine["max"] = max(value.get("max", 0.0), mine["max"])
        mine["min"] = min(value.get("max", 0.0), mine["max"])
        mine["count"] += value.get("count", 0.0)
        if mine["count"]:
            mine["average"] += (value.get("average", 0.0) - mine["average"]) * value.get("count", 0.0) / mine["count"]
        else:
            mine["average"] = 0.0
    if total["percentiles"]:
        total["percentiles"].sort(key=lambda p: p.get("quantile", 0.0), reverse=True)


_CHANNEL_SUMS = ("depth", "memory_depth", "backend_depth", "in_flight_count", "deferred_count", "requeue_count",
                 "timeout_count", "message_count", "client_count")
_TOPIC_SUMS = ("depth", "memory_depth", "backend_depth", "message_count")


def _add_channel(total: dict[str, Any], other: dict[str, Any]) -> None:
    """ChannelStats.Add: `total` becomes the sum over the nodes (node `*`), `other` one of its nodes."""
    total["node"] = "*"
    for name in _CHANNEL_SUMS:
        total[name] += other[name]
    total["paused"] = total["paused"] or other["paused"]
    total["nodes"] = sorted([*(total["nodes"] or []), other], key=lambda c: c["hostname"])
    if total["e2e_processing_latency"] is None:
        total["e2e_processing_latency"] = _e2e({"topic": total["topic_name"], "channel": total["channel_name"],
                                                "host": "*"})
    _add_e2e(total["e2e_processing_latency"], other["e2e_processing_latency"])
    if other["clients"]:
        total["clients"] = sorted([*(total["clients"] or []), *other["clients"]], key=lambda c: c.get("hostname", ""))


def _add_topic(total: dict[str, Any], other: dict[str, Any]) -> None:
    """TopicStats.Add. A channel met first on one node is that node's own record, which then takes the
    other nodes' sums (clusterinfo keeps the pointer): nsqadmin's answers show it so, and so do these."""
    total["node"] = "*"
    for name in _TOPIC_SUMS:
        total[name] += other[name]
    total["paused"] = total["paused"] or other["paused"]
    for channel in other["channels"]:
        mine = next((c for c in total["channels"] if c["channel_name"] == channel["channel_name"]), None)
        if mine is None:
            total["channels"].append(channel)
        else:
            _add_channel(mine, channel)
    total["nodes"] = sorted([*(total["nodes"] or []), other], key=lambda t: t["hostname"])
    if total["e2e_processing_latency"] is None:
        total["e2e_processing_latency"] = _e2e({"topic": total["topic_name"], "host": "*"})
    _add_e2e(total["e2e_processing_latency"], other["e2e_processing_latency"])


def _new_channel(node: str, hostname: str, topic: str, name: str) -> dict[str, Any]:
    return {"node": node, "hostname": hostname, "topic_name": topic, "channel_name": name,
            **dict.fromkeys(_CHANNEL_SUMS, 0), "nodes": None, "clients": None, "paused": False,
            "e2e_processing_latency": None}


class Admin:
    """What nsqadmin's handlers do, over the lookupds given."""

    def __init__(self, lookupds: list[str]) -> None:
        self.lookupds = lookupds
        self.warnings: list[str] = []  # of the request being answered (one thread each)

    # --- clusterinfo ---

    def _lookupds(self, path: str) -> list[Any]:
        """Each lookupd's answer; an Upstream when none answered, a warning for each that did not."""
        answers, errors = [], []
        for lookupd in self.lookupds:
            try:
                answers.append(_v1("GET", f"http://{lookupd}{path}"))
            except (OSError, ValueError) as error:
                errors.append(str(error))
        if errors and len(errors) == len(self.lookupds):
            raise Upstream(errors, "failed to query any nsqlookupd: ")
        self.warnings += errors
        return answers

    def producers(self) -> list[dict[str, Any]]:
        """GetLookupdProducers: every lookupd's /nodes, one producer a TCP address, topics with their tombstones."""
        found: dict[str, dict[str, Any]] = {}
        for lookupd in self.lookupds:
            try:
                answer = _v1("GET", f"http://{lookupd}/nodes")
            except (OSError, ValueError) as error:
                self.warnings.append(str(error))
                continue
            for raw in answer.get("producers") or []:
                key = f"{raw['broadcast_address']}:{raw['tcp_port']}"
                if key not in found:
                    topics = [{"topic": topic, "tombstoned": tombstoned}
                              for topic, tombstoned in zip(raw.get("topics") or [], raw.get("tombstones") or [],
                                                           strict=False)]
                    found[key] = {"remote_addresses": [], "remote_address": raw.get("remote_address", ""),
                                  "hostname": raw.get("hostname", ""), "broadcast_address": raw["broadcast_address"],
                                  "tcp_port": raw["tcp_port"], "http_port": raw["http_port"],
                                  "version": raw.get("version", ""),
                                  "topics": sorted(topics, key=lambda t: t["topic"]) or None, "out_of_date": False}
                found[key]["remote_addresses"].append(f"{lookupd}/{raw.get('remote_address', '')}")
        if self.lookupds and len(self.warnings) >= len(self.lookupds):
            raise Upstream(self.warnings, "failed to query any nsqlookupd: ")
        newest = max((_version_key(p["version"]) for p in found.values()), default=(0, 0, 0))
        for producer in found.values():
            producer["out_of_date"] = _version_key(producer["version"]) < newest
        return sorted(found.values(), key=lambda p: p["hostname"])

    def topic_producers(self, topic: str) -> list[dict[str, Any]]:
        """GetLookupdTopicProducers: every lookupd's /lookup?topic=, one producer an HTTP address."""
        found: dict[str, dict[str, Any]] = {}
        for answer in self._lookupds("/lookup?topic=" + urllib.parse.quote_plus(topic)):
            for producer in answer.get("producers") or []:
                found.setdefault(_http_address(producer), producer)
        return list(found.values())

    def stats(self, producers: list[dict[str, Any]], topic: str, channel: str,
              clients: bool) -> tuple[list[dict[str, Any]], dict[str, dict[str, Any]]]:
        """GetNSQDStats: each producer's topics (of `topic` only, when given) and the channels summed by name."""
        path = "/stats?format=json"
        if topic:
            path += "&topic=" + urllib.parse.quote_plus(topic)
            if channel:
                path += "&channel=" + urllib.parse.quote_plus(channel)
        if not clients:
            path += "&include_clients=false"
        topics: list[dict[str, Any]] = []
        channels: dict[str, dict[str, Any]] = {}
        errors = []
        for producer in producers:
            address = _http_address(producer)
            try:
                answer = _v1("GET", f"http://{address}{path}")
            except (OSError, ValueError) as error:
                errors.append(str(error))
                continue
            hostname = producer.get("hostname", "")
            for raw in answer.get("topics") or []:
                if topic and raw.get("topic_name") != topic:
                    continue
                own = {"node": address, "hostname": hostname, "topic_name": raw.get("topic_name", ""),
                       **{name: int(raw.get(name, 0)) for name in _TOPIC_SUMS}, "nodes": None, "channels": [],
                       "paused": bool(raw.get("paused", False)),
                       "e2e_processing_latency": _e2e(raw.get("e2e_processing_latency"))}
                own["memory_depth"] = own["depth"] - own["backend_depth"]
                topics.append(own)
                for raw_channel in raw.get("channels") or []:
                    mine = _new_channel(address, hostname, own["topic_name"], raw_channel.get("channel_name", ""))
                    for name in _CHANNEL_SUMS:
                        mine[name] = int(raw_channel.get(name, 0))
                    mine["memory_depth"] = mine["depth"] - mine["backend_depth"]
                    mine["paused"] = bool(raw_channel.get("paused", False))
                    mine["e2e_processing_latency"] = _e2e(raw_channel.get("e2e_processing_latency"))
                    if raw_channel.get("clients") is not None:  # null with include_clients=false
                        mine["clients"] = [{**c, "node": address} for c in raw_channel["clients"]]
                    own["channels"].append(mine)
                    key = mine["channel_name"] if topic else f"{own['topic_name']}:{mine['channel_name']}"
                    if key not in channels:
                        channels[key] = _new_channel(address, "", own["topic_name"], mine["channel_name"])
                    _add_channel(channels[key], mine)
        if len(errors) == len(producers):
            raise Upstream(errors, "failed to query any nsqd: ")
        self.warnings += errors
        topics.sort(key=lambda t: t["hostname"])
        return topics, channels

    def post_producers(self, producers: list[dict[str, Any]], path: str) -> None:
        """producersPOST: a failure is a warning (clusterinfo's PartialErr)."""
        for producer in producers:
            try:
                _v1("POST", f"http://{_http_address(producer)}{path}")
            except (OSError, ValueError) as error:
                self.warnings.append(str(error))

    def post_lookupds(self, path: str) -> None:
        for lookupd in self.lookupds:
            try:
                _v1("POST", f"http://{lookupd}{path}")
            except (OSError, ValueError) as error:
                self.warnings.append(str(error))

    # --- handlers ---

    def nodes(self) -> dict[str, Any]:
        return {"nodes": self.producers()}

    def node(self, node: str) -> dict[str, Any]:
        producer = next((p for p in self.producers() if _http_address(p) == node), None)
        if producer is None:
            raise ApiError(404, "NODE_NOT_FOUND")
        topics, _ = self.stats([producer], "", "", clients=True)
        return {"node": node, "topics": topics, "total_messages": sum(t["message_count"] for t in topics),
                "total_clients": sum(len(c["clients"] or []) for t in topics for c in t["channels"])}

    def topics(self, inactive: bool) -> dict[str, Any]:
        names = sorted({name for answer in self._lookupds("/topics") for name in answer.get("topics") or []})
        if not inactive:
            return {"topics": names}
        idle: dict[str, list[str]] = {}
        for name in names:  # the topics no node produces, with the channels lookupd still has
            if not self.topic_producers_quiet(name):
                quoted = urllib.parse.quote_plus(name)
                idle[name] = sorted({c for answer in self._lookupds_quiet(f"/channels?topic={quoted}")
                                     for c in answer.get("channels") or []})
        return {"topics": idle}

    def topic_producers_quiet(self, topic: str) -> list[dict[str, Any]]:
        try:
            return self.topic_producers(topic)
        except Upstream:
            return []

    def _lookupds_quiet(self, path: str) -> list[Any]:
        try:
            return self._lookupds(path)
        except Upstream:
            return []

    def topic(self, topic: str) -> dict[str, Any]:
        topics, _ = self.stats(self.topic_producers(topic), topic, "", clients=False)
        total = {"node": "", "hostname": "", "topic_name": topic, **dict.fromkeys(_TOPIC_SUMS, 0), "nodes": None,
                 "channels": [], "paused": False, "e2e_processing_latency": None}
        for each in topics:
            _add_topic(total, each)
        total["channels"] = total["channels"] or None
        return total

    def channel(self, topic: str, channel: str) -> dict[str, Any]:
        _, channels = self.stats(self.topic_producers(topic), topic, channel, clients=True)
        # No node has it: nsqadmin's embedded nil record, only the message left.
        return channels.get(channel, {})

    def action(self, topic: str, channel: str, body: bytes) -> dict[str, Any]:
        try:
            action = json.loads(body or b"null")
        except ValueError as error:
            raise ApiError(400, str(error)) from None
        name = action.get("action") if isinstance(action, dict) else None
        if name not in ACTIONS:
            raise ApiError(400, "INVALID_ACTION")
        query = "topic=" + urllib.parse.quote_plus(topic)
        if channel:
            query += "&channel=" + urllib.parse.quote_plus(channel)
        self.post_producers(self.topic_producers(topic), f"/{'channel' if channel else 'topic'}/{name}?{query}")
        return {}

    def delete(self, topic: str, channel: str) -> dict[str, Any]:
        """The producers first, then every lookupd forgets it, then each producer deletes it."""
        producers = self.topic_producers(topic)
        query = "topic=" + urllib.parse.quote_plus(topic)
        if channel:
            query += "&channel=" + urllib.parse.quote_plus(channel)
        path = f"/{'channel' if channel else 'topic'}/delete?{query}"
        self.post_lookupds(path)
        self.post_producers(producers, path)
        return {}


class Handler(BaseHTTPRequestHandler):
    server: AdminServer
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _answer(self, status: int, document: dict[str, Any]) -> None:
        data = json.dumps(document, separators=(",", ":")).encode()
        self.send_response(status)
        self.send_header("Content-Type", JSON_CONTENT_TYPE)
        self.send_header("X-NSQ-Content-Type", NSQ_CONTENT_TYPE)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _handle(self) -> None:
        started = time.monotonic()
        url = urllib.parse.urlsplit(self.path)
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        admin = Admin(self.server.lookupds)
        status, document = 200, {}
        try:
            document = self._route(admin, self.command, url.path, urllib.parse.parse_qs(url.query), body)
            document["message"] = "WARNING: " + "; ".join(admin.warnings) if admin.warnings else ""
        except ApiError as error:
            status, document = error.status, {"message": error.message}
        except Upstream as error:
            log("ERROR", str(error))
            status, document = 502, {"message": f"UPSTREAM_ERROR: {error}"}
        self._answer(status, document)
        took = (time.monotonic() - started) * 1e6
        log("INFO", f"{status} {self.command} {self.path} ({self.client_address[0]}:{self.client_address[1]}) "
                    f"{took:.3f}µs")

    def _route(self, admin: Admin, method: str, path: str, query: dict[str, list[str]], body: bytes) -> dict[str, Any]:
        for pattern, methods, served in _ROUTES:
            match = pattern.fullmatch(path)
            if match is None:
                continue
            if method not in methods:
                raise ApiError(405, "METHOD_NOT_ALLOWED")
            if method not in served:
                log("WARNING", f"{method} {path}: nsqadmin's, not served by this fake")
                raise ApiError(404, "NOT_FOUND")
            parts = [urllib.parse.unquote(part) for part in match.groups()]
            if path.startswith("/api/nodes"):
                return admin.node(parts[0]) if parts else admin.nodes()
            if not parts:
                return admin.topics(query.get("inactive", [""])[0] == "true")
            topic, channel = parts[0], parts[1] if len(parts) > 1 else ""
            if method == "GET":
                return admin.channel(topic, channel) if channel else admin.topic(topic)
            if method == "POST":
                return admin.action(topic, channel, body)
            return admin.delete(topic, channel)
        raise ApiError(404, "NOT_FOUND")

    do_GET = do_POST = do_DELETE = do_PUT = do_HEAD = _handle


class AdminServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], lookupds: list[str]) -> None:
        super().__init__(address, Handler)
        self.lookupds = lookupds


def main(argv: list[str]) -> None:
    values = parse_flags("nsqadmin", argv, {
        "version": (BOOL, False), "http-address": (STRING, DEFAULT_HTTP_ADDRESS),
        "lookupd-http-address": (LIST, [])}, unsupported=("nsqd-http-address",))
    if values["version"]:
        print(f"nsqadmin v{NSQ_VERSION} (built w/{GO_BUILD})")
        return
    if not values["lookupd-http-address"]:
        log("FATAL", "failed to instantiate nsqadmin - --nsqd-http-address or --lookupd-http-address required")
        exit_now(1)
    stopped = catch_signals([signal.SIGINT, signal.SIGTERM])
    host, _, port = values["http-address"].rpartition(":")
    server = AdminServer((host or "0.0.0.0", int(port)), values["lookupd-http-address"])
    log("INFO", f"nsqadmin v{NSQ_VERSION} (built w/{GO_BUILD})")
    bound_host, bound_port = server.server_address[:2]
    log("INFO", f"HTTP: listening on {bound_host}:{bound_port}")
    threading.Thread(target=server.serve_forever, daemon=True).start()
    stopped.wait()
    log("INFO", "HTTP: closing 0.0.0.0")
    exit_now(0)


if __name__ == "__main__":
    main(sys.argv[1:])
