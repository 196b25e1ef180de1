"""Each node's report of itself to the others, so every node shows the whole cluster.

Every REPORT_INTERVAL_S a node publishes on `polymq.report.<node>` (plain NATS, JSON) its number, host,
process and start time, and what it holds of each shared queue: its consumers there, the deliveries its
clients have not finished, the copies it fetched and has not handed out. Every node keeps the last report
of each; a node not heard from for REPORT_LAPSE_S is gone from the view. Beside them, the cluster's own
counts of each queue (JetStream's consumer info: what it has not given out, what it gave out and was not
answered, what it gave more than once), which the node's topology reads in turn (every topic at least once
a second, 20 topics a second), the deferred publishes of each topic (one read of the deferred stream's
subjects per report), and each topic's stream (its leader, its replicas and their lag: 20 streams per
report, in turn). `view()` puts them together (core/cluster.py says what each number counts).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from typing import TYPE_CHECKING, Any

import attrs
import trio

from polymq.core.cluster import ClusterView, NodeView, QueuePart, QueueTotals, ReplicaView, StreamView
from polymq.core.shared import SharedQueue
from polymq.jetstream import api, deferred
from polymq.jetstream.nats_connection import Msg, NatsError

if TYPE_CHECKING:
    from polymq.jetstream.backend import JetStreamLink

log = logging.getLogger("polymq.jetstream")

REPORT_PREFIX = "polymq.report."
REPORT_INTERVAL_S = 2.0
# A node whose reports stopped is gone from the view after three missed ones (as long as a node takes to
# leave a silent link).
REPORT_LAPSE_S = 3 * REPORT_INTERVAL_S
# Queues one report names at most, those with the most in flight and held first: a report stays well under
# NATS's default max_payload (1 MB) with names of MQKS's 255 bytes.
REPORT_QUEUES = 2000
# Host names and the like from another node's report are cut to this (they reach logs and pages).
TEXT_LIMIT = 255
# Topic streams whose info (leader, replicas, lag) is read per report, in turn: a large cluster's are read
# over several reports, at a pace that does not load its meta leader.
STREAMS_PER_REPORT = 20


@attrs.frozen(slots=True)
class Heard:
    """A node's last report, and when it came (this node's monotonic clock)."""

    node: int
    host: str
    pid: int
    started: float
    parts: dict[str, QueuePart]
    at: float


def own_parts(queues: Any) -> dict[str, QueuePart]:
    """What this node holds of each shared queue (those it holds nothing of, and has no consumer of, left out)."""
    parts = {}
    for queue in queues:
        if isinstance(queue, SharedQueue) and (queue.consumers or queue.in_flight or queue.ready):
            parts[queue.name] = QueuePart(len(queue.consumers), len(queue.in_flight), len(queue.ready))
    return parts


def encode(node: int, host: str, pid: int, started: float, parts: dict[str, QueuePart]) -> bytes:
    ordered = sorted(parts.items(), key=lambda item: item[1].in_flight + item[1].held, reverse=True)
    return json.dumps({"node": node, "host": host, "pid": pid, "started": started,
                       "queues": [[name, part.consumers, part.in_flight, part.held]
                                  for name, part in ordered[:REPORT_QUEUES]]},
                      separators=(",", ":")).encode()


def decode(payload: bytes, at: float) -> Heard | None:
    """Another node's report, or None for one that is not (anyone on the NATS account may publish there)."""
    try:
        found = json.loads(payload)
        node, host, pid, started = found["node"], found["host"], found["pid"], found["started"]
        if not (isinstance(node, int) and isinstance(pid, int) and isinstance(host, str)
                and isinstance(started, int | float)):
            return None
        parts = {}
        for name, consumers, in_flight, held in found["queues"]:
            if isinstance(name, str) and all(isinstance(n, int) and n >= 0 for n in (consumers, in_flight, held)):
                parts[name] = QueuePart(consumers, in_flight, held)
    except (ValueError, KeyError, TypeError):
        return None
    return Heard(node, host[:TEXT_LIMIT], pid, float(started), parts, at)


class NodeReports:
    """This node's reports, the others' as last heard, and the cluster view made of them (module's text)."""

    def __init__(self, link: JetStreamLink) -> None:
        self.link = link
        self.heard: dict[int, Heard] = {}
        self.host = socket.gethostname()[:TEXT_LIMIT]
        self.pid = os.getpid()
        self.started = time.time()
        self.deferred_by_topic: dict[str, int] = {}
        self.streams: dict[str, StreamView] = {}  # by topic, as last read
        self._streams_read_at: dict[str, float] = {}
        self._streams_from = 0
        self.sent = 0
        self.refused = 0  # reports of others that were not reports

    def subscribe(self) -> None:
        self.link.connection.subscribe(REPORT_PREFIX + "*", self._on_report)

    async def run(self) -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._send_on_a_clock)  # reads that wait on a slow cluster never delay a report
            while True:
                await self._read_deferred()
                await self._read_streams()
                await trio.sleep(REPORT_INTERVAL_S)

    async def _send_on_a_clock(self) -> None:
        while True:
            self.send()
            await trio.sleep(REPORT_INTERVAL_S)

    def send(self) -> None:
        engine = self.link.engine
        if engine is None:
            return
        payload = encode(engine.node, self.host, self.pid, self.started, own_parts(engine.queues.values()))
        try:
            self.link.connection.publish(f"{REPORT_PREFIX}{engine.node}", payload)
            self.sent += 1
        except NatsError as error:  # the link down (the next one goes), or over max_payload
            log.debug("no report sent: %s", error)

    async def _read_deferred(self) -> None:
        """Deferred publishes not due yet, by topic (the deferred stream's messages, by subject)."""
        try:
            answer = await api.api(self.link.connection, f"STREAM.INFO.{deferred.STREAM}",
                                   {"subjects_filter": deferred.SUBJECT_PREFIX + ">"}, timeout=REPORT_INTERVAL_S)
        except NatsError:
            return  # as last read; the stream is made once a deferred publish needs it
        counts: dict[str, int] = {}
        for subject, count in ((answer.get("state") or {}).get("subjects") or {}).items():
            try:
                counts[api.untoken(subject[len(deferred.SUBJECT_PREFIX):])] = int(count)
            except (ValueError, UnicodeDecodeError):
                continue
        self.deferred_by_topic = counts

    async def _read_streams(self) -> None:
        """The next STREAMS_PER_REPORT topics' stream infos: leader, replicas and their lag."""
        topics = sorted(self.link.topology.read)
        for topic in list(self.streams):
            if topic not in self.link.topology.read:
                del self.streams[topic]
        if self._streams_from >= len(topics):
            self._streams_from = 0
        for topic in topics[self._streams_from:self._streams_from + STREAMS_PER_REPORT]:
            try:
                info = await api.api(self.link.connection, f"STREAM.INFO.{api.topic_stream(topic)}",
                                     timeout=REPORT_INTERVAL_S)
            except NatsError:
                continue  # as last read
            cluster = info.get("cluster") or {}
            replicas = tuple(
                ReplicaView(str(replica.get("name", ""))[:TEXT_LIMIT], bool(replica.get("current")),
                            int(replica.get("lag", 0) or 0),
                            None if replica.get("active") is None else int(replica["active"]) / 1e9,
                            bool(replica.get("offline")))
                for replica in cluster.get("replicas") or [])
            leader = cluster.get("leader")
            self.streams[topic] = StreamView(topic, str(leader)[:TEXT_LIMIT] if leader else None, replicas,
                                             int((info.get("state") or {}).get("messages", 0)), 0.0)
            self._streams_read_at[topic] = self.link.clock.now()
        self._streams_from += STREAMS_PER_REPORT

    def _on_report(self, msg: Msg) -> None:
        engine = self.link.engine
        heard = decode(msg.payload, self.link.clock.now())
        if heard is None:
            self.refused += 1
            return
        if engine is not None and heard.node != engine.node:
            self.heard[heard.node] = heard

    # -- the view ------------------------------------------------------------------------------

    def view(self) -> ClusterView:
        engine = self.link.engine
        assert engine is not None
        now = self.link.clock.now()
        for node in [node for node, heard in self.heard.items() if now - heard.at > REPORT_LAPSE_S]:
            del self.heard[node]
        nodes = [NodeView(engine.node, self.host, self.pid, self.started, 0.0, True)]
        nodes += [NodeView(h.node, h.host, h.pid, h.started, now - h.at, False) for h in self.heard.values()]
        parts_by_node = {node: heard.parts for node, heard in self.heard.items()}
        parts_by_node[engine.node] = own_parts(engine.queues.values())
        streams = {topic: attrs.evolve(stream, read_s=now - self._streams_read_at.get(topic, now))
                   for topic, stream in self.streams.items()}
        return ClusterView(engine.node, tuple(sorted(nodes, key=lambda view: view.node)),
                           self._queues(parts_by_node, now), frozenset(self.link.topology.read),
                           min(view.node for view in nodes), self.link.connection.connected_url, streams)

    def _queues(self, parts_by_node: dict[int, dict[str, QueuePart]], now: float) -> dict[str, QueueTotals]:
        topology = self.link.topology
        counts: dict[str, list[int]] = {}  # queue -> [pending, ack pending, redelivered, deferred publishes]
        topics: dict[str, list[str]] = {}
        read_at: dict[str, float] = {}
        for topic, consumers in topology.read.items():
            for name, consumer in consumers.items():
                found = counts.setdefault(name, [0, 0, 0, 0])
                found[0] += consumer.pending
                found[1] += consumer.ack_pending
                found[2] += consumer.redelivered
                found[3] += self.deferred_by_topic.get(topic, 0)
                topics.setdefault(name, []).append(topic)
                read_at[name] = min(read_at.get(name, now), topology.read_at.get(topic, now))
        totals = {}
        for name, (pending, ack_pending, redelivered, deferred_publishes) in counts.items():
            parts = {node: part[name] for node, part in parts_by_node.items() if name in part}
            in_flight = sum(part.in_flight for part in parts.values())
            held = sum(part.held for part in parts.values())
            totals[name] = QueueTotals(
                name, tuple(sorted(topics[name])), depth=pending + held, in_flight=in_flight,
                deferred=deferred_publishes + max(0, ack_pending - in_flight - held), redelivered=redelivered,
                parts=dict(sorted(parts.items())), read_s=now - read_at[name])
        return totals
