"""Tracing through a real gateway: a message published over each protocol and consumed over another
(NSQ → MQKS with a requeue, MQKS → NSQ with a timeout, PZQ → eMQP with two workers gone and a dead
letter, PHPMQ → PZQ with a refusal, eMQP → PHPMQ with a dead letter) gives the exact timeline
through the admin API, found by the id its consumer saw, and the same events on the trace topic,
read by an NSQ consumer. A kill -9 while tracing loses no message."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

from polymq.clients import emqp as emqp_client
from polymq.clients import mqks_blocking, nsq, phpmq, pzq_blocking
from polymq.codecs import nsq_client, pzq

from support.gateway import GatewayProcess, running_gateway

ROOT = Path(__file__).resolve().parent.parent
TRACED = ("orders", "invoices", "jobs", "tasks")
# Every bounded wait: long enough for a loaded 2-core machine, never slept through.
WAIT_S = 15.0
TRACE_TOPIC = "polymq.trace"


@pytest.fixture(scope="module")
def gateway() -> Iterator[GatewayProcess]:
    args = [arg for topic in TRACED for arg in ("--trace", topic)]
    with running_gateway(*args, "--pzq-queue", "jobs", "--emqp-max-attempts", "2") as process:
        yield process


@pytest.fixture(scope="module")
def tail(gateway: GatewayProcess) -> Iterator[nsq.Connection]:
    """An NSQ consumer of the trace topic, subscribed before anything is traced."""
    with nsq.Connection(gateway.nsq_tcp) as connection:
        connection.send(nsq_client.sub(TRACE_TOPIC, "tail"))
        connection.wait_for_ok("SUB")
        connection.send(nsq_client.rdy(1000))
        yield connection


def _get(gateway: GatewayProcess, path: str, **query: str) -> Any:
    with urllib.request.urlopen(f"http://{gateway.http}{path}?{urllib.parse.urlencode(query)}", timeout=10) as reply:
        return json.load(reply)


def _until(check: Callable[[], Any], what: str) -> Any:
    deadline = time.monotonic() + WAIT_S
    while True:
        found = check()
        if found:
            return found
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {WAIT_S} s: {what}")
        time.sleep(0.02)


def _timeline(gateway: GatewayProcess, shown_id: str, events: int) -> dict[str, Any]:
    """The one traced message with `shown_id`, once it has `events` events."""
    def found() -> dict[str, Any] | None:
        messages = _get(gateway, "/api/trace/find", q=shown_id)["messages"]
        return messages[0] if len(messages) == 1 and len(messages[0]["events"]) >= events else None
    return _until(found, f"{events} events of {shown_id}")


def _steps(timeline: dict[str, Any]) -> list[tuple[Any, ...]]:
    return [(event["event"], event.get("queue") or event.get("topic"), event.get("protocol"), event.get("attempt"))
            for event in timeline["events"]]


def _from_tail(tail: nsq.Connection, message_id: int, count: int) -> list[dict[str, Any]]:
    """The trace topic's events of `message_id`, as an NSQ consumer reads them (each FINished)."""
    seen: list[dict[str, Any]] = []
    deadline = time.monotonic() + WAIT_S
    while len(seen) < count:
        frame = tail.next_frame(max(0.01, deadline - time.monotonic()))
        assert frame is not None, f"{len(seen)} of {count} events on the trace topic"
        message = nsq_client.decode_message(frame.data)
        tail.send(nsq_client.fin(message.msg_id))
        event = json.loads(message.body)
        if event["message_id"] == message_id:
            seen.append(event)
    return seen


def _check_the_trace_topic(tail: nsq.Connection, timeline: dict[str, Any]) -> None:
    assert _from_tail(tail, timeline["message_id"], len(timeline["events"])) == timeline["events"]


def _nsq_consumer(gateway: GatewayProcess, topic: str, channel: str, **identify: Any) -> nsq.Connection:
    connection = nsq.Connection(gateway.nsq_tcp)
    connection.send(nsq_client.identify({"client_id": f"{channel}-reader", **identify}))
    connection.wait_for_ok("IDENTIFY")
    connection.send(nsq_client.sub(topic, channel))
    connection.wait_for_ok("SUB")
    connection.send(nsq_client.rdy(1))
    return connection


def _nsq_message(connection: nsq.Connection) -> nsq_client.Message:
    frame = connection.next_frame(WAIT_S)
    assert frame is not None and frame.is_message
    return nsq_client.decode_message(frame.data)


def test_nsq_to_mqks_with_a_requeue(gateway: GatewayProcess, tail: nsq.Connection) -> None:
    with mqks_blocking.Connection(gateway.host_port("mqks")) as mqks, nsq.Connection(gateway.nsq_tcp) as publisher:
        mqks.request("c-billing", "consume", "billing orders --manual-ack", confirm=True)
        assert mqks.next_line(WAIT_S) == b"c-billing ok "
        publisher.send(nsq_client.identify({"client_id": "shop"}))
        publisher.wait_for_ok("IDENTIFY")
        publisher.send(nsq_client.pub("orders", b"order 1"))
        publisher.wait_for_ok("PUB")
        first = mqks.next_line(WAIT_S)
        assert first is not None and first.endswith(b" event=orders order 1")
        msg_id = first.split(b" ")[2].decode()
        mqks.request("r1", "reject", f"c-billing {msg_id}")
        assert mqks.next_line(WAIT_S) == f"c-billing ok {msg_id} event=orders,retry=1 order 1".encode()
        mqks.request("a1", "ack", f"c-billing {msg_id}")
        timeline = _timeline(gateway, msg_id, 6)
    assert _steps(timeline) == [
        ("published", "orders", "nsq", None), ("queued", "billing", None, None),
        ("delivered", "billing", "mqks", 1), ("requeued", "billing", "mqks", 1),
        ("delivered", "billing", "mqks", 2), ("finished", "billing", "mqks", 2),
    ]
    published, delivered = timeline["events"][0], timeline["events"][2]
    assert (published["client_name"], published["size"]) == ("shop", 7)
    assert published["client"].startswith("127.0.0.1:") and delivered["client"].startswith("127.0.0.1:")
    assert delivered["client_name"] == "c-billing"
    assert timeline["ids"]["nsq"] == timeline["ids"]["mqks"] == msg_id == f"{timeline['message_id']:016x}"
    assert timeline["gaps"] == []
    _check_the_trace_topic(tail, timeline)


def test_mqks_to_nsq_with_a_timeout(gateway: GatewayProcess, tail: nsq.Connection) -> None:
    with _nsq_consumer(gateway, "invoices", "audit", msg_timeout=1000) as reader, \
            mqks_blocking.Connection(gateway.host_port("mqks")) as mqks:
        mqks.request("invoice-77", "publish", "invoices invoice 77", confirm=True)
        assert mqks.next_line(WAIT_S) == b"invoice-77 ok "
        first = _nsq_message(reader)
        assert first.attempts == 1
        again = _nsq_message(reader)  # not finished within the second: sent again
        assert (again.msg_id, again.attempts) == (first.msg_id, 2)
        reader.send(nsq_client.fin(again.msg_id))
        timeline = _timeline(gateway, "invoice-77", 6)
    assert _steps(timeline) == [
        ("published", "invoices", "mqks", None), ("queued", "invoices/audit", None, None),
        ("delivered", "invoices/audit", "nsq", 1), ("timed_out", "invoices/audit", "nsq", 1),
        ("delivered", "invoices/audit", "nsq", 2), ("finished", "invoices/audit", "nsq", 2),
    ]
    assert timeline["events"][0]["publisher_id"] == "invoice-77" == timeline["ids"]["mqks"]
    assert timeline["ids"]["nsq"] == first.msg_id.decode()
    assert timeline["events"][2]["client_name"] == "audit-reader"
    assert _get(gateway, "/api/trace/find", q=first.msg_id.decode())["messages"][0]["events"] == timeline["events"]
    _check_the_trace_topic(tail, timeline)


def test_pzq_to_emqp_two_workers_gone_then_a_dead_letter(gateway: GatewayProcess, tail: nsq.Connection) -> None:
    context = zmq.Context()
    try:
        backend = gateway.addresses["emqp-backend"]
        with emqp_client.Worker(context, backend, identity=b"worker-1") as first:
            first.inform([(10, "jobs")])  # the queue, made by eMQP with its max attempts (2)
            first.ready(1)
            with pzq_blocking.Producer(context, gateway.addresses["pzq-receive"]) as producer:
                assert producer.produce(b"job 9", producer_id=b"produced-9")[:2] == [b"produced-9", pzq.ACK_OK]
            job = first.job(WAIT_S)
            first.leave()
        with emqp_client.Worker(context, backend, identity=b"worker-2") as second:
            second.inform([(10, "jobs")])
            second.ready(1)
            assert second.job(WAIT_S)[3] == job[3]
            second.leave()
        msgid = job[3].decode()
        timeline = _timeline(gateway, msgid, 8)
    finally:
        context.term()
    assert _steps(timeline) == [
        ("published", "jobs", "pzq", None), ("queued", "jobs", None, None),
        ("delivered", "jobs", "emqp", 1), ("returned", "jobs", "emqp", 1),
        ("delivered", "jobs", "emqp", 2), ("returned", "jobs", "emqp", 2),
        ("dead_lettered", "jobs", None, 2), ("kept", "jobs.dead", None, None),
    ]
    assert timeline["events"][0]["publisher_id"] == "produced-9"
    assert [timeline["events"][index]["client_name"] for index in (2, 4)] == ["worker-1", "worker-2"]
    assert timeline["events"][6]["topic"] == "jobs.dead" and timeline["events"][6]["reason"] == "max attempts"
    assert timeline["gaps"] == ["sitting in dead-letter topic jobs.dead: no queue reads it"]
    assert timeline["ids"]["emqp"] == msgid and timeline["ids"]["pzq"] == f"{timeline['message_id']:016x}"
    _check_the_trace_topic(tail, timeline)


def test_phpmq_to_pzq_with_a_refusal(gateway: GatewayProcess, tail: nsq.Connection) -> None:
    context = zmq.Context()
    try:
        with pzq_blocking.Consumer(context, gateway.addresses["pzq-send"]) as consumer, \
                phpmq.Connection(gateway.host_port("phpmq")) as publisher:
            publisher.publish("jobs", b"job 10")
            publisher.barrier()
            first = consumer.receive(WAIT_S)
            consumer.ack(first, b"0")  # refused: sent again first
            again = consumer.receive(WAIT_S)
            assert again[1] == first[1]
            consumer.ack(again)
            key = first[1].decode()
            timeline = _timeline(gateway, key, 6)
    finally:
        context.term()
    assert _steps(timeline) == [
        ("published", "jobs", "phpmq", None), ("queued", "jobs", None, None),
        ("delivered", "jobs", "pzq", 1), ("requeued", "jobs", "pzq", 1),
        ("delivered", "jobs", "pzq", 2), ("finished", "jobs", "pzq", 2),
    ]
    assert timeline["ids"]["pzq"] == key and timeline["ids"]["phpmq"] == f"{timeline['message_id']:032x}"
    assert timeline["gaps"] == []
    _check_the_trace_topic(tail, timeline)


def test_emqp_to_phpmq_with_a_dead_letter(gateway: GatewayProcess, tail: nsq.Connection) -> None:
    context = zmq.Context()
    try:
        with phpmq.Connection(gateway.host_port("phpmq")) as reader, \
                emqp_client.Client(context, gateway.addresses["emqp-frontend"], identity=b"client-5") as client:
            reader.consume("tasks", 1)
            reader.barrier()
            msgid = client.request("tasks", b"task 5").decode()
            [delivery] = reader.deliveries(1, WAIT_S)
            reader.dead_letter("tasks", delivery.message_id)
            timeline = _timeline(gateway, delivery.message_id.decode(), 5)
    finally:
        context.term()
    assert _steps(timeline) == [
        ("published", "tasks", "emqp", None), ("queued", "tasks", None, None),
        ("delivered", "tasks", "phpmq", 1), ("dead_lettered", "tasks", None, 1), ("kept", "tasks.dead", None, None),
    ]
    assert timeline["events"][0]["publisher_id"] == msgid == timeline["ids"]["emqp"]
    assert timeline["events"][0]["client_name"] == "client-5"
    assert timeline["gaps"] == ["sitting in dead-letter topic tasks.dead: no queue reads it"]
    _check_the_trace_topic(tail, timeline)


def test_the_trace_topic_cannot_be_traced_and_switching_is_an_action(gateway: GatewayProcess) -> None:
    def post(path: str, topic: str, origin: str | None = None) -> tuple[int, Any]:
        request = urllib.request.Request(f"http://{gateway.http}{path}?topic={topic}", method="POST",
                                         headers={"Origin": origin} if origin else {})
        try:
            with urllib.request.urlopen(request, timeout=10) as reply:
                return reply.status, json.load(reply)
        except urllib.error.HTTPError as error:
            return error.code, json.load(error)

    assert post("/api/trace/on", TRACE_TOPIC) == (400, {
        "message": "TRACE_REFUSED", "reason": "'polymq.trace' is the trace topic: its own events are never traced"})
    assert post("/api/trace/on", "other", origin="http://evil.example")[0] == 403
    assert post("/api/trace/on", "other") == (200, {"topic": "other", "traced": True})
    assert post("/api/trace/off", "other") == (200, {"topic": "other", "traced": False})
    state = _get(gateway, "/api/trace")
    assert [topic["name"] for topic in state["topics"] if topic["traced"]] == sorted(TRACED)
    assert state["trace_topic"] == [TRACE_TOPIC]


def test_a_kill_9_while_tracing_loses_no_message(tmp_path: Path) -> None:
    """Tracing lives in memory: the kill takes the trace's tail, never an acknowledged message."""
    published = [b"order %d" % number for number in range(200)]
    with running_gateway("--trace", "orders", data_dir=tmp_path) as gateway:
        with nsq.Connection(gateway.nsq_tcp) as publisher:
            publisher.send(nsq_client.mpub("orders", published[:100]))
            publisher.wait_for_ok("MPUB")
            with _nsq_consumer(gateway, "orders", "keep"):
                pass  # the channel exists now: the rest is kept for it
            for body in published[100:]:
                publisher.send(nsq_client.pub("orders", body))
                publisher.wait_for_ok("PUB")
        gateway.stop(signal.SIGKILL)
    with running_gateway(data_dir=tmp_path) as gateway, _nsq_consumer(gateway, "orders", "keep") as reader:
        reader.send(nsq_client.rdy(200))
        got = []
        while len(got) < len(published):
            message = _nsq_message(reader)
            reader.send(nsq_client.fin(message.msg_id))
            got.append(message.body)
        assert sorted(got) == sorted(published)
        assert _get(gateway, "/api/trace")["topics"] == []  # the trace itself was in memory


def test_the_documented_commands_run_as_printed(tmp_path: Path) -> None:
    """docs/operations.md's "Tracing a topic": its curl lines and its MQKS reader, on a gateway started as
    it says (its ports put where the lines name the defaults), each answer as its comment says."""
    section = (ROOT / "docs" / "operations.md").read_text().split("\n## Tracing a topic\n")[1].split("\n## ")[0]
    curls = re.findall(r"^(curl .*?)(?:\s+# (.*))?$", section, re.MULTILINE)
    [script] = re.findall(r"^\.venv/bin/python - <<'EOF'\n(.*?)^EOF$", section, re.MULTILINE | re.DOTALL)
    assert len(curls) == 3 and "--trace orders" in section
    with running_gateway("--in-memory", "--trace", "orders", data_dir=tmp_path) as gateway:
        ports = {"4151": gateway.nsq_http.rsplit(":", 1)[1], "4181": gateway.http.rsplit(":", 1)[1],
                 "25000": str(gateway.host_port("mqks")[1])}

        def on_gateway(text: str) -> str:
            return re.sub(r"\b(4151|4181|25000)\b", lambda match: ports[match.group(1)], text)

        for command, expected in curls:
            result = subprocess.run(["bash", "-c", on_gateway(command)], capture_output=True, text=True, timeout=30,
                                    check=True)
            if expected:
                assert result.stdout == expected, command
        recent = _get(gateway, "/api/trace/recent", topic="orders")["messages"]
        assert [(message["protocol"], message["last_event"]) for message in recent] == [("nsq", "kept")]
        result = subprocess.run([sys.executable, "-"], input=on_gateway(script), capture_output=True, text=True,
                                timeout=60, check=True)
        assert result.stdout.splitlines() == ["c1 ok ", "c2 ok ", "published orders p1"]
