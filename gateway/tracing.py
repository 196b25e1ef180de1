"""Tracing in the running gateway (docs/operations.md, "Tracing a topic"): the tracer of core/trace.py
with every protocol's ids, the topics the config traces, the trace topic and the metrics.

Every event is also published, as one JSON object, to the trace topic (`[trace] topic`, default
`polymq.trace`), as RabbitMQ's firehose is an exchange: any client of any protocol reads it. Events
wait in a bounded buffer and go out as one batch a tick, from a task of their own, so the traced
path only appends to a deque; past the bound the newest are dropped and counted. With no queue bound
to the trace topic they are dropped too (nobody reads them; MQKS's rule), so the trace topic never
piles up a backlog. The trace topic is never traced itself, so its publishes make no events.
"""

from __future__ import annotations

import json
import logging
import socket
from collections import deque
from collections.abc import Iterator
from typing import Any

import trio
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from polymq.adapters.registry import protocols
from polymq.core.engine import Engine
from polymq.core.trace import Event, Tracer, event_json

log = logging.getLogger("polymq.trace")

# The trace topic's default name: a name no protocol's client makes by chance.
DEFAULT_TRACE_TOPIC = "polymq.trace"
# How often buffered events go to the trace topic: a consumer sees an event within this.
PUBLISH_TICK_S = 0.1
# Events waiting for the next tick at most (a burst of 100k messages a second is ~600k events a second
# at most: the ring keeps what the topic could not take).
MAX_PENDING = 100_000
# The protocol name the trace topic's messages carry as their origin.
ORIGIN = "trace"


class TraceTopic:
    """Publishes the tracer's events to the trace topic, a batch a tick."""

    def __init__(self, engine: Engine, tracer: Tracer, name: str) -> None:
        self.engine = engine
        self.tracer = tracer
        self.name = name
        self.pending: deque[Event] = deque()
        self.published = 0
        self.dropped_full = 0  # past MAX_PENDING
        self.dropped_unread = 0  # no queue bound to the trace topic, or it refused them
        tracer.refused.add(name)
        tracer.listeners.append(self._add)

    def _add(self, event: Event) -> None:
        if len(self.pending) >= MAX_PENDING:
            self.dropped_full += 1
            return
        self.pending.append(event)

    def flush(self) -> int:
        """Publish what waits as one batch; returns how many were published."""
        if not self.pending:
            return 0
        events = list(self.pending)
        self.pending.clear()
        engine = self.engine
        topic = engine.topics.get(self.name)
        if (topic is None or not topic.queues or engine.storage.failure is not None
                or engine.publish_refusal(self.name, len(events)) is not None):
            self.dropped_unread += len(events)
            return 0
        node = self.tracer.node
        bodies = [json.dumps(event_json(event, node), separators=(",", ":")).encode() for event in events]
        engine.publish_many(self.name, bodies, origin=ORIGIN)
        self.published += len(bodies)
        return len(bodies)

    async def run(self) -> None:
        while True:
            await trio.sleep(PUBLISH_TICK_S)
            self.flush()


def make_tracer(engine: Engine, options: Any) -> tuple[Tracer, TraceTopic]:
    """The gateway's tracer, every protocol's ids, the trace topic, and the topics the config traces."""
    shown_ids = {unit.name: unit.shown_id for unit in protocols() if unit.shown_id is not None}
    tracer = Tracer(engine, shown_ids, ring_size=options.ring_size,
                    body_prefix=options.body_prefix, node=socket.gethostname())
    trace_topic = TraceTopic(engine, tracer, options.topic)
    for name in options.topics:
        tracer.trace(name)
        log.info("tracing topic %r", name)
    return tracer, trace_topic


class TraceCollector(Collector):
    """The trace's own metrics, read when scraped."""

    def __init__(self, tracer: Tracer, trace_topic: TraceTopic) -> None:
        self.tracer = tracer
        self.trace_topic = trace_topic

    def collect(self) -> Iterator[Metric]:
        traced = GaugeMetricFamily("polymq_trace_topic_traced", "1 while a topic is traced.", labels=["topic"])
        events = CounterMetricFamily("polymq_trace_events", "Events recorded for a traced topic's messages.",
                                     labels=["topic"])
        dropped = CounterMetricFamily("polymq_trace_events_dropped", "Events pushed out of a traced topic's full "
                                      "ring (the oldest first).", labels=["topic"])
        for name, ring in sorted(self.tracer.rings.items()):
            traced.add_metric([name], 1 if name in self.tracer.topics else 0)
            events.add_metric([name], ring.recorded)
            dropped.add_metric([name], ring.dropped)
        yield traced
        yield events
        yield dropped
        topic = self.trace_topic
        yield CounterMetricFamily("polymq_trace_published", "Events published to the trace topic.",
                                  value=topic.published)
        lost = CounterMetricFamily("polymq_trace_unpublished", "Events not published to the trace topic: no queue "
                                   "was bound to it (or it refused them), or too many waited.", labels=["why"])
        lost.add_metric(["unread"], topic.dropped_unread)
        lost.add_metric(["full"], topic.dropped_full)
        yield lost
