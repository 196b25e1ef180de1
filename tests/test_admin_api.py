"""The admin API without a browser: its exact JSON, its actions, who may use it, and start-up's rules
for its token. Sans-IO against an engine where it can be, a real `polymq serve` where it must."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from polymq.adapters.http import NeedBody, Request, Response
from polymq.adapters.traffic import Traffic
from polymq.codecs import nsq_client, phpmq, stream_rows
from polymq.core.engine import Engine
from polymq.gateway.admin_access import AdminAccess, is_loopback
from polymq.gateway.admin_api import AdminApi
from polymq.gateway.http import GatewayHttpApi

from support.gateway import running_gateway

TOKEN = "api-test-token-0123456789"
HOST = (b"host", b"127.0.0.1:4181")
HOSTILE = "<script>alert(1)</script>&\u2028"
ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "gateway" / "admin_page.html"
# A documented example: a curl command line to the default listener, and the answer its comment shows.
CURL = re.compile(r"^(curl .*127\.0\.0\.1:4181.*?)(?:\s+# (\{.*\}))?$", re.MULTILINE)


class TcpLike:
    """A service that lists its clients, as TCP services do."""

    def connections(self) -> int:
        return 1

    def traffic(self) -> Traffic:
        return Traffic(connections_opened=3, bytes_in=100, bytes_out=20)

    def peers(self) -> list[tuple[str, str]]:
        return [("127.0.0.1:9100", "127.0.0.1:50000")]


class ZmqLike:
    """A service that does not (ZeroMQ hides its peers)."""

    def connections(self) -> int:
        return 0

    def traffic(self) -> Traffic:
        return Traffic(messages_in=5, messages_out=4)


def _api(engine: Engine, token: str | None = None) -> GatewayHttpApi:
    admin = AdminApi(engine, lambda: {"phpmq": TcpLike(), "pzq": ZmqLike()}, AdminAccess(token))  # type: ignore[dict-item]
    return GatewayHttpApi(engine, admin.routes())


def _call(api: GatewayHttpApi, method: str, path: str, query: bytes = b"",
          headers: tuple[tuple[bytes, bytes], ...] = (HOST,)) -> Response:
    answer = api.handle(Request(method, path, query, headers=headers))
    assert not isinstance(answer, NeedBody)
    return answer


def _json(response: Response) -> Any:
    assert response.content_type == "application/json; charset=utf-8"
    return json.loads(response.body)


def _engine() -> Engine:
    """Topic orders made by PHPMQ with its PHPMQ queue and an NSQ channel; queue jobs with dead letters."""
    engine = Engine()
    engine.publish("orders", b"one", origin="phpmq")
    engine.ensure_queue("orders", origin="phpmq")
    engine.bind("orders", "orders")
    engine.ensure_queue("orders/billing", origin="nsq", owner_topic="orders")  # an NSQ channel
    engine.bind("orders/billing", "orders")
    engine.publish("orders", b"two", origin="nsq")
    engine.ensure_queue("jobs", origin="emqp")
    engine.bind("jobs", "jobs")
    delivered: list[Any] = []
    consumer = engine.attach("jobs", delivered.append, credit=2)
    engine.publish_many("jobs", [b"a", b"b"], origin="emqp")
    for message in delivered:
        engine.queues["jobs"].dead_letter(message.id)
    consumer.detach()
    return engine


def test_the_state_lists_topics_queues_and_protocols_exactly() -> None:
    state = _json(_call(_api(_engine()), "GET", "/api/state"))
    assert state["topics"] == [
        {"name": "jobs", "traced": None, "made_by": "emqp",
         "paused": False, "ephemeral": False, "depth": 0, "messages": 2,
         "queues": ["jobs"], "dead_letters_of": None},
        {"name": "jobs.dead", "traced": None, "made_by": None,
         "paused": False, "ephemeral": False, "depth": 2, "messages": 2,
         "queues": [], "dead_letters_of": "jobs"},
        {"name": "orders", "traced": None, "made_by": "phpmq",
         "paused": False, "ephemeral": False, "depth": 0, "messages": 2,
         "queues": ["orders", "orders/billing"], "dead_letters_of": None},
    ]
    jobs, orders, billing = state["queues"]
    assert jobs == {"name": "jobs", "made_by": "emqp", "topics": ["jobs"], "paused": False, "ephemeral": False,
                    "stream": False, "depth": 0, "in_flight": 0, "deferred": 0, "consumers": 0, "messages": 2,
                    "requeued": 0, "timed_out": 0, "expired": 0, "dead_lettered": 2, "dead_letter_topic": "jobs.dead",
                    "dead_letters": 2}
    assert (orders["name"], orders["made_by"], orders["depth"], orders["messages"]) == ("orders", "phpmq", 2, 2)
    assert (billing["name"], billing["made_by"], billing["depth"], billing["messages"]) == (
        "orders/billing", "nsq", 1, 1)
    assert state["protocols"] == [
        {"name": "phpmq", "connections": 1, "connections_opened": 3, "bytes_received": 100, "bytes_sent": 20,
         "messages_received": 0, "messages_sent": 0,
         "sessions": [{"listener": "127.0.0.1:9100", "peer": "127.0.0.1:50000"}]},
        {"name": "pzq", "connections": 0, "connections_opened": 0, "bytes_received": 0, "bytes_sent": 0,
         "messages_received": 5, "messages_sent": 4, "sessions": None},
    ]
    assert state["omitted"] == {"topics": 0, "queues": 0}
    assert state["store_failure"] is None


def test_actions_change_the_engine_and_answer_after_the_store_syncs() -> None:
    engine = _engine()
    api = _api(engine)
    paused = _call(api, "POST", "/api/queue/pause", b"queue=orders%2Fbilling")
    assert (paused.status, _json(paused), paused.after_sync) == (200, {"queue": "orders/billing", "paused": True}, True)
    assert engine.queues["orders/billing"].paused
    assert _json(_call(api, "POST", "/api/queue/unpause", b"queue=orders/billing")) == {
        "queue": "orders/billing", "paused": False}
    assert not engine.queues["orders/billing"].paused
    assert _json(_call(api, "POST", "/api/topic/pause", b"topic=orders")) == {"topic": "orders", "paused": True}
    assert engine.topics["orders"].paused
    engine.publish("orders", b"kept while paused")
    assert _json(_call(api, "POST", "/api/topic/empty", b"topic=orders")) == {"topic": "orders", "depth": 0}
    assert _json(_call(api, "POST", "/api/queue/empty", b"queue=orders")) == {"queue": "orders", "depth": 0}
    assert _json(_call(api, "POST", "/api/queue/requeue-dead", b"queue=jobs")) == {"queue": "jobs", "moved": 2,
                                                                                   "left": 0}
    assert [message.body for message in engine.queues["jobs"].ready] == [b"a", b"b"]
    assert _json(_call(api, "POST", "/api/topic/delete", b"topic=orders")) == {
        "topic": "orders", "deleted": True, "queues_deleted": ["orders/billing"], "queues_unbound": ["orders"]}
    assert "orders" not in engine.topics and "orders/billing" not in engine.queues
    assert engine.queues["orders"].topics == []
    assert _json(_call(api, "POST", "/api/queue/delete", b"queue=orders")) == {"queue": "orders", "deleted": True}
    assert "orders" not in engine.queues


@pytest.mark.parametrize(("method", "path", "query", "status", "answer"), [
    ("POST", "/api/queue/pause", b"queue=nope", 404, {"message": "QUEUE_NOT_FOUND", "reason": "no queue 'nope'"}),
    ("POST", "/api/topic/delete", b"topic=nope", 404, {"message": "TOPIC_NOT_FOUND", "reason": "no topic 'nope'"}),
    ("POST", "/api/topic/pause", b"", 400, {"message": "MISSING_ARG_TOPIC", "reason": "topic is required"}),
    ("POST", "/api/queue/empty", b"queue=%zz", 400,
     {"message": "INVALID_REQUEST", "reason": "the query string cannot be parsed"}),
    ("GET", "/api/queue/delete", b"queue=jobs", 405, {"message": "METHOD_NOT_ALLOWED",
                                                       "reason": "/api/queue/delete takes POST"}),
    ("GET", "/api/nothing", b"", 404, {"message": "NOT_FOUND", "reason": "no endpoint '/api/nothing'"}),
])
def test_errors_are_json(method: str, path: str, query: bytes, status: int, answer: dict[str, str]) -> None:
    response = _call(_api(_engine()), method, path, query)
    assert (response.status, _json(response)) == (status, answer)


def test_with_a_token_the_api_and_every_action_ask_for_it_and_the_page_does_not() -> None:
    engine = _engine()
    api = _api(engine, TOKEN)
    for method, path, query in (("GET", "/api/state", b""), ("POST", "/api/queue/delete", b"queue=jobs")):
        missing = _call(api, method, path, query)
        assert (missing.status, _json(missing)) == (401, {
            "message": "UNAUTHORIZED", "reason": "the admin API asks for its token: Authorization: Bearer TOKEN"})
        assert ("WWW-Authenticate", 'Bearer realm="polymq"') in missing.headers
        basic = _call(api, method, path, query, (HOST, (b"authorization", b"Basic " + TOKEN.encode())))
        assert basic.status == 401
        wrong = _call(api, method, path, query, (HOST, (b"authorization", b"Bearer " + TOKEN[:-1].encode())))
        assert (wrong.status, _json(wrong)) == (403, {"message": "FORBIDDEN",
                                                      "reason": "the token is not the admin API's"})
    assert "jobs" in engine.queues
    # Any Host and Origin once the token is right: the token is what a foreign page cannot send.
    right = ((b"host", b"gateway.example:4181"), (b"origin", b"http://elsewhere.example"),
             (b"authorization", b"bearer " + TOKEN.encode()))
    assert _call(api, "GET", "/api/state", headers=right).status == 200
    assert _call(api, "POST", "/api/queue/delete", b"queue=jobs", right).status == 200
    assert "jobs" not in engine.queues
    page = _call(api, "GET", "/", headers=())
    assert (page.status, page.content_type) == (200, "text/html; charset=utf-8")


def test_without_a_token_only_loopback_requests_and_the_page_itself_may_act() -> None:
    engine = _engine()
    api = _api(engine)
    rebound = _call(api, "GET", "/api/state", headers=((b"host", b"attacker.example:4181"),))
    assert (rebound.status, _json(rebound)["message"]) == (403, "FORBIDDEN")
    for host in (b"127.0.0.1:4181", b"localhost:4181", b"[::1]:4181", b"127.0.0.1"):
        assert _call(api, "GET", "/api/state", headers=((b"host", host),)).status == 200, host
    foreign = _call(api, "POST", "/api/queue/pause", b"queue=jobs", (HOST, (b"origin", b"http://attacker.example")))
    assert (foreign.status, _json(foreign)) == (403, {"message": "FORBIDDEN",
                                                      "reason": "an action is taken only from the admin page itself"})
    assert _call(api, "POST", "/api/queue/pause", b"queue=jobs", (HOST, (b"origin", b"null"))).status == 403
    assert not engine.queues["jobs"].paused
    own = _call(api, "POST", "/api/queue/pause", b"queue=jobs", (HOST, (b"origin", b"http://127.0.0.1:4181")))
    assert own.status == 200 and engine.queues["jobs"].paused
    assert _call(api, "POST", "/api/queue/unpause", b"queue=jobs").status == 200  # curl sends no Origin


def test_a_hostile_name_reaches_the_page_as_escaped_json_and_the_page_renders_only_text() -> None:
    engine = Engine()
    engine.publish(HOSTILE, b"x", origin="phpmq")
    body = _call(_api(engine), "GET", "/api/state").body
    assert b"<" not in body and b">" not in body and b"&" not in body and "\u2028".encode() not in body
    assert json.loads(body)["topics"][0]["name"] == HOSTILE
    # The page's script turns data into text nodes only: no HTML parsing sink appears in it.
    script = re.search(r"<script>(.*)</script>", PAGE.read_text(), re.DOTALL)
    assert script is not None
    for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval(", "new Function",
                 "setAttribute(\"on", "srcdoc"):
        assert sink not in script.group(1), sink
    # And the browser is told to run nothing else: no inline script but the page's own.
    policy = dict(_call(_api(engine), "GET", "/").headers)["Content-Security-Policy"]
    assert "'unsafe-inline'" not in policy and "script-src 'sha256-" in policy and "frame-ancestors 'none'" in policy


@pytest.mark.parametrize(("host", "loopback"), [
    ("127.0.0.1", True), ("127.1.2.3", True), ("::1", True), ("[::1]", True), ("localhost", True),
    ("0.0.0.0", False), ("::", False), ("192.168.1.10", False), ("gateway.example", False), ("", False)])
def test_loopback_addresses(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback


# -- the real gateway --------------------------------------------------------------------------

FREE_PORTS = ("--nsq-tcp-port", "0", "--nsq-http-port", "0", "--mqks-port", "0", "--phpmq-port", "0",
              "--phpmq-console-port", "0", "--no-pzq", "--no-emqp", "--admin-port", "0", "--in-memory")


def _serve(tmp_path: Path, *args: str) -> list[str]:
    """The ERROR lines of a `polymq serve` that must fail at start-up (exit status 1), run in `tmp_path`."""
    result = subprocess.run([sys.executable, "-m", "polymq", "serve", *FREE_PORTS, *args], capture_output=True,
                            text=True, timeout=30, cwd=tmp_path)
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr
    return [line.split(" gateway  ", 1)[1] for line in result.stderr.splitlines() if " ERROR " in line]


def test_bound_beyond_loopback_without_a_token_the_gateway_does_not_start(tmp_path: Path) -> None:
    assert _serve(tmp_path, "--admin-bind", "0.0.0.0") == [
        "--admin-bind 0.0.0.0 is beyond loopback: give --admin-token-file (or --admin-token) so that the admin "
        "API and its actions ask for a token"]
    assert _serve(tmp_path, "--admin-token", "short") == [
        "--admin-token: the token must have at least 16 characters (`openssl rand -hex 16` makes one)"]
    missing = tmp_path / "missing"
    assert _serve(tmp_path, "--admin-token-file", str(missing)) == [
        f"cannot read --admin-token-file {missing}: no such file or directory"]
    token_file = tmp_path / "token"
    token_file.write_text("with a space in it, and long enough\n")
    assert _serve(tmp_path, "--admin-token-file", str(token_file)) == [
        f"--admin-token-file {token_file}: the token must be visible ASCII characters without spaces"]
    assert _serve(tmp_path, "--admin-token", TOKEN, "--admin-token-file", str(token_file)) == [
        "give --admin-token or --admin-token-file, not both"]


def _get(url: str, headers: dict[str, str] | None = None, data: bytes | None = None) -> tuple[int, Any]:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data=data, headers=headers or {}), timeout=10) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def test_a_real_gateway_says_how_its_api_is_guarded_and_checks_the_token(tmp_path: Path) -> None:
    with running_gateway("--admin-token", TOKEN, "--in-memory", data_dir=tmp_path) as gateway:
        line = gateway.wait_for_log(lambda text: " admin page " in text)
        assert line.endswith(f"admin page http://{gateway.http}/: the API and its actions, /metrics and the stream "
                             "API ask for the token (Authorization: Bearer)")
        assert _get(f"http://{gateway.http}/api/state")[0] == 401
        status, state = _get(f"http://{gateway.http}/api/state", {"Authorization": f"Bearer {TOKEN}"})
        assert status == 200 and [protocol["name"] for protocol in state["protocols"]] == [
            "nsq", "mqks", "phpmq", "pzq", "emqp"]
    with running_gateway("--in-memory", data_dir=tmp_path) as gateway:
        line = gateway.wait_for_log(lambda text: " admin page " in text)
        assert line.endswith(f"admin page http://{gateway.http}/: the API and its actions are open to this machine's "
                             "users without a token (loopback only; --admin-token-file sets one)")
        assert _get(f"http://{gateway.http}/api/state")[0] == 200
        status, refused = _get(f"http://{gateway.http}/api/topic/pause?topic=none", {"Origin": "http://evil.example"},
                               b"")
        assert (status, refused["message"]) == (403, "FORBIDDEN")
        assert _get(f"http://{gateway.http}/api/topic/pause?topic=none", data=b"")[0] == 404


def test_the_documented_curl_examples_run_as_printed(tmp_path: Path) -> None:
    section = (ROOT / "docs" / "operations.md").read_text().split("\n## The admin page\n")[1].split("\n## ")[0]
    examples = CURL.findall(section)
    assert len(examples) >= 8
    with running_gateway("--in-memory", data_dir=tmp_path) as gateway, \
            socket.create_connection(gateway.host_port("phpmq"), timeout=10) as php, \
            socket.create_connection(gateway.host_port("nsq-tcp"), timeout=10) as nsq:
        php.sendall(phpmq.send(b"orders", b"one"))
        deadline = time.monotonic() + 60
        while not any(topic["name"] == "orders" for topic in _get(f"http://{gateway.http}/api/state")[1]["topics"]):
            assert time.monotonic() < deadline, "the PHPMQ publish did not arrive"
            time.sleep(0.05)
        nsq.sendall(nsq_client.magic() + nsq_client.sub("orders", "billing"))
        reader = nsq_client.FrameReader()
        while not reader.frames():
            reader.receive_data(nsq.recv(65536))
        for command, expected in examples:
            result = subprocess.run(["bash", "-c", command.replace("127.0.0.1:4181", gateway.http)],
                                    capture_output=True, text=True, timeout=30)
            assert result.returncode == 0, (command, result.stderr)
            answer = json.loads(result.stdout)
            if expected:
                assert answer == json.loads(expected), command


def _status(url: str, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=10) as reply:
            return reply.status, reply.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


def test_with_a_token_metrics_and_the_stream_api_ask_for_it_and_ping_does_not(tmp_path: Path) -> None:
    from pyspark_polymq.source import Options

    from polymq.clients.stream import StreamClient, StreamClientError

    with running_gateway("--admin-token", TOKEN, "--in-memory", data_dir=tmp_path) as gateway:
        base = f"http://{gateway.http}"
        assert _status(f"{base}/ping") == (200, b"OK")
        status, body = _status(f"{base}/metrics")
        assert (status, json.loads(body)) == (401, {
            "message": "UNAUTHORIZED", "reason": "/metrics asks for its token: Authorization: Bearer TOKEN"})
        status, body = _status(f"{base}/metrics", {"Authorization": "Bearer not-the-token-at-all"})
        assert (status, json.loads(body)) == (403, {"message": "FORBIDDEN",
                                                    "reason": "the token is not the one /metrics asks for"})
        status, body = _status(f"{base}/metrics", {"Authorization": f"Bearer {TOKEN}"})
        assert status == 200 and b"polymq_store_failing 0.0" in body

        with StreamClient(gateway.http) as anonymous, pytest.raises(StreamClientError) as refused:
            anonymous.open("s", ["t"])
        assert (refused.value.status, refused.value.code) == (401, "UNAUTHORIZED")
        with StreamClient(gateway.http, token="not-the-token-at-all") as wrong, \
                pytest.raises(StreamClientError) as refused:
            wrong.offsets("s")
        assert (refused.value.status, refused.value.code) == (403, "FORBIDDEN")
        # The Spark data source's `token` option: its clients carry it.
        options = Options.of({"gateway": gateway.http, "token": TOKEN})
        with options.client(gateway.http) as client:
            assert client.open("s", ["t"])["start"] == 0
            assert client.publish([stream_rows.encode_publish_row(b"row")], topic="t") == {
                "published": 1, "duplicates": 0}
            assert client.offsets("s")["end"] == 1
    with running_gateway("--in-memory", data_dir=tmp_path) as gateway:  # loopback without a token: open
        assert _status(f"http://{gateway.http}/metrics")[0] == 200
        with StreamClient(gateway.http) as client:
            assert client.open("s", ["t"])["start"] == 0
