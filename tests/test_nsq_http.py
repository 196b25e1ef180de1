"""The nsqd HTTP API (docs/protocols/nsq.md).

Two layers: the sans-IO request logic (`adapters/nsq/http_api.py`) against an in-process engine
and a fake NSQ server object, then real HTTP over 127.0.0.1 against `python -m polymq serve`,
asserting exact status codes, bodies and headers, and that HTTP publishes reach a TCP consumer.
"""

from __future__ import annotations

import http.client
import json
import re
import socket
import struct
import time
from collections.abc import Callable
from typing import Any

import pytest
import trio
from trio.testing import wait_all_tasks_blocked

from polymq.adapters.nsq.http import nsq_http_app
from polymq.adapters.nsq.http_api import (
    GcPauses,
    NeedBody,
    NsqHttpApi,
    QueryError,
    Request,
    Response,
    clean_client,
    go_duration,
    go_json,
    go_rfc3339,
    memory_stats,
    parse_query,
)
from polymq.codecs import nsq_client
from polymq.codecs.nsq import ServerLimits
from polymq.core.engine import Engine
from polymq.core.storage import MemoryStorage

from support.gateway import GatewayProcess, running_gateway

JSON = "application/json; charset=utf-8"
TEXT = "text/plain; charset=utf-8"
NSQ_HEADER = "nsq; version=1.0"
MAX_MSG = 1048576
MAX_BODY = 5242880

# ---------------------------------------------------------------------------------------------
# In-process: the sans-IO API with a fake NSQ server


class FakeNSQ:
    def __init__(self, clients: list[dict[str, Any]] | None = None, *, auth: bool = False) -> None:
        self.limits = ServerLimits()
        self.tcp_port = 4150
        self.http_port = 4151
        self.start_time = 1_700_000_000
        self.hostname = "host1"
        self.auth_enabled = auth
        self.clients = clients or []

    def client_stats(self) -> list[dict[str, Any]]:
        return [dict(c) for c in self.clients]


def call(api: NsqHttpApi, method: str, path: str, query: bytes = b"", body: bytes | None = None,
         content_length: int | None = None) -> Response:
    if content_length is None and body is not None:
        content_length = len(body)
    result = api.handle(Request(method, path, query, content_length))
    if isinstance(result, NeedBody):
        data = (body or b"")[: result.read_max]
        return result.complete(data)
    return result


def make_api(clients: list[dict[str, Any]] | None = None, **kwargs: Any) -> tuple[Engine, NsqHttpApi]:
    engine = Engine()
    api = NsqHttpApi(engine, FakeNSQ(clients, **kwargs), now=lambda: 1_700_000_065.5)
    return engine, api


def consumer_client(**extra: Any) -> dict[str, Any]:
    base = {
        "client_id": "c1", "hostname": "worker", "version": "V2", "remote_address": "127.0.0.1:50000",
        "state": 3, "ready_count": 10, "in_flight_count": 1, "message_count": 5, "finish_count": 4,
        "requeue_count": 0, "connect_ts": 1_700_000_000, "sample_rate": 0, "deflate": False, "snappy": False,
        "user_agent": "pynsq/0.9.1", "tls": False, "tls_cipher_suite": "", "tls_version": "",
        "tls_negotiated_protocol": "", "tls_negotiated_protocol_is_mutual": False,
        "_topic": "orders", "_channel": "billing",
    }
    base.update(extra)
    return base


def test_query_parsing_follows_go():
    assert parse_query(b"topic=a&x=1&x=2&&y") == {b"topic": [b"a"], b"x": [b"1", b"2"], b"y": [b""]}
    assert parse_query(b"t=a+b%20c") == {b"t": [b"a b c"]}
    with pytest.raises(QueryError):
        parse_query(b"topic=a;b")
    with pytest.raises(QueryError):
        parse_query(b"topic=%zz")


def test_go_formatting_helpers():
    assert go_duration(0) == "0s"
    assert go_duration(1_500_000) == "1.5ms"
    assert go_duration(999) == "999ns"
    assert go_duration(2_000) == "2µs"
    assert go_duration(5_063_118_219) == "5.063118219s"
    assert go_duration(3_723_500_000_000) == "1h2m3.5s"
    assert go_duration(60 * 1_000_000_000) == "1m0s"
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(Z|[+-]\d\d:\d\d)", go_rfc3339(1_700_000_000))
    assert go_json({"a": "<&>", "b": None, "c": [1, True]}) == b'{"a":"\\u003c\\u0026\\u003e","b":null,"c":[1,true]}'


def test_pub_checks_in_nsqd_order_and_defers():
    engine, api = make_api()
    big = b"x" * (MAX_MSG + 1)
    # MSG_TOO_BIG comes before the topic checks, by Content-Length or by the bytes read.
    assert call(api, "POST", "/pub", b"", big).body == b'{"message":"MSG_TOO_BIG"}'
    assert call(api, "POST", "/pub", b"", big, content_length=0).status == 413
    assert call(api, "POST", "/pub", b"topic=t", b"").body == b'{"message":"MSG_EMPTY"}'
    assert call(api, "POST", "/pub", b"", b"x").body == b'{"message":"MISSING_ARG_TOPIC"}'
    assert call(api, "POST", "/pub", b"topic=a*", b"x").body == b'{"message":"INVALID_TOPIC"}'
    assert call(api, "POST", "/pub", b"topic=a;", b"x").body == b'{"message":"INVALID_REQUEST"}'
    for bad in (b"-1", b"3600001", b"abc", b"", b"1.5"):
        assert call(api, "POST", "/pub", b"topic=d&defer=" + bad, b"x").body == b'{"message":"INVALID_DEFER"}'
    assert "d" not in engine.topics  # a refused publish creates nothing (nsqd would)
    ok = call(api, "POST", "/pub", b"topic=d&defer=3600000", b"x")
    assert (ok.status, ok.body, ok.content_type) == (200, b"OK", TEXT)
    assert call(api, "POST", "/pub", b"topic=t", b"x" * MAX_MSG).status == 200
    call(api, "POST", "/channel/create", b"topic=d&channel=c")
    queue = engine.queue("d/c")
    assert queue is not None and queue.deferred_count == 1 and queue.depth == 0


def test_pub_ephemeral_topic():
    engine, api = make_api()
    assert call(api, "POST", "/pub", b"topic=e%23ephemeral", b"x").status == 200
    assert engine.topics["e#ephemeral"].ephemeral


def test_pub_and_mpub_refused_when_auth_is_on():
    engine, api = make_api(auth=True)
    for path in ("/pub", "/mpub"):
        response = call(api, "POST", path, b"topic=t", b"x")
        assert (response.status, response.body) == (403, b'{"message":"UNAUTHORIZED"}')
    assert not engine.topics


def test_mpub_text_and_binary():
    engine, api = make_api()
    call(api, "POST", "/topic/create", b"topic=m")
    call(api, "POST", "/channel/create", b"topic=m&channel=c")
    assert call(api, "POST", "/mpub", b"topic=m", b"a\n\nb\nc").body == b"OK"
    assert [m.body for m in engine.queue("m/c").ready] == [b"a", b"b", b"c"]
    body = nsq_client.mpub_body([b"x\ny", b"z"])
    for flag in (b"true", b"1", b"yes", b""):
        assert call(api, "POST", "/mpub", b"topic=m&binary=" + flag, body).status == 200
    assert [m.body for m in engine.queue("m/c").ready][3:5] == [b"x\ny", b"z"]
    # binary=false / 0 is text mode: the binary batch is split on its newline.
    assert call(api, "POST", "/mpub", b"topic=m&binary=0", b"1\n2").status == 200
    assert [m.body for m in engine.queue("m/c").ready][-2:] == [b"1", b"2"]


def test_mpub_errors():
    engine, api = make_api()
    assert call(api, "POST", "/mpub", b"topic=m", content_length=MAX_BODY + 1).body == b'{"message":"BODY_TOO_BIG"}'
    assert call(api, "POST", "/mpub", b"", b"a").body == b'{"message":"MISSING_ARG_TOPIC"}'
    assert call(api, "POST", "/mpub", b"topic=m", b"a\n" + b"x" * (MAX_MSG + 1)).body == b'{"message":"MSG_TOO_BIG"}'
    # A too-long first line is MSG_TOO_BIG even in a body over the limit (nsqd checks per line).
    assert call(api, "POST", "/mpub", b"topic=m", b"x" * (MAX_MSG + 1) + b"\n" + b"y" * MAX_BODY,
                content_length=0).body == b'{"message":"MSG_TOO_BIG"}'
    lines = (b"y" * 1000 + b"\n") * (MAX_BODY // 1001 + 1)
    assert call(api, "POST", "/mpub", b"topic=m", lines, content_length=0).body == b'{"message":"BODY_TOO_BIG"}'
    binary = b"topic=m&binary=true"
    assert call(api, "POST", "/mpub", binary, b"\x00\x00\x00\x00").body == b'{"message":"BAD_BODY"}'
    assert call(api, "POST", "/mpub", binary, b"\x00").body == b'{"message":"BAD_BODY"}'
    too_big = struct.pack(">ii", 1, MAX_MSG + 1) + b"x" * (MAX_MSG + 1)
    response = call(api, "POST", "/mpub", binary, too_big)
    assert (response.status, response.body) == (413, b'{"message":"BAD_MESSAGE"}')
    assert call(api, "POST", "/mpub", binary, struct.pack(">ii", 1, 0)).body == b'{"message":"BAD_MESSAGE"}'
    assert "m" not in engine.topics


def test_topic_and_channel_admin():
    engine, api = make_api()
    assert call(api, "POST", "/topic/create", b"").body == b'{"message":"MISSING_ARG_TOPIC"}'
    assert call(api, "POST", "/topic/create", b"topic=").body == b'{"message":"INVALID_TOPIC"}'
    # Answered once stored (and held on every node of a cluster): a change's answer waits for the sync.
    assert call(api, "POST", "/topic/create", b"topic=t") == Response(200, after_sync=True)
    assert call(api, "POST", "/topic/create", b"topic=t") == Response(200, after_sync=True)
    assert call(api, "POST", "/channel/create", b"topic=nope&channel=c").body == b'{"message":"TOPIC_NOT_FOUND"}'
    assert call(api, "POST", "/channel/create", b"topic=t").body == b'{"message":"MISSING_ARG_CHANNEL"}'
    assert call(api, "POST", "/channel/create", b"topic=t*&channel=c").body == b'{"message":"INVALID_ARG_TOPIC"}'
    assert call(api, "POST", "/channel/create", b"topic=t&channel=c*").body == b'{"message":"INVALID_ARG_CHANNEL"}'
    assert call(api, "POST", "/channel/create", b"topic=t&channel=c%23ephemeral").status == 200
    assert engine.queue("t/c#ephemeral").ephemeral
    assert call(api, "POST", "/channel/create", b"topic=t&channel=c").status == 200
    assert engine.queue("t/c").topics == ["t"]
    call(api, "POST", "/pub", b"topic=t", b"x")
    assert call(api, "POST", "/channel/pause", b"topic=t&channel=c").status == 200
    assert engine.queue("t/c").paused
    assert call(api, "POST", "/channel/unpause", b"topic=t&channel=c").status == 200
    assert not engine.queue("t/c").paused
    assert call(api, "POST", "/channel/empty", b"topic=t&channel=c").status == 200
    assert engine.queue("t/c").depth == 0
    assert call(api, "POST", "/channel/empty", b"topic=t&channel=zz").body == b'{"message":"CHANNEL_NOT_FOUND"}'
    assert call(api, "POST", "/channel/delete", b"topic=t&channel=c").status == 200
    assert engine.queue("t/c") is None
    assert call(api, "POST", "/channel/delete", b"topic=t&channel=c").status == 404
    assert call(api, "POST", "/topic/pause", b"topic=t").status == 200
    assert engine.topics["t"].paused
    assert call(api, "POST", "/topic/unpause", b"topic=t").status == 200
    assert call(api, "POST", "/topic/empty", b"topic=t*").body == b'{"message":"INVALID_TOPIC"}'
    assert call(api, "POST", "/topic/pause", b"topic=t*").body == b'{"message":"TOPIC_NOT_FOUND"}'
    assert call(api, "POST", "/topic/empty", b"topic=t").status == 200
    assert call(api, "POST", "/topic/delete", b"topic=t").status == 200
    assert call(api, "POST", "/topic/delete", b"topic=t").body == b'{"message":"TOPIC_NOT_FOUND"}'
    assert not engine.topics and not engine.queues


def test_routing_404_405_options_redirects():
    _, api = make_api()
    assert call(api, "GET", "/nope") == Response(404, b'{"message":"NOT_FOUND"}', JSON)
    assert call(api, "GET", "/pub") == Response(
        405, b'{"message":"METHOD_NOT_ALLOWED"}', JSON, (("Allow", "POST, OPTIONS"),))
    assert call(api, "POST", "/config/x").headers == (("Allow", "GET, PUT, OPTIONS"),)
    assert call(api, "HEAD", "/ping").headers == (("Allow", "GET, OPTIONS"),)
    assert call(api, "OPTIONS", "/stats") == Response(200, headers=(("Allow", "GET, OPTIONS"),))
    assert call(api, "OPTIONS", "/nope").status == 404
    assert call(api, "GET", "/config/").status == 404
    redirect = call(api, "GET", "/ping/", b"a=1")
    assert (redirect.status, redirect.headers) == (301, (("Location", "/ping?a=1"),))
    assert call(api, "POST", "/PUB", b"topic=t").headers == (("Location", "/pub?topic=t"),)
    assert call(api, "POST", "/PUB").status == 307


def test_config_get_and_put():
    _, api = make_api()
    assert call(api, "GET", "/config/max_rdy_count").body == b"2500"
    assert call(api, "GET", "/config/msg_timeout").body == b"60000000000"
    assert call(api, "GET", "/config/nsqlookupd_tcp_addresses").body == b"[]"
    assert call(api, "GET", "/config/max-rdy-count").body == b'{"message":"INVALID_OPTION"}'
    assert call(api, "PUT", "/config/max_rdy_count", body=b"").body == b'{"message":"INVALID_VALUE"}'
    assert call(api, "PUT", "/config/max_rdy_count", body=b"1").body == b'{"message":"INVALID_OPTION"}'
    put = call(api, "PUT", "/config/nsqlookupd_tcp_addresses", body=b'["127.0.0.1:4160"]')
    assert (put.status, put.body) == (200, b'["127.0.0.1:4160"]')
    assert call(api, "PUT", "/config/nsqlookupd_tcp_addresses", body=b'"x"').body == b'{"message":"INVALID_VALUE"}'
    assert call(api, "PUT", "/config/log_level", body=b"warn").body == b"3"
    assert call(api, "GET", "/config/log_level").body == b"3"
    assert call(api, "PUT", "/config/log_level", body=b"loud").body == b'{"message":"INVALID_VALUE"}'
    call(api, "PUT", "/config/log_level", body=b"info")


def test_stats_json_shape_filters_and_clients():
    producer = consumer_client(client_id="p1", state=0, ready_count=0, in_flight_count=0, message_count=0,
                               finish_count=0, _topic=None, _channel=None,
                               pub_counts=[{"topic": "orders", "count": 3}, {"topic": "other", "count": 1}])
    engine, api = make_api([consumer_client(), producer])
    call(api, "POST", "/topic/create", b"topic=orders")
    call(api, "POST", "/channel/create", b"topic=orders&channel=billing")
    call(api, "POST", "/channel/create", b"topic=orders&channel=audit")
    call(api, "POST", "/pub", b"topic=orders", b"hello")
    engine.ensure_topic("zeta")
    response = call(api, "GET", "/stats", b"format=json&include_mem=false")
    assert response.content_type == JSON
    stats = json.loads(response.body)
    assert list(stats) == ["version", "health", "start_time", "topics", "producers"]
    assert stats["version"] == "1.3.0" and stats["health"] == "OK" and stats["start_time"] == 1_700_000_000
    assert [t["topic_name"] for t in stats["topics"]] == ["orders", "zeta"]
    orders = stats["topics"][0]
    assert list(orders) == ["topic_name", "channels", "depth", "backend_depth", "message_count", "message_bytes",
                            "paused", "e2e_processing_latency"]
    assert (orders["message_count"], orders["message_bytes"], orders["depth"]) == (1, 5, 0)
    assert [c["channel_name"] for c in orders["channels"]] == ["audit", "billing"]
    billing = orders["channels"][1]
    assert list(billing) == ["channel_name", "depth", "backend_depth", "in_flight_count", "deferred_count",
                             "message_count", "requeue_count", "timeout_count", "expired_count",
                             "dead_letter_count", "client_count", "clients", "paused", "e2e_processing_latency"]
    assert billing["e2e_processing_latency"] == {"count": 0, "percentiles": None}
    assert billing["depth"] == 1 and orders["channels"][0]["clients"] == []
    (client,) = billing["clients"]
    assert "_topic" not in client and "_channel" not in client and "pub_counts" not in client
    assert list(client)[:3] == ["client_id", "hostname", "version"]
    (prod,) = stats["producers"]
    assert prod["client_id"] == "p1" and len(prod["pub_counts"]) == 2
    # Filters: a topic filter narrows pub_counts; an unknown topic gives null topics and producers.
    filtered = json.loads(call(api, "GET", "/stats", b"format=json&topic=orders&channel=billing").body)
    assert [c["channel_name"] for c in filtered["topics"][0]["channels"]] == ["billing"]
    assert filtered["producers"][0]["pub_counts"] == [{"topic": "orders", "count": 3}]
    assert list(filtered["memory"]) == ["heap_objects", "heap_idle_bytes", "heap_in_use_bytes",
                                        "heap_released_bytes", "gc_pause_usec_100", "gc_pause_usec_99",
                                        "gc_pause_usec_95", "next_gc_bytes", "gc_total_runs"]
    missing = json.loads(call(api, "GET", "/stats", b"format=json&topic=nope&include_mem=0").body)
    assert missing == {"version": "1.3.0", "health": "OK", "start_time": 1_700_000_000, "topics": None,
                       "producers": None}
    no_channel = json.loads(call(api, "GET", "/stats", b"format=json&channel=nope&include_mem=0").body)
    assert no_channel["topics"] == []
    no_clients = json.loads(call(api, "GET", "/stats", b"format=json&include_clients=false&include_mem=0").body)
    assert no_clients["producers"] is None
    assert no_clients["topics"][0]["channels"][1]["clients"] is None
    assert call(api, "GET", "/stats", b"format=json&topic=a;b").body == b'{"message":"INVALID_REQUEST"}'


def test_stats_text_exact():
    producer = consumer_client(client_id="p1", hostname="pub", remote_address="127.0.0.1:40000", user_agent="go",
                               _topic=None, _channel=None, pub_counts=[{"topic": "orders", "count": 3}])
    _, api = make_api([consumer_client(), producer])
    call(api, "POST", "/topic/create", b"topic=orders")
    call(api, "POST", "/channel/create", b"topic=orders&channel=billing")
    call(api, "POST", "/pub", b"topic=orders", b"hello")
    call(api, "POST", "/channel/pause", b"topic=orders&channel=billing")
    call(api, "POST", "/topic/create", b"topic=idle")
    call(api, "POST", "/topic/pause", b"topic=idle")
    text = call(api, "GET", "/stats", b"include_mem=false").body.decode()
    lines = text.split("\n")
    assert lines[0] == f"nsqd v1.3.0 (built w/{api.python_version})"
    assert lines[1] == f"start_time {go_rfc3339(1_700_000_000)}"
    assert lines[2:] == [
        "uptime 1m5.5s",
        "",
        "Health: OK",
        "",
        "Topics:",
        "*P [idle           ] depth: 0     be-depth: 0     msgs: 0        e2e%: ",
        "",
        "   [orders         ] depth: 0     be-depth: 0     msgs: 1        e2e%: ",
        "   *P [billing                  ] depth: 1     be-depth: 0     inflt: 0    def: 0    re-q: 0     "
        "timeout: 0     msgs: 1        e2e%: ",
        "        [V2 worker:50000 pynsq/0.9.1] state: 3 inflt: 1    rdy: 10   fin: 4        re-q: 0        "
        "msgs: 5        connected: 1m5s",
        "",
        "Producers:",
        "   [V2 pub:40000 go         ] msgs: 3        topics: orders=3 connected: 1m5s",
        "",
    ]
    with_mem = call(api, "GET", "/stats", b"topic=none").body.decode()
    assert "\n\nMemory:\n   heap_objects             \t" in with_mem
    assert with_mem.endswith("\nHealth: OK\n\nMemory:\n" + with_mem.split("\nMemory:\n")[1].split("\n\nTopics")[0]
                             + "\n\nTopics: None\n\nProducers: None\n")


def test_info_and_ping():
    _, api = make_api()
    assert call(api, "GET", "/ping") == Response(200, b"OK", TEXT, plain=True)
    assert json.loads(call(api, "GET", "/info").body) == {
        "version": "1.3.0", "broadcast_address": "host1", "hostname": "host1", "http_port": 4151,
        "tcp_port": 4150, "start_time": 1_700_000_000, "max_heartbeat_interval": 60_000_000_000,
        "max_output_buffer_size": 65536, "max_output_buffer_timeout": 30_000_000_000, "max_deflate_level": 6,
    }


def test_clean_client_and_memory():
    raw = consumer_client(authed=False, auth_identity="", pub_counts=[], extra="kept")
    cleaned = clean_client(raw)
    assert "authed" not in cleaned and "pub_counts" not in cleaned and cleaned["extra"] == "kept"
    assert list(cleaned)[-2:] == ["tls_negotiated_protocol_is_mutual", "extra"]
    pauses = GcPauses()
    pauses.install()
    try:
        import gc

        gc.collect()
    finally:
        pauses.uninstall()
    stats = memory_stats(pauses)
    assert len(pauses.pauses_ns) >= 1 and stats["gc_total_runs"] >= 1 and stats["heap_in_use_bytes"] > 0
    assert stats["gc_pause_usec_100"] >= stats["gc_pause_usec_95"]


# ---------------------------------------------------------------------------------------------
# Real HTTP against a real gateway


def http_request(gateway: GatewayProcess, method: str, target: str, body: bytes | None = None,
                 headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    host, port = gateway.host_port("nsq-http")
    connection = http.client.HTTPConnection(host, port, timeout=10)
    try:
        connection.request(method, target, body=body, headers=headers or {})
        response = connection.getresponse()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()
    finally:
        connection.close()


def assert_error(result: tuple[int, dict[str, str], bytes], status: int, message: str) -> None:
    code, headers, body = result
    assert (code, body) == (status, json.dumps({"message": message}, separators=(",", ":")).encode())
    assert headers["content-type"] == JSON
    assert headers["x-nsq-content-type"] == NSQ_HEADER
    assert headers["content-length"] == str(len(body))


def assert_ok(result: tuple[int, dict[str, str], bytes]) -> None:
    code, headers, body = result
    assert (code, body, headers["content-type"]) == (200, b"OK", TEXT)
    assert headers["x-nsq-content-type"] == NSQ_HEADER


def assert_empty(result: tuple[int, dict[str, str], bytes]) -> None:
    code, headers, body = result
    assert (code, body, headers["content-length"]) == (200, b"", "0")
    assert "content-type" not in headers
    assert headers["x-nsq-content-type"] == NSQ_HEADER


def raw_http(gateway: GatewayProcess, request: bytes, *, shut_write: bool = False) -> bytes:
    """Send raw bytes and read until the server closes or a full response has arrived."""
    host, port = gateway.host_port("nsq-http")
    with socket.create_connection((host, port), timeout=10) as sock:
        sock.sendall(request)
        if shut_write:
            sock.shutdown(socket.SHUT_WR)
        data = b""
        while True:
            try:
                chunk = sock.recv(65536)
            except ConnectionResetError:
                break
            if not chunk:
                break
            data += chunk
            head, sep, rest = data.partition(b"\r\n\r\n")
            match = re.search(rb"content-length: (\d+)", head, re.IGNORECASE)
            if sep and not head.startswith(b"HTTP/1.1 100") and match and len(rest) >= int(match.group(1)):
                break
        return data


class TcpConsumer:
    """SUB over a raw socket with the client codec: magic, SUB, RDY, then message frames."""

    def __init__(self, gateway: GatewayProcess, topic: str, channel: str, rdy: int = 100) -> None:
        host, port = gateway.host_port("nsq-tcp")
        self.sock = socket.create_connection((host, port), timeout=5)
        self.reader = nsq_client.FrameReader()
        self.pending: list[nsq_client.Frame] = []
        self.sock.sendall(nsq_client.magic() + nsq_client.sub(topic, channel))
        frame = self.next_frame()
        assert frame.is_response and frame.data == b"OK", frame
        self.sock.sendall(nsq_client.rdy(rdy))

    def next_frame(self, timeout: float = 5.0) -> nsq_client.Frame:
        deadline = time.monotonic() + timeout
        while not self.pending:
            self.sock.settimeout(max(0.01, deadline - time.monotonic()))
            data = self.sock.recv(65536)
            assert data, "server closed the NSQ connection"
            self.reader.receive_data(data)
            self.pending.extend(self.reader.frames())
        return self.pending.pop(0)

    def messages(self, count: int, timeout: float = 5.0) -> list[nsq_client.Message]:
        out = []
        while len(out) < count:
            frame = self.next_frame(timeout)
            if frame.is_message:
                message = nsq_client.decode_message(frame.data)
                out.append(message)
                self.sock.sendall(nsq_client.fin(message.msg_id))
        return out

    def close(self) -> None:
        self.sock.close()


def test_http_basic_endpoints_exact(module_gateway: GatewayProcess):
    code, headers, body = http_request(module_gateway, "GET", "/ping")
    assert (code, body, headers["content-type"], headers["content-length"]) == (200, b"OK", TEXT, "2")
    assert "x-nsq-content-type" not in headers  # nsqd's PlainText /ping skips the V1 headers
    assert "server" not in headers
    code, headers, body = http_request(module_gateway, "GET", "/info")
    info = json.loads(body)
    assert (code, headers["content-type"], headers["x-nsq-content-type"]) == (200, JSON, NSQ_HEADER)
    assert list(info) == ["version", "broadcast_address", "hostname", "http_port", "tcp_port", "start_time",
                          "max_heartbeat_interval", "max_output_buffer_size", "max_output_buffer_timeout",
                          "max_deflate_level", "polymq_http_address"]  # nsqd's keys, then where the stream API is
    assert info["polymq_http_address"] == module_gateway.http
    assert info["http_port"] == module_gateway.host_port("nsq-http")[1]
    assert info["tcp_port"] == module_gateway.host_port("nsq-tcp")[1]
    assert info["version"] == "1.3.0" and info["max_heartbeat_interval"] == 60_000_000_000
    assert_error(http_request(module_gateway, "GET", "/nope"), 404, "NOT_FOUND")
    assert_error(http_request(module_gateway, "GET", "/put?topic=x"), 404, "NOT_FOUND")
    result = http_request(module_gateway, "GET", "/pub?topic=x")
    assert_error(result, 405, "METHOD_NOT_ALLOWED")
    assert result[1]["allow"] == "POST, OPTIONS"
    result = http_request(module_gateway, "POST", "/config/max_rdy_count")
    assert_error(result, 405, "METHOD_NOT_ALLOWED")
    assert result[1]["allow"] == "GET, PUT, OPTIONS"
    code, headers, body = http_request(module_gateway, "GET", "/config/max_rdy_count")
    assert (code, body, headers["content-type"]) == (200, b"2500", JSON)
    assert http_request(module_gateway, "GET", "/config/msg_timeout")[2] == b"60000000000"
    assert_error(http_request(module_gateway, "GET", "/config/nope"), 400, "INVALID_OPTION")
    assert_error(http_request(module_gateway, "PUT", "/config/max_rdy_count", b"10"), 400, "INVALID_OPTION")
    assert http_request(module_gateway, "PUT", "/config/log_level", b"info")[:3:2] == (200, b"2")
    code, headers, _ = http_request(module_gateway, "GET", "/ping/")
    assert (code, headers["location"]) == (301, "/ping")


def test_http_pub_mpub_reach_a_tcp_consumer(module_gateway: GatewayProcess):
    consumer = TcpConsumer(module_gateway, "http_flow", "c")
    try:
        assert_ok(http_request(module_gateway, "POST", "/pub?topic=http_flow", b"one"))
        assert_ok(http_request(module_gateway, "POST", "/mpub?topic=http_flow", b"two\n\nthree\n"))
        batch = nsq_client.mpub_body([b"four\nwith newline", b"five"])
        assert_ok(http_request(module_gateway, "POST", "/mpub?topic=http_flow&binary=true", batch))
        messages = consumer.messages(5)
        assert [m.body for m in messages] == [b"one", b"two", b"three", b"four\nwith newline", b"five"]
        assert all(m.attempts == 1 and re.fullmatch(rb"[0-9a-f]{16}", m.msg_id) for m in messages)
        # A deferred publish arrives after its delay, not before.
        started = time.monotonic()
        assert_ok(http_request(module_gateway, "POST", "/pub?topic=http_flow&defer=300", b"later"))
        (late,) = consumer.messages(1)
        assert late.body == b"later" and time.monotonic() - started >= 0.25
        # The consumer shows up in /stats under its channel, without the routing keys.
        stats = json.loads(http_request(module_gateway, "GET", "/stats?format=json&topic=http_flow")[2])
        (channel,) = stats["topics"][0]["channels"]
        assert channel["channel_name"] == "c" and channel["client_count"] == 1
        assert channel["message_count"] == 6
        (client,) = channel["clients"]
        assert client["version"] == "V2" and client["state"] == 3 and client["finish_count"] >= 5
        assert not any(key.startswith("_") for key in client)
        assert stats["topics"][0]["message_count"] == 6
    finally:
        consumer.close()


def test_http_backlog_and_channel_admin(module_gateway: GatewayProcess):
    gw = module_gateway
    assert_empty(http_request(gw, "POST", "/topic/create?topic=adm"))
    assert_ok(http_request(gw, "POST", "/pub?topic=adm", b"kept"))
    assert_empty(http_request(gw, "POST", "/channel/create?topic=adm&channel=ch"))
    assert_error(http_request(gw, "POST", "/channel/create?topic=nope_adm&channel=ch"), 404, "TOPIC_NOT_FOUND")
    assert_error(http_request(gw, "POST", "/channel/create?topic=adm"), 400, "MISSING_ARG_CHANNEL")
    assert_error(http_request(gw, "POST", "/channel/create?topic=adm&channel=b@d"), 400, "INVALID_ARG_CHANNEL")
    assert_empty(http_request(gw, "POST", "/channel/pause?topic=adm&channel=ch"))
    stats = json.loads(http_request(gw, "GET", "/stats?format=json&topic=adm&include_mem=false")[2])
    assert stats["topics"][0]["channels"][0]["paused"] is True
    assert stats["topics"][0]["channels"][0]["depth"] == 1  # the backlog went to the first channel
    text = http_request(gw, "GET", "/stats?topic=adm&include_mem=false")[2].decode()
    assert "   *P [ch                       ] depth: 1     be-depth: 0     inflt: 0    def: 0    re-q: 0     " in text
    assert_empty(http_request(gw, "POST", "/channel/unpause?topic=adm&channel=ch"))
    consumer = TcpConsumer(gw, "adm", "ch")
    try:
        assert [m.body for m in consumer.messages(1)] == [b"kept"]
    finally:
        consumer.close()
    assert_empty(http_request(gw, "POST", "/channel/empty?topic=adm&channel=ch"))
    assert_error(http_request(gw, "POST", "/channel/empty?topic=adm&channel=zz"), 404, "CHANNEL_NOT_FOUND")
    assert_empty(http_request(gw, "POST", "/channel/delete?topic=adm&channel=ch"))
    assert_error(http_request(gw, "POST", "/channel/delete?topic=adm&channel=ch"), 404, "CHANNEL_NOT_FOUND")
    assert_empty(http_request(gw, "POST", "/topic/pause?topic=adm"))
    assert_empty(http_request(gw, "POST", "/topic/unpause?topic=adm"))
    assert_empty(http_request(gw, "POST", "/topic/empty?topic=adm"))
    assert_empty(http_request(gw, "POST", "/topic/delete?topic=adm"))
    assert_error(http_request(gw, "POST", "/topic/delete?topic=adm"), 404, "TOPIC_NOT_FOUND")
    assert_error(http_request(gw, "POST", "/topic/pause"), 400, "MISSING_ARG_TOPIC")
    assert_error(http_request(gw, "POST", "/topic/create?topic=b@d"), 400, "INVALID_TOPIC")
    code, _, body = http_request(gw, "GET", "/stats?format=json&topic=adm")
    assert code == 200 and json.loads(body)["topics"] is None and json.loads(body)["producers"] is None


def test_http_pub_errors(module_gateway: GatewayProcess):
    gw = module_gateway
    assert_error(http_request(gw, "POST", "/pub?topic=perr", b""), 400, "MSG_EMPTY")
    assert_error(http_request(gw, "POST", "/pub", b"x"), 400, "MISSING_ARG_TOPIC")
    assert_error(http_request(gw, "POST", "/pub?topic=b@d", b"x"), 400, "INVALID_TOPIC")
    assert_error(http_request(gw, "POST", "/pub?topic=perr&defer=-1", b"x"), 400, "INVALID_DEFER")
    assert_error(http_request(gw, "POST", "/pub?topic=perr&defer=3600001", b"x"), 400, "INVALID_DEFER")
    assert_error(http_request(gw, "POST", "/pub?topic=perr;x", b"x"), 400, "INVALID_REQUEST")
    assert_ok(http_request(gw, "POST", "/pub?topic=perr", b"m" * MAX_MSG))
    # Too big by Content-Length: answered at once, before the body is sent.
    head = (b"POST /pub?topic=perr HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % (MAX_MSG + 1))
    reply = raw_http(gw, head)
    assert reply.startswith(b"HTTP/1.1 413")
    assert reply.endswith(b'\r\n\r\n{"message":"MSG_TOO_BIG"}')
    assert b"X-NSQ-Content-Type: nsq; version=1.0\r\n" in reply
    # Too big in a chunked body: the server stops reading at the cap and answers.
    chunk = b"a" * (MAX_MSG + 1)
    reply = raw_http(gw, b"POST /pub?topic=perr HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                     + b"%x\r\n" % len(chunk) + chunk + b"\r\n0\r\n\r\n")
    assert reply.startswith(b"HTTP/1.1 413") and reply.endswith(b'{"message":"MSG_TOO_BIG"}')
    assert_error(http_request(gw, "POST", "/mpub?topic=perr", b"x" * (MAX_MSG + 1)), 413, "MSG_TOO_BIG")
    assert_error(http_request(gw, "POST", "/mpub?topic=perr&binary=true", b"\x00\x00\x00\x00"), 413, "BAD_BODY")
    assert_error(http_request(gw, "POST", "/mpub?topic=perr&binary=1", struct.pack(">ii", 1, 5) + b"ab"),
                 413, "BAD_MESSAGE")
    head = b"POST /mpub?topic=perr HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % (MAX_BODY + 1)
    assert raw_http(gw, head).endswith(b'{"message":"BODY_TOO_BIG"}')
    # A keep-alive connection survives a refused small request (the server drains the body).
    host, port = gw.host_port("nsq-http")
    connection = http.client.HTTPConnection(host, port, timeout=10)
    try:
        connection.request("POST", "/pub?topic=b@d", body=b"x" * 1000)
        assert connection.getresponse().read() == b'{"message":"INVALID_TOPIC"}'
        connection.request("GET", "/ping")
        assert connection.getresponse().read() == b"OK"
    finally:
        connection.close()


def test_http_producer_in_stats(module_gateway: GatewayProcess):
    host, port = module_gateway.host_port("nsq-tcp")
    with socket.create_connection((host, port), timeout=5) as sock:
        sock.sendall(nsq_client.magic() + nsq_client.pub("prod_stats", b"x"))
        reader = nsq_client.FrameReader()
        frames: list[nsq_client.Frame] = []
        while not frames:
            reader.receive_data(sock.recv(4096))
            frames = reader.frames()
        assert frames[0].data == b"OK"
        stats = json.loads(http_request(module_gateway, "GET", "/stats?format=json&topic=prod_stats")[2])
        producers = [p for p in stats["producers"] if p.get("pub_counts")]
        assert {"topic": "prod_stats", "count": 1} in [c for p in producers for c in p["pub_counts"]]
        assert all(set(p["pub_counts"][0]) == {"topic", "count"} for p in producers)
        text = http_request(module_gateway, "GET", "/stats?topic=prod_stats&include_mem=0")[2].decode()
        assert re.search(r"\n\nProducers:\n   \[V2 .*\] msgs: 1 +topics: prod_stats=1 connected: \d+s\n", text)


def test_http_refused_with_auth_enabled():
    # Nothing listens on the auth address: HTTP publishes must be refused without asking it.
    with running_gateway("--auth-http-address", "127.0.0.1:9") as gw:
        assert_error(http_request(gw, "POST", "/pub?topic=a", b"x"), 403, "UNAUTHORIZED")
        assert_error(http_request(gw, "POST", "/mpub?topic=a", b"x"), 403, "UNAUTHORIZED")
        stats = json.loads(http_request(gw, "GET", "/stats?format=json")[2])
        assert stats["topics"] == []


# -- durability: an HTTP publish is acknowledged only after the storage sync ---------------------


class HeldSyncStorage(MemoryStorage):
    """Holds `sync` callbacks until the test releases them (a disk that has not fsynced yet)."""

    def __init__(self) -> None:
        self.pending: list[Callable[[OSError | None], None]] = []

    def sync(self, callback: Callable[[OSError | None], None]) -> None:
        self.pending.append(callback)


@pytest.mark.parametrize(("path", "query", "body"), [
    ("/pub", b"topic=durable", b"hello"),
    ("/mpub", b"topic=durable", b"one\ntwo"),
])
@pytest.mark.parametrize(("outcome", "status", "answer"), [
    (None, 200, b"OK"),
    # The storage could not write it (disk full): nsqd's doPUB answers 503 EXITING.
    (OSError(28, "No space left on device"), 503, b'{"message":"EXITING"}'),
])
async def test_http_publish_answer_waits_for_the_storage_sync(path: str, query: bytes, body: bytes,
                                                               outcome: OSError | None, status: int, answer: bytes):
    storage = HeldSyncStorage()
    app = nsq_http_app(NsqHttpApi(Engine(storage=storage), FakeNSQ()))
    scope = {"type": "http", "method": "POST", "path": path, "query_string": query,
             "headers": [(b"content-length", str(len(body)).encode())]}
    incoming = [{"type": "http.request", "body": body, "more_body": False}]
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return incoming.pop(0) if incoming else {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(app, scope, receive, send)
        await wait_all_tasks_blocked()
        assert sent == []  # stored, not yet durable: no answer
        assert len(storage.pending) == 1
        storage.pending.pop()(outcome)
    assert sent[0]["status"] == status
    assert sent[1]["body"] == answer


async def test_http_publish_is_refused_while_the_storage_is_failing():
    storage = HeldSyncStorage()
    storage.failure = "No space left on device"
    engine = Engine(storage=storage)
    app = nsq_http_app(NsqHttpApi(engine, FakeNSQ()))
    scope = {"type": "http", "method": "POST", "path": "/pub", "query_string": b"topic=full",
             "headers": [(b"content-length", b"1")]}
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"x", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await app(scope, receive, send)
    assert (sent[0]["status"], sent[1]["body"]) == (503, b'{"message":"EXITING"}')
    assert engine.topic("full") is None and storage.pending == []


async def test_http_publish_errors_do_not_wait_for_a_sync():
    storage = HeldSyncStorage()
    app = nsq_http_app(NsqHttpApi(Engine(storage=storage), FakeNSQ()))
    scope = {"type": "http", "method": "POST", "path": "/pub", "query_string": b"topic=bad*name",
             "headers": [(b"content-length", b"1")]}
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"x", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await app(scope, receive, send)
    assert sent[0]["status"] == 400
    assert storage.pending == []


def test_stats_backend_depth_counts_what_lives_on_disk_only():
    # nsqd's backend_depth: messages past --mem-queue-size, held in the diskqueue only.
    with running_gateway("--mem-queue-size", "5") as gateway:
        assert_ok(http_request(gateway, "POST", "/mpub?topic=spill", b"\n".join(b"m%d" % i for i in range(12))))

        def stats() -> dict[str, Any]:
            return json.loads(http_request(gateway, "GET", "/stats?format=json&topic=spill")[2])["topics"][0]

        assert (stats()["depth"], stats()["backend_depth"]) == (12, 7)  # a backlog: no channel yet
        assert_empty(http_request(gateway, "POST", "/channel/create?topic=spill&channel=c"))
        assert_ok(http_request(gateway, "POST", "/pub?topic=spill", b"m12"))
        # The backlog moves on to the new channel a batch per loop turn: wait for it, with a deadline.
        deadline = time.monotonic() + 5
        while stats()["depth"] and time.monotonic() < deadline:
            time.sleep(0.01)
        topic = stats()
        channel = topic["channels"][0]
        assert (topic["depth"], topic["backend_depth"]) == (0, 0)
        assert (channel["depth"], channel["backend_depth"]) == (13, 8)
