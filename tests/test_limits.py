"""The limits that hold connections and queue depths, on a real gateway: exact refusals on the wire,
the counters in `/metrics`, and the log lines an operator reads."""

from __future__ import annotations

import re
import socket
import time
import urllib.request

import pytest
import zmq

from polymq.clients.stream import StreamClient, StreamClientError
from polymq.codecs import emqp, nsq, nsq_client, stream_rows
from tests.support.emqp_wire import Peer as EMQPPeer
from tests.support.gateway import GatewayProcess, running_gateway
from tests.support.mqks_wire import MQKSWire
from tests.support.nsq_wire import RawClient, consumer
from tests.support.phpmq_wire import PHPMQWire

DEADLINE_S = 10.0


def metric(gateway: GatewayProcess, name: str, labels: str) -> float:
    with urllib.request.urlopen(f"http://{gateway.http}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    found = re.search(rf"^{re.escape(name)}\{{{re.escape(labels)}\}} (\S+)$", text, re.M)
    assert found, f"no {name}{{{labels}}} in /metrics"
    return float(found.group(1))


def read_until_closed(sock: socket.socket) -> bytes:
    """Every byte the server sends until it closes (within the deadline)."""
    sock.settimeout(DEADLINE_S)
    received = bytearray()
    while data := sock.recv(65536):
        received += data
    return bytes(received)


def test_connections_past_the_maximum_get_each_protocols_refusal() -> None:
    with running_gateway("--nsq-max-connections", "2", "--mqks-max-connections", "1",
                         "--phpmq-max-connections", "1") as gateway:
        # The ones allowed, each proven served (a round trip) before the next one comes.
        kept = [RawClient(gateway.nsq_tcp), RawClient(gateway.nsq_tcp)]
        for client in kept:
            client.send(nsq_client.pub("t", b"x"))
            client.expect_response(b"OK")
        with socket.create_connection(gateway.host_port("nsq-tcp")) as refused:
            refused.sendall(nsq_client.magic())
            assert read_until_closed(refused) == nsq.frame_error(
                nsq.fatal("E_TOO_MANY_CONNECTIONS", "too many connections"))

        mqks = MQKSWire(gateway.host_port("mqks"))
        assert mqks.barrier() == []
        with socket.create_connection(gateway.host_port("mqks")) as refused:
            refused.sendall(b"p1 ping x\n")
            assert re.fullmatch(rb"None error \S+\n", read_until_closed(refused))

        php = PHPMQWire(gateway.host_port("phpmq"))
        php.publish("p", b"z")
        php.consume("p", 1)
        assert [delivery.content for delivery in php.deliveries(1)] == [b"z"]  # served: a round trip
        with socket.create_connection(gateway.host_port("phpmq")) as refused:
            assert read_until_closed(refused) == b""

        assert metric(gateway, "polymq_connections_refused_total", 'protocol="nsq"') == 1
        assert metric(gateway, "polymq_connections_refused_total", 'protocol="mqks"') == 1
        assert metric(gateway, "polymq_connections_refused_total", 'protocol="phpmq"') == 1

        # One gone, one more may come.
        kept.pop().close()
        deadline = time.monotonic() + DEADLINE_S
        while metric(gateway, "polymq_connections", 'protocol="nsq"') != 1:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        with RawClient(gateway.nsq_tcp) as again:
            again.send(nsq_client.pub("t", b"y"))
            again.expect_response(b"OK")
        for client in kept:
            client.close()
        mqks.close()
        php.close()
        gateway.wait_for_log(lambda line: " nsq " in line and "connection refused" in line
                             and "E_TOO_MANY_CONNECTIONS" in line)
        gateway.wait_for_log(lambda line: " nsq " in line and "connection opened on 127.0.0.1:" in line)
        gateway.wait_for_log(lambda line: " nsq " in line and "connection closed: client went away" in line)


def test_a_full_queue_refuses_nsq_publishes_with_e_pub_failed() -> None:
    # The consumer sends no RDY: everything stays ready.
    with (running_gateway("--max-queue-depth", "3") as gateway, consumer(gateway.nsq_tcp, "orders", "billing"),
          RawClient(gateway.nsq_tcp) as producer):
        producer.send(nsq_client.mpub("orders", [b"1", b"2"]))
        producer.expect_response(b"OK")
        producer.send(nsq_client.pub("orders", b"3"))
        producer.expect_response(b"OK")
        producer.send(nsq_client.pub("orders", b"4"))
        producer.expect_error(b"E_PUB_FAILED PUB failed queue orders/billing is full "
                              b"(3 messages, the limit is 3)")
        producer.expect_closed()


def test_a_full_queue_refuses_http_and_mqks_publishes() -> None:
    with running_gateway("--max-queue-depth", "2") as gateway:
        with consumer(gateway.nsq_tcp, "ev", "c"):
            with MQKSWire(gateway.host_port("mqks")) as mqks:
                mqks.send(b"a1 publish --confirm ev one")
                mqks.send(b"a2 publish --confirm ev two")
                assert mqks.line() == b"a1 ok "
                assert mqks.line() == b"a2 ok "
                mqks.send(b"a3 publish --confirm ev three")
                assert re.fullmatch(rb"a3 error \S+", mqks.line())
            request = urllib.request.Request(f"http://{gateway.nsq_http}/pub?topic=ev", data=b"x", method="POST")
            try:
                urllib.request.urlopen(request, timeout=10)
                raise AssertionError("HTTP /pub to a full queue was taken")
            except urllib.error.HTTPError as error:
                assert (error.code, error.read()) == (503, b'{"message":"EXITING"}')
        assert metric(gateway, "polymq_queue_rejected_total", 'queue="ev/c"') >= 2
        gateway.wait_for_log(lambda line: " mqks " in line and "publish to ev refused" in line)


def test_drop_oldest_keeps_the_newest() -> None:
    with running_gateway("--max-queue-depth", "3", "--queue-overflow", "drop-oldest") as gateway:
        with consumer(gateway.nsq_tcp, "logs", "tail") as reader:
            with RawClient(gateway.nsq_tcp) as producer:
                producer.send(nsq_client.mpub("logs", [b"1", b"2", b"3", b"4"]))
                producer.expect_response(b"OK")
                producer.send(nsq_client.pub("logs", b"5"))
                producer.expect_response(b"OK")
            reader.send(nsq_client.rdy(10))
            bodies = [reader.read_message().body for _ in range(3)]
            assert bodies == [b"3", b"4", b"5"]
            reader.expect_nothing(0.2)
        assert metric(gateway, "polymq_queue_overflow_dropped_total", 'queue="logs/tail"') == 2


def wait_for_metric(gateway: GatewayProcess, name: str, labels: str, value: float) -> None:
    """Scrape until the counter shows `value` (a PUBLISH of eMQP's pub/sub gets no answer to wait on)."""
    deadline = time.monotonic() + DEADLINE_S
    while metric(gateway, name, labels) != value:
        assert time.monotonic() < deadline, f"{name}{{{labels}}} never reached {value}"
        time.sleep(0.05)


def test_a_full_queue_refuses_stream_api_publishes_with_507() -> None:
    row = stream_rows.encode_publish_row
    with running_gateway("--max-queue-depth", "2") as gateway, consumer(gateway.nsq_tcp, "rows", "c"), \
            StreamClient(gateway.http) as client:
        assert client.publish([row(b"1"), row(b"2")], topic="rows", dedup="g") == {"published": 2, "duplicates": 0}
        with pytest.raises(StreamClientError) as refused:
            client.publish([row(b"3")], topic="rows")
        assert (refused.value.status, refused.value.code) == (507, "QUEUE_FULL")
        assert str(refused.value).endswith("queue rows/c is full (2 messages, the limit is 2)")
        # Rows of another topic in the same batch: the whole batch is refused, nothing of it published.
        with pytest.raises(StreamClientError):
            client.publish([row(b"x", topic="elsewhere"), row(b"4")], topic="rows")
        assert metric(gateway, "polymq_topic_messages_total", 'topic="rows"') == 2
        # A replay of rows the group had publishes nothing, so nothing is refused.
        assert client.publish([row(b"1"), row(b"2")], topic="rows", dedup="g") == {"published": 0, "duplicates": 2}
        assert metric(gateway, "polymq_queue_rejected_total", 'queue="rows/c"') == 2


def test_the_emqp_pub_sub_device_applies_the_depth_policy(context: zmq.Context) -> None:
    for overflow, kept, counter in (("reject", [b"1", b"2"], "polymq_queue_rejected_total"),
                                    ("drop-oldest", [b"2", b"3"], "polymq_queue_overflow_dropped_total")):
        with running_gateway("--max-queue-depth", "2", "--queue-overflow", overflow) as gateway, \
                consumer(gateway.nsq_tcp, "updates", "c") as reader, \
                EMQPPeer(context, gateway.addresses["emqp-pubsub-in"]) as publisher:
            for body in (b"1", b"2", b"3"):
                publisher.send(emqp.PUBLISH, b"updates", body)
            wait_for_metric(gateway, counter, 'queue="updates/c"', 1)
            assert metric(gateway, "polymq_queue_depth", 'queue="updates/c"') == 2
            reader.send(nsq_client.rdy(10))
            assert [reader.read_message().body for _ in range(2)] == kept, overflow
            reader.expect_nothing(0.2)
