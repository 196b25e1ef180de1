"""Snapshots of a queue on JetStream (the Spark source's batch reads, `/stream/snapshot`): every message the
queue holds now, whichever node holds it, without taking any.

A queue's messages are in three places:

- **Not given out yet**: the topic's stream after what the queue's consumer has delivered, on the topic's
  subject and the queue's own (copies put back at its tail), read with batched direct gets.
- **Given out, not answered**: held by nodes, in flight to their clients or fetched and waiting for credit, or
  given back (`-NAK`, with a delay or not: JetStream counts them as given out until it gives them again). A
  node remembers what it gave back until it is due and DELAYED_GRACE_S more, for as long as no node has a
  consumer of the queue (nothing can take it then). Every node is asked
  (`polymq.holdings.<queue token>`) and answers with the stream sequences and attempts it holds; the bodies
  are read from the stream by sequence (a message stays there until its queue answers for it).
- **Deferred publishes** to the queue's topics, in the deferred stream until due.

JetStream counts what a consumer gave out and was not answered (`num_ack_pending`). When the nodes account
for fewer, the rest were given to a node that went away (JetStream gives them again after its ack wait) or
are between two nodes: asked again for SETTLE_S, then refused, since a part of a queue answered as the
whole would be wrong without a word. Rows come in the embedded store's order: in flight, ready (by sequence),
deferred (by due time). A quiet queue's snapshot is exact; of a queue that moves while it is taken, a
message delivered or answered meanwhile may be in it or not (no message is in it twice).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import attrs
import trio

from polymq.core.message import Message
from polymq.core.shared import SharedQueue
from polymq.core.streams import MESSAGE_OVERHEAD, SnapshotTooLarge, StreamError
from polymq.jetstream import api, deferred
from polymq.jetstream.nats_connection import Msg, NatsError, RequestTimeout
from polymq.jetstream.reports import REPORT_LAPSE_S
from polymq.jetstream.streams import DIRECT_BATCH, allow_direct, direct_get, leader_first_at

if TYPE_CHECKING:
    from polymq.jetstream.backend import JetStreamLink

log = logging.getLogger("polymq.jetstream")

HOLDINGS_PREFIX = "polymq.holdings."
# Entries of one node's answer per message: well under NATS's default max_payload (1 MB) at ~60 bytes each.
HOLDINGS_PER_ANSWER = 5000
# How long the nodes heard from are waited for; one that does not answer leaves its part unaccounted.
GATHER_S = 2.0
# A snapshot whose nodes account for less than JetStream gave out is asked again this often, this long, before
# it is refused (what a node that went away held comes back after the ack wait, 60 s by default).
SETTLE_S = 5.0
SETTLE_RETRY_S = 0.1
# A queue no read of the cluster has shown yet is looked for this long: every topic is read again within a second
# (jetstream/topology.py's REFRESH_S), sooner on JetStream's advisory of its consumer.
FOLLOW_S = 2.0
# A node forgets what it gave back this long after it was due, while some node has a consumer of the queue: JetStream
# gives it again at once to a node that asks, which then holds it.
DELAYED_GRACE_S = 1.0
# Given-back messages between two prunings of what every queue remembers.
PRUNE_EVERY = 1024

IN_FLIGHT, READY, DELAYED = "in_flight", "ready", "delayed"
STATE_ORDER = {IN_FLIGHT: 0, READY: 1, DELAYED: 2}


@attrs.frozen(slots=True)
class Held:
    """A message a node holds of a queue: in the topic's stream at `seq`."""

    topic: str
    seq: int
    attempts: int
    state: str  # IN_FLIGHT, READY or DELAYED
    due_ns: int = 0  # wall clock, for DELAYED


@attrs.frozen(slots=True)
class Delivered:
    """A queue's consumer of one topic, as JetStream counts it."""

    delivered: int  # the highest stream sequence it gave out
    ack_pending: int
    floor: int  # stream sequences up to it were emptied from the queue


class QueueSnapshots:
    """This node's answers to the others' questions, and the snapshots it takes (see the module's text)."""

    def __init__(self, link: JetStreamLink) -> None:
        self.link = link
        self.connection = link.connection
        # Given back with a delay by this node, until due: queue -> (topic, seq) -> (attempts, due wall ns).
        self.delayed: dict[str, dict[tuple[str, int], tuple[int, int]]] = {}
        self._given_back = 0
        self.taken = 0
        self.refused = 0  # snapshots refused: a part of the queue unaccounted for

    def subscribe(self) -> None:
        self.connection.subscribe(HOLDINGS_PREFIX + "*", self._on_asked)

    # -- what this node holds ----------------------------------------------------------------------

    def given_back(self, queue: str, handle: str, attempts: int, delay_s: float) -> None:
        place = _place(handle)
        if place is not None:
            due = self.link.clock.wall_ns() + int(delay_s * 1e9)
            self.delayed.setdefault(queue, {})[place] = (attempts, due)
        self._given_back += 1
        if self._given_back % PRUNE_EVERY == 0:  # what was given again on other nodes goes from here too
            for name in list(self.delayed):
                self._prune(name)

    def given_again(self, queue: str, topic: str, seq: int) -> None:
        held = self.delayed.get(queue)
        if held is not None and held.pop((topic, seq), None) is not None and not held:
            del self.delayed[queue]

    def holdings(self, name: str) -> list[Held]:
        found: list[Held] = []
        engine = self.link.engine
        queue = engine.queue(name) if engine is not None else None
        if isinstance(queue, SharedQueue):
            for state, messages in ((IN_FLIGHT, queue.in_flight.values()), (READY, queue.ready)):
                for message in messages:
                    place = _place(queue.handles.get(message.id))
                    if place is not None:
                        found.append(Held(place[0], place[1], message.attempts, state))
        self._prune(name)
        delayed = self.delayed.get(name, {})
        found += [Held(topic, seq, attempts, DELAYED, due) for (topic, seq), (attempts, due) in delayed.items()]
        return found

    def _prune(self, name: str) -> None:
        delayed = self.delayed.get(name)
        if delayed and not self._exists(name):
            del self.delayed[name]  # the queue is gone from the cluster
            return
        if delayed and self._consumed_anywhere(name):
            forget = self.link.clock.wall_ns() - int(DELAYED_GRACE_S * 1e9)
            for key in [key for key, (_, due) in delayed.items() if due < forget]:
                del delayed[key]
            if not delayed:
                del self.delayed[name]

    def _exists(self, name: str) -> bool:
        """Whether the queue is this node's, or in the cluster as last read (a queue this node made may not be in
        a read yet: under load the next one can be seconds away)."""
        engine = self.link.engine
        if engine is not None and engine.queue(name) is not None:
            return True
        return any(name in consumers for consumers in self.link.topology.read.values())

    def _consumed_anywhere(self, name: str) -> bool:
        """Whether this node, or a node heard from, has a consumer of the queue."""
        engine = self.link.engine
        queue = engine.queue(name) if engine is not None else None
        if queue is not None and queue.consumers:
            return True
        now = self.link.clock.now()
        return any(now - heard.at <= REPORT_LAPSE_S and heard.parts.get(name, None) is not None
                   and heard.parts[name].consumers > 0 for heard in self.link.reports.heard.values())

    def _on_asked(self, msg: Msg) -> None:
        if msg.reply is None:
            return
        try:
            name = api.untoken(msg.subject[len(HOLDINGS_PREFIX):])
        except (ValueError, UnicodeDecodeError):
            return
        engine = self.link.engine
        node = engine.node if engine is not None else 0
        held = [[h.topic, h.seq, h.attempts, h.state, h.due_ns] for h in self.holdings(name)]
        parts = max(1, -(-len(held) // HOLDINGS_PER_ANSWER))
        try:
            for part in range(parts):
                chunk = held[part * HOLDINGS_PER_ANSWER:(part + 1) * HOLDINGS_PER_ANSWER]
                self.connection.publish(msg.reply, json.dumps(
                    {"node": node, "part": part, "parts": parts, "held": chunk}, separators=(",", ":")).encode())
        except NatsError as error:
            log.debug("holdings of %r not sent: %s", name, error)

    # -- taking a snapshot -----------------------------------------------------------------------------

    async def take(self, name: str, max_bytes: int) -> tuple[list[Message], int, str]:
        """Every message queue `name` holds (module's text), the memory they take, and the key every node of
        the cluster gives the same queue; SnapshotTooLarge past `max_bytes` of bodies (plus MESSAGE_OVERHEAD
        each) read back."""
        topics = await self._topics_of(name)
        unaccounted: dict[str, int] | None = None  # None until one round was asked whole
        missing_nodes: set[int] = set()
        with trio.move_on_after(SETTLE_S) as settling:
            while True:
                before = {topic: await self._delivered(topic, name) for topic in topics}
                held, missing_nodes = await self._gather(name)
                after = {topic: await self._delivered(topic, name) for topic in topics}
                unaccounted = self._unaccounted(before, after, held)
                if not unaccounted and not missing_nodes:
                    break
                await trio.sleep(SETTLE_RETRY_S)
        if settling.cancelled_caught:
            if unaccounted is None:
                raise RequestTimeout(f"JetStream did not answer for queue {name} within {SETTLE_S:g} s")
            self.refused += 1
            count = sum(unaccounted.values())
            nodes = f"; nodes {sorted(missing_nodes)} did not answer" if missing_nodes else ""
            raise StreamError(
                f"queue {name}: JetStream gave out {count} message(s) that no node holds now (given to a node "
                f"that went away: they are given again after the ack wait, {self.link.settings.ack_wait_s:g} s, to "
                f"the next consumer of the queue){nodes}: a snapshot now would miss them; take it again later")
        reader = _Reader(self.link, max_bytes)
        in_flight: list[Message] = []
        ready: list[tuple[int, Message]] = []
        later: list[tuple[int, Message]] = []
        seen: set[tuple[str, int]] = set()
        for entry in sorted(held, key=lambda h: (STATE_ORDER[h.state], h.seq)):  # one copy each, the live first
            if entry.seq <= after[entry.topic].floor or (entry.topic, entry.seq) in seen:
                continue
            seen.add((entry.topic, entry.seq))
            message = await reader.at(entry.topic, entry.seq, entry.attempts)
            if message is None:
                continue  # answered meanwhile: gone from the stream
            if entry.state == IN_FLIGHT:
                in_flight.append(message)
            elif entry.state == READY:
                ready.append((entry.seq, message))
            else:
                later.append((entry.due_ns, message))
        for topic in topics:
            start = max(before[topic].delivered, before[topic].floor) + 1
            for seq, message in await reader.after(topic, name, start):
                if (topic, seq) not in seen:
                    seen.add((topic, seq))
                    ready.append((seq, message))
        later += await reader.deferred(topics)
        ids: set[int] = set()
        rows = []
        for message in [*in_flight, *(m for _, m in sorted(ready, key=_first)), *(m for _, m in
                                                                                   sorted(later, key=_first))]:
            if message.id not in ids:  # a deferred publish moved to its topic while it was read: once
                ids.add(message.id)
                rows.append(message)
        self.taken += 1
        return rows, reader.read_back, reader.cluster_key

    async def _topics_of(self, name: str) -> list[str]:
        """The topics the queue is bound to: as the cluster was last read, and as this node bound it. A queue
        another node made a moment ago is in the cluster's next read (within FOLLOW_S)."""
        engine = self.link.engine
        with trio.move_on_after(FOLLOW_S):
            while True:
                local = engine.queue(name) if engine is not None else None
                topics = {topic for topic, consumers in self.link.topology.read.items() if name in consumers}
                topics.update(local.topics if local is not None else ())
                if topics:
                    return sorted(topics)
                await trio.sleep(SETTLE_RETRY_S)
        raise StreamError(f"no stream or queue {name}")

    async def _delivered(self, topic: str, name: str) -> Delivered:
        try:
            info = await api.api(self.connection, f"CONSUMER.INFO.{api.topic_stream(topic)}.{api.queue_consumer(name)}")
        except api.JetStreamError as error:
            if error.err_code in (api.ERR_CONSUMER_NOT_FOUND, api.ERR_STREAM_NOT_FOUND):
                raise StreamError(f"no stream or queue {name}") from None
            raise
        metadata = (info.get("config") or {}).get("metadata") or {}
        return Delivered(int((info.get("delivered") or {}).get("stream_seq", 0)), int(info.get("num_ack_pending", 0)),
                         int(metadata.get(api.FLOOR_METADATA, 0) or 0))

    async def _gather(self, name: str) -> tuple[list[Held], set[int]]:
        """What every node heard from holds of the queue, and the nodes that did not answer in time."""
        engine = self.link.engine
        now = self.link.clock.now()
        expected = {node for node, heard in self.link.reports.heard.items() if now - heard.at <= REPORT_LAPSE_S}
        if engine is not None:
            expected.add(engine.node)
        parts: dict[int, dict[int, list[Any]]] = {}
        counts: dict[int, int] = {}
        complete = trio.Event()

        def on_answer(msg: Msg) -> None:
            try:
                answer = json.loads(msg.payload)
                node, part, total, held = int(answer["node"]), int(answer["part"]), int(answer["parts"]), answer["held"]
            except (ValueError, KeyError, TypeError):
                return
            parts.setdefault(node, {})[part] = held
            counts[node] = total
            if all(node in counts and len(parts[node]) >= counts[node] for node in expected):
                complete.set()

        inbox = self.connection.new_inbox()
        sid = self.connection.subscribe(inbox, on_answer)
        try:
            self.connection.publish(HOLDINGS_PREFIX + api.token(name), b"", reply=inbox)
            with trio.move_on_after(GATHER_S):
                await complete.wait()
        finally:
            self.connection.unsubscribe(sid)
        held = []
        for node, chunks in parts.items():
            if len(chunks) < counts.get(node, 1):
                continue
            for chunk in chunks.values():
                for topic, seq, attempts, state, due in chunk:
                    if state in STATE_ORDER:
                        held.append(Held(str(topic), int(seq), int(attempts), str(state), int(due)))
        answered = {node for node, chunks in parts.items() if len(chunks) >= counts.get(node, 1)}
        return held, expected - answered

    @staticmethod
    def _unaccounted(before: dict[str, Delivered], after: dict[str, Delivered], held: Iterable[Held]) -> dict[str, int]:
        """By topic, what JetStream gave out that no node holds. Deliveries made while the nodes were asked are
        excused: they are read with the messages not given out yet (from the delivered sequence before on)."""
        by_topic: dict[str, set[int]] = {}
        for entry in held:
            if entry.topic in after and entry.seq > after[entry.topic].floor:
                by_topic.setdefault(entry.topic, set()).add(entry.seq)
        missing = {}
        for topic, counted in after.items():
            moved = max(counted.delivered - before[topic].delivered, 0)
            short = counted.ack_pending - len(by_topic.get(topic, ())) - moved
            if short > 0:
                missing[topic] = short
        return missing


def _place(handle: Any) -> tuple[str, int] | None:
    """The topic and stream sequence of the message a delivery's handle (its ack subject) stands for."""
    if handle is None:
        return None
    try:
        delivery = api.parse_ack_subject(handle)
    except ValueError:
        return None
    topic = api.topic_of_stream(delivery.stream)
    return None if topic is None else (topic, delivery.stream_seq)


def _first(item: tuple[int, Message]) -> int:
    return item[0]


class _Reader:
    """Messages read back from the streams for one snapshot, counted against its memory."""

    def __init__(self, link: JetStreamLink, max_bytes: int) -> None:
        self.link = link
        self.connection = link.connection
        self.max_bytes = max_bytes
        self.read_back = 0
        self._direct: set[str] = set()  # streams answering direct gets
        self.cluster_key = ""  # the same on every node of the cluster (its name, the first topic's stream's making)

    async def _get(self, stream: str, request: dict[str, Any], what: str) -> list[tuple[Msg, int]]:
        if stream not in self._direct:
            await allow_direct(self.connection, stream)
            self._direct.add(stream)
        page = await direct_get(self.connection, stream, request, what)
        for msg, _ in page:
            self.read_back += len(msg.payload) + MESSAGE_OVERHEAD
        if self.read_back > self.max_bytes:
            raise SnapshotTooLarge(f"a snapshot would read back more than {self.max_bytes >> 20} MiB")
        return page

    async def at(self, topic: str, seq: int, attempts: int) -> Message | None:
        page = await self._get(api.topic_stream(topic), {"seq": seq, "batch": 1}, f"topic {topic}")
        if not page or page[0][1] != seq:
            return None
        message = self.link.message_of(topic, page[0][0], attempts=0, fallback_id=seq, fallback_timestamp=0)
        message.attempts = attempts
        return message

    async def after(self, topic: str, queue: str, start: int) -> list[tuple[int, Message]]:
        """The queue's messages of the topic's stream from `start` on: the topic's and those put back at the
        queue's tail, as far as the stream's leader had them when the read began."""
        stream = api.topic_stream(topic)
        info = await api.api(self.connection, f"STREAM.INFO.{stream}")
        if not self.cluster_key:
            self.cluster_key = f"jetstream:{(info.get('cluster') or {}).get('name', '')}:{info.get('created', '')}"
        last = int((info.get("state") or {}).get("last_seq", 0))
        found: list[tuple[int, Message]] = []
        for subject in (api.topic_subject(topic), api.requeue_subject(topic, queue)):
            seq = start
            while seq <= last:
                page = await self._get(stream, {"seq": seq, "next_by_subj": subject, "batch": DIRECT_BATCH},
                                       f"topic {topic}")
                page = [(msg, position) for msg, position in page if position <= last]
                found += [(position, self.link.message_of(topic, msg, attempts=0, fallback_id=position,
                                                          fallback_timestamp=0)) for msg, position in page]
                if page:
                    seq = page[-1][1] + 1
                if len(page) < DIRECT_BATCH:
                    beyond = await leader_first_at(self.connection, stream, subject, seq)
                    if beyond is None or beyond > last:
                        break
                    await trio.sleep(0.02)  # a replica that has not applied the tail yet answered
        return found

    async def deferred(self, topics: list[str]) -> list[tuple[int, Message]]:
        """Deferred publishes to the topics, not moved yet, with their due times."""
        found: list[tuple[int, Message]] = []
        for topic in topics:
            seq = 1
            while True:
                try:
                    page = await self._get(deferred.STREAM, {"seq": seq, "next_by_subj": deferred.SUBJECT_PREFIX
                                                             + api.token(topic), "batch": DIRECT_BATCH},
                                           "the deferred publishes")
                except api.JetStreamError as error:
                    if error.err_code == api.ERR_STREAM_NOT_FOUND:
                        return found
                    raise
                for msg, _ in page:
                    due = int((msg.headers or {}).get(deferred.HEADER_DUE, 0) or 0)
                    found.append((due, self.link.message_of(topic, msg, attempts=0, fallback_id=0,
                                                            fallback_timestamp=due)))
                if len(page) < DIRECT_BATCH:
                    break
                seq = page[-1][1] + 1
        return found
