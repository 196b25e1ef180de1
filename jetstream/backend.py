"""The shared engine on NATS JetStream: `core/shared.py`'s `Link`, over one NATS connection.

Each topic is a stream (`POLYMQ_T_<t>`, subject `polymq.t.<t>`, interest retention); each queue bound
to it, a durable pull consumer of that stream; a topic without queues keeps its messages for the first
one through the consumer `polymq-backlog` (nsqd's backlog rule). The whole mapping, row by row, with
what differs from the embedded engine: docs/cluster.md.

What goes through JetStream's API (streams and consumers made and deleted) is done in order by one
task; a publish to a topic whose stream is still being made waits for it. Deliveries and acks are
plain NATS messages on the connection, handled synchronously as they are read.
"""

from __future__ import annotations

import bisect
import contextlib
import json
import logging
import re
from collections import Counter, deque
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import attrs
import trio

from polymq.core.clock import Clock, SystemClock
from polymq.core.cluster import ClusterView
from polymq.core.dead_letters import Requeued
from polymq.core.engine import DEAD_LETTER_QUEUE_HEADER, Topic
from polymq.core.ids import NODE_BITS
from polymq.core.message import PUBLISHER_ID_HEADER, Message, shown_headers
from polymq.core.shared import SharedEngine, SharedQueue, SharedTopicLog, Stored
from polymq.core.timers import TimerService
from polymq.jetstream import api
from polymq.jetstream.batches import BATCH_MAX, ERR_BATCH_DISABLED, Batches, Item
from polymq.jetstream.dead_letters import requeue_dead
from polymq.jetstream.deferred import DeferredMover
from polymq.jetstream.nats_connection import (
    NO_RESPONDERS,
    ConnectionLost,
    Msg,
    NatsConnection,
    NatsError,
    NatsOptions,
    NoResponders,
    RequestTimeout,
)
from polymq.jetstream.orphans import Orphans
from polymq.jetstream.reports import NodeReports
from polymq.jetstream.schedules import SharedScheduleKeeper
from polymq.jetstream.snapshots import QueueSnapshots
from polymq.jetstream.topology import Topology, paused_key

log = logging.getLogger("polymq.jetstream")

# Subject on which a node forwards an ack by id it cannot serve itself (`polymq.ack.<queue token>`).
ACK_FORWARD_PREFIX = "polymq.ack."
# Subjects on which a node tells the others a queue was emptied (`polymq.emptied.<queue token>`), paused
# or unpaused (`polymq.paused.<queue token>`, payload 1 or 0), or deleted (`polymq.deleted.<queue token>`,
# payload the deleting node's number: its own notice is not for it).
EMPTIED_PREFIX = "polymq.emptied."
PAUSED_PREFIX = "polymq.paused."
DELETED_PREFIX = "polymq.deleted."
# What a node tells every node (`SharedEngine.tell_every_node`: eMQP's pub/sub), as plain NATS messages at
# most once: `polymq.told.<kind token>`, the telling node's number in a header (its own are not for it),
# the frames each after its length (4 bytes, big-endian).
TOLD_PREFIX = "polymq.told."
HEADER_NODE = "Polymq-Node"
# What a node tells one node (`SharedEngine.tell_maker_of`: eMQP's "dispatched"): `polymq.to.<node>.<kind
# token>`, framed as above, as a request that node answers once it has it. Asked again until answered (a node
# whose link went silent is on another server within STALE_LINK_S of the silence, plus a reconnect): each try
# waits TELL_ATTEMPT_S for the answer (the next comes that long after a "no responders"), for TELL_DEADLINE_S.
# At least once: a notice whose answer was lost comes twice (eMQP's REPLY goes once: the first takes it).
TO_NODE_PREFIX = "polymq.to."
TELL_ATTEMPT_S = 1.0
TELL_DEADLINE_S = api.API_DEADLINE_S
# JetStream's advisories of consumers and streams made and deleted, by any node.
CONSUMER_ADVISORIES = "$JS.EVENT.ADVISORY.CONSUMER.*.*.*"
STREAM_ADVISORIES = "$JS.EVENT.ADVISORY.STREAM.*.*"
# A queue auto-deleted on a node (no consumer left there) is deleted from the cluster once its consumers show
# no node reading them: asked this many times, this far apart (the node's own pull requests and copies given
# back take a moment to leave the counts).
UNUSED_CHECKS = 3
UNUSED_CHECK_PAUSE_S = 0.05
# A pull request lasts this long; a queue whose consumers go quiet gets its unused credit back then.
PULL_EXPIRES_S = 5.0
# What a node's pull requests bring once the queue's last consumer there left waits for another consumer there
# until they have ended, and this much more (a loaded machine's late answers).
IDLE_HOLD_MARGIN_S = 1.0
# Rounds of +WPI reports per ack wait (`SharedEngine.hold_refresh_s`): at two per ack wait, a delivery made
# just after a round was first reported one whole ack wait later, as JetStream gave it again.
REFRESH_ROUNDS_PER_ACK_WAIT = 3
# A pull request sent while its consumer has no leader (a killed one being replaced) is answered at once
# with "503 No Responders"; it is asked again after this long, not at once (that loops as fast as the
# link goes: 20-25 thousand requests a second measured, for the seconds an election takes).
PULL_RETRY_S = 0.1
# A pull request with no end heard this long after its lifetime (JetStream answers 408 at its end) was lost;
# pull requests are checked for that this often (`_forget_lost_pulls`).
PULL_LOST_AFTER_S = 2.0
PULL_LOST_CHECK_S = 1.0
# The status of a pull request that ended (its `expires`) before it got all it asked for.
REQUEST_TIMEOUT = 408
# Messages one pull request asks for at most (nats-server's default max batch of a pull consumer
# is unlimited; smaller requests spread a queue's messages over the nodes' consumers).
MAX_PULL_BATCH = 256
# Pull requests a consumer of the node keeps waiting at once (nats-server's max_waiting is 512).
MAX_PULLS_WAITING = 64
# A publish JetStream had no answer for (a stream electing its leader) is tried again this often, until
# `JetStreamSettings.publish_timeout_s` (publish acks paused 5-9 s while a killed leader was replaced).
PUBLISH_RETRY_S = 0.1
# A message made longer ago than this before its first publish carries its own time (a deferred one moved to
# its topic, one that waited for a leader); others take the time the cluster stores them, a few ms later.
OWN_TIME_AFTER_NS = 100_000_000
# A publisher's id that goes as a header value as it is: printable ASCII, no space (NATS trims a value's ends).
PLAIN_VALUE = re.compile(rb"[!-~]+")
# A message with no headers but its id and origin (a batch's member) shares this: never written to (Batches
# copies what it adds its headers to).
NO_HEADERS: dict[str, str] = {}
# The longest origin a batch's id carries (a protocol's name; a batch id is at most 64 characters, nats-server's
# limit): a batch of another origin keeps every message's headers.
MAX_TAGGED_ORIGIN = 16
# How long a node waits at start-up for the stream of node numbers to take publishes: as long as any API
# request (a stream whose leader was cut off or paused answers nothing until the others elect one).
STREAM_READY_S = api.API_DEADLINE_S
# How long a node waits for its server's INFO to list as many servers as the replicas asked: while a
# cluster forms, its routes tell each server of the others' client addresses within about a second
# here (nats-server 2.x, three servers on loopback); five times that for a loaded machine.
CLUSTER_FORMING_WAIT_S = 5.0
# Node numbers repeat after this many starts: the ids' node bits.
NODE_NUMBERS = 1 << NODE_BITS


@attrs.define(slots=True)
class JetStreamSettings:
    nats: NatsOptions
    replicas: int = 3  # or the cluster's size when it is smaller
    # A delivery the node never finishes (the node died) is delivered again after this long
    # (nsqd's default msg_timeout, 60 s).
    ack_wait_s: float = 60.0
    publish_timeout_s: float = 10.0  # beyond a leader's election (5-9 s measured)
    duplicate_window_s: float = 120.0


# Buckets of the publish acknowledgements' latency, seconds: a quorum's answer on one machine is under a
# millisecond or two, a leader's election takes seconds.
PUBLISH_ACK_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, 5.0, 10.0)


@attrs.define(slots=True)
class PublishLatency:
    counts: list[int] = attrs.Factory(lambda: [0] * (len(PUBLISH_ACK_BUCKETS_S) + 1))  # the last: above them all
    total_s: float = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(PUBLISH_ACK_BUCKETS_S, seconds)] += 1
        self.total_s += seconds


@attrs.define(slots=True, eq=False)
class Puller:
    """The node's reading of one queue's consumer in one topic's stream."""

    queue: SharedQueue
    topic: str
    consumer: str
    subject: str  # where pull requests go
    inbox: str  # `inbox.<n>` is the reply subject of pull request n
    sid: int = 0
    requests: dict[str, int] = attrs.Factory(dict)  # pull requests waiting, by token: messages still owed
    outstanding: int = 0  # messages owed by every waiting request
    counter: int = 0
    active: bool = True
    floor: int = 0  # stream sequences up to it were emptied from the queue: acked, never delivered
    retry_due: bool = False  # a pull found no consumer leader: the queue asks again at PULL_RETRY_S
    # Messages the consumer holds for the queue not given to any node yet, as last heard (at first: some).
    pending: int = 1
    issued: deque[tuple[float, str]] = attrs.Factory(deque)  # (when it is lost if unanswered, token), in order
    # Requests made before the node lapsed (`JetStreamLink.lapsed`): still first in `requests` (JetStream serves
    # them in order), not counted in `outstanding`, what they bring is not taken.
    stale: set[str] = attrs.Factory(set)

    def served_one(self) -> str | None:
        """A message came: JetStream serves a consumer's pull requests in order, so the oldest request owes
        one less (and has ended when it owes none). Its token, or None if none was waiting."""
        requests = self.requests
        for request in requests:
            requests[request] -= 1
            if requests[request] <= 0:
                del requests[request]
            return request
        return None


@attrs.define(slots=True, eq=False)
class TopicState:
    ready: bool = False  # its stream exists
    # Publishes that wait for the stream, or for this node's bindings to be made (what a client did
    # before it published holds when its publish is stored, as with the embedded engine).
    waiting: list[tuple[list[Message], Stored, bool]] = attrs.Factory(list)
    # The queues bound to it on any node (its stream's consumers, but the backlog's), as JetStream's
    # advisories tell; None until the stream is known.
    queues: set[str] | None = None
    made: trio.Event = attrs.Factory(trio.Event)  # set once the stream is made, or making it failed
    # MQKS publishes waiting while the cluster is asked whether the topic has queues (`_unbound`).
    asking: list[tuple[list[Message], Stored]] | None = None


@attrs.frozen(slots=True)
class Gathered:
    """A single publish waiting to go with others to its topic (`JetStreamLink._send_gathered`)."""

    message: Message
    deadline: float
    finished: Callable[[int, Exception | None], None]  # how many it stored now, or why not
    answered: Callable[[Msg | NatsError], None]  # the same from a plain publish's answer


class JetStreamLink:
    """`core.shared.Link` on JetStream (see the table above)."""

    def __init__(self, connection: NatsConnection, settings: JetStreamSettings, clock: Clock) -> None:
        self.connection = connection
        self.settings = settings
        self.clock = clock
        self.engine: SharedEngine | None = None
        self.stream_settings = api.StreamSettings(replicas=settings.replicas,
                                                  duplicate_window_s=settings.duplicate_window_s)
        self.topics: dict[str, TopicState] = {}
        self.streams: dict[str, TopicState] = {}  # the same, by stream name
        self.binding = 0  # this node's bindings whose consumer is being made: publishes wait for them
        self.pullers: dict[str, list[Puller]] = {}  # by queue name
        self.queue_tokens: dict[str, str] = {}  # a queue's subject token -> its name (forwarded acks)
        self._control_send, self._control_receive = trio.open_memory_channel[Callable[[], Any]](float("inf"))
        self.publish_latency = PublishLatency()  # from a publish to JetStream's last answer for it
        self.deferred = DeferredMover(self)
        self.topology = Topology(self)
        self.orphans = Orphans(connection, clock)  # what a replica's diverging state leaves kept (orphans.py)
        self.reports = NodeReports(self)
        self.snapshots = QueueSnapshots(self)
        self.batches = Batches(connection, clock, lambda: None if self.engine is None else self.engine.timers.schedule)
        # Single publishes waiting for the end of the loop's turn, by topic (`_send_gathered`).
        self._gathered: dict[str, list[Gathered]] = {}
        self._gather_wake = trio.Event()
        # This node's changes to the cluster, which a read of the cluster taken before one finished must not
        # undo: bindings made, removed or deleted, by (queue, topic); streams made or deleted, by topic.
        self.pending: Counter[Any] = Counter()  # asked for, not finished
        self.changes = 0  # changes finished so far
        self.finished: dict[Any, int] = {}  # when (in `changes`) each one's latest change finished
        # Pause and empty notices about queues this node does not follow yet: a read of the cluster taken
        # before them may be what makes the queue here, so they are applied then. Let go with `finished`.
        self.noticed_paused: dict[str, bool] = {}
        self.noticed_floors: dict[tuple[str, str], int] = {}  # (queue, stream) -> floor
        self.forwarded_acks = 0
        self.lost_pulls = 0  # pull requests that ended unheard (`_forget_lost_pulls`)
        self.lapses = 0  # times the node found it had said nothing for a whole ack wait (`lapsed`)
        self.told_dropped = 0  # what this node could not tell the others (the link down and its buffer full)
        self.tell_retries = 0  # notices to one node asked again (no answer yet)
        self._down_since: float | None = None  # while the link to the cluster is down: since when
        self.progress_reports = 0  # `+WPI`s sent: deliveries and held copies still worked on
        self.schedule_keeper: SharedScheduleKeeper | None = None  # set at start

    # -- start ------------------------------------------------------------------------------

    async def start(self, nursery: trio.Nursery) -> None:
        self.connection.subscribe(ACK_FORWARD_PREFIX + "*", self._on_forwarded_ack)
        self.connection.subscribe(CONSUMER_ADVISORIES, self._on_consumer_advisory)
        self.connection.subscribe(STREAM_ADVISORIES, self._on_stream_advisory)
        self.connection.subscribe(EMPTIED_PREFIX + "*", self._on_emptied)
        self.connection.subscribe(PAUSED_PREFIX + "*", self._on_paused)
        self.connection.subscribe(DELETED_PREFIX + "*", self._on_deleted)
        self.connection.subscribe(TOLD_PREFIX + "*", self._on_told)
        if self.engine is not None:
            self.reports.subscribe()
            self.snapshots.subscribe()
            own = f"{TO_NODE_PREFIX}{self.engine.node}."
            self.connection.subscribe(own + "*", lambda msg: self._on_told_to_this_node(msg, len(own)))
        if self.engine is not None:
            await self.topology.load()  # after the advisories' subscriptions: a change meanwhile is read again
        await self.deferred.prepare(self.settings.replicas)
        if self.engine is not None:
            self.schedule_keeper = SharedScheduleKeeper(self, self.engine.schedules, self.engine.node)
            self.engine.schedules.keeper = self.schedule_keeper
            await self.schedule_keeper.prepare(self.settings.replicas)
            nursery.start_soon(self.schedule_keeper.run)
        nursery.start_soon(self._control)
        nursery.start_soon(self._send_gathered)
        nursery.start_soon(self.deferred.run)
        if self.engine is not None:
            nursery.start_soon(self.topology.run)
            nursery.start_soon(self.reports.run)
            self.engine.timers.schedule(self.clock.now() + PULL_LOST_CHECK_S, self._forget_lost_pulls)

    async def _control(self) -> None:
        """Run the API calls in the order the engine asked for them; a failed one is logged and skipped."""
        async for operation in self._control_receive:
            try:
                await operation()
            except (NatsError, ValueError, KeyError) as error:
                log.error("JetStream operation failed: %r", str(error))

    def _later(self, operation: Callable[[], Any]) -> None:
        self._control_send.send_nowait(operation)

    def _change_later(self, key: Any, change: Callable[[], Awaitable[Any]]) -> None:
        """Run `change` in order with the node's other operations; `key` is unsettled until it has run."""
        self.pending[key] += 1

        async def run() -> None:
            try:
                await change()
            finally:
                self._done(key)

        self._later(run)

    # -- topics -----------------------------------------------------------------------------

    def topic_made(self, topic: Topic, done: Stored) -> None:
        state = self._topic_state(topic.name)
        if state.ready:
            done(None)
            return

        async def told() -> None:  # after the stream's making, which was asked for first
            done(None if state.ready else RequestTimeout(f"the JetStream cluster made no stream for topic "
                                                         f"{topic.name}"))

        self._later(told)

    def _topic_state(self, name: str) -> TopicState:
        state = self.topics.get(name)
        if state is None:
            state = self.topics[name] = self.streams[api.topic_stream(name)] = TopicState()
            self._change_later(name, lambda: self._make_stream(name, state))
        return state

    def _done(self, key: Any) -> None:
        self.pending[key] -= 1
        if self.pending[key] <= 0:
            del self.pending[key]
        self.changes += 1
        self.finished[key] = self.changes

    def heard(self, key: Any) -> None:
        """Another node changed it (an advisory, a notice): a read of the cluster taken before is stale for it."""
        self.changes += 1
        self.finished[key] = self.changes

    def unsettled(self, key: Any, since: int) -> bool:
        """This node changed it in the cluster, or heard it changed, after a read taken when `changes` was `since`;
        or is changing it."""
        return bool(self.pending.get(key)) or self.finished.get(key, 0) > since

    def known_topic(self, name: str) -> TopicState:
        """The state of a topic whose stream the cluster was just read to hold."""
        state = self.topics.get(name)
        if state is None:
            state = self.topics[name] = self.streams[api.topic_stream(name)] = TopicState(ready=True, queues=set())
            state.made.set()
        return state

    async def _make_stream(self, name: str, state: TopicState) -> None:
        try:
            await api.ensure_stream(self.connection, name, self.stream_settings)
            names = await api.consumer_names(self.connection, name)
            if not names:
                await self._keep_backlog(name)
        except NatsError as error:
            waiting, state.waiting = state.waiting, []
            self.topics.pop(name, None)  # asked again at the next publish or binding
            state.made.set()
            for _, stored, _ in waiting:
                stored(error)
            raise
        known = set(names) - {api.BACKLOG_CONSUMER}
        state.queues = known if state.queues is None else state.queues | known
        state.ready = True
        state.made.set()
        self._release(name, state)

    async def stream_made(self, topic: str) -> None:
        """Wait until the topic's stream exists (made now if it is not), within the API deadline."""
        with trio.move_on_after(api.API_DEADLINE_S):
            while True:
                state = self._topic_state(topic)
                if state.ready:
                    return
                await state.made.wait()
        raise RequestTimeout(f"the JetStream cluster made no stream for topic {topic} "
                             f"within {api.API_DEADLINE_S:.0f} s")

    def _release(self, name: str, state: TopicState) -> None:
        """Send what waited for the topic's stream and this node's bindings."""
        if not state.ready or self.binding:
            return
        waiting, state.waiting = state.waiting, []
        for messages, stored, drop_if_unbound in waiting:
            self._publish_now(name, state, messages, stored, drop_if_unbound)

    def _on_consumer_advisory(self, msg: Msg) -> None:
        """`$JS.EVENT.ADVISORY.CONSUMER.CREATED.<stream>.<consumer>` (or DELETED): which topics have queues
        (at once, for MQKS's rule), and the topic read again (`Topology`)."""
        parts = msg.subject.split(".")
        if len(parts) != 7:
            return
        action, stream, consumer = parts[4], parts[5], parts[6]
        topic = api.topic_of_stream(stream)
        if topic is None or consumer == api.BACKLOG_CONSUMER:
            return
        state = self.streams.get(stream)
        if state is not None and state.queues is not None:
            if action == "CREATED":
                state.queues.add(consumer)
            elif action == "DELETED":
                state.queues.discard(consumer)
        if action in ("CREATED", "DELETED"):
            self.heard(topic)
            self.topology.changed(topic)

    def _on_stream_advisory(self, msg: Msg) -> None:
        """`$JS.EVENT.ADVISORY.STREAM.CREATED.<stream>` (or DELETED): a topic made or deleted by any node."""
        parts = msg.subject.split(".")
        if len(parts) != 6 or parts[4] not in ("CREATED", "DELETED"):
            return
        topic = api.topic_of_stream(parts[5])
        if topic is not None:
            self.heard(topic)
            self.topology.changed(topic)

    async def _has_consumers(self, topic: str) -> bool:
        return bool(await api.consumer_names(self.connection, topic))

    async def _keep_backlog(self, topic: str) -> None:
        config = api.consumer_config(api.BACKLOG_CONSUMER, topic=topic, ack_wait_s=self.settings.ack_wait_s,
                                     start_seq=0)
        await api.ensure_consumer(self.connection, topic, api.BACKLOG_CONSUMER, config)

    def topic_deleted(self, name: str) -> None:
        self.topic_forgotten(name)
        self._change_later(name, lambda: api.delete_stream(self.connection, name))

    def topic_forgotten(self, name: str) -> None:
        self.topics.pop(name, None)
        self.streams.pop(api.topic_stream(name), None)

    # -- publishing -------------------------------------------------------------------------

    def publish(self, topic: Topic, messages: list[Message], stored: Stored, drop_if_unbound: bool) -> None:
        now = self.clock.now()
        if len(messages) == 1 and messages[0].due is not None and messages[0].due > now:
            message = messages[0]  # NSQ's DPUB: kept in the cluster until it is due (deferred.py)
            due_wall_ns = self.clock.wall_ns() + int((message.due - now) * 1e9)  # type: ignore[operator]
            self.deferred.defer(topic.name, message, due_wall_ns, self._counting_deferred(topic, stored),
                                self.kept_headers(message, f"deferred-{message.id}"))
            return
        self.publish_to(topic.name, messages, stored, drop_if_unbound)

    def _counting_deferred(self, topic: Topic, stored: Stored) -> Stored:
        """`stored`, once the deferred message is kept: counted in this node's queues of the topic until it is
        due."""

        def counted(error: Exception | None) -> None:
            if error is None:
                for queue in topic.queues:
                    if isinstance(queue, SharedQueue):
                        queue.deferred_elsewhere += 1
            stored(error)

        return counted

    def moved(self, topic: str) -> None:
        """A deferred message of the topic was due and moved to it by this node."""
        engine = self.engine
        found = engine.topics.get(topic) if engine is not None else None
        for queue in found.queues if found is not None else ():
            if isinstance(queue, SharedQueue) and queue.deferred_elsewhere > 0:
                queue.deferred_elsewhere -= 1

    def publish_to(self, name: str, messages: list[Message], stored: Stored, drop_if_unbound: bool = False) -> None:
        """Publish to the topic `name` once its stream is there and this node's bindings are made."""
        state = self._topic_state(name)
        if not state.ready or self.binding:
            entry = (messages, stored, drop_if_unbound)
            state.waiting.append(entry)
            if self.engine is not None:  # a stream the cluster cannot make now fails it within the bound
                self.engine.timers.schedule(self.clock.now() + self.settings.publish_timeout_s,
                                            self._waited_too_long, state, entry)
            return
        self._publish_now(name, state, messages, stored, drop_if_unbound)

    def _waited_too_long(self, state: TopicState, entry: tuple[list[Message], Stored, bool]) -> None:
        for index, waiting in enumerate(state.waiting):
            if waiting is entry:
                del state.waiting[index]
                entry[1](RequestTimeout(f"the JetStream cluster made no stream for it within "
                                        f"{self.settings.publish_timeout_s:g} s"))
                return

    def _publish_now(self, name: str, state: TopicState, messages: list[Message], stored: Stored,
                     drop_if_unbound: bool) -> None:
        if drop_if_unbound and (not state.queues or state.asking is not None) and self.engine is not None:
            self._unbound(name, state, messages, stored)  # behind those asked about, in their order
            return
        self._send(name, messages, stored)

    def _unbound(self, name: str, state: TopicState, messages: list[Message], stored: Stored) -> None:
        """MQKS's rule: a publish to a topic no queue on any node is bound to is dropped. The advisory of a queue
        bound a moment ago may still be on its way here, so the cluster is asked before anything is dropped
        (once for every such publish that comes meanwhile): a publish made after a confirmed consume reaches
        the queue, whichever node took either."""
        if state.asking is not None:
            state.asking.append((messages, stored))
            return
        state.asking = [(messages, stored)]

        async def ask() -> None:
            queues: set[str] | None = None
            try:
                queues = set(await api.consumer_names(self.connection, name)) - {api.BACKLOG_CONSUMER}
            finally:
                asking, state.asking = state.asking or [], None
                if queues:
                    state.queues = (state.queues or set()) | queues
                for waiting, waiting_stored in asking:
                    if queues is None or queues:
                        self._send(name, waiting, waiting_stored)  # bound after all (or the cluster is away)
                    elif self.engine is not None:
                        self.engine.dropped_count += len(waiting)
                        waiting_stored(None)

        self._later(ask)

    def _send(self, topic: str, messages: list[Message], stored: Stored) -> None:
        subject = api.topic_subject(topic)
        finished = self._tally(topic, len(messages), stored)

        def answered(reply: Msg | NatsError) -> None:
            if isinstance(reply, NatsError):
                finished(0, reply)
                return
            try:
                _, _, duplicate = api.parse_publish_ack(reply.payload)
            except (api.JetStreamError, ValueError, KeyError) as error:
                finished(0, error)
                return
            finished(0 if duplicate else 1, None)

        if not messages:
            stored(None)
            return
        deadline = self.clock.now() + self.settings.publish_timeout_s
        if len(messages) == 1 and topic not in self.batches.plain:
            self._gathered.setdefault(topic, []).append(Gathered(messages[0], deadline, finished, answered))
            self._gather_wake.set()
            return
        if topic in self.batches.plain:
            for message in messages:
                self.publish_one(subject, message.body, self._headers(message), deadline, answered)
            return
        self._send_batches(topic, messages, deadline, stored)

    def _tally(self, topic: str, parts: int, stored: Stored) -> Callable[[int, Exception | None], None]:
        """What `parts` answers come to, each with how many messages it stored now, or why not: `stored` is told
        once all have come (the first failure, if any)."""
        left = [parts]
        first_error: list[Exception | None] = [None]
        clock = self.clock
        sent = clock.now()

        def finished(count: int, error: Exception | None) -> None:
            for _ in range(count):
                self._count_stored(topic)
            first_error[0] = first_error[0] or error
            left[0] -= 1
            if left[0] == 0:
                self.publish_latency.observe(clock.now() - sent)
                stored(first_error[0])

        return finished

    async def _send_gathered(self) -> None:
        """Single publishes to a topic made in one turn of the node's loop (many clients' at once) go as one
        batch: the servers' quorum wait is paid once for all of them, and each client is answered when the
        batch's answer comes. One alone goes as a plain publish."""
        while True:
            await self._gather_wake.wait()
            self._gather_wake = trio.Event()
            gathered, self._gathered = self._gathered, {}
            for topic, items in gathered.items():
                self._send_group(topic, items)

    def _send_group(self, topic: str, items: list[Gathered]) -> None:
        subject = api.topic_subject(topic)
        if len(items) == 1 or topic in self.batches.plain:
            for item in items:
                self.publish_one(subject, item.message.body, self._headers(item.message), item.deadline,
                                  item.answered)
            return
        for start in range(0, len(items), BATCH_MAX):
            chunk = items[start:start + BATCH_MAX]

            def done(count: int, error: Exception | None, chunk: list[Gathered] = chunk) -> None:
                if error is None or isinstance(error, RequestTimeout | ConnectionLost):
                    # Stored (0: by an earlier try of the batch), or no answer by the deadline: maybe stored, and
                    # its members have no repeat key of their own to go again by.
                    for item in chunk:
                        item.finished(1 if count else 0, error)
                    return
                # Refused, nothing of it stored: each goes alone, so what one client sent (too large, say) fails no
                # other client's.
                for item in chunk:
                    self.publish_one(subject, item.message.body, self._headers(item.message), item.deadline,
                                      item.answered)

            batch, tag = self._batch([item.message for item in chunk])
            self.batches.publish(topic, batch, min(item.deadline for item in chunk), done, tag)

    def _send_batches(self, topic: str, messages: list[Message], deadline: float, stored: Stored) -> None:
        """Several messages at once: atomic batches (jetstream/batches.py), BATCH_MAX a batch; `stored` is told
        once every batch is answered (the first failure, if any: a failed batch stored none of its messages)."""
        chunks = [messages[start:start + BATCH_MAX] for start in range(0, len(messages), BATCH_MAX)]
        finished = self._tally(topic, len(chunks), stored)

        def answered(chunk: list[Message], count: int, error: Exception | None) -> None:
            if isinstance(error, api.JetStreamError) and error.err_code == ERR_BATCH_DISABLED:
                self._send(topic, chunk, lambda plain_error: finished(0, plain_error))  # one at a time after all
                return
            finished(count, error)

        for chunk in chunks:
            batch, tag = self._batch(chunk)
            self.batches.publish(topic, batch, deadline,
                                 lambda count, error, chunk=chunk: answered(chunk, count, error), tag)

    def _count_stored(self, topic: str) -> None:
        """One more message waits in the topic: in each of this node's queues bound to it, or in its backlog.
        (The node's view: `Topology` sets what JetStream says of every node's publishes and deliveries.)"""
        engine = self.engine
        found = engine.topics.get(topic) if engine is not None else None
        if found is None:
            return
        if found.queues:
            for queue in found.queues:
                if isinstance(queue, SharedQueue):
                    queue.shared_log.spilled += 1
        elif isinstance(found.log, SharedTopicLog):
            state = self.topics.get(topic)
            if state is None or not state.queues:
                found.log.spilled += 1

    def publish_one(self, subject: str, body: bytes, headers: dict[str, str], deadline: float,
                     answered: Callable[[Msg | NatsError], None]) -> None:
        """Publish until JetStream answers or `deadline`: a stream without a leader yet (just made, or
        electing one) has no responders, and a publish whose server went away has no answer; both are asked
        again (over the next server once reconnected); `Nats-Msg-Id` makes a repeat count once."""

        def answer(reply: Msg | NatsError) -> None:
            retry_at = self.clock.now() + PUBLISH_RETRY_S
            if isinstance(reply, NoResponders | RequestTimeout | ConnectionLost) and retry_at < deadline \
                    and self.engine is not None:
                self.engine.timers.schedule(retry_at, self.publish_one, subject, body, headers, deadline, answered)
                return
            answered(reply)

        timeout = max(deadline - self.clock.now(), 0.001)
        try:
            self.connection.request_nowait(subject, body, answer, headers=headers, timeout=timeout)
        except NatsError as error:  # refused before it left: over the servers' max_payload, or closed
            answered(error)

    def _headers(self, message: Message) -> dict[str, str]:
        """The headers of a message's first publish: its `Nats-Msg-Id` is its id, then its origin and what else
        it carries (`_own_headers`)."""
        headers = {api.HEADER_MSG_ID: str(message.id)}
        if message.origin is not None:
            headers[api.HEADER_POLYMQ_ORIGIN] = message.origin
        own = self._own_headers(message)
        if own:
            headers.update(own)  # a dead letter's key of its own replaces its Nats-Msg-Id
        return headers

    def _own_headers(self, message: Message) -> dict[str, str]:
        """What a message carries besides its id and origin (NO_HEADERS if nothing): its time only when it was
        made a while before (else its time is when the cluster stores it: each header costs the servers,
        docs/performance.md), its publisher's id or its headers, its expiry."""
        own: dict[str, str] = {}
        if self.clock.wall_ns() - message.timestamp_ns > OWN_TIME_AFTER_NS:
            own[api.HEADER_POLYMQ_TIMESTAMP] = str(message.timestamp_ns)
        publisher_id = message.publisher_id
        if not message.headers and publisher_id is not None and PLAIN_VALUE.fullmatch(publisher_id):
            own[api.HEADER_POLYMQ_PUBLISHER] = publisher_id.decode("ascii")
        else:
            shown = shown_headers(message)  # a publisher's id kept apart travels among the headers
            if shown:
                own[api.HEADER_POLYMQ_HEADERS] = json.dumps(dict(shown), separators=(",", ":"))
                dead_of = shown.get(DEAD_LETTER_QUEUE_HEADER)
                if dead_of is not None:
                    # A dead letter keeps its message's id: its key names its queue and when, so the message
                    # dead-lettered again (its letters requeued) or by another queue into the same topic is
                    # another letter, not a repeat JetStream would drop.
                    own[api.HEADER_MSG_ID] = (f"dead-{api.queue_consumer(str(dead_of))}-{message.id}-"
                                              f"{self.clock.wall_ns()}")
                    own[api.HEADER_POLYMQ_ID] = str(message.id)
        if message.expires_at is not None:
            wall = self.clock.wall_ns() + int((message.expires_at - self.clock.now()) * 1e9)
            own[api.HEADER_POLYMQ_EXPIRES] = str(wall)
        return own or NO_HEADERS

    def _batch(self, messages: list[Message]) -> tuple[list[Item], str]:
        """A batch's bodies and headers, and the tag its id ends with (`api.batch_tag`): a message of the first's
        origin goes without its origin, and without its id too when that is the first's plus its place (both read
        back from the batch's headers, `api.batch_member`), else with its id as `Polymq-Id`; the first alone
        keeps its `Nats-Msg-Id`, which makes a batch asked again count once."""
        first = messages[0]
        origin = first.origin
        if origin is not None and not (origin.isalnum() and len(origin) <= MAX_TAGGED_ORIGIN):
            return [(message.body, self._headers(message)) for message in messages], ""
        items: list[Item] = []
        for place, message in enumerate(messages):
            if place and message.origin == origin:
                own = self._own_headers(message)
                if message.id == first.id + place:
                    items.append((message.body, own))
                    continue
                if api.HEADER_MSG_ID not in own:  # else a dead letter's key: it goes whole
                    # Its id, but not as a `Nats-Msg-Id`: JetStream keeps each of those in its repeat window,
                    # a cost the batch's first one alone pays for all (docs/performance.md).
                    items.append((message.body, {**own, api.HEADER_POLYMQ_ID: str(message.id)}))
                    continue
            items.append((message.body, self._headers(message)))
        return items, api.batch_tag(first.id, origin)

    async def requeue_dead(self, queue: SharedQueue) -> Requeued:
        return await requeue_dead(self, queue)

    def kept_headers(self, message: Message, msg_id: str) -> dict[str, str]:
        """The headers of another publish of a message (put back, requeued, deferred): its own `Nats-Msg-Id`,
        and the message's id and time kept beside it."""
        headers = self._headers(message)
        headers[api.HEADER_MSG_ID] = msg_id
        headers[api.HEADER_POLYMQ_ID] = str(message.id)
        headers[api.HEADER_POLYMQ_TIMESTAMP] = str(message.timestamp_ns)
        return headers

    # -- queues -----------------------------------------------------------------------------

    def queue_made(self, queue: SharedQueue) -> None:
        self.queue_tokens[api.token(queue.name)] = queue.name

    def _options(self, queue: SharedQueue) -> str:
        """What another node needs to make the same queue, kept in its consumers' metadata."""
        engine = self.engine
        assert engine is not None
        return json.dumps(engine._queue_options(queue), separators=(",", ":"), sort_keys=True)

    def bound(self, queue: SharedQueue, topic: str, done: Stored) -> None:
        state = self._topic_state(topic)
        self.binding += 1

        async def attach() -> None:
            error: Exception | None = None
            try:
                await self._attach_consumer(queue, topic, state)
            except NatsError as failure:
                error = failure
                raise
            finally:
                self.binding -= 1
                done(error)
                for name, waiting in list(self.topics.items()):
                    self._release(name, waiting)

        self._change_later((queue.name, topic), attach)

    async def _attach_consumer(self, queue: SharedQueue, topic: str, state: TopicState) -> None:
        if not state.ready or queue.deleted or topic not in queue.topics:
            return
        if state.queues is not None:
            state.queues.add(api.queue_consumer(queue.name))
        name = api.queue_consumer(queue.name)
        names = await api.consumer_names(self.connection, topic)
        floor = 0  # a consumer made now has emptied nothing yet
        if name not in names:
            # The first queue of a topic takes its backlog (from the stream's first message); an ephemeral
            # channel starts at its subscription and leaves the backlog to the first durable queue.
            first = api.BACKLOG_CONSUMER in names and not queue.ephemeral
            start = 0 if first else await api.next_sequence(self.connection, topic)
            config = api.consumer_config(name, topic=topic, ack_wait_s=self.settings.ack_wait_s, start_seq=start,
                                         queue=queue.name, options=self._options(queue), ephemeral=queue.ephemeral)
            await api.ensure_consumer(self.connection, topic, name, config)
            if first:  # this queue took the backlog over (from the stream's first message)
                await api.delete_consumer(self.connection, topic, api.BACKLOG_CONSUMER)
        else:  # made before: what was kept with it (emptied below a floor, paused)
            kept = await api.metadata(self.connection, topic, name)
            floor = int(kept.get(api.FLOOR_METADATA, 0))
            if kept.get(api.PAUSED_METADATA) == "1" and not queue.paused:
                queue.paused_here(True)
        if queue.deleted or topic not in queue.topics:
            return
        self._add_puller(queue, topic, floor)

    def _add_puller(self, queue: SharedQueue, topic: str, floor: int) -> Puller:
        self._stop_puller(queue, topic, retire=True)
        name = api.queue_consumer(queue.name)
        inbox = self.connection.new_inbox()
        puller = Puller(queue, topic, name, api.pull_subject(topic, name), inbox, floor=floor)
        puller.sid = self.connection.subscribe(inbox + ".*", lambda msg: self._on_pulled(puller, msg))
        self.pullers.setdefault(queue.name, []).append(puller)
        self.want(queue)
        return puller

    def followed(self, queue: SharedQueue, topic: str) -> None:
        """Bound in the cluster (by another node, or before this node started): read with what the topology
        read of its consumer."""
        state = self.known_topic(topic)
        name = api.queue_consumer(queue.name)
        if state.queues is not None:
            state.queues.add(name)
        consumer = self.topology.consumer(topic, queue.name)
        paused = self.noticed_paused.get(queue.name, consumer is not None and consumer.paused)
        if paused and not queue.paused:
            queue.paused_here(True)
        floor = max(consumer.floor if consumer is not None else 0,
                    self.noticed_floors.get((queue.name, api.topic_stream(topic)), 0))
        puller = self._add_puller(queue, topic, floor)
        if consumer is not None:
            puller.pending = consumer.pending

    def unfollowed(self, queue: SharedQueue, topic: str) -> None:
        dropped = queue.deleted and queue.forgotten and not queue.forgotten_empty
        self._stop_puller(queue, topic, retire=not dropped)  # a dropped one's pull requests end with it
        if not queue.deleted:
            return
        self.queue_tokens.pop(api.token(queue.name), None)
        if dropped:
            # Deleted here for want of consumers (MQKS's --delete-queue-when-unused, an NSQ ephemeral channel's
            # last client gone): deleted from the cluster too, unless another node's clients read it. In the
            # order of this node's other changes: a client naming the queue again meanwhile makes a new one.
            self._change_later((queue.name, topic), lambda: self._drop_if_unused(queue.name, topic))

    async def _drop_if_unused(self, queue_name: str, topic: str) -> None:
        """The queue's consumer in the topic goes unless some node reads it: pull requests waiting, or copies
        given out and not acknowledged. This node's own last ones are gone within a moment (its pull requests
        lost their subscriber, its copies were given back), so a count above zero is asked again."""
        name = api.queue_consumer(queue_name)
        for check in range(UNUSED_CHECKS):
            if check:
                await trio.sleep(UNUSED_CHECK_PAUSE_S)
            try:
                info = await api.consumer_info(self.connection, topic, name)
            except api.JetStreamError as error:
                if error.err_code in (api.ERR_CONSUMER_NOT_FOUND, api.ERR_STREAM_NOT_FOUND):
                    return
                raise
            if not int(info.get("num_waiting", 0)) and not int(info.get("num_ack_pending", 0)):
                await self._drop_consumer(queue_name, topic)
                return

    def bind_again(self, queue: SharedQueue, topic: str) -> None:
        """An ephemeral channel with clients here whose consumer is gone (no node read it for a while): made
        again, from now on."""
        self._stop_puller(queue, topic)
        self.bound(queue, topic, lambda error: None)

    def consumer_read(self, queue_name: str, topic: str, floor: int, pending: int) -> None:
        """What a read of the cluster found in the queue's consumer of the topic: its floor, what it holds."""
        self._floor(queue_name, api.topic_stream(topic), floor)
        for puller in self.pullers.get(queue_name, ()):
            if puller.topic == topic:
                puller.pending = pending

    def _stop_puller(self, queue: SharedQueue, topic: str, *, retire: bool = False) -> None:
        """The node stops reading the queue's consumer in the topic. `retire`: the consumer stays in the
        cluster, read by other nodes (`_retire`); else it is being deleted, which ends its pull requests, and
        a node telling whether any node still reads it must not count this one's."""
        pullers = self.pullers.get(queue.name, [])
        for puller in [p for p in pullers if p.topic == topic]:
            puller.active = False
            pullers.remove(puller)
            if retire:
                self._retire(puller)
            else:
                self.connection.unsubscribe(puller.sid, late=self._give_back_late)
        if not pullers:
            self.pullers.pop(queue.name, None)

    def _retire(self, puller: Puller) -> None:
        """A reading stopped: JetStream cannot take its pull requests back, and serves the oldest first, so
        one left unheard would take the next message to an inbox nobody reads (given again only after the
        ack wait, though another node's consumer waits for it). The inbox is kept until every request has
        ended, giving back at once what they bring (`_on_pulled`); at the latest once they are lost."""
        if not puller.requests or self.engine is None:
            self._retired(puller)
            return
        lost_at = puller.issued[-1][0]  # the newest request's: every waiting one has its entry there
        self.engine.timers.schedule(lost_at, self._retired, puller)

    def _retired(self, puller: Puller) -> None:
        if puller.sid:
            self.connection.unsubscribe(puller.sid, late=self._give_back_late)
            puller.sid = 0

    def unbound(self, queue: SharedQueue, topic: str) -> None:
        self._stop_puller(queue, topic)
        self._drop_later(queue.name, topic)

    def _drop_later(self, queue_name: str, topic: str) -> None:
        self._change_later((queue_name, topic), lambda: self._drop_consumer(queue_name, topic))

    async def _drop_consumer(self, queue_name: str, topic: str) -> None:
        await api.delete_consumer(self.connection, topic, api.queue_consumer(queue_name))
        if topic in self.topics and not await self._has_consumers(topic):
            await self._keep_backlog(topic)  # nsqd's rule: a topic without channels keeps what comes

    def queue_deleted(self, queue: SharedQueue, topics: list[str]) -> None:
        self.queue_tokens.pop(api.token(queue.name), None)
        for topic in topics:
            self._stop_puller(queue, topic)
        for topic in topics:
            self._drop_later(queue.name, topic)
        node = self.engine.node if self.engine is not None else 0
        # Told once its consumers are gone: a node that reads the cluster then finds no binding to undo.
        self._later(lambda: self._tell(DELETED_PREFIX + api.token(queue.name), b"%d" % node))

    async def _tell(self, subject: str, payload: bytes) -> None:
        self.connection.publish(subject, payload)

    def _on_deleted(self, msg: Msg) -> None:
        """Another node deleted a queue: deleted here too, its consumers here told as a deletion here tells them."""
        engine = self.engine
        name = self.queue_tokens.get(msg.subject[len(DELETED_PREFIX):])
        if engine is None or name is None or msg.payload == b"%d" % engine.node:
            return
        queue = engine.queues.get(name)
        if not isinstance(queue, SharedQueue) or any(isinstance(key, tuple) and key[0] == name for key in self.pending):
            return  # this node binds it again meanwhile: a client here named it after the deletion
        with engine.following():
            engine.delete_queue(name)

    def queue_configured(self, queue: SharedQueue) -> None:
        topics = [topic for topic in queue.topics if topic in self.topics]
        name, options = api.queue_consumer(queue.name), self._options(queue)

        async def keep() -> None:
            for topic in topics:
                await api.set_metadata(self.connection, topic, name, {api.OPTIONS_METADATA: options})

        self._later(keep)

    def topic_emptied(self, topic: Topic) -> None:
        """The backlog's consumer made again from the stream's next message: nothing else wants the old
        ones, so the stream drops them (interest retention)."""
        name = topic.name

        async def empty() -> None:
            if not await api.delete_consumer(self.connection, name, api.BACKLOG_CONSUMER):
                return  # the topic has queues: nothing was kept for a first one
            config = api.consumer_config(api.BACKLOG_CONSUMER, topic=name, ack_wait_s=self.settings.ack_wait_s,
                                         start_seq=await api.next_sequence(self.connection, name))
            await api.ensure_consumer(self.connection, name, api.BACKLOG_CONSUMER, config)

        self._later(empty)

    def queue_emptied(self, queue: SharedQueue, done: Stored) -> None:
        """A consumer cannot skip ahead: the node reads the stream's last sequence and keeps it as the
        queue's floor in the consumer's metadata; every node acks, undelivered, what comes at or below it."""
        topics = list(queue.topics)

        async def empty() -> None:
            error: Exception | None = None
            try:
                for topic in topics:
                    floor = await api.empty_consumer(self.connection, topic, api.queue_consumer(queue.name))
                    self._floor(queue.name, api.topic_stream(topic), floor)
                    self.connection.publish(EMPTIED_PREFIX + api.token(queue.name),
                                            f"{api.topic_stream(topic)} {floor}".encode())
            except NatsError as failure:
                error = failure
                raise
            finally:
                done(error)

        self._later(empty)

    def _floor(self, queue_name: str, stream: str, floor: int) -> None:
        for puller in self.pullers.get(queue_name, ()):
            if api.topic_stream(puller.topic) == stream:
                puller.floor = max(puller.floor, floor)

    def queue_paused(self, queue: SharedQueue, paused: bool, done: Stored) -> None:
        """Paused in JetStream itself (no node is given its messages from the answer on), kept in its
        consumers' metadata for the nodes that read it, and told to the others at once."""
        topics = list(queue.topics)
        name = api.queue_consumer(queue.name)

        async def keep() -> None:
            error: Exception | None = None
            try:
                for topic in topics:
                    await api.pause_consumer(self.connection, topic, name, paused)
                    await api.set_metadata(self.connection, topic, name,
                                           {api.PAUSED_METADATA: "1" if paused else "0"})
                self.connection.publish(PAUSED_PREFIX + api.token(queue.name), b"1" if paused else b"0")
            except NatsError as failure:
                error = failure
                raise
            finally:
                done(error)

        self._change_later(paused_key(queue.name), keep)

    def _queue_named(self, token: str) -> str | None:
        name = self.queue_tokens.get(token)
        if name is not None:
            return name
        try:
            return api.untoken(token)
        except (ValueError, UnicodeDecodeError):
            return None

    def _on_paused(self, msg: Msg) -> None:
        name = self._queue_named(msg.subject[len(PAUSED_PREFIX):])
        engine = self.engine
        if name is None or engine is None:
            return
        self.heard(paused_key(name))
        paused = msg.payload == b"1"
        queue = engine.queues.get(name)
        if isinstance(queue, SharedQueue):
            if queue.paused != paused:
                queue.paused_here(paused)
        else:
            self.noticed_paused[name] = paused

    def _on_emptied(self, msg: Msg) -> None:
        name = self._queue_named(msg.subject[len(EMPTIED_PREFIX):])
        try:
            stream, floor_text = msg.payload.decode().split(" ")
            floor = int(floor_text)
        except ValueError:
            return
        if name is None:
            return
        if not any(api.topic_stream(puller.topic) == stream for puller in self.pullers.get(name, ())):
            key = (name, stream)
            self.noticed_floors[key] = max(self.noticed_floors.get(key, 0), floor)
        self._floor(name, stream, floor)

    # -- pulling ----------------------------------------------------------------------------

    def want(self, queue: SharedQueue) -> None:
        """Ask for what the queue's consumers here can take. A pull request holds its share of their credit
        until it is served or ends (5 s): a queue bound to several topics keeps one request waiting in each
        (a message there is seen at once, even past the credit: what comes beyond it waits here), and gives
        the rest of its credit to the topics JetStream last said hold messages for it."""
        pullers = self.pullers.get(queue.name)
        if not pullers:
            return
        room = queue.wanted()
        if room <= 0:
            return
        wanted = room - sum(p.outstanding for p in pullers)
        if len(pullers) == 1:
            if wanted > 0:
                self._pull(pullers[0], wanted)
            return
        for puller in pullers:
            if not puller.outstanding:
                self._pull(puller, 1)
                wanted -= 1
        busy = [puller for puller in pullers if puller.pending > 0]
        for index, puller in enumerate(busy):
            if wanted <= 0:
                return
            share = -(-wanted // (len(busy) - index))
            self._pull(puller, share)
            wanted -= share

    def _pull(self, puller: Puller, count: int) -> None:
        while count > 0 and len(puller.requests) - len(puller.stale) < MAX_PULLS_WAITING:
            batch = min(count, MAX_PULL_BATCH)
            puller.counter += 1
            request = str(puller.counter)
            puller.requests[request] = batch
            puller.outstanding += batch
            puller.issued.append((self.clock.now() + PULL_EXPIRES_S + PULL_LOST_AFTER_S, request))
            self.connection.publish(puller.subject, api.pull_request(batch, PULL_EXPIRES_S),
                                    reply=f"{puller.inbox}.{request}")
            count -= batch

    def _forget_lost_pulls(self) -> None:
        """A pull request JetStream ends with a status (served, expired, its consumer's leader gone); one that
        never hears one was lost (made on a link that died unseen, held by a server that forgot it) and still
        holds its share of the consumers' credit here: past its lifetime and a margin it is let go, and the
        queue asks again. Checked every `PULL_LOST_CHECK_S`."""
        if self.engine is not None:
            self.engine.catch_up()  # after a pause, what the requests made before bring is not taken
        now = self.clock.now()
        for pullers in list(self.pullers.values()):
            lost = False
            for puller in pullers:
                issued = puller.issued
                while issued and issued[0][0] <= now:
                    token = issued.popleft()[1]
                    owed = puller.requests.pop(token, 0)
                    if token in puller.stale:
                        puller.stale.discard(token)
                        continue
                    if owed:
                        puller.outstanding = max(puller.outstanding - owed, 0)
                        self.lost_pulls += 1
                        lost = True
            if lost and pullers:
                self.want(pullers[0].queue)
        if self.engine is not None:
            self.engine.timers.schedule(now + PULL_LOST_CHECK_S, self._forget_lost_pulls)

    def lapsed(self) -> None:
        self.lapses += 1
        queues = []
        for pullers in self.pullers.values():
            for puller in pullers:
                puller.stale = set(puller.requests)
                puller.outstanding = 0
            if pullers:
                queues.append(pullers[0].queue)
        for queue in queues:
            self.want(queue)

    def _on_pulled(self, puller: Puller, msg: Msg) -> None:
        if not puller.active:
            self._on_retired_pull(puller, msg)
            return
        engine = self.engine
        if engine is not None:
            engine.catch_up()  # after a pause: copies for the requests made before it are not taken
        if msg.status is not None:
            self._on_status(puller, msg)
            return
        if msg.reply is None:
            return
        request = puller.served_one()
        if puller.stale and request in puller.stale:
            if request not in puller.requests:
                puller.stale.discard(request)
            puller.queue.taken_back_count += 1  # left to its ack wait: no word to JetStream about it
            return
        puller.outstanding = max(puller.outstanding - 1, 0)
        self._delivered(puller, msg)

    def _on_retired_pull(self, puller: Puller, msg: Msg) -> None:
        """What a stopped reading's pull requests bring goes back; once none is left waiting, its inbox goes."""
        if not puller.sid:
            return
        if msg.status is None:
            self._give_back_late(msg)
            puller.served_one()
        elif msg.status != 100:  # not an idle heartbeat: the request ended
            puller.requests.pop(msg.subject.rsplit(".", 1)[-1], None)
        if not puller.requests:
            self._retired(puller)

    def _give_back_late(self, msg: Msg) -> None:
        """A copy that came for a reading this node stopped goes back to the queue at once, no client having
        seen it: no attempt counted."""
        if msg.status is not None or msg.reply is None:
            return
        try:
            delivery = api.parse_ack_subject(msg.reply)
        except ValueError:
            return  # not JetStream's: nothing to give back
        topic = api.topic_of_stream(delivery.stream)
        if topic is None:
            self.connection.publish(msg.reply, api.NAK)
            return
        self._put_back(msg.reply, delivery, self._message(topic, msg, delivery))

    def _delivered(self, puller: Puller, msg: Msg) -> None:
        assert msg.reply is not None
        try:
            delivery = api.parse_ack_subject(msg.reply)
            if delivery.stream_seq <= puller.floor:
                self.connection.publish(msg.reply, api.ACK)  # emptied from the queue before it came
                self.want(puller.queue)
                return
            message = self._message(puller.topic, msg, delivery)
        except ValueError as error:
            log.error("a delivery polymq cannot read, left to JetStream: %r", str(error))
            return
        queue = puller.queue
        if self.snapshots.delayed:
            self.snapshots.given_again(queue.name, puller.topic, delivery.stream_seq)
        puller.pending = delivery.pending
        queue.shared_log.spilled = delivery.pending
        queue.receive([(message, msg.reply)])

    def _on_status(self, puller: Puller, msg: Msg) -> None:
        if msg.status == 100:  # idle heartbeat
            return
        request = msg.subject.rsplit(".", 1)[-1]
        owed = puller.requests.pop(request, 0)
        if request in puller.stale:
            puller.stale.discard(request)  # counted in nothing since the lapse
        else:
            puller.outstanding = max(puller.outstanding - owed, 0)
        if msg.status == REQUEST_TIMEOUT:
            puller.pending = 0  # it waited its whole time for what was not there
        if msg.status == 409 and "deleted" in msg.description.lower():
            puller.active = False
            return
        if msg.status == NO_RESPONDERS:  # no leader: one is being elected
            if not puller.retry_due and self.engine is not None:
                puller.retry_due = True
                self.engine.timers.schedule(self.clock.now() + PULL_RETRY_S, self._pull_again, puller)
            return
        self.want(puller.queue)

    def _pull_again(self, puller: Puller) -> None:
        puller.retry_due = False
        if puller.active:
            self.want(puller.queue)

    def _message(self, topic: str, msg: Msg, delivery: api.Delivery) -> Message:
        return self.message_of(topic, msg, attempts=delivery.delivered - 1, fallback_id=delivery.stream_seq,
                               fallback_timestamp=delivery.timestamp_ns)

    def message_of(self, topic: str, msg: Msg, *, attempts: int, fallback_id: int, fallback_timestamp: int) -> Message:
        """The engine's message a stored one stands for (its id, timestamp, headers, expiry, origin); the
        fallbacks are for a message some other NATS client stored, without polymq's headers."""
        headers = msg.headers or {}
        # A first publish's id is its Nats-Msg-Id; another publish of it keeps the id apart.
        shown_id = headers.get(api.HEADER_POLYMQ_ID) or headers.get(api.HEADER_MSG_ID, "")
        origin = headers.get(api.HEADER_POLYMQ_ORIGIN)
        if api.is_number(shown_id):
            message_id = int(shown_id)
            if origin is None and api.HEADER_MSG_ID not in headers:
                # One of a batch with its own id and the batch's origin (`_batch`).
                member = api.batch_member(headers)
                origin = member[1] if member is not None else None
        else:  # one of a batch that went with no headers of its own
            member = api.batch_member(headers)
            message_id, origin = (fallback_id, origin) if member is None else member
        # Its time is when the cluster stored it, unless it keeps its own (a deferred or requeued copy).
        timestamp = int(headers.get(api.HEADER_POLYMQ_TIMESTAMP) or fallback_timestamp
                        or api.stored_at(headers.get(api.HEADER_TIME_STAMP, "")))
        engine_headers: Mapping[str, Any] | None = None
        if api.HEADER_POLYMQ_HEADERS in headers:
            engine_headers = json.loads(headers[api.HEADER_POLYMQ_HEADERS])
        elif api.HEADER_POLYMQ_PUBLISHER in headers:
            engine_headers = {PUBLISHER_ID_HEADER: headers[api.HEADER_POLYMQ_PUBLISHER]}
        expires_at = None
        if api.HEADER_POLYMQ_EXPIRES in headers:
            left_ns = int(headers[api.HEADER_POLYMQ_EXPIRES]) - self.clock.wall_ns()
            expires_at = self.clock.now() + left_ns / 1e9
        attempts += int(headers.get(api.HEADER_POLYMQ_ATTEMPTS) or 0)  # a copy put back at a queue's tail
        return Message(message_id, msg.payload, timestamp, engine_headers, expires_at, attempts, topic, origin)

    # -- acknowledgements -------------------------------------------------------------------

    def _reply(self, queue: SharedQueue, message: Message, payload: bytes) -> None:
        handle = queue.handles.pop(message.id, None)
        if handle is not None:
            self.connection.publish(handle, payload)

    def ack(self, queue: SharedQueue, message: Message) -> None:
        self._reply(queue, message, api.ACK)

    def nak(self, queue: SharedQueue, message: Message, delay: float) -> None:
        handle = queue.handles.get(message.id)
        if handle is not None:  # held by no node until given again: a snapshot asks this one for it
            self.snapshots.given_back(queue.name, handle, message.attempts, delay)
        self._reply(queue, message, api.nak(delay))

    def term(self, queue: SharedQueue, message: Message) -> None:
        self._reply(queue, message, api.TERM)

    def progress(self, queue: SharedQueue, message: Message) -> None:
        handle = queue.handles.get(message.id)
        if handle is not None:
            self.connection.publish(handle, api.PROGRESS)
            self.progress_reports += 1

    def requeue_to_tail(self, queue: SharedQueue, message: Message) -> None:
        """A copy of the message at the tail of this queue only (its own subject), with its attempts and its
        new expiry; the delivery is acked once the copy is stored, and given back if it cannot be."""
        topic = message.topic or ""
        # Its key names the queue: the stream holds every queue's copies of the message (those of the topic's
        # other queues, requeued at the same attempt, are not repeats of this one).
        key = f"requeue-{api.queue_consumer(queue.name)}-{message.id}-{message.attempts}"
        headers = self.kept_headers(message, key)
        headers[api.HEADER_POLYMQ_ATTEMPTS] = str(message.attempts)
        handle = queue.handles.pop(message.id, None)

        def answered(reply: Msg | NatsError) -> None:
            if handle is not None:
                self.connection.publish(handle, api.ACK if api.publish_failure(reply) is None else api.NAK)

        deadline = self.clock.now() + self.settings.publish_timeout_s
        self.publish_one(api.requeue_subject(topic, queue.name), message.body, headers, deadline, answered)

    def give_back_unseen(self, queue: SharedQueue, message: Message) -> None:
        handle = queue.handles.pop(message.id, None)
        if handle is not None:
            self._put_back(handle, api.parse_ack_subject(handle), message)

    def _put_back(self, handle: str, delivery: api.Delivery, message: Message) -> None:
        """The delivery `handle` ends in a copy of its message at the tail of its queue only (the queue's own
        subject) carrying the message's attempts (JetStream counts every delivery; a copy no client saw is no
        attempt): stored first, then the delivery acked; given back with -NAK (counted) when the copy cannot
        be stored. Its Nats-Msg-Id names the delivery it ends (its queue's consumer, the stream sequence, the
        delivery count), so a publish asked again is stored once, and a message put back twice, or by two queues
        of its topic, is two copies, never one taken for a repeat of the other."""
        key = f"put-back-{delivery.consumer}-{delivery.stream_seq}-{delivery.delivered}"
        headers = self.kept_headers(message, key)
        headers[api.HEADER_POLYMQ_ATTEMPTS] = str(message.attempts)

        def answered(reply: Msg | NatsError) -> None:
            self.connection.publish(handle, api.ACK if api.publish_failure(reply) is None else api.NAK)

        deadline = self.clock.now() + self.settings.publish_timeout_s
        subject = api.requeue_subject(message.topic or "", api.untoken(delivery.consumer))
        self.publish_one(subject, message.body, headers, deadline, answered)

    def same_copy(self, handle: Any, other: Any) -> bool:
        return bool(api.parse_ack_subject(handle).stream_seq == api.parse_ack_subject(other).stream_seq)

    def discard(self, handle: Any) -> None:
        self.connection.publish(handle, api.ACK)

    def forward_ack(self, queue: SharedQueue, message_id: int) -> None:
        self.connection.publish(ACK_FORWARD_PREFIX + api.token(queue.name), b"%d" % message_id)

    def _on_forwarded_ack(self, msg: Msg) -> None:
        name = self.queue_tokens.get(msg.subject[len(ACK_FORWARD_PREFIX):])
        engine = self.engine
        if name is None or engine is None:
            return
        queue = engine.queues.get(name)
        if isinstance(queue, SharedQueue):
            try:
                message_id = int(msg.payload)
            except ValueError:
                return
            if queue.ack_forwarded(message_id):
                self.forwarded_acks += 1

    # -- told to every node -------------------------------------------------------------------

    def tell_every_node(self, kind: str, frames: list[bytes]) -> None:
        node = self.engine.node if self.engine is not None else 0
        self._tell_frames(TOLD_PREFIX + api.token(kind), frames, {HEADER_NODE: str(node)})

    def tell_node(self, node: int, kind: str, frames: list[bytes]) -> None:
        self._tell_until_heard(f"{TO_NODE_PREFIX}{node}.{api.token(kind)}", _framed(frames),
                               self.clock.now() + TELL_DEADLINE_S)

    def _tell_until_heard(self, subject: str, payload: bytes, deadline: float) -> None:
        def answered(answer: Msg | NatsError) -> None:
            if isinstance(answer, NatsError):
                # A timeout was a whole try; no responders (that node's link down) and a lost link are not.
                self._tell_again(subject, payload, deadline, 0.0 if isinstance(answer, RequestTimeout)
                                 else TELL_ATTEMPT_S)

        try:
            self.connection.request_nowait(subject, payload, answered, timeout=TELL_ATTEMPT_S)
        except NatsError:
            self._tell_again(subject, payload, deadline, TELL_ATTEMPT_S)

    def _tell_again(self, subject: str, payload: bytes, deadline: float, pause: float) -> None:
        engine = self.engine
        at = self.clock.now() + pause
        if engine is None or at >= deadline:
            self.told_dropped += 1
            return
        self.tell_retries += 1
        engine.timers.schedule(at, self._tell_until_heard, subject, payload, deadline)

    def _on_told_to_this_node(self, msg: Msg, prefix: int) -> None:
        if msg.reply:
            with contextlib.suppress(NatsError):  # the teller asks again
                self.connection.publish(msg.reply, b"")
        self._hand_told(msg, prefix)

    def _tell_frames(self, subject: str, frames: list[bytes], headers: dict[str, str] | None) -> None:
        try:
            self.connection.publish(subject, _framed(frames), headers=headers)
        except NatsError:
            self.told_dropped += 1  # at most once: nothing is kept for later

    def _on_told(self, msg: Msg) -> None:
        engine = self.engine
        if engine is not None and (msg.headers or {}).get(HEADER_NODE) != str(engine.node):
            self._hand_told(msg, len(TOLD_PREFIX))

    def _hand_told(self, msg: Msg, prefix: int) -> None:
        engine = self.engine
        if engine is None:
            return
        try:
            kind = api.untoken(msg.subject[prefix:])
        except (ValueError, UnicodeDecodeError):
            return
        frames: list[bytes] = []
        payload, index = msg.payload, 0
        while index + 4 <= len(payload):
            size = int.from_bytes(payload[index:index + 4], "big")
            index += 4
            if index + size > len(payload):
                return  # not a node's: cut short
            frames.append(payload[index:index + size])
            index += size
        if index == len(payload):
            engine.told(kind, frames)

    # -- the link itself ----------------------------------------------------------------------

    def cluster(self) -> ClusterView:
        return self.reports.view()

    def describe(self) -> dict[str, Any]:
        return {"kind": "jetstream", "servers": list(self.settings.nats.servers),
                "connected": self.connection.connected_url, "replicas": self.settings.replicas,
                "ack_wait_s": self.settings.ack_wait_s,
                "publish_ack_buckets_s": list(PUBLISH_ACK_BUCKETS_S),
                "publish_ack_counts": list(self.publish_latency.counts),
                "publish_ack_total_s": self.publish_latency.total_s, "lost_pull_requests": self.lost_pulls,
                "lapses": self.lapses, "taken_back": self._taken_back(), "batches": self.batches.sent,
                "batches_sent_again": self.batches.retried, "snapshots": self.snapshots.taken,
                "snapshots_refused": self.snapshots.refused}

    def _taken_back(self) -> int:
        engine = self.engine
        queues = engine.queues.values() if engine is not None else ()
        return sum(queue.taken_back_count for queue in queues if isinstance(queue, SharedQueue))

    def disconnected(self) -> None:
        """The link to one server is gone; the connection tries the others. Publishes wait for it (each up to
        its own bound); only a link down that long makes new ones fail at once."""
        down_since = self._down_since = self.clock.now()
        if self.engine is not None:
            self.engine.timers.schedule(down_since + self.settings.publish_timeout_s, self._still_down, down_since)

    def _still_down(self, down_since: float) -> None:
        if self._down_since == down_since and self.engine is not None:
            self.engine.barrier.failure = "the JetStream cluster cannot be reached"

    def reconnected(self) -> None:
        """Pull requests die with the link: every consumer asks again. Advisories and schedule changes sent
        meanwhile are lost: every topic, and the schedules, are read again."""
        self._down_since = None
        for name in self.topics:
            self.topology.changed(name)
        if self.schedule_keeper is not None:
            self.schedule_keeper.reload_due = True
        if self.engine is not None:
            self.engine.barrier.failure = None
        for pullers in list(self.pullers.values()):
            for puller in pullers:
                puller.requests.clear()
                puller.issued.clear()
                puller.outstanding = 0
            if pullers:
                self.want(pullers[0].queue)


async def node_number(connection: NatsConnection, replicas: int) -> int:
    """A number no other running node has (unless 4,096 nodes started since it did): the sequence of a
    message this node stores in the stream `POLYMQ_NODES`."""
    config = {"name": api.NODES_STREAM, "subjects": [api.NODES_SUBJECT], "retention": "limits", "max_msgs": 1,
              "storage": "file", "num_replicas": replicas}
    try:
        await api.api(connection, f"STREAM.CREATE.{api.NODES_STREAM}", config)
    except api.JetStreamError as error:
        if error.err_code != api.ERR_STREAM_NAME_IN_USE:
            raise
    reply: Msg | None = None
    with trio.move_on_after(STREAM_READY_S):
        while reply is None:
            try:
                reply = await connection.request(api.NODES_SUBJECT, b"", timeout=api.API_ATTEMPT_S)
            except (NoResponders, RequestTimeout, ConnectionLost):
                # Made just now, by this node or another, or its leader gone silent: no leader yet (or the
                # server went away: the next is asked). A publish answered too late only uses up a number.
                await trio.sleep(PUBLISH_RETRY_S)
    if reply is None:
        raise NatsError(f"the stream {api.NODES_STREAM} took no publish within {STREAM_READY_S:.0f} s")
    _, sequence, _ = api.parse_publish_ack(reply.payload)
    return sequence % NODE_NUMBERS


def cluster_size(connection: NatsConnection) -> int:
    """Servers of the cluster the connection reached, as its INFO lists their client addresses."""
    urls = set(connection.server_info.get("connect_urls") or ())
    return max(len(urls), 1)


async def cluster_replicas(connection: NatsConnection, asked: int, wait_s: float = CLUSTER_FORMING_WAIT_S) -> int:
    """The replicas the node's streams get: as many as asked, or the cluster's size when it is smaller.
    A standalone server (its INFO names no cluster) is one. A cluster's servers are counted in INFO's
    `connect_urls`, waiting up to `wait_s` for the INFO updates of a cluster still forming: a stream
    made then with fewer replicas keeps them for good."""
    if not connection.server_info.get("cluster"):
        return 1
    with trio.move_on_after(wait_s):
        while cluster_size(connection) < asked:
            await connection.next_info()
    size = cluster_size(connection)
    if size < asked:
        log.warning("the JetStream cluster lists %d servers after %.0f s, fewer than the %d replicas asked; "
                    "streams get %d", size, wait_s, asked, size)
    return max(1, min(asked, size))


def _framed(frames: list[bytes]) -> bytes:
    """Told frames as they travel: each after its length (4 bytes, big-endian)."""
    return b"".join(len(frame).to_bytes(4, "big") + frame for frame in frames)


async def open_shared_engine(settings: JetStreamSettings, nursery: trio.Nursery, *, clock: Clock | None = None,
                             timers: TimerService | None = None) -> tuple[SharedEngine, JetStreamLink]:
    """Connect, draw the node's number and return an engine whose durable queues live in JetStream."""
    link_box: list[JetStreamLink] = []
    connection = await NatsConnection.connect(
        settings.nats, nursery,
        on_disconnected=lambda: link_box[0].disconnected() if link_box else None,
        on_reconnected=lambda: link_box[0].reconnected() if link_box else None)
    try:
        await api.api(connection, "INFO", timeout=settings.publish_timeout_s)
    except (NoResponders, RequestTimeout, api.JetStreamError) as error:
        raise NatsError(f"JetStream does not answer at {connection.connected_url} ({error})") from error
    settings.replicas = await cluster_replicas(connection, settings.replicas)
    number = await node_number(connection, settings.replicas)
    clock = clock or SystemClock()
    link = JetStreamLink(connection, settings, clock)
    link_box.append(link)
    engine = SharedEngine(link, node=number, clock=clock, timers=timers)
    # A delivery is reported at the second round after it was made (one that ends sooner needs no +WPI): a
    # third of the ack wait between rounds reports it within two thirds of it.
    engine.hold_refresh_s = settings.ack_wait_s / REFRESH_ROUNDS_PER_ACK_WAIT
    engine.ack_wait_s = settings.ack_wait_s
    engine.idle_hold_s = PULL_EXPIRES_S + IDLE_HOLD_MARGIN_S  # until the last pull requests have ended
    link.engine = engine
    await link.start(nursery)
    return engine, link
