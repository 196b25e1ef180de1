"""`/metrics` on the gateway's own listener: what Prometheus scrapes, for every protocol at once."""

from __future__ import annotations

import re
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from polymq.adapters.traffic import MAX_ERROR_CODES, OTHER_ERROR, Traffic
from polymq.clients.stream import StreamClient, StreamClientError
from polymq.codecs import nsq_client, phpmq, stream_rows
from polymq.core.engine import Engine
from polymq.gateway import metrics as metrics_module
from polymq.gateway.metrics import OTHER, Metrics

from support import nsq_wire
from support.gateway import GatewayProcess, running_gateway
from support.mqks_wire import MQKSWire
from support.nsq_wire import subscribed_socket
from support.phpmq_wire import PHPMQWire

ROOT = Path(__file__).resolve().parent.parent
Scraped = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def _samples(text: str) -> Scraped:
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


def _scrape(gateway: GatewayProcess) -> Scraped:
    with urllib.request.urlopen(f"http://{gateway.http}/metrics", timeout=10) as reply:
        assert reply.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        return _samples(reply.read().decode())



def test_a_scrape_shows_topics_queues_connections_and_the_store(tmp_path) -> None:
    with running_gateway(data_dir=tmp_path) as gateway:
        consumer = subscribed_socket(gateway.host_port("nsq-tcp"), "orders", "billing")
        with consumer, socket.create_connection(gateway.host_port("phpmq"), timeout=10) as php:
            for body in (b"one", b"two", b"three"):
                php.sendall(phpmq.send(b"orders", body))  # topic orders; its queue orders; channel billing
            host, port = gateway.host_port("nsq-http")
            urllib.request.urlopen(f"http://{host}:{port}/pub?topic=orders", data=b"four", timeout=10).read()
            # PHPMQ publishes get no answer: scrape until the gateway has read them all.
            deadline = time.monotonic() + 30
            while (scraped := _scrape(gateway))[("polymq_topic_messages_total", (("topic", "orders"),))] < 4:
                assert time.monotonic() < deadline, scraped
                time.sleep(0.05)
            assert scraped[("polymq_topic_messages_total", (("topic", "orders"),))] == 4
            assert scraped[("polymq_queue_depth", (("queue", "orders"),))] == 4  # PHPMQ's queue
            assert scraped[("polymq_queue_depth", (("queue", "orders/billing"),))] == 4  # the NSQ channel (RDY 0)
            assert scraped[("polymq_queue_consumers", (("queue", "orders/billing"),))] == 1
            assert scraped[("polymq_queue_messages_total", (("queue", "orders"),))] == 4
            assert scraped[("polymq_connections", (("protocol", "nsq"),))] == 1
            assert scraped[("polymq_connections", (("protocol", "phpmq"),))] == 1
            assert scraped[("polymq_connections", (("protocol", "mqks"),))] == 0
            sent = sum(len(phpmq.send(b"orders", body)) for body in (b"one", b"two", b"three"))
            assert scraped[("polymq_bytes_received_total", (("protocol", "phpmq"),))] == sent
            assert scraped[("polymq_connections_opened_total", (("protocol", "phpmq"),))] == 1
            assert scraped[("polymq_bytes_sent_total", (("protocol", "nsq"),))] == 10  # the OK to SUB: size, type, OK
            assert scraped[("polymq_store_failing", ())] == 0
            assert scraped[("polymq_store_syncs_total", ())] >= 1  # the publishes were acknowledged after one
            fsyncs = scraped[("polymq_store_fdatasync_seconds_count", ())]
            assert fsyncs >= 1 and scraped[("polymq_store_fdatasync_seconds_bucket", (("le", "+Inf"),))] == fsyncs
            assert scraped[("polymq_store_fdatasync_seconds_sum", ())] > 0
            # Four bodies went into two queues and a topic's records at least once each.
            assert scraped[("polymq_store_written_bytes_total", ())] >= 2 * len(b"onetwothreefour")
            on_disk = sum(path.stat().st_blocks * 512 for path in tmp_path.rglob("*") if path.is_file())
            assert 0 < scraped[("polymq_store_disk_bytes", ())] <= on_disk + (1 << 20)  # what has grown since
            assert scraped[("polymq_store_files", ())] >= 1
            assert scraped[("process_resident_memory_bytes", ())] > 0


def test_the_event_loop_lag_is_measured(tmp_path) -> None:
    with running_gateway("--in-memory", data_dir=tmp_path) as gateway:
        # The lag task wakes twice a second: scrape until the histogram counts a measurement.
        deadline = time.monotonic() + 30
        while (count := _scrape(gateway)[("polymq_event_loop_lag_seconds_count", ())]) < 1:
            assert time.monotonic() < deadline, "no loop-lag measurement in 30 s"
            time.sleep(metrics_module.LAG_INTERVAL_S)
        assert count >= 1


def test_series_are_bounded_the_rest_summed_as_other(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(metrics_module, "MAX_LABELLED", 2)
    engine = Engine()
    for number, count in enumerate((5, 1, 3, 2)):
        engine.ensure_queue(f"q{number}")
        engine.bind(f"q{number}", f"t{number}")
        for _ in range(count):
            engine.publish(f"t{number}", b"x")
    scraped = _samples(Metrics(engine, dict).exposition().decode())
    depths = {labels: value for (name, labels), value in scraped.items() if name == "polymq_queue_depth"}
    assert depths == {(("queue", "q0"),): 5, (("queue", "q2"),): 3, (("queue", OTHER),): 3}  # 1 + 2


def _scrape_until(gateway: GatewayProcess, done: Callable[[Scraped], bool]) -> Scraped:
    """Scrape until `done` says the gateway has handled what the test sent (some protocols never answer)."""
    deadline = time.monotonic() + 30
    while not done(scraped := _scrape(gateway)):
        assert time.monotonic() < deadline, scraped
        time.sleep(0.05)
    return scraped


def _queue(name: str) -> tuple[tuple[str, str], ...]:
    return (("queue", name),)


def _protocol(name: str) -> tuple[tuple[str, str], ...]:
    return (("protocol", name),)


def test_deliveries_and_acknowledgements_per_queue_and_topic(tmp_path) -> None:
    with running_gateway(data_dir=tmp_path) as gateway:
        with nsq_wire.consumer(gateway.nsq_tcp, "counted", "c", rdy=10) as reader:
            nsq_wire.publish(gateway.nsq_tcp, "counted", [b"one", b"two", b"three"])
            first = [reader.read_message() for _ in range(3)]
            reader.send(nsq_client.req(first[0].msg_id, 0))  # sent again: a fourth delivery
            again = reader.read_message()
            assert again.body == first[0].body and again.attempts == 2
            for message in (*first[1:], again):
                reader.send(nsq_client.fin(message.msg_id))
            scraped = _scrape_until(gateway, lambda s: s.get(("polymq_queue_finished_total",
                                                              _queue("counted/c"))) == 3)
        assert scraped[("polymq_topic_messages_total", (("topic", "counted"),))] == 3
        assert scraped[("polymq_queue_messages_total", _queue("counted/c"))] == 3
        assert scraped[("polymq_queue_delivered_total", _queue("counted/c"))] == 4
        assert scraped[("polymq_queue_finished_total", _queue("counted/c"))] == 3
        assert scraped[("polymq_queue_requeued_total", _queue("counted/c"))] == 1
        assert scraped[("polymq_topic_delivered_total", (("topic", "counted"),))] == 4
        assert scraped[("polymq_topic_finished_total", (("topic", "counted"),))] == 3


def test_messages_and_errors_per_protocol(tmp_path) -> None:
    with running_gateway(data_dir=tmp_path) as gateway:
        # NSQ: three published, three delivered, one command it does not know (fatal E_INVALID).
        with nsq_wire.consumer(gateway.nsq_tcp, "p", "c", rdy=10) as reader:
            nsq_wire.publish(gateway.nsq_tcp, "p", [b"a", b"b", b"c"])
            for message in [reader.read_message() for _ in range(3)]:
                reader.send(nsq_client.fin(message.msg_id))
        with nsq_wire.RawClient(gateway.nsq_tcp) as bad:
            bad.send(b"BOGUS\n")
            bad.expect_error(b"E_INVALID invalid command BOGUS")
            bad.expect_closed()
        # The nsqd HTTP API counts as NSQ: one more published, one topic name nsqd refuses.
        host, port = gateway.host_port("nsq-http")
        urllib.request.urlopen(f"http://{host}:{port}/pub?topic=h", data=b"d", timeout=10).read()
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(f"http://{host}:{port}/pub?topic=no!such", data=b"e", timeout=10)
        assert (refused.value.code, refused.value.read()) == (400, b'{"message":"INVALID_TOPIC"}')
        # MQKS: two published, two delivered (auto-ack), one request it cannot parse.
        with MQKSWire(gateway.host_port("mqks")) as mqks:
            mqks.send(b"c1 consume --confirm mq me")
            assert mqks.line() == b"c1 ok "
            mqks.send(b"m1 publish me x\nm2 publish me y")
            assert [delivery.body for delivery in mqks.deliveries(2)] == [b"x", b"y"]
            mqks.send(b"r1 no-such-action")
            assert mqks.line().startswith(b"None error ")  # the original names no request it cannot read
        # PHPMQ: two sent, two delivered, then a frame it cannot read ends the connection.
        with PHPMQWire(gateway.host_port("phpmq")) as php:
            php.publish("pq", b"1")
            php.publish("pq", b"2")
            php.consume("pq", 2)
            for delivery in php.deliveries(2):
                php.ack("pq", delivery.message_id)
            php.send(b"not-a-header")
            assert php.closed_by_server()
        scraped = _scrape_until(gateway, lambda s: s.get(("polymq_queue_finished_total", _queue("pq"))) == 2
                                and ("polymq_protocol_errors_total", (("code", "bad framing"),
                                                                      ("protocol", "phpmq"))) in s)
    for protocol, published, delivered in (("nsq", 4, 3), ("mqks", 2, 2), ("phpmq", 2, 2)):
        assert scraped[("polymq_messages_received_total", _protocol(protocol))] == published, protocol
        assert scraped[("polymq_messages_sent_total", _protocol(protocol))] == delivered, protocol
    errors = {labels: value for (name, labels), value in scraped.items() if name == "polymq_protocol_errors_total"}
    assert errors == {
        (("code", "E_INVALID"), ("protocol", "nsq")): 1,
        (("code", "INVALID_TOPIC"), ("protocol", "nsq")): 1,
        (("code", "error"), ("protocol", "mqks")): 1,
        (("code", "bad framing"), ("protocol", "phpmq")): 1,
    }
    assert scraped[("polymq_queue_delivered_total", _queue("mq"))] == 2
    assert scraped[("polymq_queue_finished_total", _queue("mq"))] == 2  # auto-ack: as they were sent


def test_the_error_codes_counted_are_bounded() -> None:
    traffic = Traffic()
    for number in range(MAX_ERROR_CODES + 5):
        traffic.error(f"E_{number}")
    assert len(traffic.errors) == MAX_ERROR_CODES + 1
    assert traffic.errors[OTHER_ERROR] == 5


def test_the_gateway_s_own_listener_counts_rows_and_errors_as_http(tmp_path) -> None:
    row = stream_rows.encode_publish_row
    with running_gateway("--in-memory", data_dir=tmp_path) as gateway, StreamClient(gateway.http) as client:
        client.open("s", ["rows"])
        assert client.publish([row(b"a"), row(b"b")], topic="rows")["published"] == 2
        assert [r.body for r in client.read("s", 0, 2)] == [b"a", b"b"]
        with pytest.raises(StreamClientError):
            client.offsets("no-such-stream")  # 404
        with pytest.raises(StreamClientError):
            client.request("GET", "/stream/read", [("stream", "s")])  # 400: no `from`
        scraped = _scrape(gateway)
    assert scraped[("polymq_messages_received_total", _protocol("http"))] == 2
    assert scraped[("polymq_messages_sent_total", _protocol("http"))] == 2
    errors = {labels: value for (name, labels), value in scraped.items()
              if name == "polymq_protocol_errors_total" and ("protocol", "http") in labels}
    assert errors == {(("code", "400"), ("protocol", "http")): 1, (("code", "404"), ("protocol", "http")): 1}


def _documented_metrics() -> set[str]:
    """The names in docs/operations.md's metrics table (`polymq_queue_depth`, `_in_flight` → polymq_queue_in_flight)."""
    section = (ROOT / "docs" / "operations.md").read_text().split("\n## Metrics\n")[1].split("\n## ")[0]
    names: set[str] = set()
    for line in section.splitlines():
        if not line.startswith("| `"):
            continue
        prefix = ""
        for name in re.findall(r"`([a-z_…]+)`", line.split(" | ")[0]):
            if name.startswith("_"):
                names.add(prefix + name)
            else:
                names.add(name)
                prefix = "_".join(name.split("_")[:2])  # polymq_queue, polymq_store, …
    return names


def test_every_polymq_metric_is_in_the_documented_table(tmp_path) -> None:
    with running_gateway(data_dir=tmp_path) as gateway, \
            urllib.request.urlopen(f"http://{gateway.http}/metrics", timeout=10) as reply:
        families = list(text_string_to_metric_families(reply.read().decode()))
    # `…_created`: prometheus_client's own creation time of a histogram, not a metric of polymq's.
    exposed = {family.name + ("_total" if family.type == "counter" else "")
               for family in families if family.name.startswith("polymq_") and not family.name.endswith("_created")}
    assert len(exposed) > 30
    assert exposed - _documented_metrics() == set()
