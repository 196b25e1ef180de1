"""Prometheus metrics at `/metrics` on the gateway's own HTTP listener, for every protocol at once.

Read at scrape time from what the engine, the store and the services already count: nothing is
done per message for them. Topics and queues get series of their own up to `MAX_LABELLED` each
(the busiest by depth first); the rest are summed under the name `_other`, so a gateway with a
million queues still answers a scrape of bounded size. The event loop's lag is measured by a task
that asks to sleep `LAG_INTERVAL_S` and counts how late it wakes.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import trio
from prometheus_client import CollectorRegistry, Histogram, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from polymq.adapters.protocol import Service
from polymq.adapters.traffic import Traffic
from polymq.core.cluster import ClusterView, queue_share, topic_share
from polymq.core.disk_storage import DiskStorage
from polymq.core.engine import Engine
from polymq.gateway.committer import SYNC_BUCKETS_S, Committer

# Topics and queues with series of their own; past it the rest are summed as `_other`.
MAX_LABELLED = 1000
OTHER = "_other"
# How often the loop-lag task wakes: often enough to see a stall, rare enough to cost nothing.
LAG_INTERVAL_S = 0.5
# Lag buckets, seconds: a healthy loop is under a millisecond late.
LAG_BUCKETS = (0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0)
# The protocol label of the gateway's own HTTP listener (the stream API, the admin API).
HTTP = "http"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def _limited(items: Iterable[Any], depth: Callable[[Any], int]) -> tuple[list[Any], list[Any]]:
    """The `MAX_LABELLED` deepest items, and the rest."""
    ordered = sorted(items, key=depth, reverse=True)
    return ordered[:MAX_LABELLED], ordered[MAX_LABELLED:]


class EngineCollector(Collector):
    """Topics, queues, connections per protocol and the store, read when scraped."""

    def __init__(self, engine: Engine, services: Callable[[], Mapping[str, Service]],
                 committer: Committer | None = None) -> None:
        self.engine = engine
        self.services = services
        self.committer = committer
        self.http: Traffic | None = None  # the gateway's own listener's, once it serves

    def collect(self) -> Iterator[Metric]:
        view = self.engine.cluster()  # read once a scrape: on a cluster, what each node's share is made of
        yield from self._topics(view)
        yield from self._queues(view)
        yield from self._protocols()
        storage = self.engine.storage
        yield CounterMetricFamily("polymq_store_syncs", "fdatasync jobs of the store that ended.",
                                  value=getattr(storage, "syncs", 0))
        yield GaugeMetricFamily("polymq_store_failing", "1 while the store's writes or syncs fail.",
                                value=1 if getattr(storage, "failure", None) is not None else 0)
        yield from self._disk(storage)
        yield from self._backend()
        yield from self._cluster(view)

    def _backend(self) -> Iterator[Metric]:
        """Where the queues live; for a JetStream cluster, its servers and the publish acks' latency."""
        backend = self.engine.backend()
        info = GaugeMetricFamily("polymq_backend_info", "1, labelled with where the queues live (embedded, "
                                 "jetstream) and, for a cluster, the server this node talks to.",
                                 labels=["backend", "connected"])
        info.add_metric([str(backend["kind"]), str(backend.get("connected") or "")], 1)
        yield info
        if "publish_ack_counts" not in backend:
            return
        cumulative, buckets = 0, []
        bounds = (*backend["publish_ack_buckets_s"], float("inf"))
        for bound, count in zip(bounds, backend["publish_ack_counts"], strict=True):
            cumulative += count
            buckets.append(("+Inf" if bound == float("inf") else repr(bound), cumulative))
        yield HistogramMetricFamily("polymq_jetstream_publish_ack_seconds", "From a publish to the JetStream "
                                    "cluster's acknowledgement of its last message.", buckets=buckets,
                                    sum_value=backend["publish_ack_total_s"])
        yield GaugeMetricFamily("polymq_jetstream_unreachable", "1 while the JetStream cluster cannot be reached.",
                                value=1 if backend.get("failure") else 0)

    def _cluster(self, view: ClusterView | None) -> Iterator[Metric]:
        """A cluster's queues over all its nodes: the same series on every node, so one scrape of any node
        gives them, and `max by (queue)` over several counts each once."""
        if view is None:
            return
        yield GaugeMetricFamily("polymq_cluster_nodes", "Nodes of the cluster heard from lately, this one included.",
                                value=len(view.nodes))
        gauges = {
            "depth": "Copies of the queue ready on the whole cluster: stored and not given out, or fetched by a "
                     "node and not handed to a client.",
            "in_flight": "Deliveries of the queue with clients of any node, not finished.",
            "deferred": "Copies of the queue due later on the whole cluster (deferred publishes, copies put back "
                        "with a delay or awaiting the ack wait).",
            "redelivered": "Copies of the queue given out more than once and not finished (JetStream's count).",
            "consumers": "Consumers of the queue on every node.",
        }
        streams, _ = _limited(view.streams.values(), lambda stream: stream.messages)
        lag = GaugeMetricFamily("polymq_cluster_stream_lag", "Operations the furthest replica of a topic's stream "
                                "is behind its leader.", labels=["topic"])
        behind = GaugeMetricFamily("polymq_cluster_stream_replicas_behind", "Replicas of a topic's stream not "
                                   "caught up with its leader (offline included); with no leader, all of them.",
                                   labels=["topic"])
        for stream in streams:
            lag.add_metric([stream.topic], max((replica.lag for replica in stream.replicas), default=0))
            behind.add_metric([stream.topic], sum(1 for replica in stream.replicas if not replica.current
                                                  or replica.offline) + (0 if stream.leader else 1))
        yield lag
        yield behind
        shown, rest = _limited(view.queues.values(), lambda queue: queue.depth)
        for name, text in gauges.items():
            family = GaugeMetricFamily(f"polymq_cluster_queue_{name}", text, labels=["queue"])
            for queue in shown:
                family.add_metric([queue.name], getattr(queue, name))
            if rest:
                family.add_metric([OTHER], sum(getattr(queue, name) for queue in rest))
            yield family

    def _disk(self, storage: Any) -> Iterator[Metric]:
        """What the embedded store wrote and holds, and how long its fdatasyncs took (none in memory)."""
        if self.committer is None or not isinstance(storage, DiskStorage):
            return
        yield CounterMetricFamily("polymq_store_written_bytes", "Bytes of records the store appended.",
                                  value=storage.files.bytes_written)
        size = files = 0
        for folder, _, names in os.walk(storage.dir):
            for name in names:
                with contextlib.suppress(OSError):  # a segment removed meanwhile
                    size += os.stat(os.path.join(folder, name)).st_blocks * 512
                    files += 1
        yield GaugeMetricFamily("polymq_store_disk_bytes", "Disk space the data dir's files take.", value=size)
        yield GaugeMetricFamily("polymq_store_files", "Files in the data dir (segments, journal, locks).",
                                value=files)
        latencies = self.committer.latencies
        cumulative, buckets = 0, []
        for bound, count in zip((*SYNC_BUCKETS_S, float("inf")), latencies.counts, strict=True):
            cumulative += count
            buckets.append(("+Inf" if bound == float("inf") else repr(bound), cumulative))
        yield HistogramMetricFamily("polymq_store_fdatasync_seconds", "How long the store's fdatasync jobs took, "
                                    "from hand-over to their end.", buckets=buckets, sum_value=latencies.total_s)

    def _protocols(self) -> Iterator[Metric]:
        connections = GaugeMetricFamily("polymq_connections", "Clients connected now, by protocol "
                                        "(ZeroMQ protocols: not counted, ZeroMQ hides its peers).",
                                        labels=["protocol"])
        counters = {
            "connections_opened": "Connections accepted (TCP protocols).",
            "connections_refused": "Connections refused past the protocol's maximum (TCP protocols).",
            "slow_clients_disconnected": "Clients disconnected for leaving their output unread (TCP protocols).",
            "bytes_received": "Bytes read from clients (TCP protocols).",
            "bytes_sent": "Bytes written to clients (TCP protocols).",
            "messages_received": "Messages published by clients (TCP protocols, http: stream rows); ZeroMQ "
                                 "messages received (ZeroMQ protocols).",
            "messages_sent": "Messages delivered to clients (TCP protocols, http: stream rows read); ZeroMQ "
                             "messages sent (ZeroMQ protocols).",
        }
        families = {name: CounterMetricFamily(f"polymq_{name}", text, labels=["protocol"])
                    for name, text in counters.items()}
        errors = CounterMetricFamily("polymq_protocol_errors", "Errors answered or closed with, by the "
                                     "protocol's own code.", labels=["protocol", "code"])
        for protocol, service in self.services().items():
            connections.add_metric([protocol], service.connections())
            traffic = service.traffic()
            for code, count in sorted(traffic.errors.items()):
                errors.add_metric([protocol, code], count)
            for name, value in (("connections_opened", traffic.connections_opened),
                                ("connections_refused", traffic.connections_refused),
                                ("slow_clients_disconnected", traffic.slow_disconnected),
                                ("bytes_received", traffic.bytes_in), ("bytes_sent", traffic.bytes_out),
                                ("messages_received", traffic.messages_in), ("messages_sent", traffic.messages_out)):
                families[name].add_metric([protocol], value)
        if self.http is not None:  # the gateway's own listener: rows published and read, errors by status
            families["messages_received"].add_metric([HTTP], self.http.messages_in)
            families["messages_sent"].add_metric([HTTP], self.http.messages_out)
            for code, count in sorted(self.http.errors.items()):
                errors.add_metric([HTTP, code], count)
        yield connections
        yield from families.values()
        yield errors

    def _topics(self, view: ClusterView | None) -> Iterator[Metric]:
        depth = GaugeMetricFamily("polymq_topic_depth", "Messages a topic keeps for no queue yet (or while paused).",
                                  labels=["topic"])
        messages = CounterMetricFamily("polymq_topic_messages", "Messages published to a topic.", labels=["topic"])
        delivered = CounterMetricFamily("polymq_topic_delivered", "Deliveries from the queues bound to a topic.",
                                        labels=["topic"])
        finished = CounterMetricFamily("polymq_topic_finished", "Deliveries acknowledged from the queues bound "
                                       "to a topic.", labels=["topic"])
        # On a cluster, each node's share: summed over the nodes, counted once.
        families = ((depth, lambda topic: topic_share(view, topic).depth),
                    (messages, lambda topic: topic.message_count),
                    (delivered, lambda topic: sum(queue.delivered_count for queue in topic.queues)),
                    (finished, lambda topic: sum(queue.finished_count for queue in topic.queues)))
        shown, rest = _limited(self.engine.topics.values(), lambda topic: topic.depth)
        for family, value in families:
            for topic in shown:
                family.add_metric([topic.name], value(topic))
            if rest:
                family.add_metric([OTHER], sum(value(topic) for topic in rest))
            yield family

    def _queues(self, view: ClusterView | None) -> Iterator[Metric]:
        # On a cluster, each node's share: summed over the nodes, counted once.
        gauges = {
            "depth": ("Messages ready in a queue (in memory and on disk); on a cluster, this node's share.",
                      lambda queue: queue_share(view, queue).depth),
            "in_flight": ("Deliveries not yet finished.", lambda queue: len(queue.in_flight)),
            "deferred": ("Messages due later (deferred publishes, delayed requeues); on a cluster, this node's "
                         "share.", lambda queue: queue_share(view, queue).deferred),
            "consumers": ("Consumers attached.", lambda queue: len(queue.consumers)),
        }
        counters = {
            "messages": ("Copies put in a queue (published to a topic it is bound to).",
                         lambda queue: queue.message_count),
            "delivered": ("Deliveries to consumers (a message sent again counts again).",
                          lambda queue: queue.delivered_count),
            "finished": ("Deliveries acknowledged (an auto-ack consumer's as it is sent).",
                         lambda queue: queue.finished_count),
            "requeued": ("Deliveries that came back to be sent again.", lambda queue: queue.requeue_count),
            "timed_out": ("Deliveries not finished in time.", lambda queue: queue.timeout_count),
            "expired": ("Copies whose TTL ran out before a delivery.", lambda queue: queue.expired_count),
            "dead_lettered": ("Copies moved to the queue's dead-letter topic.",
                              lambda queue: queue.dead_letter_count),
            "rejected": ("Publishes refused because the queue was full (--max-queue-depth, reject).",
                         lambda queue: queue.rejected_count),
            "overflow_dropped": ("Oldest copies dropped because the queue was full (--max-queue-depth, drop-oldest).",
                                 lambda queue: queue.overflow_dropped_count),
        }
        shown, rest = _limited(self.engine.queues.values(), lambda queue: queue.depth)
        families: list[tuple[Metric, Callable[[Any], int]]] = []
        for name, (text, value) in gauges.items():
            families.append((GaugeMetricFamily(f"polymq_queue_{name}", text, labels=["queue"]), value))
        for name, (text, value) in counters.items():
            families.append((CounterMetricFamily(f"polymq_queue_{name}", text, labels=["queue"]), value))
        for family, value in families:
            for queue in shown:
                family.add_metric([queue.name], value(queue))  # type: ignore[attr-defined]
            if rest:
                family.add_metric([OTHER], sum(value(queue) for queue in rest))  # type: ignore[attr-defined]
            yield family


class Metrics:
    """The registry `/metrics` answers from, and the loop-lag task that feeds it."""

    def __init__(self, engine: Engine, services: Callable[[], Mapping[str, Service]],
                 committer: Committer | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        ProcessCollector(registry=self.registry)  # resident memory, CPU seconds, open file descriptors
        self.collector = EngineCollector(engine, services, committer)
        self.registry.register(self.collector)
        self.loop_lag = Histogram("polymq_event_loop_lag_seconds", "How late the event loop ran a task that asked "
                                  f"to wake every {LAG_INTERVAL_S} s.", buckets=LAG_BUCKETS, registry=self.registry)

    def count_http(self, traffic: Traffic) -> None:
        """Show what the gateway's own listener counts, under `protocol="http"`."""
        self.collector.http = traffic

    async def measure_loop_lag(self) -> None:
        while True:
            asked = trio.current_time() + LAG_INTERVAL_S
            await trio.sleep_until(asked)
            self.loop_lag.observe(max(0.0, trio.current_time() - asked))

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
