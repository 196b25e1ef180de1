"""`/metrics` on the gateway's own listener: what Prometheus scrapes, for every protocol at once."""

from __future__ import annotations

import socket
import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from polymq.codecs import phpmq
from polymq.core.engine import Engine
from polymq.gateway import metrics as metrics_module
from polymq.gateway.metrics import OTHER, Metrics

from support.gateway import GatewayProcess, running_gateway
from support.nsq_wire import subscribed_socket


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


def _scrape(gateway: GatewayProcess) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
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
