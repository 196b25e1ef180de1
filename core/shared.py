"""An engine whose durable topics and queues live in a shared, replicated engine (docs/cluster.md).

Several gateways pointed at one shared engine (NATS JetStream, `polymq.jetstream`) serve the same
topics and queues. What must be shared lives there: a publish goes to the shared engine and is
acknowledged once it answers; a queue's ready messages, its in-flight deliveries, their attempts and
delays are the shared engine's. What each node keeps is its own consumers' window: the copies it
took for them (`SharedQueue.ready`, each fetched only when a local consumer has credit), the
deliveries they hold, their credit, rings, pools, priorities and filters, exactly as the embedded
engine runs them. So the adapters call this engine as they call the embedded one.

The node speaks to the shared engine through a `Link` (I/O, asynchronous), which this module never
awaits: every call here stays synchronous and deterministic. What goes the other way comes back as
calls of `SharedQueue.receive` (copies fetched) and of the `PublishBarrier`'s callbacks (publishes
stored).

Ephemeral topics and queues stay in the node, in the embedded engine's own classes.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, Final, Protocol

from polymq.core.clock import Clock
from polymq.core.cluster import ClusterView
from polymq.core.dead_letters import Requeued
from polymq.core.engine import Consumer, Engine, Outcome, Queue, Topic
from polymq.core.ids import IdSource, node_of
from polymq.core.message import Message
from polymq.core.storage import OwnerLog, Snapshot, SyncCallback
from polymq.core.timers import Timer, TimerService
from polymq.core.trace import Client

# Copies a node holds for credit are reported worked on this often unless the link says otherwise (half
# of nsqd's 60 s msg_timeout, the ack wait's default).
DEFAULT_HOLD_REFRESH_S: Final = 30.0

# Copies fetched for consumers that left wait this long for another consumer on the node before they go back,
# unless the link says otherwise (its pull requests' lifetime and a margin).
DEFAULT_IDLE_HOLD_S: Final = 6.0

# The bodies a client's publishes held for its order (`PublisherOrder`) may weigh before its next publish is
# refused: as much as the NATS link buffers for a slow writer (nats-server's default max_pending, 64 MiB).
MAX_HELD_BYTES: Final = 64 * 1024 * 1024

# Called once the shared engine has stored a publish, with None, or with why it could not.
Stored = Callable[[Exception | None], None]


class Link(Protocol):
    """What a node asks of the shared engine; each call returns at once, its I/O happens later."""

    def publish(self, topic: Topic, messages: list[Message], stored: Stored, drop_if_unbound: bool) -> None:
        """Store the messages in the topic (one copy for every queue bound to it anywhere); with
        `drop_if_unbound`, drop them (counted in the engine's `dropped_count`) when no queue anywhere is."""
        ...

    def want(self, queue: SharedQueue) -> None:
        """The queue's consumers can take `queue.wanted()` more copies than it holds or has asked for."""
        ...

    def ack(self, queue: SharedQueue, message: Message) -> None:
        """The copy is done with: gone from the queue."""
        ...

    def nak(self, queue: SharedQueue, message: Message, delay: float) -> None:
        """The copy goes back to the queue, to be delivered again after `delay` seconds."""
        ...

    def progress(self, queue: SharedQueue, message: Message) -> None:
        """The copy's consumer is still working on it: its timeout starts again."""
        ...

    def term(self, queue: SharedQueue, message: Message) -> None:
        """The copy leaves the queue for good without being done (its dead letter is stored)."""
        ...

    def forward_ack(self, queue: SharedQueue, message_id: int) -> None:
        """An acknowledgement by id of a copy this node does not hold: the node that holds it acks it."""
        ...

    def same_copy(self, handle: Any, other: Any) -> bool:
        """The two handles deliver one stored copy (given again), not two stored copies of one message."""
        ...

    def discard(self, handle: Any) -> None:
        """A stored copy this node will not deliver (the message is here by another): done with."""
        ...

    def requeue_to_tail(self, queue: SharedQueue, message: Message) -> None:
        """The message again at the tail of this queue only (its attempts and expiry as they are now); the
        delivery it came by ends once that copy is stored."""
        ...

    def give_back_unseen(self, queue: SharedQueue, message: Message) -> None:
        """A copy the node fetched and no client of it saw goes back without an attempt counted: the message
        again at the tail of this queue only, with the attempts it came with."""
        ...

    def describe(self) -> dict[str, Any]:
        """The shared engine as operators see it: its kind, servers, the publish acknowledgements' latency."""
        ...

    def cluster(self) -> ClusterView:
        """The cluster's nodes and its queues' numbers over all of them, as this node knows them now."""
        ...

    def requeue_dead(self, queue: SharedQueue) -> Awaitable[Requeued]:
        """Every message of the cluster's letters of `queue` back in it, each once (core/dead_letters.py)."""
        ...

    def topic_made(self, topic: Topic, done: Stored) -> None:
        """Make the topic's place in the cluster; `done` once it is there (or why not)."""
        ...

    def topic_deleted(self, name: str) -> None: ...

    def queue_made(self, queue: SharedQueue) -> None: ...

    def bound(self, queue: SharedQueue, topic: str, done: Stored) -> None:
        """The queue takes the topic's messages from now on, on every node, once `done` is called."""
        ...

    def unbound(self, queue: SharedQueue, topic: str) -> None: ...

    def queue_deleted(self, queue: SharedQueue, topics: list[str]) -> None:
        """Deleted on every node: its consumers in the shared engine go, and the other nodes are told."""
        ...

    def queue_configured(self, queue: SharedQueue) -> None:
        """Its settings changed: kept with it in the shared engine, for the nodes that make it next."""
        ...

    # What the engine does while it follows the shared engine (`SharedEngine.following`): the change was
    # made elsewhere and is already there; only this node's reading of it changes.

    def followed(self, queue: SharedQueue, topic: str) -> None:
        """The queue is bound to the topic in the shared engine: this node reads that binding too."""
        ...

    def unfollowed(self, queue: SharedQueue, topic: str) -> None:
        """The binding is gone from the shared engine (or the queue is forgotten here): this node stops reading it."""
        ...

    def topic_forgotten(self, name: str) -> None:
        """The topic is gone from the shared engine, or this node forgets it."""
        ...

    def tell_every_node(self, kind: str, frames: list[bytes]) -> None:
        """Hand the frames to the listener of `kind` on every other node, at most once."""
        ...

    def tell_node(self, node: int, kind: str, frames: list[bytes]) -> None:
        """Hand the frames to the listener of `kind` on the node of that number, at most once."""
        ...

    def topic_emptied(self, topic: Topic) -> None:
        """What the topic keeps for its first queue is dropped."""
        ...

    def lapsed(self) -> None:
        """The node said nothing for a whole ack wait (paused, or starved): what its requests for copies made
        before bring from now on was given again elsewhere meanwhile, or will be, and is not taken; the
        queues ask again."""
        ...

    def queue_paused(self, queue: SharedQueue, paused: bool, done: Stored) -> None:
        """Kept with the queue and told to every node, so none delivers from it while it is paused; `done`
        once the shared engine holds it."""
        ...

    def queue_emptied(self, queue: SharedQueue, done: Stored) -> None:
        """Every message the queue holds on any node now is dropped; `done` once that holds everywhere."""
        ...


class PublishBarrier:
    """The `Storage` of a shared engine: a sync waits for the shared engine's answer to every publish made
    before it (an adapter acknowledges its client from the sync's callback, as with the embedded store).

    Answers can come out of order (topics are stored apart); a sync fires once every publish numbered
    up to its own has its answer. It carries an error when one of its own publishes failed: those made
    since the sync before it (an adapter asks for one right after its publishes), not another client's."""

    persistent = False  # the engine opens no log of the embedded store
    mem_queue_size = 0

    def __init__(self) -> None:
        self.failure: str | None = None  # set while the shared engine cannot be reached
        self.syncs = 0
        self._issued = 0  # publishes numbered so far
        self._done_below = 1  # every publish numbered lower has its answer
        self._answered: set[int] = set()  # answered above `_done_below`
        # (the last publish it covers, callback, the first error among its own, its first own publish)
        self._waiting: deque[list[Any]] = deque()
        self._synced_up_to = 0  # the last publish the latest sync covers
        self.publish_count = 0
        self.publish_errors = 0
        # Where records kept by key go when the shared engine keeps them (publish de-duplication): each
        # is stored like a publish, so a sync after it covers it. None: the node keeps none.
        self.keeper: Callable[[str, str, Mapping[str, Any], Stored], None] | None = None

    def issue(self) -> Stored:
        """Number one more publish; its answer goes to the callback returned."""
        self._issued += 1
        self.publish_count += 1
        number = self._issued

        def stored(error: Exception | None) -> None:
            self._answer(number, error)

        return stored

    def _answer(self, number: int, error: Exception | None) -> None:
        if error is not None:
            self.publish_errors += 1
            for waiting in self._waiting:
                if waiting[3] <= number <= waiting[0] and waiting[2] is None:
                    waiting[2] = error
        self._answered.add(number)
        while self._done_below in self._answered:
            self._answered.discard(self._done_below)
            self._done_below += 1
        waiting_list = self._waiting
        while waiting_list and waiting_list[0][0] < self._done_below:
            _, callback, first_error, _ = waiting_list.popleft()
            self.syncs += 1
            callback(None if first_error is None else OSError(f"the shared engine did not store it: {first_error}"))

    # -- Storage ---------------------------------------------------------------------------------

    def sync(self, callback: SyncCallback) -> None:
        own_from = self._synced_up_to + 1
        self._synced_up_to = self._issued
        if self._issued < self._done_below:
            callback(None)
            return
        self._waiting.append([self._issued, callback, None, own_from])

    def write_now(self) -> None:
        pass

    def hold_work(self) -> None:
        pass

    def release_work(self) -> None:
        pass

    def load(self, ids: IdSource) -> Snapshot:
        return Snapshot()

    def topic_saved(self, name: str, paused: bool) -> None:
        pass

    def queue_saved(self, name: str, topics: Iterable[str], paused: bool, options: Mapping[str, Any]) -> None:
        pass

    def kept_saved(self, kind: str, key: str, record: Mapping[str, Any]) -> None:
        if self.keeper is not None:
            self.keeper(kind, key, record, self.issue())

    def kept_deleted(self, kind: str, key: str) -> None:
        pass

    def open_topic(self, name: str, made_by: str | None = None) -> OwnerLog:
        raise TypeError("a shared engine's topics keep no log here")

    def open_queue(self, name: str, topics: Iterable[str], paused: bool, options: Mapping[str, Any]) -> OwnerLog:
        raise TypeError("a shared engine's queues keep no log here")

    def topic_deleted(self, name: str, log: OwnerLog | None) -> None:
        pass

    def queue_deleted(self, name: str, log: OwnerLog | None) -> None:
        pass

    def adopt(self, topic: str, queue: str, topic_log: OwnerLog, queue_log: OwnerLog) -> OwnerLog | None:
        return None

    def close(self) -> None:
        pass


class SharedLog:
    """A shared queue's stand-in for the embedded store's log: the engine's dispatch loop tells it
    when a copy is gone (acked in the shared engine) and reads "spilled" copies from it (the ones
    the shared engine holds for the queue, fetched asynchronously: `read` asks and returns none)."""

    may_hold_deferred = False

    def __init__(self, queue: SharedQueue) -> None:
        self.queue = queue
        self.spilled = 0  # copies the shared engine holds for the queue, as it last said
        self.on_readable: Callable[[], None] | None = None
        self.recovered_ready: list[Message] = []
        self.recovered_deferred: list[Message] = []

    def append(self, messages: Sequence[Message], keep: int | None = None) -> None:
        pass  # copies of ephemeral topics, put in directly: the node's own

    def removed(self, message: Message) -> None:
        self.queue.link.ack(self.queue, message)

    def removed_after_next_write(self, message: Message) -> None:
        self.queue.link.ack(self.queue, message)

    def state(self, message: Message, due_wall_ns: int = 0) -> None:
        pass  # the shared engine counts deliveries itself

    def emptied(self) -> None:
        pass  # `SharedQueue.empty` tells the shared engine; a topic's, `SharedTopicLog.emptied`

    def next_position(self) -> int:
        raise ValueError("a queue of the shared engine is not read by position")

    def peek_pages(self, page: int) -> Iterator[list[Message]]:
        return iter(())

    def start_after(self, position: int) -> None:
        raise ValueError("a queue of the shared engine is not read by position")

    def read(self, count: int) -> list[Message]:
        self.queue.link.want(self.queue)
        return []

    def bytes_on_disk(self) -> int:
        return 0


class SharedTopicLog(SharedLog):
    """A shared topic's backlog, as the node knows it: `spilled` is what JetStream keeps for its first queue."""

    def __init__(self, link: Link, topic: Topic) -> None:
        self.link = link
        self.topic = topic
        self.spilled = 0
        self.on_readable: Callable[[], None] | None = None
        self.recovered_ready: list[Message] = []
        self.recovered_deferred: list[Message] = []

    def removed(self, message: Message) -> None:
        pass

    def removed_after_next_write(self, message: Message) -> None:
        pass

    def read(self, count: int) -> list[Message]:
        return []

    def emptied(self) -> None:
        self.spilled = 0
        self.link.topic_emptied(self.topic)


class SharedQueue(Queue):
    """A queue of the shared engine, as one node sees it: its consumers, and the copies fetched for them."""

    def __init__(self, engine: SharedEngine, name: str, *, auto_delete: float | None,
                 options: Mapping[str, Any] | None, owner_topic: str | None = None, ephemeral: bool = False) -> None:
        # An ephemeral one (an NSQ `#ephemeral` channel of a shared topic) is shared too: an NSQ client
        # reading it through every node lookupd names gets each message once. The node forgets it when its
        # last consumer here leaves; the shared engine, once no node reads it.
        super().__init__(engine, name, ephemeral=ephemeral, auto_delete=auto_delete, options=options,
                         owner_topic=owner_topic)
        self.link: Link = engine.link
        self.shared_log = SharedLog(self)
        self.log = self.shared_log
        # The shared engine's handle of each copy this node holds (its ack address), by message id.
        self.handles: dict[int, Any] = {}
        self.fetched_count = 0
        self._hold_timer: Timer | None = None  # while fetched copies wait here for credit (`_hold`)
        self._give_back_timer: Timer | None = None  # while copies wait for a consumer here (`_give_back_soon`)
        # Deferred publishes to its topics the shared engine keeps until they are due (NSQ's DPUB).
        self.deferred_elsewhere = 0
        # Deleted on this node only (unused here for its auto-delete time): other nodes may still use it.
        self.forgotten = False
        self.stale_count = 0  # copies the shared engine gave again while this node still held them
        self.twin_count = 0  # second stored copies of a message this node held, discarded
        # Deliveries in flight at the last refresh: still held at the next, they are reported worked on.
        self._in_flight_seen: set[int] = set()
        # Deliveries and copies the shared engine gave again while this node said nothing of them (`take_back`).
        self.taken_back_count = 0

    def wanted(self) -> int:
        """Copies the consumers here could take now beyond those already fetched."""
        if self.paused or self.deleted:
            return 0
        room = 0
        pools: list[Any] = []
        for consumer in self.ring:
            pool = consumer.pool
            if pool is None:
                room += max(consumer.available(), 0)
            elif pool not in pools:
                pools.append(pool)
                room += max(pool.tokens, 0)
        return room - len(self.ready)

    def receive(self, messages: list[tuple[Message, Any]]) -> None:
        """Copies the shared engine delivered to this node, with their handles; `attempts` is how many
        deliveries each has had before this one."""
        ready, handles = self.ready, self.handles
        for message, handle in messages:
            held = handles.get(message.id)
            if held is not None:
                if not self.link.same_copy(held, handle):
                    # Two stored copies of one message: a node put it back at the tail and ended before
                    # it acknowledged the delivery the copy replaces. The one here is enough.
                    self.link.discard(handle)
                    self.twin_count += 1
                    continue
                if message.id not in self.in_flight:
                    handles[message.id] = handle  # given again while it waits here: the newer handle is live
                    continue
                # Its timeout ran out in the shared engine first (this node was slow): the older
                # delivery here can no longer be acknowledged; this one replaces it.
                self._take_any(message.id)
                self.stale_count += 1
            handles[message.id] = handle
            message.owner = None
            ready.append(message)
            if not message.attempts:
                self.message_count += 1  # a copy put in the queue, counted once, as the embedded queue does
        self.fetched_count += len(messages)
        if not self.consumers:
            # Asked for while a consumer had credit, which left: kept a moment for a consumer coming back.
            self._give_back_soon()
            return
        if not self.paused:
            self._dispatch()
        if self.ready:
            self._hold()  # fetched for credit spent meanwhile (another queue of a pool, RDY lowered, a pause)
        self.link.want(self)

    def _hold(self) -> None:
        """Copies fetched here wait for this node's consumers' credit, the shared engine told they are still
        worked on, for `idle_hold_s` at a time: what the consumers here still have no room for then goes back
        (`_idle`), so a consumer that keeps no credit here (RDY 0, a PZQ send socket with no peer) does not keep
        it from another node's."""
        engine = self.engine
        assert isinstance(engine, SharedEngine)
        if self._hold_timer is None:
            self._hold_timer = engine.timers.schedule(engine.clock.now() + engine.hold_refresh_s, self._still_held)
        self._arm_give_back()

    def _arm_give_back(self) -> None:
        engine = self.engine
        assert isinstance(engine, SharedEngine)
        if self._give_back_timer is None:
            self._give_back_timer = engine.timers.schedule(engine.clock.now() + engine.idle_hold_s, self._idle)

    def _still_held(self) -> None:
        self._hold_timer = None
        if self.deleted or not self.ready:
            return
        for message in self.ready:
            self.link.progress(self, message)
        self._hold()

    def take_back(self) -> None:
        """The last refresh came a whole ack wait ago (the node was paused, or starved): every delivery in
        flight and every copy waiting here came before (what comes, and every dispatch, catches up first), and
        the shared engine has given them again, maybe to another node, or will, as nothing reports them.
        Forgotten here without a word to it, deliveries as timed out: a consumer's late FIN of one is
        answered as one of an id it does not hold, and nothing is acknowledged for, or handed out of, a
        delivery that is no longer the live one."""
        for message in self.ready:
            self.handles.pop(message.id, None)
            self.taken_back_count += 1
        self.ready.clear()
        changed: list[Consumer] = []
        for message in list(self.in_flight.values()):
            consumer = message.owner
            assert isinstance(consumer, Consumer)
            self._drop_timed_out(consumer, message)
            self.taken_back_count += 1
            self.handles.pop(message.id, None)
            if consumer not in changed:
                changed.append(consumer)
        self._in_flight_seen = set()
        for consumer in changed:
            self._consumer_changed(consumer)

    def _dispatch(self) -> None:
        engine = self.engine
        assert isinstance(engine, SharedEngine)
        engine.catch_up()  # after a pause: copies the shared engine gave again are not handed out here
        super()._dispatch()

    def _take_in_flight(self, consumer: Consumer, message_id: int) -> Message | Outcome:
        engine = self.engine
        assert isinstance(engine, SharedEngine)
        engine.catch_up()  # a FIN after a pause: of a delivery the shared engine gave again, it fails
        return super()._take_in_flight(consumer, message_id)

    def refresh_in_flight(self) -> None:
        """A delivery its consumer has held since the last refresh is reported worked on (`+WPI`): the
        node's own timeout decides when it goes back; the shared engine's ack wait only when the node is gone."""
        in_flight = self.in_flight
        for message_id in self._in_flight_seen:
            message = in_flight.get(message_id)
            if message is not None:
                self.link.progress(self, message)
        self._in_flight_seen = set(in_flight)

    def _give_back_soon(self) -> None:
        """No consumer of the queue is left on this node. What it fetched and what its pull requests still
        bring (they cannot be taken back) wait here for `idle_hold_s`: a consumer that comes back meanwhile gets
        them without an attempt more; then they go back to the shared engine (no attempt counted either)."""
        if self.ready:
            self._hold()
        self._arm_give_back()

    def _idle(self) -> None:
        self._give_back_timer = None
        if self.deleted:
            return
        if not self.consumers:
            self.give_back()
        elif not self.paused:  # a paused queue's copies wait for its unpause
            self.give_back(-self.wanted())  # what the consumers here have no room for

    def give_back(self, count: int | None = None) -> None:
        """Fetched copies no consumer here took go back to the shared engine at once, every one or the `count`
        fetched last (what pull requests still bring goes back as it comes, until they end)."""
        ready = self.ready
        going = [ready.pop() for _ in range(len(ready) if count is None else min(max(count, 0), len(ready)))]
        for message in reversed(going):
            self.link.give_back_unseen(self, message)

    # -- where the embedded queue keeps a copy, this one asks the shared engine ----------------

    def _consumer_changed(self, consumer: Consumer) -> None:
        super()._consumer_changed(consumer)
        if consumer.in_ring and not self.paused and not self._dispatching:
            self.link.want(self)

    def _return(self, message: Message, delay: float = 0.0, front: bool = False) -> None:
        max_attempts = self.max_attempts
        if max_attempts and message.attempts >= max_attempts:
            self._dead_letter(message, "max attempts")
            return
        self.link.nak(self, message, delay)
        self.handles.pop(message.id, None)

    def _touch(self, consumer: Consumer, message_id: int) -> Outcome:
        outcome = super()._touch(consumer, message_id)
        if outcome is Outcome.OK:
            self.link.progress(self, self.in_flight[message_id])
        return outcome

    def _dead_letter(self, message: Message, reason: str) -> None:
        """The letter is stored in the dead-letter topic first; then the copy leaves this queue (`+TERM`):
        a crash between leaves it in both places, as with the embedded store."""
        self.dead_letter_count += 1
        engine = self.engine
        assert isinstance(engine, SharedEngine)
        letter = self._letter(message, reason)
        topic = engine.ensure_topic(letter.topic or "", ephemeral=self.ephemeral)
        if self.traced:
            engine._trace().dead_lettered(self, message, reason, topic)
        link = self.link
        if topic.ephemeral:  # an ephemeral channel's letters stay on the node, as the channel's would on nsqd
            Engine._publish_messages(engine, topic, [letter])
            link.term(self, message)
            return

        def stored(error: Exception | None) -> None:
            if error is None:
                link.term(self, message)
            else:
                link.nak(self, message, 0.0)  # tried again later: nothing is lost

        engine.publish_stored(topic, [letter], stored)  # its handle stays until the +TERM

    def _put_at_tail(self, message: Message, expires_at: float | None) -> None:
        """A copy for this queue only, with its attempts and new expiry, stored before the delivery is acked."""
        message.expires_at = expires_at
        self.link.requeue_to_tail(self, message)

    def finish_any(self, message_id: int) -> Outcome:
        """Acknowledge a delivery whoever holds it, on this node or on another (PHPMQ, MQKS acks by id)."""
        if self._take_any(message_id, finished=True) is not None:
            self.handles.pop(message_id, None)
            return Outcome.OK
        self.link.forward_ack(self, message_id)
        return Outcome.OK

    def ack_forwarded(self, message_id: int) -> bool:
        """Another node forwarded an acknowledgement by id: True when this node held the copy."""
        if self._take_any(message_id, finished=True) is None:
            return False
        self.handles.pop(message_id, None)
        return True

    def _detach(self, consumer: Consumer, *, requeue: bool, to_tail: bool = False) -> None:
        super()._detach(consumer, requeue=requeue, to_tail=to_tail)
        if not self.consumers and not self.deleted:
            self._give_back_soon()

    def _auto_delete(self) -> None:
        """Unused on this node: forgotten here (the topic it takes with it too), kept in the shared engine,
        where another node may use it."""
        engine = self.engine
        assert isinstance(engine, SharedEngine)
        self.forgotten = True
        with engine.following():
            super()._auto_delete()
        if self.deleted and not self.ephemeral:
            engine.forgotten.add(self.name)
        else:
            self.forgotten = False

    def set_paused(self, paused: bool) -> None:
        """Paused or unpaused on every node: the shared engine keeps it and tells the others."""
        self.paused_here(paused)
        engine = self.engine
        assert isinstance(engine, SharedEngine)
        self.link.queue_paused(self, paused, engine.barrier.issue())

    def paused_here(self, paused: bool) -> None:
        """Paused or unpaused on this node only (another node told so). What the node fetched waits here."""
        super().set_paused(paused)
        if paused:
            if self.ready:
                self._hold()
        elif self.ring:
            self.link.want(self)

    @property
    def deferred_count(self) -> int:
        return len(self.deferred) + self.deferred_elsewhere

    def empty(self) -> None:
        held = list(self.in_flight.values())
        self.shared_log.spilled = 0
        super().empty()
        for message in held:
            self.link.ack(self, message)
        for message in self.ready:
            self.link.ack(self, message)
        self.ready.clear()
        engine = self.engine
        assert isinstance(engine, SharedEngine)
        self.link.queue_emptied(self, engine.barrier.issue())


class PublisherOrder:
    """The publishes on their way to the shared engine of a client whose protocol acknowledges none
    (`Client.publishes_in_order`: PHPMQ). Topics are stored apart, and a publish JetStream had no answer
    for is asked again later, so a later publish to another topic could be stored (and delivered) first.
    A publish to another topic than the client's pending ones waits here until they are stored: what
    such a client published before holds once its later publish is delivered, as in the embedded
    engine's one log (a PHPMQ publisher proves a batch handled by a marker after it). A client of a
    protocol that can acknowledge publishes (NSQ's OK, MQKS's --confirm, a PZQ producer's ACK) gets its
    proof there, and its publishes to many topics (MQKS events round-robin) are not held back a round
    trip each."""

    __slots__ = ("held", "held_bytes", "pending", "releasing", "topic")

    def __init__(self, topic: str) -> None:
        self.topic = topic  # the topic of the pending publishes
        self.pending = 0  # sent, not answered yet
        # Waiting, in order: (topic, messages, stored, drop_if_unbound, their bodies' bytes).
        self.held: deque[tuple[Topic, list[Message], Stored, bool, int]] = deque()
        self.held_bytes = 0  # the bodies of all of them
        self.releasing = False


class SharedEngine(Engine):
    """The engine of a node sharing its durable topics and queues through a `Link`."""

    def __init__(self, link: Link, *, node: int, clock: Clock | None = None,
                 timers: TimerService | None = None) -> None:
        self.barrier = PublishBarrier()
        super().__init__(clock=clock, timers=timers, storage=self.barrier)
        self.link = link
        self.node = node
        self._drop_if_unbound = False  # the publish under way follows MQKS's rule (`publish`)
        self._publisher: Client | None = None  # who makes the publish under way, when the adapter says
        self._orders: dict[Client, PublisherOrder] = {}  # clients with publishes not stored yet
        self.hands_over_at_once = False
        # A node holds only the copies it fetched for its consumers: its own queues are not what a stream or a
        # snapshot reads. Both are the shared engine's (`SharedStreams`), whichever node holds the messages.
        self.streams_refused = "a node on JetStream serves streams and snapshots from its JetStream cluster only"
        # How often copies held for credit are reported as still worked on (well inside the ack wait).
        self.hold_refresh_s = DEFAULT_HOLD_REFRESH_S
        # The shared engine's ack wait: what the node said nothing of for this long, it gave again (None: never).
        self.ack_wait_s: float | None = None
        self._refreshed_at = self.clock.now()  # the last round of `_refresh_in_flight`
        # How long copies fetched for consumers that left wait for another one here (`SharedQueue._give_back_soon`):
        # as long as the node's pull requests may still bring some (the link says).
        self.idle_hold_s = DEFAULT_IDLE_HOLD_S
        self.ids = IdSource(self.clock.wall_ns(), node)
        self._refresh_timer: Timer | None = None  # while shared queues exist (`_refresh_in_flight`)
        # Set while the engine applies what another node (or the shared engine itself) changed: the node's
        # topics and queues follow it without telling the shared engine again (`following`).
        self._following = 0
        # Queues this node forgot (unused here for their auto-delete time) and that the shared engine
        # keeps: not made again here until a client names one or it changes in the shared engine.
        self.forgotten: set[str] = set()

    @property
    def is_following(self) -> bool:
        return bool(self._following)

    @contextlib.contextmanager
    def following(self) -> Iterator[None]:
        """Topics and queues made, bound, unbound and deleted inside are this node's view of what the shared
        engine already holds (another node's change, or this node forgetting what it no longer uses)."""
        self._following += 1
        try:
            yield
        finally:
            self._following -= 1

    def overdue(self, since: float, now: float) -> bool:
        """Whether a report made at `since` is a whole ack wait old."""
        return self.ack_wait_s is not None and now - since >= self.ack_wait_s

    def catch_up(self) -> None:
        """The rounds of reports, at once if the last one is a whole ack wait old (the node was paused, or
        starved, and its timers are late): what the shared engine gave again is taken back before anything
        else is done with it."""
        if self._refresh_timer is None or not self.overdue(self._refreshed_at, self.clock.now()):
            return  # no rounds run (no shared queue here), or the last one is recent
        self._refresh_timer.cancel()
        self._refresh_in_flight()

    def _refresh_in_flight(self) -> None:
        """Every hold_refresh_s, deliveries held longer than that are reported worked on."""
        self._refresh_timer = None
        now = self.clock.now()
        lapsed = self.overdue(self._refreshed_at, now)
        self._refreshed_at = now
        shared = [queue for queue in self.queues.values() if isinstance(queue, SharedQueue)]
        if lapsed:
            self.link.lapsed()
            for queue in shared:
                queue.take_back()
        for queue in shared:
            queue.refresh_in_flight()
        if shared:
            self._refresh_timer = self.timers.schedule(self.clock.now() + self.hold_refresh_s,
                                                       self._refresh_in_flight)

    def _new_queue(self, name: str, ephemeral: bool, auto_delete: float | None, options: Mapping[str, Any] | None,
                   owner_topic: str | None) -> Queue:
        owner = self.topics.get(owner_topic) if owner_topic is not None else None
        if ephemeral and (owner is None or owner.ephemeral):
            return super()._new_queue(name, ephemeral, auto_delete, options, owner_topic)  # the node's own
        if self._refresh_timer is None:
            self._refreshed_at = self.clock.now()
            self._refresh_timer = self.timers.schedule(self.clock.now() + self.hold_refresh_s,
                                                       self._refresh_in_flight)
        return SharedQueue(self, name, auto_delete=auto_delete, options=options, owner_topic=owner_topic,
                           ephemeral=ephemeral)

    def ensure_topic(self, name: str, *, ephemeral: bool = False, origin: str | None = None) -> Topic:
        made = name not in self.topics
        topic = super().ensure_topic(name, ephemeral=ephemeral, origin=origin)
        if made and not topic.ephemeral:
            topic.log = SharedTopicLog(self.link, topic)
            # In the barrier as a publish is: a topic made through any client is in the cluster when it is told.
            self.link.topic_made(topic, self.barrier.issue())
        return topic

    def ensure_queue(self, name: str, *, ephemeral: bool = False, auto_delete: float | None = None,
                     options: Mapping[str, Any] | None = None, origin: str | None = None,
                     owner_topic: str | None = None) -> Queue:
        made = name not in self.queues
        queue = super().ensure_queue(name, ephemeral=ephemeral, auto_delete=auto_delete, options=options,
                                    origin=origin, owner_topic=owner_topic)
        if made and isinstance(queue, SharedQueue):
            if not self._following:
                self.forgotten.discard(name)  # named by a client: followed again
            self.link.queue_made(queue)
        return queue

    def configure_queue(self, queue: Queue, *, auto_delete: float | None, options: Mapping[str, Any]) -> None:
        super().configure_queue(queue, auto_delete=auto_delete, options=options)
        if isinstance(queue, SharedQueue) and not self._following:
            self.link.queue_configured(queue)

    def bind(self, queue_name: str, topic_name: str, *, ephemeral_topic: bool = False) -> Queue:
        queue = self.queues[queue_name]
        new = topic_name not in queue.topics
        super().bind(queue_name, topic_name, ephemeral_topic=ephemeral_topic)
        topic = self.topics.get(topic_name)
        if new and isinstance(queue, SharedQueue) and topic is not None and not topic.ephemeral:
            backlog = topic.log
            if isinstance(backlog, SharedTopicLog) and len(topic.queues) == 1 and not queue.ephemeral:
                queue.shared_log.spilled += backlog.spilled  # the first queue takes the backlog
                backlog.spilled = 0
            if self._following:
                self.link.followed(queue, topic_name)
            else:
                self.link.bound(queue, topic_name, self.barrier.issue())
        return queue

    def set_bindings(self, queue_name: str, topic_names: Iterable[str]) -> None:
        """As the embedded engine's, but the new bindings are made before the old ones go: another node
        following the change never sees the queue bound to nothing (and forgets it) on the way."""
        wanted = list(dict.fromkeys(topic_names))
        queue = self.queues[queue_name]
        for topic_name in wanted:
            self.bind(queue_name, topic_name)
        for topic_name in list(queue.topics):
            if topic_name not in wanted:
                self.unbind(queue_name, topic_name)

    def _unbind(self, queue: Queue, topic_name: str) -> None:
        bound = topic_name in queue.topics
        super()._unbind(queue, topic_name)
        if bound and isinstance(queue, SharedQueue):
            if self._following:
                self.link.unfollowed(queue, topic_name)
            elif not queue.deleted:
                self.link.unbound(queue, topic_name)

    def delete_queue(self, name: str) -> bool:
        queue = self.queues.get(name)
        topics = list(queue.topics) if queue is not None else []
        if isinstance(queue, SharedQueue):
            queue.give_back()
        deleted = super().delete_queue(name)
        if deleted and isinstance(queue, SharedQueue) and not self._following:
            self.forgotten.discard(name)
            self.link.queue_deleted(queue, topics)
        return deleted

    def delete_topic(self, name: str) -> bool:
        topic = self.topics.get(name)
        deleted = super().delete_topic(name)
        if deleted and topic is not None and not topic.ephemeral:
            if self._following:
                self.link.topic_forgotten(name)
            else:
                self.link.topic_deleted(name)
        return deleted

    # -- publishing: to the shared engine, never straight into the node's queues -----------------

    def publish(self, topic_name: str, body: bytes, *, delay: float = 0.0, headers: Mapping[str, Any] | None = None,
                ttl: float | None = None, drop_if_unbound: bool = False, origin: str | None = None,
                client: Client | None = None, publisher_id: bytes | None = None,
                traced_id: bytes | None = None) -> int:
        """As the embedded engine's, but MQKS's rule (`drop_if_unbound`) asks about every node's queues: the
        link decides once it knows them."""
        self._drop_if_unbound = drop_if_unbound and not self._bound_here(topic_name)
        self._publisher = client
        try:
            return super().publish(topic_name, body, delay=delay, headers=headers, ttl=ttl, origin=origin,
                                   client=client, publisher_id=publisher_id, traced_id=traced_id)
        finally:
            self._drop_if_unbound = False
            self._publisher = None

    def publish_many(self, topic_name: str, bodies: list[bytes], *, headers: Mapping[str, Any] | None = None,
                     each_headers: list[Mapping[str, Any]] | None = None,
                     each_publisher_id: list[bytes] | None = None, drop_if_unbound: bool = False,
                     origin: str | None = None, client: Client | None = None) -> int:
        self._drop_if_unbound = drop_if_unbound and not self._bound_here(topic_name)
        self._publisher = client
        try:
            return super().publish_many(topic_name, bodies, headers=headers, each_headers=each_headers,
                                        each_publisher_id=each_publisher_id, origin=origin, client=client)
        finally:
            self._drop_if_unbound = False
            self._publisher = None

    def publish_refusal(self, topic_name: str, count: int = 1, client: Client | None = None) -> str | None:
        order = self._orders.get(client) if client is not None else None
        if order is not None and order.held_bytes > MAX_HELD_BYTES:
            return (f"{order.held_bytes} bytes of this client's publishes wait for the shared engine to store "
                    f"its earlier ones (the limit is {MAX_HELD_BYTES})")
        return super().publish_refusal(topic_name, count, client)

    def tell_every_node(self, kind: str, frames: list[bytes]) -> None:
        super().tell_every_node(kind, frames)
        self.link.tell_every_node(kind, frames)

    def tell_maker_of(self, message_id: int, kind: str, frames: list[bytes]) -> None:
        node = node_of(message_id)
        if node == self.node:
            self.told(kind, frames)
        else:
            self.link.tell_node(node, kind, frames)

    def cluster(self) -> ClusterView:
        return self.link.cluster()

    def backend(self) -> dict[str, Any]:
        return {**self.link.describe(), "node": self.node, "publishes": self.barrier.publish_count,
                "publish_errors": self.barrier.publish_errors, "failure": self.barrier.failure}

    def settled(self, callback: Callable[[OSError | None], None]) -> None:
        self.barrier.sync(callback)  # bindings count in the barrier, as publishes do

    def _bound_here(self, topic_name: str) -> bool:
        topic = self.topics.get(topic_name)
        return topic is not None and bool(topic.queues)

    def _publish_messages(self, topic: Topic, messages: list[Message]) -> None:
        if topic.ephemeral:
            super()._publish_messages(topic, messages)
            return
        stored = self.barrier.issue()
        client = self._publisher
        if client is None or not client.publishes_in_order:
            self.publish_stored(topic, messages, stored, self._drop_if_unbound)
            return
        order = self._orders.get(client)
        if order is None:
            order = self._orders[client] = PublisherOrder(topic.name)
        elif order.held or (order.pending and order.topic != topic.name):
            size = sum(len(message.body) for message in messages)
            order.held.append((topic, messages, stored, self._drop_if_unbound, size))
            order.held_bytes += size
            return
        order.topic = topic.name
        self._send_in_order(client, order, topic, messages, stored, self._drop_if_unbound)

    def _send_in_order(self, client: Client, order: PublisherOrder, topic: Topic, messages: list[Message],
                       stored: Stored, drop_if_unbound: bool) -> None:
        order.pending += 1

        def answered(error: Exception | None) -> None:
            order.pending -= 1
            stored(error)
            if error is not None:
                # Not stored: what the client published after it is not stored either, so none of it is
                # delivered as if the failed publish had been.
                held, order.held = order.held, deque()
                order.held_bytes = 0
                for _, _, later_stored, _, _ in held:
                    later_stored(error)
            if not order.releasing:
                self._release(client, order)

        self.publish_stored(topic, messages, answered, drop_if_unbound)

    def _release(self, client: Client, order: PublisherOrder) -> None:
        """Once a client's pending publishes are stored: its held publishes to the next topic go."""
        order.releasing = True
        try:
            while not order.pending:
                if not order.held:
                    if self._orders.get(client) is order:
                        del self._orders[client]
                    return
                order.topic = order.held[0][0].name
                while order.held and order.held[0][0].name == order.topic:
                    topic, messages, stored, drop_if_unbound, size = order.held.popleft()
                    order.held_bytes -= size
                    self._send_in_order(client, order, topic, messages, stored, drop_if_unbound)
        finally:
            order.releasing = False

    def publish_stored(self, topic: Topic, messages: list[Message], stored: Stored,
                       drop_if_unbound: bool = False) -> None:
        topic.message_count += len(messages)
        topic.message_bytes += sum(len(message.body) for message in messages)
        self.link.publish(topic, messages, stored, drop_if_unbound)

    def restore(self) -> None:
        pass  # the shared engine keeps everything; the node's queues are made as clients come
