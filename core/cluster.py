"""What every node of a shared engine shows of the whole cluster: its nodes, and each shared queue's numbers
over all of them. The numbers are the cluster's own (what it stores for the queue, what it gave out and was
not answered yet) beside what each node says it holds; both are read on a clock, so each says how old it is.

A queue's copies are in exactly one of these states, cluster-wide:
- `depth`: ready now: stored and not given out yet, or fetched by a node and not handed to a client yet;
- `in_flight`: with a client of some node, not finished;
- `deferred`: due later: a deferred publish (NSQ's DPUB) not due yet, or given out and not held by any
  node any more (put back with a delay, or its node went and the ack wait has not run out).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import attrs

if TYPE_CHECKING:
    from polymq.core.engine import Queue, Topic


@attrs.frozen(slots=True)
class NodeView:
    """A node as the others hear it (its own report, every few seconds)."""

    node: int
    host: str
    pid: int
    started: float  # wall-clock seconds
    heard_s: float  # seconds since its last report reached this node
    this: bool  # the node answering


@attrs.frozen(slots=True)
class QueuePart:
    """What one node holds of a queue."""

    consumers: int
    in_flight: int
    held: int  # copies fetched, not handed to a client yet


@attrs.frozen(slots=True)
class QueueTotals:
    """A shared queue's numbers over the whole cluster (see the module's text)."""

    name: str
    topics: tuple[str, ...]
    depth: int
    in_flight: int
    deferred: int
    redelivered: int  # copies given out more than once and not finished yet (JetStream's count)
    parts: dict[int, QueuePart]  # by node, the nodes that hold anything of it or have consumers of it
    read_s: float  # seconds since the cluster's counts of it were read

    @property
    def consumers(self) -> int:
        return sum(part.consumers for part in self.parts.values())


@attrs.frozen(slots=True)
class ReplicaView:
    """A server holding a copy of a topic's stream, as its leader sees it."""

    server: str
    current: bool  # caught up with the leader
    lag: int  # operations it is behind
    active_s: float | None  # seconds since the leader last heard from it
    offline: bool


@attrs.frozen(slots=True)
class StreamView:
    """A topic's stream in the cluster: its leader, its other replicas, what it holds."""

    topic: str
    leader: str | None  # none while it elects one
    replicas: tuple[ReplicaView, ...]
    messages: int
    read_s: float  # seconds since it was read


@attrs.frozen(slots=True)
class ClusterView:
    """The cluster as one node sees it now."""

    node: int  # the node answering
    nodes: tuple[NodeView, ...]  # those heard from lately, this one included, by number
    queues: dict[str, QueueTotals]
    topics: frozenset[str]  # the cluster's topics (a node's ephemeral topics are its own)
    # The one node that reports what no node holds (a queue's stored copies, its deferred ones) in views
    # that are summed over the nodes (nsqd's /stats under nsqadmin, per-node metrics): the lowest-numbered
    # node heard from, so a sum over the nodes counts them once.
    reporter: int
    connected: str | None = None  # the server this node talks to
    streams: dict[str, StreamView] = attrs.Factory(dict)  # by topic, as last read

    @property
    def reports_stored(self) -> bool:
        """Whether this node is the one that counts what no node holds."""
        return self.reporter == self.node


@attrs.frozen(slots=True)
class Share:
    """What a node shows of a queue or topic where the nodes' numbers are summed (nsqd's /stats under nsqadmin
    and nsq_stat, the per-node metrics): what it holds itself and, on the reporter only, what no node holds."""

    depth: int
    stored: int  # of the depth, what is stored and not fetched by any node (nsqd's backend_depth)
    deferred: int


def queue_share(view: ClusterView | None, queue: Queue) -> Share:
    """The node's share of the queue: all of it for a node alone or a queue of its own (an ephemeral topic's)."""
    totals = None if view is None else view.queues.get(queue.name)
    if view is None or totals is None:
        return Share(queue.depth, queue.spilled, queue.deferred_count)
    if view.reports_stored:
        return Share(queue.depth, queue.spilled, totals.deferred)
    return Share(queue.depth - queue.spilled, 0, 0)


def topic_share(view: ClusterView | None, topic: Topic) -> Share:
    """The node's share of what the topic keeps for no queue yet (its backlog)."""
    if view is None or topic.name not in view.topics or view.reports_stored:
        return Share(topic.depth, topic.spilled, 0)
    return Share(topic.depth - topic.spilled, 0, 0)
