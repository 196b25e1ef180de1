"""Tracing: the life of each message of a traced topic, as events (docs/operations.md, "Tracing a topic").

The engine calls a `Tracer` where a message's life moves on (published, put in a queue, delivered,
finished, requeued, timed out, touched, returned, expired, dead-lettered, dropped, deleted), but
only where a topic or queue says it is traced (`Topic.traced`, `Queue.traced`): with nothing
traced the engine pays one flag check per event and builds nothing. A message is traced when it
is published to a topic named by `Tracer.trace`; its later events are recorded wherever it goes
(a dead-letter topic and its queues included), by its engine id, which every copy and dead letter
keeps.

Each traced topic keeps its messages' events in a ring of `ring_size` events (the oldest dropped and
counted) and at most `ring_size` messages. Every event carries the message's engine id and the id
each protocol shows for it (`shown_ids`, one renderer per protocol, given by the gateway), so a
client's log line of any protocol finds it. Bodies are kept only up to `body_prefix` bytes.
Everything here lives in memory: a restart starts with empty rings.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

import attrs

from polymq.core.message import Message

if TYPE_CHECKING:
    from polymq.core.engine import Consumer, Engine, Queue, Topic

# The events, as the API and the trace topic name them.
PUBLISHED = "published"
KEPT = "kept"  # in the topic's backlog: no queue bound yet, or the topic is paused
QUEUED = "queued"
DELIVERED = "delivered"
FINISHED = "finished"
REQUEUED = "requeued"
TIMED_OUT = "timed_out"
TOUCHED = "touched"
RETURNED = "returned"  # its consumer went away while it was in flight
EXPIRED = "expired"
DEAD_LETTERED = "dead_lettered"
DROPPED = "dropped"
DELETED = "deleted"  # with its queue, or its queue or topic emptied

# Where a copy is, after its latest event (`Traced.places`).
READY = "ready"
IN_FLIGHT = "in flight"
DEFERRED = "deferred"
GONE = "gone"  # finished, expired, dead-lettered, dropped or deleted: nothing of it left there

# Where a copy is after each kind of event another node tells (`Tracer.absorb`); None: no place changes.
STATES: dict[str, str | None] = {
    PUBLISHED: None, KEPT: READY, QUEUED: READY, DELIVERED: IN_FLIGHT, FINISHED: GONE, REQUEUED: READY,
    TIMED_OUT: READY, TOUCHED: IN_FLIGHT, RETURNED: READY, EXPIRED: GONE, DEAD_LETTERED: GONE, DROPPED: GONE,
    DELETED: GONE,
}

# The default ring: events kept per traced topic (about 6 per message that is consumed once).
DEFAULT_RING_SIZE = 10_000
# Events `Tracer.recent` lists per topic at most: a page's worth.
RECENT_LIMIT = 50
# Timelines a search returns at most.
FOUND_LIMIT = 20


@attrs.define(slots=True, eq=False)
class Client:
    """Who published or consumed: the protocol, the client's address and its name (NSQ's client_id, a
    ZeroMQ identity, an MQKS consumer id), as the adapter knows them. All client-chosen text."""

    protocol: str
    address: str = ""
    name: str = ""
    # Its protocol acknowledges no publish, so the delivery of a later one is all the proof a client
    # has of the earlier ones: an engine whose topics are stored apart (shared) stores its publishes
    # in its order across topics.
    publishes_in_order: bool = False


@attrs.define(slots=True, eq=False)
class TopicRing:
    """A traced topic's events (bounded), and its traced messages (bounded)."""

    name: str
    size: int
    events: deque[Event]
    # Oldest first; an OrderedDict drops its oldest in O(1) (a dict's first key slows down as its
    # deleted slots pile up in front).
    messages: OrderedDict[int, Traced] = attrs.Factory(OrderedDict)
    recorded: int = 0  # events recorded, dropped ones included
    dropped: int = 0  # events pushed out of the full ring

    def add(self, event: Event) -> None:
        if len(self.events) == self.size:
            self.dropped += 1
        self.events.append(event)
        self.recorded += 1


ShownId = Callable[[Message], str]


# Defined before `Traced`, whose `tracer` field names it: compiled, a class's field annotations
# are built when the class is, and a native class defined later is not there yet.
class Tracer:
    def __init__(self, engine: Engine, shown_ids: Mapping[str, ShownId], *, ring_size: int = DEFAULT_RING_SIZE,
                 body_prefix: int = 0, node: str = "") -> None:
        self.engine = engine
        self.shown_ids = dict(shown_ids)
        self.ring_size = ring_size
        self.body_prefix = body_prefix
        self.node = node
        self.topics: set[str] = set()  # traced: a publish there starts a message's trace
        self.refused: set[str] = set()  # never traced (the trace topic itself)
        self.rings: dict[str, TopicRing] = {}  # kept after tracing stops, until traced again
        self.live: dict[int, Traced] = {}
        self.listeners: list[Callable[[Event], None]] = []  # each event, as it is recorded
        # Each switch made here (not one another node told): (topic, traced), for the nodes sharing its queues.
        self.switched: list[Callable[[str, bool], None]] = []
        # On nodes sharing their queues: a message of a traced topic published through another node is traced
        # here from its first event here. A node on its own traces from the publish only.
        self.adopts = False
        self._seq = itertools.count(1)
        engine.on_topic_created.append(self._topic_created)

    # -- switching ------------------------------------------------------------------------------

    def trace(self, name: str, *, told: bool = False) -> None:
        """Trace the topic `name` (made or not yet): its next publishes are traced. `told`: another node
        switched it on."""
        if name in self.refused:
            raise ValueError(f"topic {name!r} cannot be traced")
        if not told:
            for listener in self.switched:
                listener(name, True)
        self.topics.add(name)
        ring = self.rings.get(name)
        if ring is None or ring.size != self.ring_size:
            self.rings[name] = TopicRing(name, self.ring_size, deque(maxlen=self.ring_size))
        topic = self.engine.topics.get(name)
        if topic is not None:
            self._follow(topic)
        self.engine.tracer = self

    def untrace(self, name: str, *, told: bool = False) -> None:
        """Stop tracing `name`: its ring stays readable; its messages' later events are not recorded."""
        if not told:
            for listener in self.switched:
                listener(name, False)
        self.topics.discard(name)
        ring = self.rings.get(name)
        if ring is not None:
            for message_id in ring.messages:
                self.live.pop(message_id, None)
            ring.messages = OrderedDict()
        self._refresh()

    def _refresh(self) -> None:
        """Flags as the traced topics and the places their live messages reached say."""
        engine = self.engine
        followed = set(self.topics)
        for traced in self.live.values():
            followed.update(name for kind, name in traced.places if kind == "topic")
        queues = {name for traced in self.live.values() for kind, name in traced.places if kind == "queue"}
        for topic in engine.topics.values():
            topic.traced = topic.name in followed
        for queue in engine.queues.values():
            queue.traced = queue.name in queues or any(name in followed for name in queue.topics)
        engine.tracer = self if self.topics else None

    def _topic_created(self, topic: Topic) -> None:
        if topic.name in self.topics:
            self._follow(topic)

    @staticmethod
    def _follow(topic: Topic) -> None:
        topic.traced = True
        for queue in topic.queues:
            queue.traced = True

    # -- recording --------------------------------------------------------------------------------

    def _shown(self, message: Message) -> dict[str, str]:
        ids: dict[str, str] = {}
        for protocol, shown in self.shown_ids.items():
            try:
                ids[protocol] = shown(message)
            except Exception:  # a renderer's bug must cost its id, not the search or the trace topic
                ids[protocol] = ""
        return ids

    def _record(self, traced: Traced, kind: str, **fields: Any) -> None:
        event = Event(next(self._seq), self.engine.clock.wall_ns(), kind, traced, **fields)
        traced.ring.add(event)
        place = _place(event)
        if place is not None:
            traced.place_at[place] = event.time_ns
        for listener in self.listeners:
            listener(event)

    def _start(self, message: Message) -> Traced | None:
        topic = message.topic or ""
        ring = self.rings.get(topic)
        if ring is None or topic not in self.topics:
            return None
        shape = Message(message.id, b"", 0, message.headers, None, 0, message.topic, message.origin,
                        message.publisher_id)
        traced = Traced(message.id, topic, message.origin, shape, self, len(message.body),
                        message.body[:self.body_prefix] if self.body_prefix else b"", ring)
        messages = ring.messages
        messages[message.id] = traced
        self.live[message.id] = traced
        if len(messages) > ring.size:
            oldest, _ = messages.popitem(last=False)
            self.live.pop(oldest, None)
        return traced

    def _traced(self, message: Message) -> Traced | None:
        """The message's trace: begun here at its publish, or, for a message of a traced topic published
        through another node that shares the queues, at its first event here."""
        traced = self.live.get(message.id)
        if traced is None and self.adopts and message.topic in self.topics:
            traced = self._start(message)
        return traced

    def published(self, topic: Topic, messages: list[Message], client: Client | None,
                  traced_id: bytes | None = None) -> None:
        """`traced_id`: an id its publisher chose that the message does not keep (PZQ's, eMQP pub/sub's)."""
        for message in messages:
            traced = self._start(message) if topic.name in self.topics else None
            if traced is None:
                continue
            shown = traced_id.decode("utf-8", "backslashreplace") if traced_id is not None else None
            self._record(traced, PUBLISHED, topic=topic.name, client=client, publisher_id=shown)

    def dropped_unbound(self, topic_name: str, body: bytes, headers: Mapping[str, Any] | None, origin: str | None,
                        client: Client | None, message_id: int, publisher_id: bytes | None = None) -> None:
        """A publish dropped because no queue is bound (MQKS's rule): traced, then dropped at once."""
        if topic_name not in self.topics:
            return
        traced = self._start(Message(message_id, body, 0, headers, None, 0, topic_name, origin, publisher_id))
        if traced is not None:
            self._record(traced, PUBLISHED, topic=topic_name, client=client)
            self._record(traced, DROPPED, topic=topic_name, reason="no queue is bound to the topic")

    def kept(self, topic: Topic, messages: Iterable[Message]) -> None:
        for message in messages:
            traced = self._traced(message)
            if traced is not None:
                traced.places["topic", topic.name] = READY
                self._record(traced, KEPT, topic=topic.name,
                             reason="the topic is paused" if topic.paused else "no queue is bound to the topic")

    def queued(self, queue: Queue, messages: Iterable[Message]) -> None:
        for message in messages:
            traced = self._traced(message)
            if traced is not None:
                for place, state in traced.places.items():
                    if place[0] == "topic" and state == READY and place[1] in queue.topics:
                        traced.places[place] = GONE  # passed on from the backlog
                now = self.engine.clock.now()
                delay = message.due - now if message.due is not None and message.due > now else None
                traced.places["queue", queue.name] = DEFERRED if delay is not None else READY
                self._record(traced, QUEUED, queue=queue.name, delay_s=None if delay is None else round(delay, 3))

    def revived(self, queue: Queue, messages: Iterable[Message], holders: Iterable[tuple[str, str]]) -> None:
        """Dead letters put back into their queue (the admin page's action): gone from every place that
        held them (`holders`: the dead-letter topic and the queues bound to it), queued again."""
        held_in = set(holders)
        for message in messages:
            traced = self.live.get(message.id)
            if traced is None:
                continue
            for place in held_in & traced.places.keys():
                traced.places[place] = GONE
            traced.places["queue", queue.name] = READY
            self._record(traced, QUEUED, queue=queue.name, reason="put back from its dead letters")

    def backlog_taken(self, queue: Queue, topic: str) -> None:
        """A topic's backlog went to its first queue, the part spilled to disk too (read back later, no
        event then): every traced copy still kept in the topic is queued now."""
        for traced in list(self.live.values()):
            if traced.places.get(("topic", topic)) == READY:
                traced.places["topic", topic] = GONE
                traced.places["queue", queue.name] = READY
                self._record(traced, QUEUED, queue=queue.name)

    def delivered(self, queue: Queue, consumer: Consumer, message: Message) -> None:
        traced = self._traced(message)
        if traced is None:
            return
        self._record(traced, DELIVERED, queue=queue.name, client=consumer.client, attempt=message.attempts)
        if consumer.auto_ack:
            traced.places["queue", queue.name] = GONE
            self._record(traced, FINISHED, queue=queue.name, client=consumer.client, attempt=message.attempts,
                         reason="acknowledged as it was sent (auto-ack)")
        else:
            traced.places["queue", queue.name] = IN_FLIGHT

    def _moved(self, queue: Queue, consumer: Consumer | None, message: Message, kind: str, state: str,
               **fields: Any) -> None:
        traced = self._traced(message)
        if traced is None:
            return
        traced.places["queue", queue.name] = state
        self._record(traced, kind, queue=queue.name, client=None if consumer is None else consumer.client,
                     attempt=message.attempts, **fields)

    def finished(self, queue: Queue, consumer: Consumer | None, message: Message) -> None:
        self._moved(queue, consumer, message, FINISHED, GONE)

    def requeued(self, queue: Queue, consumer: Consumer | None, message: Message, delay: float) -> None:
        self._moved(queue, consumer, message, REQUEUED, DEFERRED if delay > 0 else READY,
                    delay_s=delay if delay > 0 else None)

    def timed_out(self, queue: Queue, consumer: Consumer, message: Message) -> None:
        traced = self._traced(message)
        if traced is not None:
            traced.timeouts[queue.name] = traced.timeouts.get(queue.name, 0) + 1
        self._moved(queue, consumer, message, TIMED_OUT, READY)

    def touched(self, queue: Queue, consumer: Consumer, message: Message) -> None:
        self._moved(queue, consumer, message, TOUCHED, IN_FLIGHT)

    def returned(self, queue: Queue, consumer: Consumer, message: Message) -> None:
        self._moved(queue, consumer, message, RETURNED, READY, reason="its consumer went away")

    def expired(self, queue: Queue, message: Message) -> None:
        self._moved(queue, None, message, EXPIRED, GONE, reason="its TTL ran out before a delivery")

    def dropped(self, queue: Queue, message: Message, reason: str) -> None:
        self._moved(queue, None, message, DROPPED, GONE, reason=reason)

    def dead_lettered(self, queue: Queue, message: Message, reason: str, topic: Topic) -> None:
        traced = self._traced(message)
        if traced is None:
            return
        self._follow(topic)  # its letter's life is the message's too
        self._moved(queue, None, message, DEAD_LETTERED, GONE, reason=reason, topic=topic.name)

    def queue_gone(self, queue: Queue, reason: str) -> None:
        """The queue was deleted or emptied: what of its traced messages was there is gone."""
        self._gone(("queue", queue.name), reason)

    def topic_gone(self, topic: Topic, reason: str) -> None:
        self._gone(("topic", topic.name), reason)

    def _gone(self, place: tuple[str, str], reason: str) -> None:
        kind, name = place
        for traced in list(self.live.values()):
            state = traced.places.get(place)
            if state is not None and state != GONE:
                traced.places[place] = GONE
                self._record(traced, DELETED, reason=reason, **{kind: name})

    # -- reading ----------------------------------------------------------------------------------

    def find(self, text: str) -> list[Traced]:
        """The traced messages one of whose ids is `text` (the engine's in decimal or hex too), or whose
        kept body prefix starts with it; newest first."""
        text = text.strip()
        if not text:
            return []
        wanted = {text, text.lower()}
        number = _number(text)
        prefix = text.encode()[:self.body_prefix] if self.body_prefix else b""
        found: list[Traced] = []
        for ring in self.rings.values():
            for traced in _messages(ring):
                if (traced.id == number or wanted.intersection(traced.ids.values())
                        or (prefix and traced.body_prefix.startswith(prefix))):
                    found.append(traced)
        found.sort(key=lambda traced: traced.id, reverse=True)
        return found[:FOUND_LIMIT]

    @staticmethod
    def timeline(traced: Traced) -> list[Event]:
        """Its events in the order they happened (another node's come when it tells them: by their time)."""
        return sorted((event for event in traced.ring.events if event.message is traced),
                      key=lambda event: event.time_ns)

    # -- other nodes' events ------------------------------------------------------------------------

    def absorb(self, found: Mapping[str, Any]) -> bool:
        """An event another node sharing the queues recorded (as `event_json` gave it), into this node's ring
        of its topic, so a timeline here shows the whole path; False for one that is not an event of a topic
        traced here."""
        try:
            kind, topic, node = found["event"], found["traced_topic"], found["node"]
            message_id, time_ns, seq = found["message_id"], found["time_ns"], found["seq"]
            ids = found.get("ids") or {}
            if not (isinstance(kind, str) and kind in STATES and isinstance(topic, str) and isinstance(node, str)
                    and all(isinstance(n, int) and not isinstance(n, bool) for n in (message_id, time_ns, seq))
                    and isinstance(ids, dict) and all(isinstance(v, str) for v in ids.values())):
                return False
            fields = {key: found.get(key) for key in ("queue", "topic", "reason", "publisher_id")}
            if not all(value is None or isinstance(value, str) for value in fields.values()):
                return False
            attempt, delay = found.get("attempt"), found.get("delay_s")
            if not (attempt is None or isinstance(attempt, int)) or \
                    not (delay is None or isinstance(delay, int | float)):
                return False
        except (KeyError, TypeError):
            return False
        ring = self.rings.get(topic)
        if ring is None or topic not in self.topics:
            return False
        traced = ring.messages.get(message_id)
        if traced is None:
            traced = Traced(message_id, topic, None, None, self, 0, b"", ring, ids={str(k): v for k, v in ids.items()})
            ring.messages[message_id] = traced
            self.live[message_id] = traced
            if len(ring.messages) > ring.size:
                oldest, _ = ring.messages.popitem(last=False)
                self.live.pop(oldest, None)
        if kind == PUBLISHED:
            traced.origin = found.get("protocol") if isinstance(found.get("protocol"), str) else None
            traced.size = found["size"] if isinstance(found.get("size"), int) else 0
        protocol = found.get("protocol")
        client = Client(protocol, str(found.get("client", "")), str(found.get("client_name", ""))) \
            if isinstance(protocol, str) and "client" in found else None
        event = Event(seq, time_ns, kind, traced, fields["queue"], fields["topic"], client, attempt,
                      delay, fields["reason"], fields["publisher_id"], node)
        ring.add(event)
        state, place = STATES[kind], _place(event)
        if place is not None and time_ns >= traced.place_at.get(place, 0):
            traced.place_at[place] = time_ns
            if state is not None:
                traced.places[place] = DEFERRED if kind in (QUEUED, REQUEUED) and delay else state
        if kind == TIMED_OUT and fields["queue"] is not None:
            traced.timeouts[fields["queue"]] = traced.timeouts.get(fields["queue"], 0) + 1
        return True

    def recent(self, topic: str, limit: int = RECENT_LIMIT) -> list[Traced]:
        ring = self.rings.get(topic)
        if ring is None:
            return []
        return list(_messages(ring))[-limit:][::-1]


@attrs.define(slots=True, eq=False)
class Traced:
    """One traced message: what every one of its events carries, and where its copies are."""

    id: int
    topic: str  # the traced topic it was published to: its events go to that topic's ring
    origin: str | None  # the protocol it was published by
    # What the protocols' ids are made of (id, headers, origin; no body), until `ids` is first read.
    shape: Message | None
    tracer: Tracer
    size: int
    body_prefix: bytes
    ring: TopicRing
    # (kind, name) -> READY / IN_FLIGHT / DEFERRED / GONE; kind is "queue" or "topic" (a backlog)
    places: dict[tuple[str, str], str] = attrs.Factory(dict)
    timeouts: dict[str, int] = attrs.Factory(dict)  # by queue
    # When the last event at each place happened (wall ns): another node's older event does not move it.
    place_at: dict[tuple[str, str], int] = attrs.Factory(dict)
    _ids: dict[str, str] | None = None

    @property
    def ids(self) -> dict[str, str]:
        """By protocol, the id that protocol shows its clients: made when first asked for (a search, the
        trace topic), never on the traced path."""
        if self._ids is None:
            shape = self.shape
            self._ids = {} if shape is None else self.tracer._shown(shape)
            self.shape = None
        return self._ids


@attrs.define(slots=True, eq=False)
class Event:
    seq: int  # order of events on this node
    time_ns: int  # wall clock
    kind: str
    message: Traced
    queue: str | None = None  # the queue it happened in (None: a topic's)
    topic: str | None = None  # the topic it happened in, when not a queue (published, kept, dead letters' topic)
    client: Client | None = None
    attempt: int | None = None
    delay_s: float | None = None
    reason: str | None = None
    publisher_id: str | None = None  # published: the id its publisher was shown (or chose)
    node: str | None = None  # the node it happened on, when another node told it (None: this one)


def _place(event: Event) -> tuple[str, str] | None:
    """Where the event happened: its queue, else its topic."""
    if event.queue is not None:
        return ("queue", event.queue)
    return None if event.topic is None else ("topic", event.topic)


def _messages(ring: TopicRing) -> list[Traced]:
    """The messages of a ring with at least one event left in it, oldest first."""
    seen: dict[int, Traced] = {}
    for event in ring.events:
        seen.setdefault(event.message.id, event.message)
    return list(seen.values())


def _number(text: str) -> int | None:
    """The engine id `text` may be: decimal, or hex (NSQ's 16 digits, PHPMQ's 32)."""
    if text.isdecimal():
        return int(text)
    try:
        return int(text, 16) if len(text) in (16, 32) else None
    except ValueError:
        return None


def gaps(events: list[Event]) -> list[str]:
    """What a timeline leaves open, in words: copies delivered and never finished, dead letters waiting,
    copies still waiting, timeouts that repeat; empty when every copy came to an end."""
    if not events:
        return []
    traced = events[0].message
    dead_topics: set[str] = set()
    dead_queues: set[str] = set()  # got their copy as a dead letter
    last_delivery: dict[str, Event] = {}
    for event in events:
        if event.kind == DEAD_LETTERED and event.topic is not None:
            dead_topics.add(event.topic)
        elif event.kind == QUEUED and event.queue is not None and dead_topics:
            dead_queues.add(event.queue)
        elif event.kind == DELIVERED and event.queue is not None:
            last_delivery[event.queue] = event
    found: list[str] = []
    for (kind, name), state in traced.places.items():
        if state == IN_FLIGHT and name in last_delivery:
            delivery = last_delivery[name]
            found.append(f"delivered in {name}{_who(delivery.client)} (attempt {delivery.attempt}) and not finished")
        elif state in (READY, DEFERRED) and kind == "topic" and name in dead_topics:
            found.append(f"sitting in dead-letter topic {name}: no queue reads it")
        elif state in (READY, DEFERRED) and name in dead_queues:
            found.append(f"sitting in {name}, a queue of dead letters")
        elif state in (READY, DEFERRED):
            found.append(f"waiting in {kind} {name}" + (" (deferred)" if state == DEFERRED else ""))
    for name, count in traced.timeouts.items():
        if count >= 2:
            found.append(f"timed out {count} times in {name}")
    return found


def _who(client: Client | None) -> str:
    if client is None:
        return ""
    return f" to {client.protocol} client {client.name or client.address}"


def event_json(event: Event, node: str) -> dict[str, Any]:
    """An event as the API and the trace topic show it: only what it has, client-chosen text as it came."""
    traced = event.message
    found: dict[str, Any] = {"seq": event.seq, "time_ns": event.time_ns, "event": event.kind,
                             "node": event.node or node,
                             "traced_topic": traced.topic, "message_id": traced.id, "ids": traced.ids}
    if event.queue is not None:
        found["queue"] = event.queue
    if event.topic is not None:
        found["topic"] = event.topic
    client = event.client
    if client is not None:
        found["protocol"] = client.protocol
        found["client"] = client.address
        found["client_name"] = client.name
    if event.attempt is not None:
        found["attempt"] = event.attempt
    if event.delay_s is not None:
        found["delay_s"] = event.delay_s
    if event.reason is not None:
        found["reason"] = event.reason
    if event.kind == PUBLISHED:
        found.setdefault("protocol", traced.origin)
        found["size"] = traced.size
        # The id its publisher chose or was shown: given by the adapter, else its protocol's own.
        found["publisher_id"] = (event.publisher_id if event.publisher_id is not None
                                 else traced.ids.get(traced.origin or ""))
        if traced.body_prefix:
            found["body_prefix"] = traced.body_prefix.decode("utf-8", "backslashreplace")
    return found
