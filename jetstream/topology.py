"""What the cluster holds, followed by every node: its topics (the streams `POLYMQ_T_<t>`) and which queues
are bound to them (each stream's consumers), with what each queue keeps in its consumer's metadata (its
settings, its floor, whether it is paused).

The cluster is the source of truth and a node's topics and queues are a cache of it. A node reads it all
at start, before it serves; reads a topic again whenever JetStream says one of its stream's consumers, or
the stream itself, was made or deleted (advisories, from any node); and reads every topic again in turn
every few seconds, so an advisory missed while the link was down is made good, and depths stay current.

What a read finds is applied to the node's engine while it follows (`SharedEngine.following`): a queue the
cluster binds to a topic is made and bound here (its consumer read by this node too), a binding gone from
the cluster is removed here, a deleted stream's topic is deleted here. None of it is sent back to the
cluster. A change this node has asked for and the cluster has not finished, or finished after the read
was taken, is left alone (`JetStreamLink.unsettled`), so a read never undoes what the node did meanwhile.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import attrs
import trio

from polymq.core.engine import OWNER_RECORD_KEY
from polymq.core.shared import SharedQueue, SharedTopicLog
from polymq.jetstream import api
from polymq.jetstream.nats_connection import NatsError

if TYPE_CHECKING:
    from polymq.core.shared import SharedEngine
    from polymq.jetstream.backend import JetStreamLink

log = logging.getLogger("polymq.jetstream")

# Every topic is read again once in this many seconds at least (a missed advisory is made good within it),
# this many topics a second (one request each), so a large cluster's topics are read in turn.
REFRESH_S = 1.0
REFRESH_TOPICS = 20
# Topics read at once at start-up (each one request, two for a stream with over 256 consumers).
LOAD_AT_ONCE = 8


def paused_key(queue: str) -> tuple[str, str]:
    """What `JetStreamLink.unsettled` knows a queue's pause by (a topic by its name, a binding by (queue, topic))."""
    return ("paused", queue)


@attrs.frozen(slots=True)
class BoundConsumer:
    """A queue's consumer in one topic's stream, as last read."""

    queue: str
    options: Mapping[str, Any]  # the queue's settings (`Engine._queue_options`), as its maker kept them
    floor: int  # stream sequences up to it were emptied from the queue
    paused: bool
    ephemeral: bool  # an NSQ ephemeral channel's: followed only by nodes whose clients name it
    pending: int  # messages it has not been given yet
    ack_pending: int = 0  # given out and not answered yet (in flight, held by a node, or put back with a delay)
    redelivered: int = 0  # of those, given more than once


def bound_consumers(infos: list[dict[str, Any]]) -> tuple[dict[str, BoundConsumer], int | None]:
    """The queues' consumers among a stream's (others: the backlog's, streams read by position, other
    clients'), by queue name; and the backlog consumer's pending count, when the stream has one."""
    found: dict[str, BoundConsumer] = {}
    backlog: int | None = None
    for info in infos:
        config = info.get("config") or {}
        pending = int(info.get("num_pending", 0))
        if info.get("name") == api.BACKLOG_CONSUMER:
            backlog = pending
            continue
        metadata = config.get("metadata") or {}
        queue = metadata.get(api.QUEUE_METADATA)
        if not queue or api.queue_consumer(queue) != info.get("name"):
            continue
        try:
            options = json.loads(metadata.get(api.OPTIONS_METADATA) or "{}")
        except ValueError:
            options = {}
        found[queue] = BoundConsumer(queue, options if isinstance(options, dict) else {},
                                     int(metadata.get(api.FLOOR_METADATA, 0) or 0),
                                     metadata.get(api.PAUSED_METADATA) == "1",
                                     metadata.get(api.EPHEMERAL_METADATA) == "1", pending,
                                     int(info.get("num_ack_pending", 0)), int(info.get("num_redelivered", 0)))
    return found, backlog


class Topology:
    """The node's following of the cluster's topics and bindings (see the module's text)."""

    def __init__(self, link: JetStreamLink) -> None:
        self.link = link
        self.read: dict[str, dict[str, BoundConsumer]] = {}  # topic -> its queues' consumers, as last read
        self.read_at: dict[str, float] = {}  # topic -> when it was last read (the link's clock)
        self._dirty: dict[str, None] = {}  # topics to read again, in the order they were asked for
        self._again: dict[str, None] = {}  # topics to read again at the next turn (a consumer went unread)
        self._wake = trio.Event()
        self._refresh_from = 0
        self.reads = 0  # topics read (start-up, advisories, refreshes)

    @property
    def engine(self) -> SharedEngine:
        engine = self.link.engine
        assert engine is not None
        return engine

    def consumer(self, topic: str, queue: str) -> BoundConsumer | None:
        return self.read.get(topic, {}).get(queue)

    # -- reading -------------------------------------------------------------------------------

    async def load(self) -> None:
        """Read every topic of the cluster and make it here, before the node serves."""
        streams = await api.stream_names(self.link.connection, api.SUBJECT_PREFIX + ">")
        topics = [topic for topic in map(api.topic_of_stream, streams) if topic is not None]
        limiter = trio.CapacityLimiter(LOAD_AT_ONCE)
        found: dict[str, api.ConsumerListing | None] = {}

        async def read(topic: str) -> None:
            async with limiter:
                found[topic] = await api.consumer_list(self.link.connection, topic)

        since = self.link.changes
        async with trio.open_nursery() as nursery:
            for topic in topics:
                nursery.start_soon(read, topic)
        for topic in topics:
            self.apply(topic, found[topic], since)

    def changed(self, topic: str) -> None:
        """JetStream said the topic's stream, or one of its consumers, was made or deleted: read it again."""
        self._dirty[topic] = None
        self._wake.set()

    async def run(self) -> None:
        """Read again the topics said changed, at once, and every topic in turn (`REFRESH_S`)."""
        while True:
            with trio.move_on_after(REFRESH_S):
                await self._wake.wait()
            self._wake = trio.Event()
            if not self._dirty:
                self._refresh_some()
                self._dirty.update(self._again)
                self._again.clear()
            while self._dirty:
                topic = next(iter(self._dirty))
                del self._dirty[topic]
                since = self.link.changes
                try:
                    consumers = await api.consumer_list(self.link.connection, topic)
                except NatsError as error:
                    log.warning("could not read topic %r of the JetStream cluster: %s", topic, error)
                    continue
                self.apply(topic, consumers, since)
                if consumers is None:
                    self.link.orphans.forget(topic)
                else:
                    await self.link.orphans.check(topic, consumers)
            # No read is under way: a later one is taken after every change known now, so what tells a read
            # taken before a change from one taken after is done with (it would grow with every name changed).
            self.link.finished.clear()
            self.link.noticed_paused.clear()
            self.link.noticed_floors.clear()

    def _refresh_some(self) -> None:
        names = list(self.link.topics)
        if self._refresh_from >= len(names):
            self._refresh_from = 0
            # Every topic was read since: a forgotten queue no topic has any more is not kept in mind.
            forgotten = self.engine.forgotten
            if forgotten:
                forgotten &= {queue for consumers in self.read.values() for queue in consumers}
        for name in names[self._refresh_from:self._refresh_from + REFRESH_TOPICS]:
            self._dirty[name] = None
        self._refresh_from += REFRESH_TOPICS

    # -- applying --------------------------------------------------------------------------------

    def apply(self, topic: str, listing: api.ConsumerListing | None, since: int) -> None:
        """Make the node's topic and its bindings what the cluster held when `link.changes` was `since` (None:
        the topic's stream was gone). A consumer the listing could not read is left as the node knows it, and
        the topic is read again."""
        self.reads += 1
        link, engine = self.link, self.engine
        if listing is None:
            self.read.pop(topic, None)
            self.read_at.pop(topic, None)
            if link.unsettled(topic, since):
                return  # this node made it, or deleted it, after the read
            known = engine.topics.get(topic)
            bound = [queue for queue in known.queues if isinstance(queue, SharedQueue)] if known is not None else []
            with engine.following():
                if not engine.delete_topic(topic):
                    link.topic_forgotten(topic)
                for queue in bound:
                    self._unused(queue)
            return
        if link.unsettled(topic, since):
            return  # JetStream said it changed after the read began: read again (`changed`), that is applied
        consumers, backlog = bound_consumers(listing.infos)
        unread = set()
        for name in listing.unread:
            try:
                unread.add(api.untoken(name))
            except (ValueError, UnicodeDecodeError):
                continue
        if unread:
            self._again[topic] = None
        self.read[topic] = {**{name: known for name, known in self.read.get(topic, {}).items() if name in unread},
                            **consumers}
        self.read_at[topic] = link.clock.now()
        state = link.known_topic(topic)
        state.queues = {api.queue_consumer(name) for name in consumers} | set(listing.unread)
        with engine.following():
            made = engine.ensure_topic(topic)
            if isinstance(made.log, SharedTopicLog) and backlog is not None:
                made.log.spilled = backlog
            for name, consumer in consumers.items():
                if not link.unsettled((name, topic), since):
                    self._follow(topic, name, consumer, since)
            for queue in list(made.queues):
                if isinstance(queue, SharedQueue) and queue.name not in consumers and queue.name not in unread \
                        and not link.unsettled((queue.name, topic), since):
                    self._lost(topic, queue)

    def _follow(self, topic: str, name: str, consumer: BoundConsumer, since: int) -> None:
        link, engine = self.link, self.engine
        queue = engine.queues.get(name)
        if queue is None:
            if consumer.ephemeral or name in engine.forgotten:
                return  # an ephemeral channel is followed where its clients are; a forgotten queue, once named
            options = dict(consumer.options)
            auto_delete = options.pop("auto_delete", None)
            owner = options.pop(OWNER_RECORD_KEY, None)
            queue = engine.ensure_queue(name, auto_delete=auto_delete, options=options, owner_topic=owner)
        if not isinstance(queue, SharedQueue):
            return  # a queue of this node's own of that name (an ephemeral topic's)
        if topic not in queue.topics:
            engine.bind(name, topic)  # read with the floor and pause just read (`JetStreamLink.followed`)
        if len(queue.topics) == 1:
            queue.shared_log.spilled = consumer.pending
        link.consumer_read(name, topic, consumer.floor, consumer.pending)
        if consumer.paused != queue.paused and not link.unsettled(paused_key(name), since):
            queue.paused_here(consumer.paused)

    def _lost(self, topic: str, queue: SharedQueue) -> None:
        """The queue is bound to the topic here, and no longer in the cluster."""
        link, engine = self.link, self.engine
        if queue.ephemeral and queue.consumers:
            link.bind_again(queue, topic)  # its clients are here: its consumer is made again, from now on
            return
        engine.unbind(queue.name, topic)
        self._unused(queue)

    def _unused(self, queue: SharedQueue) -> None:
        """A queue bound to nothing in the cluster and read by no client of this node: nothing of it is left."""
        if not queue.deleted and not queue.topics and not queue.consumers:
            self.engine.delete_queue(queue.name)
