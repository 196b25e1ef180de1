"""The queue engine (docs/architecture.md): topics, queues, bindings, consumers with credit.

Synchronous and deterministic: no I/O, no awaits, time from an injected clock, timers through
one `TimerService`. Protocol adapters call it; it calls back each consumer's `deliver` function
synchronously, and the adapter queues the bytes for its writer.

Model in one paragraph: publishing to a topic puts one copy in every bound queue (a topic with
no bound queue keeps a backlog that the first bound queue receives, unless the publisher asks
to drop it). Consumers of a queue compete; each has a credit. In "window" mode (NSQ RDY, PHPMQ
window) the credit caps unacknowledged deliveries; in "tokens" mode (eMQP READY) each delivery
spends one token. An acknowledged ("manual") delivery is in flight until finished, requeued
(now or later), timed out, or its consumer goes away; then it returns to the queue and its
attempts count the next delivery.
"""

from __future__ import annotations

import enum
import heapq
import itertools
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Final

from polymq.core.clock import Clock, SystemClock
from polymq.core.cluster import ClusterView
from polymq.core.dedup import KEPT_DEDUP, Dedup
from polymq.core.ids import IdSource
from polymq.core.message import Message
from polymq.core.schedules import KEPT_SCHEDULE, Schedules
from polymq.core.storage import MemoryStorage, OwnerLog, Storage
from polymq.core.timers import Timer, TimerService
from polymq.core.trace import Client, Tracer


class Outcome(enum.Enum):
    """What an acknowledgement by id came to; each adapter says it in its own protocol's words."""

    OK = enum.auto()
    NOT_IN_FLIGHT = enum.auto()  # no delivery of that id is in flight in the queue
    NOT_OWNED = enum.auto()  # in flight, but held by another consumer


class CreditMode(enum.Enum):
    WINDOW = "window"  # credit caps outstanding deliveries (NSQ RDY, PHPMQ window)
    TOKENS = "tokens"  # each delivery spends one unit of credit (eMQP READY)


Deliver = Callable[[Message], None]
# A consumer's filter: a copy it refuses leaves the queue without being delivered (see `Engine.attach`).
Accept = Callable[[Message], bool]


def _accept_all(message: Message) -> bool:
    return True


# A queue's dead letters go to the topic `<queue>` + this, unless its DEAD_LETTER_TOPIC_OPTION names
# another (docs/architecture.md).
DEAD_LETTER_SUFFIX: Final = ".dead"
# Queue option: the topic its dead letters go to, for an adapter whose protocol names them otherwise.
DEAD_LETTER_TOPIC_OPTION: Final = "dead_letter_topic"
# Where the store's record of a queue keeps `Queue.owner_topic` (beside its options, as "auto_delete").
OWNER_RECORD_KEY: Final = "owner_topic"
# Headers a dead letter carries besides its own: where it came from and why.
DEAD_LETTER_QUEUE_HEADER: Final = "dead_letter_queue"
DEAD_LETTER_REASON_HEADER: Final = "dead_letter_reason"
# Queue option: deliveries after which a message that comes back again is dead-lettered (0 = never).
MAX_ATTEMPTS_OPTION: Final = "max_attempts"
# Queue options of a stream (core/streams.py): a queue read by position instead of by consumers,
# and the position below which its reader has committed everything.
STREAM_OPTION: Final = "stream"
STREAM_COMMITTED_OPTION: Final = "stream_committed"
# Queue option: auto-delete the queue only when it is empty (nothing ready, on disk, deferred or
# in flight), and its own topic with it when nothing else is bound to that or waits in it (PHPMQ's
# queues: the original keeps no empty queue).
AUTO_DELETE_EMPTY_OPTION: Final = "auto_delete_empty"
# Queue option: the origin its maker gave (`ensure_queue`), kept for the operators' view; topics
# keep theirs as `Topic.made_by`.
MADE_BY_OPTION: Final = "made_by"


# What a queue past the engine's `max_queue_depth` does with a publish (`Engine.overflow`): refuse it
# (`Engine.publish_refusal` says why; the adapter answers with its protocol's error), or take it and
# drop the queue's oldest ready copies down to the maximum.
OVERFLOW_REJECT: Final = "reject"
OVERFLOW_DROP_OLDEST: Final = "drop-oldest"

# Spilled copies read back from disk at a time when a queue's memory runs dry.
REFILL_BATCH: Final = 1024
# Spilled backlog copies passed on to the bound queues per timer turn (the rest wait a turn, so
# a big backlog never stalls the loop).
PUMP_BATCH: Final = 1024


class CreditPool:
    """Tokens several consumers share: an eMQP worker's free slots serve every queue it works on.

    A delivery to any of them spends one. When tokens come, the consumers are offered them in the
    order they joined (the worker's own order of its queues): the first whose queue holds a message
    takes it."""

    __slots__ = ("consumers", "tokens")

    def __init__(self) -> None:
        self.tokens = 0
        self.consumers: list[Consumer] = []

    def add(self, count: int = 1) -> None:
        self.tokens += count
        for consumer in list(self.consumers):
            if self.tokens <= 0:
                break
            consumer.queue._consumer_changed(consumer)


class Consumer:
    """A session attached to one queue."""

    __slots__ = ("accept", "auto_ack", "client", "closed", "credit", "deliver", "filtered", "finish_count", "in_flight",
                 "in_ring", "max_msg_timeout", "message_count", "mode", "msg_timeout", "on_close", "outstanding",
                 "pool", "priority", "queue", "requeue_count", "retry_first", "tag", "timeout_count", "timer")

    def __init__(
        self,
        queue: Queue,
        deliver: Deliver,
        *,
        credit: int,
        mode: CreditMode,
        auto_ack: bool,
        msg_timeout: float | None,
        max_msg_timeout: float | None,
        on_close: Callable[[str], None] | None,
        tag: Any,
        retry_first: bool = False,
        pool: CreditPool | None = None,
        priority: int = 0,
        accept: Accept | None = None,
        client: Client | None = None,
    ) -> None:
        self.queue = queue
        # Who it is, as its adapter describes it: only read when a traced message reaches it.
        self.client = client
        # Tokens shared with other consumers (their deliveries spend them too); replaces `credit`.
        self.pool = pool
        if pool is not None:
            pool.consumers.append(self)
        # Among the consumers with credit, the higher priority is served first (eMQP's weights);
        # equal priorities take turns.
        self.priority = priority
        # Its timed-out and requeued messages go back to the front of the queue, to be tried
        # first (PZQ's order), instead of the tail (nsqd's).
        self.retry_first = retry_first
        self.deliver = deliver
        self.credit = credit
        self.mode = mode
        self.auto_ack = auto_ack
        self.msg_timeout = msg_timeout
        self.max_msg_timeout = max_msg_timeout
        # Called once per copy about to be delivered, when there is a filter (`filtered`): the dispatch
        # loop reads that native bool first, which costs less than testing an object slot for None.
        self.accept: Accept = _accept_all if accept is None else accept
        self.filtered = accept is not None
        self.on_close = on_close
        self.tag = tag  # whatever the adapter wants to find its session by
        self.in_flight: dict[int, Message] = {}  # ordered by deadline (see `touch`)
        self.outstanding = 0  # auto-ack deliveries the adapter has not released yet
        self.in_ring = False
        self.closed = False
        self.timer: Timer | None = None
        self.message_count = 0
        self.finish_count = 0
        self.requeue_count = 0
        self.timeout_count = 0

    # -- credit ------------------------------------------------------------------------------

    def available(self) -> int:
        if self.pool is not None:
            return self.pool.tokens
        if self.mode is CreditMode.TOKENS:
            return self.credit
        used = self.outstanding if self.auto_ack else len(self.in_flight)
        return self.credit - used

    def set_credit(self, credit: int) -> None:
        self.credit = credit
        self.queue._consumer_changed(self)

    def add_credit(self, amount: int = 1) -> None:
        self.credit += amount
        self.queue._consumer_changed(self)

    def release(self, count: int = 1) -> None:
        """An auto-ack consumer's adapter has written `count` deliveries out: room for more."""
        self.outstanding -= count
        self.queue._consumer_changed(self)

    # -- acknowledgements --------------------------------------------------------------------

    def finish(self, message_id: int, *, refill: bool = True) -> Outcome:
        """Acknowledge. With `refill=False` the freed credit waits for `refill()`, so an adapter
        that handles a whole read of acks dispatches once for all of them."""
        return self.queue._finish(self, message_id, refill)

    def finish_many(self, message_ids: list[int]) -> list[tuple[int, Outcome]]:
        """`finish` each (refill=False), in order; returns (index, outcome) of those that failed.
        A negative id names no message."""
        queue = self.queue
        failed: list[tuple[int, Outcome]] = []
        for index, message_id in enumerate(message_ids):
            outcome = queue._finish(self, message_id, False) if message_id >= 0 else Outcome.NOT_IN_FLIGHT
            if outcome is not Outcome.OK:
                failed.append((index, outcome))
        return failed

    def refill(self) -> None:
        """Deliver what this consumer's credit allows now."""
        self.queue._consumer_changed(self)

    def requeue(self, message_id: int, delay: float = 0.0) -> Outcome:
        return self.queue._requeue(self, message_id, delay)

    def touch(self, message_id: int) -> Outcome:
        return self.queue._touch(self, message_id)

    def requeue_all(self) -> int:
        """Return every in-flight message of this consumer to its queue (MQKS `reject --all`)."""
        ids = list(self.in_flight)
        for message_id in ids:
            self.queue._requeue(self, message_id, 0.0)
        return len(ids)

    def finish_all(self) -> int:
        ids = list(self.in_flight)
        for message_id in ids:
            self.queue._finish(self, message_id)
        return len(ids)

    def detach(self, *, to_tail: bool = False) -> None:
        """The consumer goes away: its in-flight messages return to the queue at once, at the front
        (they were its oldest messages) or, for MQKS's reject-on-disconnect, at the tail."""
        self.queue._detach(self, requeue=True, to_tail=to_tail)


class Queue:
    """A named, ordered store with competing consumers, bound to one or more topics."""

    def __init__(self, engine: Engine, name: str, *, ephemeral: bool, auto_delete: float | None,
                 options: Mapping[str, Any] | None, owner_topic: str | None = None) -> None:
        self.engine = engine
        self.name = name
        self.ephemeral = ephemeral
        # The topic this queue belongs to, if any: deleting that topic deletes the queue, where it
        # only unbinds the other queues bound to it. The adapter that makes a queue says so.
        self.owner_topic = owner_topic
        # False for a queue restored from a record written before records kept the owner: its
        # adapter may tell by its own naming (`Engine.set_owner_topic`).
        self.owner_topic_recorded = True
        # Seconds to wait after the last consumer leaves before deleting; None = keep forever.
        self.auto_delete = 0.0 if ephemeral and auto_delete is None else auto_delete
        self.options: dict[str, Any] = dict(options or {})
        self.topics: list[str] = []
        self.ready: deque[Message] = deque()
        self.deferred: list[tuple[float, int, Message]] = []
        self.in_flight: dict[int, Message] = {}
        self.consumers: list[Consumer] = []
        self.ring: deque[Consumer] = deque()  # consumers with credit to spare
        self.paused = False
        self.deleted = False
        # Deleted by AUTO_DELETE_EMPTY_OPTION's countdown: empty and unused (not by an operator).
        self.forgotten_empty = False
        # It may hold copies of traced messages (core/trace.py): checked where their events happen.
        self.traced = False
        self.log: OwnerLog | None = None  # set by the engine for a durable queue
        self._deferred_timer: Timer | None = None
        self._delete_timer: Timer | None = None
        self._dispatching = False  # a deliver callback that acks or releases must not recurse
        self._prioritized = False  # some consumer has a priority: the ring keeps their order
        self._deferred_seq = itertools.count()
        # A stream is read by position (core/streams.py): every copy gets the next position as it
        # becomes readable (the store's place for it, else this counter), and nothing is dispatched.
        self.stream = bool(self.options.get(STREAM_OPTION))
        self.next_memory_position = 0
        self.message_count = 0
        self.delivered_count = 0  # deliveries (a message sent again counts again)
        self.finished_count = 0  # deliveries acknowledged (an auto-ack consumer's, as it is sent)
        self.requeue_count = 0
        self.timeout_count = 0
        self.expired_count = 0  # copies whose TTL ran out before a delivery
        self.dead_letter_count = 0  # copies moved to `dead_letter_topic`
        self.rejected_count = 0  # publishes refused while it was full (OVERFLOW_REJECT)
        self.overflow_dropped_count = 0  # its oldest copies dropped to make room (OVERFLOW_DROP_OLDEST)

    @property
    def durable(self) -> bool:
        return self.log is not None

    @property
    def max_attempts(self) -> int:
        """Deliveries after which a message coming back is dead-lettered instead; 0 = no limit."""
        return int(self.options.get(MAX_ATTEMPTS_OPTION) or 0)

    @property
    def dead_letter_topic(self) -> str:
        return str(self.options.get(DEAD_LETTER_TOPIC_OPTION) or self.name + DEAD_LETTER_SUFFIX)

    @property
    def depth(self) -> int:
        """Ready copies, in memory and spilled to disk."""
        return len(self.ready) + (self.log.spilled if self.log is not None else 0)

    @property
    def spilled(self) -> int:
        return self.log.spilled if self.log is not None else 0

    # -- putting messages in -------------------------------------------------------------------

    def _put(self, message: Message, due: float | None = None) -> None:
        self.message_count += 1
        deferred = due is not None and due > self.engine.clock.now()
        log = self.log
        if log is not None:
            message.due = due if deferred else None
            if not deferred and not self.ready and not log.spilled and self._auto_acked_at_once():
                # Gone before any commit: its ADD would be cancelled at once (`OwnerLog.removed`), so it
                # is never appended (an MQKS auto-ack consumer's every delivery at light load).
                self.ready.append(message)
                self._dispatch()
                return
            if not deferred and (log.spilled or len(self.ready) >= self.engine.storage.mem_queue_size):
                log.append((message,), 0)  # past the memory limit: on disk only
                return
            log.append((message,))
        elif self.stream and not deferred:
            message.pos = self.next_memory_position
            self.next_memory_position += 1
        if deferred:
            self._defer(message, due)  # type: ignore[arg-type]
        else:
            self.ready.append(message)
            if self.ring and not self.paused:
                self._dispatch()

    def _auto_acked_at_once(self) -> bool:
        """Whether a copy put in an empty queue now leaves it in this call, to the auto-ack consumer whose
        turn it is (or expired, or refused by its filter): nothing of it is left to store."""
        ring = self.ring
        if not ring or self.paused or self.stream or self._dispatching:
            return False
        consumer = ring[0]
        return consumer.auto_ack and consumer.pool is None and consumer.available() > 0

    def _put_many(self, messages: list[Message]) -> None:
        self.message_count += len(messages)
        if self.log is not None:
            messages = _store(self.log, messages, len(self.ready), self.engine.storage.mem_queue_size)
        elif self.stream:
            for message in messages:
                message.pos = self.next_memory_position
                self.next_memory_position += 1
        self.ready.extend(messages)
        if self.ring and not self.paused:
            self._dispatch()

    def _drop_oldest(self, count: int) -> None:
        """Drop up to `count` of the oldest ready copies (the depth policy's drop-oldest)."""
        ready = self.ready
        log = self.log
        dropped = 0
        while dropped < count and (ready or (log is not None and log.spilled and self._refill(count - dropped))):
            message = ready.popleft()
            if log is not None:
                log.removed(message)
            if self.traced:
                self.engine._trace().dropped(self, message, "the queue was full (drop-oldest)")
            dropped += 1
        self.overflow_dropped_count += dropped

    def _refill(self, count: int = 0) -> bool:
        """Read spilled copies back into memory (`count` of them, else as many as the memory limit
        allows up to REFILL_BATCH); False when none can be read now."""
        log = self.log
        if log is None or not log.spilled:
            return False
        messages = log.read(count or min(REFILL_BATCH, max(1, self.engine.storage.mem_queue_size)))
        if log.may_hold_deferred:  # a topic backlog's log taken over: it can spill deferred copies
            now = self.engine.clock.now()
            for message in messages:
                if message.due is not None and message.due > now:
                    self._defer(message, message.due)
                else:
                    message.due = None
                    self.ready.append(message)
        else:
            self.ready.extend(messages)
        return bool(messages)

    def _on_readable(self) -> None:
        if not self.ready and self.ring and not self.paused:
            self._dispatch()

    def _defer(self, message: Message, due: float) -> None:
        message.due = due
        heapq.heappush(self.deferred, (due, next(self._deferred_seq), message))
        if self._deferred_timer is None or self._deferred_timer.due > due:
            if self._deferred_timer is not None:
                self._deferred_timer.cancel()
            self._deferred_timer = self.engine.timers.schedule(due, self._release_deferred)

    def _release_deferred(self) -> None:
        self._deferred_timer = None
        now = self.engine.clock.now()
        deferred = self.deferred
        released = False
        while deferred and deferred[0][0] <= now:
            _, _, message = heapq.heappop(deferred)
            message.due = None
            if self.stream:
                self._renumber(message)
            self.ready.append(message)
            released = True
        if deferred:
            self._deferred_timer = self.engine.timers.schedule(deferred[0][0], self._release_deferred)
        if released and self.ring and not self.paused:
            self._dispatch()

    def _renumber(self, message: Message) -> None:
        """A stream's deferred copy becomes readable: it takes the next position (its reader may
        have read past the one it was stored at)."""
        log = self.log
        if log is not None:
            log.removed(message)
            log.append((message,))
        else:
            message.pos = self.next_memory_position
            self.next_memory_position += 1

    # -- delivering ----------------------------------------------------------------------------

    def _dispatch(self) -> None:
        if self.stream:
            return  # read by position only: consumers attached to it by name get nothing
        if self._dispatching:
            # Called from a deliver callback (finish, release, credit...): the running loop
            # below sees the change on its next turn, without one stack frame per message.
            return
        self._dispatching = True
        try:
            self._dispatch_loop()
        finally:
            self._dispatching = False

    def _dispatch_loop(self) -> None:
        ready = self.ready
        ring = self.ring
        engine = self.engine
        now = engine.clock.now()
        log = self.log
        while ring and not self.paused and (ready or (log is not None and log.spilled and self._refill())):
            consumer = ring[0]
            pool = consumer.pool
            if pool is not None and pool.tokens <= 0:
                ring.popleft()  # its pool was spent in another queue
                consumer.in_ring = False
                continue
            message = ready.popleft()
            if message.expires_at is not None and message.expires_at <= now:
                engine.expired_count += 1
                self.expired_count += 1
                if log is not None:
                    log.removed(message)
                if self.traced:
                    engine._trace().expired(self, message)
                continue
            if consumer.filtered and not consumer.accept(message):
                # Refused: gone from the queue, never delivered, so not counted as a delivery.
                if log is not None:
                    log.removed(message)
                if self.traced:
                    engine._trace().dropped(self, message, "refused by its consumer's filter")
                continue
            message.attempts += 1
            consumer.message_count += 1
            self.delivered_count += 1
            if pool is not None:
                pool.tokens -= 1
            elif consumer.mode is CreditMode.TOKENS:
                consumer.credit -= 1
            if consumer.auto_ack:
                self.finished_count += 1
                if consumer.mode is CreditMode.WINDOW:
                    consumer.outstanding += 1
                if log is not None:
                    log.removed(message)
            else:
                if log is not None:
                    log.state(message)  # attempts survive a crash while it is in flight
                message.owner = consumer
                message.delivered_at = now
                timeout = consumer.msg_timeout
                if timeout is not None:
                    message.deadline = now + timeout
                    if consumer.timer is None:
                        consumer.timer = engine.timers.schedule(message.deadline, self._timeouts, consumer)
                consumer.in_flight[message.id] = message
                self.in_flight[message.id] = message
            if self.traced:
                engine._trace().delivered(self, consumer, message)
            if consumer.available() <= 0:
                ring.popleft()
                consumer.in_ring = False
            elif len(ring) > 1:
                if self._prioritized:
                    ring.popleft()
                    self._enter_ring(consumer)  # the end of its priority's turn
                else:
                    ring.rotate(-1)
            consumer.deliver(message)

    def _consumer_changed(self, consumer: Consumer) -> None:
        if consumer.closed:
            return
        if consumer.available() > 0:
            if not consumer.in_ring:
                consumer.in_ring = True
                self._enter_ring(consumer)
            if (self.ready or self.spilled) and not self.paused:
                self._dispatch()
        elif consumer.in_ring:
            consumer.in_ring = False
            self.ring.remove(consumer)

    def _enter_ring(self, consumer: Consumer) -> None:
        """Behind every consumer of its priority or a higher one, ahead of the lower ones."""
        ring = self.ring
        if not self._prioritized or not ring or ring[-1].priority >= consumer.priority:
            ring.append(consumer)
            return
        for index, other in enumerate(ring):
            if other.priority < consumer.priority:
                ring.insert(index, consumer)
                return

    # -- acknowledgements ----------------------------------------------------------------------

    def _take_in_flight(self, consumer: Consumer, message_id: int) -> Message | Outcome:
        message = self.in_flight.get(message_id)
        if message is None:
            return Outcome.NOT_IN_FLIGHT
        if message.owner is not consumer:
            return Outcome.NOT_OWNED
        del self.in_flight[message_id]
        del consumer.in_flight[message_id]
        message.owner = None
        message.deadline = None
        return message

    def _finish(self, consumer: Consumer, message_id: int, refill: bool = True) -> Outcome:
        message = self._take_in_flight(consumer, message_id)
        if isinstance(message, Outcome):
            return message
        consumer.finish_count += 1
        self.finished_count += 1
        if self.log is not None:
            self.log.removed(message)
        if self.traced:
            self.engine._trace().finished(self, consumer, message)
        if refill:
            self._consumer_changed(consumer)
        return Outcome.OK

    def _requeue(self, consumer: Consumer, message_id: int, delay: float) -> Outcome:
        message = self._take_in_flight(consumer, message_id)
        if isinstance(message, Outcome):
            return message
        consumer.requeue_count += 1
        self.requeue_count += 1
        if self.traced:
            self.engine._trace().requeued(self, consumer, message, delay)
        self._return(message, delay, front=consumer.retry_first)
        self._consumer_changed(consumer)
        if self.ready and self.ring and not self.paused:
            # The requeuing consumer may have no credit left (RDY 0 then REQ): others may take it.
            self._dispatch()
        return Outcome.OK

    def _return(self, message: Message, delay: float = 0.0, front: bool = False) -> None:
        max_attempts = self.max_attempts
        if max_attempts and message.attempts >= max_attempts:
            self._dead_letter(message, "max attempts")
            return
        if self.log is not None:
            self.log.state(message, self.engine.clock.wall_ns() + int(delay * 1e9) if delay > 0 else 0)
        if delay > 0:
            self._defer(message, self.engine.clock.now() + delay)
        elif front:
            self.ready.appendleft(message)
        else:
            self.ready.append(message)

    def _touch(self, consumer: Consumer, message_id: int) -> Outcome:
        message = self.in_flight.get(message_id)
        if message is None:
            return Outcome.NOT_IN_FLIGHT
        if message.owner is not consumer:
            return Outcome.NOT_OWNED
        if self.traced:
            self.engine._trace().touched(self, consumer, message)
        if consumer.msg_timeout is None:
            return Outcome.OK
        now = self.engine.clock.now()
        deadline = now + consumer.msg_timeout
        if consumer.max_msg_timeout is not None:
            deadline = min(deadline, message.delivered_at + consumer.max_msg_timeout)
        message.deadline = deadline
        in_flight = consumer.in_flight
        del in_flight[message_id]
        last = next(reversed(in_flight.values()), None) if in_flight else None
        in_flight[message_id] = message
        if last is not None and last.deadline is not None and last.deadline > deadline:
            # Capped by max_msg_timeout, so earlier than the tail: keep the dict in deadline order.
            ordered = sorted(in_flight.values(), key=lambda m: m.deadline or 0.0)
            in_flight.clear()
            in_flight.update((m.id, m) for m in ordered)
            if consumer.timer is not None and consumer.timer.due > deadline:
                consumer.timer.cancel()
                consumer.timer = None
            if consumer.timer is None:
                consumer.timer = self.engine.timers.schedule(deadline, self._timeouts, consumer)
        return Outcome.OK

    # -- acknowledgements by message id, from any session (PHPMQ) --------------------------------

    def _take_any(self, message_id: int, *, finished: bool = False) -> Message | None:
        """Take an in-flight message from whichever consumer holds it; its window slot is freed."""
        message = self.in_flight.pop(message_id, None)
        if message is None:
            return None
        owner = message.owner
        message.owner = None
        message.deadline = None
        if finished:
            self.finished_count += 1
            if self.log is not None:
                self.log.removed(message)
            if self.traced:
                self.engine._trace().finished(self, owner, message)
        if owner is not None:
            del owner.in_flight[message_id]
            if finished:
                owner.finish_count += 1
            self._consumer_changed(owner)
        return message

    def finish_any(self, message_id: int) -> Outcome:
        """Acknowledge a delivery, whoever holds it (PHPMQ acks from any connection)."""
        return Outcome.OK if self._take_any(message_id, finished=True) is not None else Outcome.NOT_IN_FLIGHT

    def requeue_to_tail(self, message_id: int, ttl: float | None) -> Outcome:
        """Put a delivery back at the tail of the queue, whoever holds it, with a new TTL (None: none).

        It goes in as a new copy (same id, body and attempts), so its new place and TTL are stored."""
        held = self.in_flight.get(message_id)
        owner = held.owner if held is not None else None
        message = self._take_any(message_id)
        if message is None:
            return Outcome.NOT_IN_FLIGHT
        self.requeue_count += 1
        if self.traced:
            self.engine._trace().requeued(self, owner, message, 0.0)
        max_attempts = self.max_attempts
        if max_attempts and message.attempts >= max_attempts:
            self._dead_letter(message, "max attempts")
            return Outcome.OK
        self._put_at_tail(message, None if ttl is None else self.engine.clock.now() + ttl)
        return Outcome.OK

    def _put_at_tail(self, message: Message, expires_at: float | None) -> None:
        """`message`, taken from its delivery, again at the tail as a new copy expiring at `expires_at`."""
        if self.log is not None:
            self.log.removed(message)
        copy = message.copy()
        copy.expires_at = expires_at
        self.message_count -= 1  # `_put` counts it again: it is the same message
        self._put(copy)
        if self.ready and self.ring and not self.paused:
            self._dispatch()

    def dead_letter(self, message_id: int, reason: str = "rejected") -> Outcome:
        """Move a delivery, whoever holds it, to this queue's dead-letter topic."""
        message = self._take_any(message_id)
        if message is None:
            return Outcome.NOT_IN_FLIGHT
        self._dead_letter(message, reason)
        return Outcome.OK

    def _dead_letter(self, message: Message, reason: str) -> None:
        """The copy leaves this queue for `dead_letter_topic`: an ordinary topic any protocol reads
        (its first queue gets what waited there). It keeps its id, body and headers, and says whence and why.

        The letter is on the disk before this copy's end: a crash between leaves it in both places."""
        if self.log is not None:
            self.log.removed_after_next_write(message)
        self.dead_letter_count += 1
        engine = self.engine
        letter = self._letter(message, reason)
        topic = engine.ensure_topic(letter.topic or "", ephemeral=self.ephemeral)
        if self.traced:
            engine._trace().dead_lettered(self, message, reason, topic)
        engine._publish_messages(topic, [letter])

    def _letter(self, message: Message, reason: str) -> Message:
        """The dead letter of `message`: same id, body and headers, plus whence and why, for `dead_letter_topic`."""
        headers: dict[str, Any] = dict(message.headers) if isinstance(message.headers, Mapping) else {}
        headers[DEAD_LETTER_QUEUE_HEADER] = self.name
        headers[DEAD_LETTER_REASON_HEADER] = reason
        name = self.dead_letter_topic
        return Message(message.id, message.body, message.timestamp_ns, headers, None, 0, name, message.origin,
                       message.publisher_id)

    def _timeouts(self, consumer: Consumer) -> None:
        consumer.timer = None
        if consumer.closed:
            return
        now = self.engine.clock.now()
        in_flight = consumer.in_flight
        expired: list[Message] = []
        for message in in_flight.values():
            if message.deadline is not None and message.deadline <= now:
                expired.append(message)
            else:
                break
        for message in expired:
            self._drop_timed_out(consumer, message)
        # In the order they were delivered: at the front, that is back to front.
        for message in reversed(expired) if consumer.retry_first else expired:
            self._return(message, front=consumer.retry_first)
        if in_flight:
            head = next(iter(in_flight.values()))
            if head.deadline is not None:
                consumer.timer = self.engine.timers.schedule(head.deadline, self._timeouts, consumer)
        if expired:
            self._consumer_changed(consumer)
            if self.ready and self.ring and not self.paused:
                self._dispatch()

    def _drop_timed_out(self, consumer: Consumer, message: Message) -> None:
        """Out of flight as timed out (counted, traced); where it goes next is the caller's."""
        del consumer.in_flight[message.id]
        del self.in_flight[message.id]
        message.owner = None
        message.deadline = None
        consumer.timeout_count += 1
        self.timeout_count += 1
        if self.traced:
            self.engine._trace().timed_out(self, consumer, message)

    # -- consumers coming and going ----------------------------------------------------------

    def _attach(self, consumer: Consumer) -> None:
        if consumer.priority:
            self._prioritized = True
        if self._delete_timer is not None:
            self._delete_timer.cancel()
            self._delete_timer = None
        self.consumers.append(consumer)
        self._consumer_changed(consumer)

    def _detach(self, consumer: Consumer, *, requeue: bool, to_tail: bool = False) -> None:
        if consumer.closed:
            return
        consumer.closed = True
        if consumer.timer is not None:
            consumer.timer.cancel()
            consumer.timer = None
        if consumer.in_ring:
            consumer.in_ring = False
            self.ring.remove(consumer)
        if consumer in self.consumers:
            self.consumers.remove(consumer)
        if consumer.pool is not None and consumer in consumer.pool.consumers:
            consumer.pool.consumers.remove(consumer)
        returned = list(consumer.in_flight.values())
        consumer.in_flight.clear()
        for message in returned:
            del self.in_flight[message.id]
            message.owner = None
            message.deadline = None
        if requeue and not self.deleted:
            if self.traced:
                for message in returned:
                    self.engine._trace().returned(self, consumer, message)
            if to_tail:
                for message in returned:
                    self._return(message)
            else:
                # Back at the front, in their order: they were the oldest messages of the queue.
                for message in reversed(returned):
                    self._return(message, front=True)
            if self.ready and self.ring and not self.paused:
                self._dispatch()
        if not self.consumers and self.auto_delete is not None and not self.deleted:
            if self.auto_delete <= 0:
                self._auto_delete()
            else:
                self._delete_timer = self.engine.timers.schedule(
                    self.engine.clock.now() + self.auto_delete, self._auto_delete
                )

    def _auto_delete(self) -> None:
        self._delete_timer = None
        if self.consumers or self.deleted or self.auto_delete is None:
            return
        engine = self.engine
        if not self.options.get(AUTO_DELETE_EMPTY_OPTION):
            engine.delete_queue(self.name)
            return
        if self.depth or self.in_flight or self.deferred:
            return  # kept: a consumer that comes and goes again starts the countdown again
        self.forgotten_empty = True  # observers of the deletion may tidy up what the queue came with
        engine.delete_queue(self.name)

    # -- administration ------------------------------------------------------------------------

    def set_paused(self, paused: bool) -> None:
        self.paused = paused
        self.engine._save_queue(self)
        if not paused and self.ready and self.ring:
            self._dispatch()

    def empty(self) -> None:
        """Drop every message: ready, deferred and in flight (nsqd's channel empty)."""
        if self.traced:
            self.engine._trace().queue_gone(self, "the queue was emptied")
        if self.log is not None:
            self.log.emptied()  # first: the refills below must find nothing spilled
        self.ready.clear()
        self.deferred.clear()
        if self._deferred_timer is not None:
            self._deferred_timer.cancel()
            self._deferred_timer = None
        for message in self.in_flight.values():
            message.owner = None
        self.in_flight.clear()
        for consumer in self.consumers:
            consumer.in_flight.clear()
            if consumer.timer is not None:
                consumer.timer.cancel()
                consumer.timer = None
            self._consumer_changed(consumer)

    @property
    def deferred_count(self) -> int:
        return len(self.deferred)

    def __repr__(self) -> str:
        return f"Queue({self.name!r}, ready={len(self.ready)}, in_flight={len(self.in_flight)})"


def _store(log: OwnerLog, messages: list[Message], held: int, mem_queue_size: int) -> list[Message]:
    """Write new copies to `log`; returns those that stay objects (past `mem_queue_size`, or behind
    copies already spilled, the rest live on disk only)."""
    room = 0 if log.spilled else mem_queue_size - held
    if room >= len(messages):
        log.append(messages)
        return messages
    room = max(room, 0)
    log.append(messages, room)
    return messages[:room]


class Topic:
    def __init__(self, engine: Engine, name: str, *, ephemeral: bool, made_by: str | None = None) -> None:
        self.engine = engine
        self.name = name
        self.ephemeral = ephemeral
        self.made_by = made_by  # the origin its maker gave (`ensure_topic`); None when not known
        self.queues: list[Queue] = []
        # Kept while no queue is bound or while paused, and until what was kept has gone on.
        self.backlog: deque[Message] = deque()
        self.log: OwnerLog | None = None  # set by the engine for a durable topic
        self.paused = False
        self.deleted = False
        # Publishes here are traced, or traced messages reached it (core/trace.py).
        self.traced = False
        self.message_count = 0
        self.message_bytes = 0
        self._pump_timer: Timer | None = None

    @property
    def durable(self) -> bool:
        return self.log is not None

    @property
    def depth(self) -> int:
        return len(self.backlog) + self.spilled

    @property
    def spilled(self) -> int:
        return self.log.spilled if self.log is not None else 0

    def _holds(self) -> bool:
        """Publishes wait in the backlog (keeping their order behind what is there already)."""
        return self.paused or not self.queues or bool(self.backlog) or bool(self.spilled)

    def _keep(self, messages: list[Message]) -> None:
        log = self.log
        if log is not None:
            if not log.spilled and any(m.due is not None for m in messages):
                log.append(messages)  # deferred copies stay objects while nothing is spilled
            else:
                messages = _store(log, messages, len(self.backlog), self.engine.storage.mem_queue_size)
        self.backlog.extend(messages)

    def _flush_backlog(self) -> None:
        """Pass the backlog on to the bound queues: what is in memory now, the spilled rest a batch a turn."""
        if self.paused or not self.queues or self.deleted:
            return
        if self.backlog:
            backlog = list(self.backlog)
            self.backlog.clear()
            self._moved(backlog)
        log = self.log
        if log is not None and log.spilled and self._pump_timer is None:
            engine = self.engine
            self._pump_timer = engine.timers.schedule(engine.clock.now(), self._pump)

    def _pump(self) -> None:
        self._pump_timer = None
        log = self.log
        if self.paused or not self.queues or self.deleted or log is None:
            return
        messages = log.read(PUMP_BATCH)
        if messages:
            self._moved(messages)
        if log.spilled and messages:
            self._pump_timer = self.engine.timers.schedule(self.engine.clock.now(), self._pump)
        # else: nothing readable yet; `on_readable` calls `_pump` after the next commit

    def _moved(self, messages: list[Message]) -> None:
        if self.log is not None:
            for message in messages:
                self.log.removed(message)  # written after the queues' copies (queues commit first)
        self.engine._distribute(self, messages)

    def set_paused(self, paused: bool) -> None:
        self.paused = paused
        if self.durable:
            self.engine.storage.topic_saved(self.name, paused)
        self._flush_backlog()

    def empty(self) -> None:
        if self.traced:
            self.engine._trace().topic_gone(self, "the topic was emptied")
        self.backlog.clear()
        if self.log is not None:
            self.log.emptied()

    def __repr__(self) -> str:
        return f"Topic({self.name!r}, queues={[q.name for q in self.queues]}, backlog={len(self.backlog)})"


class Engine:
    def __init__(
        self,
        *,
        clock: Clock | None = None,
        timers: TimerService | None = None,
        storage: Storage | None = None,
        ids: IdSource | None = None,
    ) -> None:
        self.clock: Clock = clock or SystemClock()
        self.timers = timers or TimerService()
        self.storage: Storage = storage or MemoryStorage()
        self.ids = ids or IdSource(self.clock.wall_ns())
        self.topics: dict[str, Topic] = {}
        self.queues: dict[str, Queue] = {}
        self.expired_count = 0
        self.dropped_count = 0  # publishes dropped because no queue was bound (MQKS rule)
        # The depth policy, off by default: past this many ready copies a queue refuses publishes or
        # drops its oldest (`overflow`); checked once per publish or batch, never per message.
        self.max_queue_depth = 0
        self.overflow = OVERFLOW_REJECT
        # Observers of topology changes (the gateway's lookupd registration, MQKS --update).
        self.on_topic_created: list[Callable[[Topic], None]] = []
        self.on_topic_deleted: list[Callable[[str], None]] = []
        # Called with the queue and the topic's name once a binding is made, or removed (a deleted
        # queue's bindings are removed before `on_queue_deleted` is called).
        self.on_bound: list[Callable[[Queue, str], None]] = []
        self.on_unbound: list[Callable[[Queue, str], None]] = []
        # Called with the deleted queue and the topics it was bound to.
        self.on_queue_deleted: list[Callable[[Queue, list[str]], None]] = []
        # Messages published on an interval or cron expression (eMQP's SCHEDULE), kept in the store.
        self.schedules = Schedules(self)
        # Publishes of replaying writers (Spark micro-batches) de-duplicated by a deterministic id.
        self.dedup = Dedup(self)
        # Whether a publish reaches a consumer with credit in the call that made it (an engine that shares
        # its queues with other nodes stores it first, and delivers it once a node fetches it).
        self.hands_over_at_once = True
        # Why queues cannot be read by position or in a snapshot here (the stream API), or None: they can.
        self.streams_refused: str | None = None
        # Set while a topic is traced (core/trace.py); the engine calls it only where a topic or queue is.
        self.tracer: Tracer | None = None
        # Who hears what is told to every node, by kind (`tell_every_node`: eMQP's pub/sub).
        self.listeners: dict[str, Callable[[list[bytes]], None]] = {}

    def tell_every_node(self, kind: str, frames: list[bytes]) -> None:
        """Hand `frames` to the listener of `kind` on this node at once; an engine shared with other nodes
        hands them to theirs too, at most once each (nothing is kept for a node that is not there)."""
        self.told(kind, frames)

    def tell_maker_of(self, message_id: int, kind: str, frames: list[bytes]) -> None:
        """Hand `frames` to the listener of `kind` on the node that made the message (here: this one)."""
        self.told(kind, frames)

    def told(self, kind: str, frames: list[bytes]) -> None:
        listener = self.listeners.get(kind)
        if listener is not None:
            listener(frames)

    def _trace(self) -> Tracer:
        """The tracer, for a topic or queue whose `traced` says there is one."""
        tracer = self.tracer
        assert tracer is not None
        return tracer

    # -- topics ------------------------------------------------------------------------------

    def topic(self, name: str) -> Topic | None:
        return self.topics.get(name)

    def ensure_topic(self, name: str, *, ephemeral: bool = False, origin: str | None = None) -> Topic:
        """The topic `name`, made if missing; `origin` (the protocol asking) is kept as its `made_by`."""
        topic = self.topics.get(name)
        if topic is None:
            topic = Topic(self, name, ephemeral=ephemeral, made_by=origin)
            self.topics[name] = topic
            if not ephemeral and self.storage.persistent:
                topic.log = self.storage.open_topic(name, origin)
                topic.log.on_readable = topic._pump
            for observer in self.on_topic_created:
                observer(topic)
        return topic

    def delete_topic(self, name: str) -> bool:
        """Delete a topic; the queues bound to it that it owns (`Queue.owner_topic`) go with it, others are unbound."""
        topic = self.topics.pop(name, None)
        if topic is None:
            return False
        topic.deleted = True
        if topic.traced:
            self._trace().topic_gone(topic, "the topic was deleted")
        for queue in list(topic.queues):
            if queue.owner_topic == name:
                self.delete_queue(queue.name)
            else:
                self.unbind(queue.name, name)
        topic.backlog.clear()
        if topic._pump_timer is not None:
            topic._pump_timer.cancel()
        if topic.durable:
            self.storage.topic_deleted(name, topic.log)
        for observer in self.on_topic_deleted:
            observer(name)
        return True

    # -- queues ------------------------------------------------------------------------------

    def queue(self, name: str) -> Queue | None:
        return self.queues.get(name)

    def ensure_queue(
        self,
        name: str,
        *,
        ephemeral: bool = False,
        auto_delete: float | None = None,
        options: Mapping[str, Any] | None = None,
        origin: str | None = None,
        owner_topic: str | None = None,
    ) -> Queue:
        """The queue `name`, made if missing with these settings: `origin` (the protocol asking) is kept
        as its `made_by` option, `owner_topic` is the topic it belongs to."""
        queue = self.queues.get(name)
        if queue is None:
            if origin is not None:
                options = {MADE_BY_OPTION: origin, **(options or {})}
            queue = self._new_queue(name, ephemeral, auto_delete, options, owner_topic)
            self.queues[name] = queue
            if not ephemeral and self.storage.persistent:
                queue.log = self.storage.open_queue(name, queue.topics, queue.paused, self._queue_options(queue))
                queue.log.on_readable = queue._on_readable
        return queue

    def _new_queue(self, name: str, ephemeral: bool, auto_delete: float | None, options: Mapping[str, Any] | None,
                   owner_topic: str | None) -> Queue:
        """A queue object (an engine whose queues live elsewhere makes its own kind)."""
        return Queue(self, name, ephemeral=ephemeral, auto_delete=auto_delete, options=options, owner_topic=owner_topic)

    def configure_queue(self, queue: Queue, *, auto_delete: float | None, options: Mapping[str, Any]) -> None:
        queue.auto_delete = auto_delete
        queue.options.update(options)
        self._save_queue(queue)

    def set_owner_topic(self, queue: Queue, owner_topic: str | None) -> None:
        """Record the topic `queue` belongs to (None: none), for a queue whose record had no owner."""
        queue.owner_topic = owner_topic
        queue.owner_topic_recorded = True
        self._save_queue(queue)

    def _save_queue(self, queue: Queue) -> None:
        if queue.durable:
            self.storage.queue_saved(queue.name, queue.topics, queue.paused, self._queue_options(queue))

    @staticmethod
    def _queue_options(queue: Queue) -> dict[str, Any]:
        # The owner is written even when None: a record without it predates owners (`owner_topic_recorded`).
        return {"auto_delete": queue.auto_delete, OWNER_RECORD_KEY: queue.owner_topic, **queue.options}

    def bind(self, queue_name: str, topic_name: str, *, ephemeral_topic: bool = False) -> Queue:
        queue = self.queues[queue_name]
        # A topic made by a binding is made by whoever made the queue.
        topic = self.ensure_topic(topic_name, ephemeral=ephemeral_topic, origin=queue.options.get(MADE_BY_OPTION))
        if topic_name not in queue.topics:
            queue.topics.append(topic_name)
            topic.queues.append(queue)
            if topic.traced:
                queue.traced = True
            self._save_queue(queue)
            if len(topic.queues) == 1:
                self._hand_over_backlog(topic, queue)
            topic._flush_backlog()
            for observer in self.on_bound:
                observer(queue, topic_name)
        return queue

    def _hand_over_backlog(self, topic: Topic, queue: Queue) -> None:
        """The first queue of a topic with a spilled backlog takes the topic's log over, copies and all.

        Copying a backlog that lives on disk means reading every copy, writing it again to the queue's
        log, and reading it back once more (docs/performance.md); taking the log costs nothing. Only
        for a queue that holds nothing yet, while neither is paused.
        """
        topic_log, queue_log = topic.log, queue.log
        if (topic_log is None or queue_log is None or not topic_log.spilled or topic.paused or queue.paused
                or queue.ready or queue.in_flight or queue.deferred or queue.stream):
            return
        new_log = self.storage.adopt(topic.name, queue.name, topic_log, queue_log)
        if new_log is None:
            return
        new_log.on_readable = topic._pump
        topic.log = new_log
        if topic._pump_timer is not None:
            topic._pump_timer.cancel()
            topic._pump_timer = None
        queue.log = topic_log
        topic_log.on_readable = queue._on_readable
        topic_log.may_hold_deferred = True
        backlog = list(topic.backlog)
        topic.backlog.clear()
        if queue.traced:
            self._trace().queued(queue, backlog)
            self._trace().backlog_taken(queue, topic.name)
        queue.message_count += len(backlog) + topic_log.spilled
        now = self.clock.now()
        for message in backlog:
            if message.due is not None and message.due > now:
                queue._defer(message, message.due)
            else:
                message.due = None
                queue.ready.append(message)
        if queue.ring:
            queue._dispatch()

    def unbind(self, queue_name: str, topic_name: str) -> None:
        queue = self.queues.get(queue_name)
        if queue is not None:
            self._unbind(queue, topic_name)

    def _unbind(self, queue: Queue, topic_name: str) -> None:
        # By object, not by name: `delete_queue` has already removed the queue from `self.queues`.
        topic = self.topics.get(topic_name)
        bound = topic_name in queue.topics
        if bound:
            queue.topics.remove(topic_name)
            if not queue.deleted:
                self._save_queue(queue)
        listed = topic is not None and queue in topic.queues
        if topic is not None and listed:
            topic.queues.remove(queue)
        if bound:
            for observer in self.on_unbound:
                observer(queue, topic_name)
        if topic is not None and listed and topic.ephemeral and not topic.queues and not topic.deleted:
            self.delete_topic(topic_name)

    def set_bindings(self, queue_name: str, topic_names: Iterable[str]) -> None:
        wanted = list(dict.fromkeys(topic_names))
        queue = self.queues[queue_name]
        for topic_name in list(queue.topics):
            if topic_name not in wanted:
                self.unbind(queue_name, topic_name)
        for topic_name in wanted:
            self.bind(queue_name, topic_name)

    def delete_queue(self, name: str) -> bool:
        queue = self.queues.pop(name, None)
        if queue is None:
            return False
        queue.deleted = True
        if queue.traced:
            self._trace().queue_gone(queue, "the queue was deleted")
        for consumer in list(queue.consumers):
            queue._detach(consumer, requeue=False)
            if consumer.on_close is not None:
                consumer.on_close("queue deleted")
        bound = list(queue.topics)
        for topic_name in bound:
            self._unbind(queue, topic_name)
        queue.ready.clear()
        queue.deferred.clear()
        queue.in_flight.clear()
        for timer in (queue._deferred_timer, queue._delete_timer):
            if timer is not None:
                timer.cancel()
        if queue.durable:
            self.storage.queue_deleted(name, queue.log)
        for observer in self.on_queue_deleted:
            observer(queue, bound)
        return True

    def backend(self) -> dict[str, Any]:
        """Where the queues live, for operators (the admin page, /metrics)."""
        return {"kind": "embedded", "persistent": self.storage.persistent}

    def cluster(self) -> ClusterView | None:
        """The nodes and the queues' numbers over all of them, for an engine shared with other nodes; None
        for a node on its own."""
        return None

    def settled(self, callback: Callable[[OSError | None], None]) -> None:
        """Call `callback` once the queues and bindings made so far have taken effect for every client
        (here at once; an engine that shares them with other nodes calls it once they are shared too).
        An adapter that confirms a subscription does so from it."""
        callback(None)

    # -- consumers ---------------------------------------------------------------------------

    def attach(
        self,
        queue_name: str,
        deliver: Deliver,
        *,
        credit: int = 0,
        mode: CreditMode = CreditMode.WINDOW,
        auto_ack: bool = False,
        msg_timeout: float | None = None,
        max_msg_timeout: float | None = None,
        on_close: Callable[[str], None] | None = None,
        tag: Any = None,
        retry_first: bool = False,
        pool: CreditPool | None = None,
        priority: int = 0,
        accept: Accept | None = None,
        client: Client | None = None,
    ) -> Consumer:
        """A consumer of the queue. `accept`, when given, is asked about each copy about to be delivered
        to it (it must not call the engine): a copy it refuses is dropped from the queue, neither
        delivered nor kept (NSQ's sample_rate: a channel client sees a sample, the rest is lost)."""
        queue = self.queues[queue_name]
        consumer = Consumer(queue, deliver, credit=credit, mode=mode, auto_ack=auto_ack,
                            msg_timeout=msg_timeout, max_msg_timeout=max_msg_timeout,
                            on_close=on_close, tag=tag, retry_first=retry_first,
                            pool=pool, priority=priority, accept=accept, client=client)
        queue._attach(consumer)
        return consumer

    # -- publishing --------------------------------------------------------------------------

    def publish_refusal(self, topic_name: str, count: int = 1, client: Client | None = None) -> str | None:
        """Why a publish of `count` messages to `topic_name` (by `client`) must be refused now, or None: a
        queue bound to it that the depth policy keeps full (counted in its `rejected_count`). Adapters ask
        before publishing, beside the store's `failure`, and answer with their protocol's error."""
        limit = self.max_queue_depth
        if not limit or self.overflow != OVERFLOW_REJECT:
            return None
        topic = self.topics.get(topic_name)
        if topic is None:
            return None
        for queue in topic.queues:
            if queue.depth + count > limit:
                queue.rejected_count += count
                return f"queue {queue.name} is full ({queue.depth} messages, the limit is {limit})"
        return None

    def publish(
        self,
        topic_name: str,
        body: bytes,
        *,
        delay: float = 0.0,
        headers: Mapping[str, Any] | None = None,
        ttl: float | None = None,
        drop_if_unbound: bool = False,
        origin: str | None = None,
        client: Client | None = None,
        publisher_id: bytes | None = None,
        traced_id: bytes | None = None,
    ) -> int:
        """Publish one message; returns its id. `drop_if_unbound` applies MQKS's rule; `origin` is
        the protocol it came in by ("nsq", "mqks", …), kept with it; `publisher_id` the id its
        publisher chose (`Message.publisher_id`), kept with it. `client` (who published) and
        `traced_id` (an id the publisher chose that the message does not keep) are only read when
        the topic is traced."""
        message_id = self.ids.next()
        topic = self.topics.get(topic_name)
        if topic is None or not topic.queues:
            if drop_if_unbound:
                self.dropped_count += 1
                if self.tracer is not None:
                    self.tracer.dropped_unbound(topic_name, body, headers, origin, client, message_id, publisher_id)
                return message_id
            if topic is None:
                topic = self.ensure_topic(topic_name, origin=origin)
        # The monotonic clock only for a TTL or a delay: most publishes have neither.
        message = Message(message_id, body, self.clock.wall_ns(), headers,
                          None if ttl is None else self.clock.now() + ttl, 0, topic_name, origin, publisher_id)
        if delay > 0:
            message.due = self.clock.now() + delay
        if topic.traced:
            self._trace().published(topic, [message], client, traced_id)
        self._publish_messages(topic, [message])
        return message_id

    def publish_many(
        self,
        topic_name: str,
        bodies: list[bytes],
        *,
        headers: Mapping[str, Any] | None = None,
        each_headers: list[Mapping[str, Any]] | None = None,
        each_publisher_id: list[bytes] | None = None,
        drop_if_unbound: bool = False,
        origin: str | None = None,
        client: Client | None = None,
    ) -> int:
        """Publish a batch in order (NSQ MPUB, consecutive MQKS publishes); returns the first id.

        `each_headers` gives every message its own headers (else they share `headers`),
        `each_publisher_id` its own `publisher_id`; `drop_if_unbound` applies MQKS's rule to the
        whole batch."""
        first = self.ids.reserve(len(bodies) or 1)  # an empty batch still spends the id it returns
        if drop_if_unbound:
            topic_or_none = self.topics.get(topic_name)
            if topic_or_none is None or not topic_or_none.queues:
                self.dropped_count += len(bodies)
                if self.tracer is not None:
                    for index, body in enumerate(bodies):
                        self.tracer.dropped_unbound(topic_name, body, each_headers[index] if each_headers else headers,
                                                    origin, client, first + index,
                                                    each_publisher_id[index] if each_publisher_id else None)
                return first
        topic = self.ensure_topic(topic_name, origin=origin)
        timestamp = self.clock.wall_ns()
        if each_headers is None and each_publisher_id is None:
            messages = [Message(first + index, body, timestamp, headers, None, 0, topic_name, origin)
                        for index, body in enumerate(bodies)]
        else:
            headers_of: Sequence[Mapping[str, Any] | None] = (each_headers if each_headers is not None
                                                              else [headers] * len(bodies))
            ids_of: Sequence[bytes | None] = (each_publisher_id if each_publisher_id is not None
                                              else [None] * len(bodies))
            messages = [Message(first + index, body, timestamp, message_headers, None, 0, topic_name, origin,
                                publisher_id)
                        for index, (body, message_headers, publisher_id)
                        in enumerate(zip(bodies, headers_of, ids_of, strict=True))]
        if topic.traced:
            self._trace().published(topic, messages, client)
        self._publish_messages(topic, messages)
        return first

    def _publish_messages(self, topic: Topic, messages: list[Message]) -> None:
        topic.message_count += len(messages)
        topic.message_bytes += sum(len(message.body) for message in messages)
        if topic._holds():
            if topic.traced:
                self._trace().kept(topic, messages)
            topic._keep(messages)
        else:
            self._distribute(topic, messages)
            if self.max_queue_depth and self.overflow == OVERFLOW_DROP_OLDEST:
                for queue in topic.queues:
                    excess = queue.depth - self.max_queue_depth
                    if excess > 0:
                        queue._drop_oldest(excess)

    def _distribute(self, topic: Topic, messages: list[Message]) -> None:
        queues = topic.queues
        for index, queue in enumerate(queues):
            # The last queue takes the original objects; the others get copies.
            copies = messages if index == len(queues) - 1 else [m.copy() for m in messages]
            if queue.traced:
                self._trace().queued(queue, messages)  # the originals: copies are made without their due time
            if len(copies) == 1:
                message = copies[0]
                due = messages[0].due
                queue._put(message, due)
            elif all(m.due is None for m in copies):
                queue._put_many(copies)
            else:
                for copy, original in zip(copies, messages, strict=True):
                    queue._put(copy, original.due)

    # -- restart -----------------------------------------------------------------------------

    def restore(self) -> None:
        """Bring back what the storage kept: topics, queues, bindings, options, pause state, messages."""
        snapshot = self.storage.load(self.ids)
        now = self.clock.now()
        for record in snapshot.topics:
            topic = Topic(self, record.name, ephemeral=False, made_by=record.made_by)
            topic.paused = record.paused
            topic.log = record.log
            topic.log.on_readable = topic._pump
            # One backlog in log order, deferred copies among the others as they were published.
            topic.backlog.extend(sorted(record.log.recovered_ready + record.log.recovered_deferred,
                                        key=lambda message: message.pos))
            record.log.recovered_ready = record.log.recovered_deferred = []
            self.topics[record.name] = topic
        for stored in snapshot.queues:
            options = dict(stored.options)
            auto_delete = options.pop("auto_delete", None)
            recorded = OWNER_RECORD_KEY in options
            queue = Queue(self, stored.name, ephemeral=False, auto_delete=auto_delete,
                          owner_topic=options.pop(OWNER_RECORD_KEY, None), options=options)
            queue.owner_topic_recorded = recorded
            queue.paused = stored.paused
            queue.log = stored.log
            queue.log.on_readable = queue._on_readable
            queue.ready.extend(stored.log.recovered_ready)
            if queue.stream:
                # Positions never go back: not even below what the reader committed before.
                stored.log.start_after(int(options.get(STREAM_COMMITTED_OPTION, 0)) - 1)
            for message in stored.log.recovered_deferred:
                queue._defer(message, message.due if message.due is not None else now)
            stored.log.recovered_ready = stored.log.recovered_deferred = []
            self.queues[stored.name] = queue
            for topic_name in stored.topics:
                # Every durable topic has a record: a binding to any other was to an ephemeral topic.
                topic = self.topics.get(topic_name) or self.ensure_topic(topic_name, ephemeral=True)
                queue.topics.append(topic_name)
                topic.queues.append(queue)
            if queue.auto_delete is not None:
                # Nobody is attached after a restart: the auto-delete countdown starts now.
                queue._delete_timer = self.timers.schedule(now + queue.auto_delete, queue._auto_delete)
        for topic in self.topics.values():
            topic._flush_backlog()
        self.schedules.restore(snapshot.kept.get(KEPT_SCHEDULE, ()))
        self.dedup.restore(snapshot.kept.get(KEPT_DEDUP, ()))

    # -- the timer task's entry point ----------------------------------------------------------

    def run_timers(self) -> int:
        return self.timers.run_due(self.clock.now())
