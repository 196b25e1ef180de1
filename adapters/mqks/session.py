"""MQKS sessions: request lines to engine calls, engine deliveries to `ok` lines.

One `MQKSSession` per TCP connection, on the shared session skeleton (`adapters/session.py`):
the reader parses everything a read returned and handles it synchronously (engine calls never
await), queueing response lines; the writer sends them as one write. Deliveries from other
connections' publishes land in the same output and wake the writer.

Model (docs/architecture.md): `publish e` publishes to engine topic `e`, dropped when no queue is
bound (MQKS's rule); `consume q e1 e2` makes engine queue `q` bound to topics `e1`, `e2`. An
MQKS consumer is an engine consumer: auto-ack ones hold a window of deliveries not yet written
(credit comes back as the writer sends), manual-ack ones a window of unacknowledged messages.
The publisher's msg_id travels as the message's `publisher_id` (other readers see it as the
`msg_id` header) and the event is the message's topic; messages published by other protocols show
their `msg_id` header if it fits a line, else the engine id (16 hex digits, as NSQ shows it).
Consecutive publishes to one event in one read are published as one batch, and a read's run of
plain acks (`mqks.Acks`) is finished with one engine call per consumer.

Where polymq differs from the original on purpose (docs/protocols/mqks.md): a TAB answers
`{id} error …` instead of dropping the client; `_eval` answers stats expressions only; a
`consume --confirm` is answered as soon as the binding is applied (no 0.1 s delay, so no
delivery overtakes it); queues and unacknowledged messages are stored durably. As in the
original, a queue bound by `rebind` alone, that no one has consumed yet, is not a queue: what is
published to its events is dropped (`MQKSLimits.keep_unconsumed_rebound` keeps it instead).
See docs/protocols/mqks.md.
"""

from __future__ import annotations

import datetime
import logging
import random
from collections.abc import Callable, Iterable
from typing import Any, Final

import attrs

from polymq.adapters.mqks import stats as mqks_stats
from polymq.adapters.session import Listener, StreamSession
from polymq.adapters.transport import Transport
from polymq.codecs import mqks
from polymq.core.engine import Consumer, Engine, Queue
from polymq.core.message import PUBLISHER_ID_HEADER, Message
from polymq.core.trace import Client

log = logging.getLogger("polymq.mqks")

# The header of an MQKS publish: the publisher's own id, shown to consumers. (The event is the
# message's topic, which the engine and the store keep.)
ORIGIN: Final = "mqks"  # the protocol the engine keeps with what comes in here
MSG_ID_HEADER: Final = PUBLISHER_ID_HEADER
# Option key under which a queue keeps its --delete-queue-when-unused as given (True or seconds).
WHEN_UNUSED_OPTION: Final = "mqks_delete_when_unused"


@attrs.frozen
class MQKSLimits:
    max_line_length: int = mqks.MAX_LINE_LENGTH
    # The original has no limit on deliveries a consumer holds (docs/architecture.md asks for a cap):
    # auto-ack consumers hold at most this many deliveries not yet written to the socket,
    # manual-ack consumers at most this many unacknowledged ones.
    consumer_window: int = 10_000
    # `host:worker_port:client_port` the original's stats tools read from `config['workers']`.
    worker_port: int = 24000
    # The original has no queue object until a queue's first consume, so a publish to events bound
    # only by `rebind` is dropped (its own test suite expects that). True makes `rebind` create the
    # queue at once, so those publishes are kept (`--mqks-keep-unconsumed`).
    keep_unconsumed_rebound: bool = False


class MQKSConsumer:
    """One consumer id: its queue, its mode, its unacknowledged msg_ids (manual-ack)."""

    __slots__ = ("consumer_id", "duplicates", "engine_consumer", "id_bytes", "manual_ack", "queue_name",
                 "session", "unacked")

    def __init__(self, session: MQKSSession, consumer_id: str, queue_name: str, manual_ack: bool) -> None:
        self.session = session
        self.consumer_id = consumer_id
        self.id_bytes = consumer_id.encode()
        self.queue_name = queue_name
        self.manual_ack = manual_ack
        self.engine_consumer: Consumer | None = None
        # msg_id -> engine id. Client-chosen msg_ids may repeat: the extra ones wait in
        # `duplicates` so that none is lost (the original overwrote them, docs/protocols/mqks.md).
        self.unacked: dict[str, int] = {}
        self.duplicates: dict[str, list[int]] = {}

    def remember(self, msg_id: str, engine_id: int) -> None:
        # One lookup: engine ids are unique, so another one there means the msg_id is held already.
        if self.unacked.setdefault(msg_id, engine_id) != engine_id:
            self.duplicates.setdefault(msg_id, []).append(engine_id)

    def take(self, msg_id: str) -> int | None:
        unacked = self.unacked
        engine_id = unacked.get(msg_id)  # get and del: compiled, two dict calls; `pop` is a method call
        if engine_id is None:
            return None
        del unacked[msg_id]
        if self.duplicates:
            more = self.duplicates.get(msg_id)
            if more:
                self.unacked[msg_id] = more.pop(0)
                if not more:
                    del self.duplicates[msg_id]
        return engine_id

    def forget_all(self) -> None:
        self.unacked.clear()
        self.duplicates.clear()

    @property
    def unacked_count(self) -> int:
        return len(self.unacked) + sum(map(len, self.duplicates.values()))


class MQKSServer(Listener):
    """Everything the MQKS listener shares: the engine, the consumers by id and by queue, counters."""

    log = log

    def __init__(self, engine: Engine, limits: MQKSLimits | None = None, *, rng: random.Random | None = None) -> None:
        super().__init__()
        self.engine = engine
        self.limits = limits or MQKSLimits()
        self.rng = rng or random.Random()
        self.consumers: dict[str, MQKSConsumer] = {}
        self.consumers_by_queue: dict[str, dict[str, MQKSConsumer]] = {}
        # Events bound by `rebind` to a queue no one has consumed yet (no engine queue: what is
        # published to them is dropped). Not stored: they hold no messages, and the original keeps
        # nothing over a restart; the queue's first consume takes them over.
        self.unconsumed_bindings: dict[str, list[str]] = {}
        engine.on_queue_deleted.append(self._queue_deleted)
        self.host = "127.0.0.1"
        self.port = 25000
        # The original's stats counters (`stats.py`): publishes, copies put in queues, deliveries.
        self.published = 0
        self.queued = 0
        self.consumed = 0

    def new_session(self, transport: Transport) -> MQKSSession:
        return MQKSSession(self, transport)

    def new_error_id(self) -> str:
        return mqks.error_id(datetime.datetime.now(datetime.UTC), self.rng)

    def refusal(self) -> tuple[str, bytes]:
        # No request to answer yet: the id of a line without one (docs/protocols/mqks.md), `None`.
        return "error (too many connections)", mqks.error_line(NO_REQUEST_ID, self.new_error_id())

    # -- stats for `_eval` ------------------------------------------------------------------------

    def queues_in_use(self) -> int:
        return len(self.consumers_by_queue)

    def unacked_count(self) -> int:
        return sum(consumer.unacked_count for consumer in self.consumers.values())

    def responses_waiting(self) -> int:
        return sum(len(session.out) for session in self.sessions)

    def sessions_with_consumers(self) -> int:
        return sum(1 for session in self.sessions if isinstance(session, MQKSSession) and session.consumers)

    def forget_events(self, events: Iterable[str]) -> None:
        """Deletes the engine topics of `events` that no queue is bound to any more and that hold nothing.

        An MQKS event exists only while a queue is bound to it (a publish to it is dropped otherwise),
        so the topics its bindings made must not pile up: a client creating and deleting queues, or
        the conformance suite, would leave one topic per event behind, stored and restored for ever.
        A topic that holds messages (published by NSQ) or is paused stays.
        """
        engine = self.engine
        for name in events:
            topic = engine.topics.get(name)
            if topic is not None and not topic.queues and not topic.depth and not topic.paused:
                engine.delete_topic(name)

    def _queue_deleted(self, queue: Queue, bound: list[str]) -> None:
        # A queue --delete-queue-when-unused removed (only MQKS queues have the option; an NSQ
        # channel leaves its topic, as nsqd does). delete_queue forgets its events itself.
        if WHEN_UNUSED_OPTION in queue.options:
            self.forget_events(bound)

    def events_by_queue(self) -> dict[str, list[str]]:
        """Every queue's bound events, those bound by `rebind` alone included (the original's `events_by_queues`)."""
        bound = {queue.name: list(queue.topics) for queue in self.engine.queues.values() if queue.topics}
        return {**self.unconsumed_bindings, **bound}

    def worker_address(self) -> str:
        return f"{self.host}:{self.limits.worker_port}:{self.port}"

    # -- consumers ----------------------------------------------------------------------------

    def register(self, consumer: MQKSConsumer) -> None:
        self.consumers[consumer.consumer_id] = consumer
        self.consumers_by_queue.setdefault(consumer.queue_name, {})[consumer.consumer_id] = consumer
        consumer.session.consumers[consumer.consumer_id] = consumer

    def unregister(self, consumer: MQKSConsumer) -> None:
        if self.consumers.get(consumer.consumer_id) is consumer:
            del self.consumers[consumer.consumer_id]
        of_queue = self.consumers_by_queue.get(consumer.queue_name)
        if of_queue is not None and of_queue.get(consumer.consumer_id) is consumer:
            del of_queue[consumer.consumer_id]
            if not of_queue:
                del self.consumers_by_queue[consumer.queue_name]
        if consumer.session.consumers.get(consumer.consumer_id) is consumer:
            del consumer.session.consumers[consumer.consumer_id]

    def delete_consumer(self, consumer: MQKSConsumer) -> None:
        """Unacknowledged messages go back to the tail with retry+1; unused-queue timers start."""
        self.unregister(consumer)
        consumer.forget_all()
        engine_consumer = consumer.engine_consumer
        if engine_consumer is not None:
            consumer.engine_consumer = None
            engine_consumer.detach(to_tail=True)
            consumer.session.forget_releases(engine_consumer)

    def send_updates(self, queue: Queue | None, queue_name: str, skip: str | None = None, *,
                     events: list[str] | None = None) -> None:
        """`--update` to every consumer of the queue but `skip` (docs/protocols/mqks.md)."""
        of_queue = self.consumers_by_queue.get(queue_name)
        if not of_queue:
            return
        if events is None:
            events = list(queue.topics) if queue is not None else []
        when_unused = queue.options.get(WHEN_UNUSED_OPTION) if queue is not None else None
        for consumer_id, consumer in list(of_queue.items()):
            if consumer_id != skip:
                consumer.session.send(mqks.update_line(consumer_id, queue_name, events, when_unused,
                                                       consumer.manual_ack))


def msg_id_of(message: Message) -> bytes:
    """The msg_id an MQKS consumer sees for a message."""
    shown = message.publisher_id
    if shown is None:
        headers = message.headers
        msg_id = headers.get(MSG_ID_HEADER) if type(headers) is dict else None
        if msg_id is None:
            return b"%016x" % message.id
        # `str()`: headers come from any protocol, and a deliver callback must never raise.
        shown = str(msg_id).encode()
    # An MQKS publisher's id is one its request line carried; another protocol's (a stream writer's)
    # with a space, a newline, another control character or a Unicode line break would break the
    # line or its fields, so it shows the engine id instead.
    if mqks.SPACE in shown or not shown or (message.origin != ORIGIN and not mqks.carries_field(shown)):
        shown = b"%016x" % message.id
    return shown


def shown_id(message: Message) -> str:
    """The msg_id an MQKS client sees for a message, as text (traces)."""
    return msg_id_of(message).decode("utf-8", "backslashreplace")


def _msg_id_and_event(message: Message, queue: Queue) -> tuple[bytes, bytes]:
    # The topic is unknown only for a record an older version wrote: then the queue's binding.
    event = message.topic or (queue.topics[0] if queue.topics else queue.name)
    return msg_id_of(message), str(event).encode()


# The one error an MQKS client is told (`{id} error {error id}`), as the metrics count it.
ERROR_CODE: Final = "error"
# The request id of an error line that answers no request (the original's, for a line with no id).
NO_REQUEST_ID: Final = "None"


class MQKSSession(StreamSession):
    log = log

    def __init__(self, server: MQKSServer, transport: Transport) -> None:
        super().__init__(server.engine, transport)
        self.server = server
        self.codec = mqks.ServerConnection(server.limits.max_line_length)
        self.client = Client(ORIGIN, self.peer)  # its publishes, as traces show them
        self.consumers: dict[str, MQKSConsumer] = {}
        # Auto-ack deliveries queued since the last write, per engine consumer: credit to give back
        # once they are written.
        self._unreleased: dict[Consumer, int] = {}
        self._refill: set[Consumer] = set()  # acked consumers of this read, refilled at its end
        self._handlers: dict[type, Callable[[Any], None]] = {
            mqks.Consume: self._consume,
            mqks.Rebind: self._rebind,
            mqks.Ack: self._ack,
            mqks.Reject: self._reject,
            mqks.DeleteConsumer: self._delete_consumer,
            mqks.DeleteQueue: self._delete_queue,
            mqks.Ping: self._ping,
            mqks.Eval: self._eval,
            mqks.BadRequest: self._bad_request,
        }

    def slow_error(self, unsent: int) -> tuple[str, bytes]:
        return "error (slow client)", mqks.error_line(NO_REQUEST_ID, self.server.new_error_id())

    def closed(self) -> None:
        # Disconnect = delete_consumer for each consumer (docs/protocols/mqks.md).
        for consumer in list(self.consumers.values()):
            self.server.delete_consumer(consumer)

    # -- reading -----------------------------------------------------------------------------

    def handle(self, data: bytes) -> None:
        self.codec.receive_data(data)
        requests = self.codec.next_events()
        handlers = self._handlers
        count = len(requests)
        index = 0
        while index < count:
            request = requests[index]
            end = index + 1
            try:
                if isinstance(request, mqks.Publish):
                    # Consecutive publishes to one event go to the engine (and the store) as one batch.
                    batch = [request]
                    event = request.event
                    while end < count:
                        following = requests[end]
                        if not isinstance(following, mqks.Publish) or following.event != event:
                            break
                        batch.append(following)
                        end += 1
                    self._publish(batch)
                elif isinstance(request, mqks.Acks):
                    self._acks(request)
                else:
                    handlers[type(request)](request)
            except Exception:
                # A bug must cost its requests, not the connection or the gateway.
                error_id = self.server.new_error_id()
                log.exception("error %s: request %r", error_id, request)
                for failed in requests[index:end]:
                    for request_id in failed.request_ids if isinstance(failed, mqks.Acks) else (failed.request_id,):
                        self.traffic.error(ERROR_CODE)
                        self.send(mqks.error_line(request_id, error_id))
            index = end
        if self._refill:
            for engine_consumer in self._refill:
                if not engine_consumer.closed:
                    engine_consumer.refill()
            self._refill.clear()

    # -- writing -----------------------------------------------------------------------------

    def forget_releases(self, consumer: Consumer) -> None:
        self._unreleased.pop(consumer, None)

    def before_send(self) -> dict[Consumer, int]:
        # The auto-ack credit of exactly the lines this round sends comes back after it.
        released = self._unreleased
        self._unreleased = {}
        return released

    def after_send(self, token: object) -> None:
        released: dict[Consumer, int] = token  # type: ignore[assignment]
        for consumer, count in released.items():
            if not consumer.closed:
                consumer.release(count)  # may deliver more into `self.out`

    def _deliverer(self, consumer: MQKSConsumer, queue: Queue) -> Callable[[Message], None]:
        prefix = consumer.id_bytes
        server = self.server
        durable = queue.durable

        def deliver(message: Message) -> None:
            msg_id, event = _msg_id_and_event(message, queue)
            server.consumed += 1
            self.traffic.messages_out += 1
            engine_consumer = consumer.engine_consumer
            if consumer.manual_ack:
                consumer.remember(msg_id.decode(), message.id)
            elif engine_consumer is not None:
                pending = self._unreleased  # swapped by every flush: looked up each time
                pending[engine_consumer] = pending.get(engine_consumer, 0) + 1
            # Positional: a keyword costs the interpreted `send_delivery` a parse per delivery.
            self.send_delivery(mqks.delivery_line(prefix, msg_id, event, message.attempts - 1, message.body), None,
                               durable and consumer.manual_ack)

        return deliver

    # -- requests ----------------------------------------------------------------------------

    def _ok(self, request_id: str, data: bytes = b"") -> None:
        self.send(mqks.ok_line(request_id, data))

    def _settled(self, request_id: str, error: OSError | None) -> None:
        """A consume's bindings took effect for every client (`Engine.settled`): its confirmation."""
        if self._closed:
            return
        if error is None:
            self.send(mqks.ok_line(request_id), now=True)  # in the read that asked: at its end
        else:
            self._error(request_id, f"consume not applied: {error}")

    def _error(self, request_id: str, reason: str, line: bytes | None = None) -> None:
        error_id = self.server.new_error_id()
        # The full error goes to the log only, under the id the client sees (docs/protocols/mqks.md).
        log.warning("error %s: %s: %s (request %r)", error_id, self.peer, reason, line)
        self.traffic.error(ERROR_CODE)
        self.send(mqks.error_line(request_id, error_id))

    def _bad_request(self, request: mqks.BadRequest) -> None:
        self._error(request.request_id, request.reason, request.line)

    def _publish(self, requests: list[mqks.Publish]) -> None:
        """Publishes to one event, in order."""
        engine = self.engine
        storage = engine.storage
        event = requests[0].event
        refusal = storage.failure or engine.publish_refusal(event, len(requests))
        if refusal is not None:
            # One line for the batch, and few for a flood: the error ids a client saw are not logged each.
            self.server.refusals.note("publish refused", f"{self.peer}: publish to {event} refused with "
                                                         f"`error` ({len(requests)} requests): {refusal}")
            for request in requests:
                self.traffic.error(ERROR_CODE)
                self.send(mqks.error_line(request.request_id, self.server.new_error_id()))
            return
        topic = engine.topics.get(event)
        bound = len(topic.queues) if topic is not None else 0
        if len(requests) == 1:  # publishers that alternate events: no batch to build
            request = requests[0]
            engine.publish(event, request.data, drop_if_unbound=True, origin=ORIGIN,
                           publisher_id=request.request_id.encode(), client=self.client)
        else:
            engine.publish_many(event, [request.data for request in requests], drop_if_unbound=True, origin=ORIGIN,
                                each_publisher_id=[request.request_id.encode() for request in requests],
                                client=self.client)
        self.server.published += len(requests)
        self.traffic.messages_in += len(requests)
        self.server.queued += bound * len(requests)
        confirms = [request.request_id for request in requests if request.confirm]
        if confirms:

            def stored(error: OSError | None) -> None:
                if self._closed:
                    return
                if error is None:
                    # One write for the batch; from a storage callback it goes out at once (`now`).
                    self.send(b"".join(mqks.ok_line(request_id) for request_id in confirms), now=True)
                    return
                for request_id in confirms:
                    self._error(request_id, f"publish not stored: {error}")

            storage.sync(stored)  # written at the end of this read (`release_work`)

    def _consume(self, request: mqks.Consume) -> None:
        server = self.server
        engine = self.engine
        consumer_id = request.request_id
        previous = server.consumers.get(consumer_id)
        if previous is not None:
            # The same id again, e.g. a reconnect seen before the old connection's end (the original does this too).
            server.delete_consumer(previous)
        queue = engine.queue(request.queue)
        if queue is None:  # its first consume: it takes over what `rebind` bound so far
            queue = engine.ensure_queue(request.queue, origin=ORIGIN)
            old_events = server.unconsumed_bindings.pop(request.queue, [])
        else:
            old_events = list(queue.topics)
        if request.replace:
            new_events = list(dict.fromkeys(request.replace + request.add))
        else:
            new_events = list(dict.fromkeys(old_events + list(request.add)))
        changed = set(new_events) != set(old_events)
        # A consume states the queue's --delete-queue-when-unused: without the flag it is cleared
        # (the original's consume.py), and either change is an --update for the other consumers.
        when_unused = request.delete_when_unused
        if queue.options.get(WHEN_UNUSED_OPTION) != when_unused:
            auto_delete = None if when_unused is None else 0.0 if when_unused is True else float(when_unused)
            engine.configure_queue(queue, auto_delete=auto_delete, options={WHEN_UNUSED_OPTION: when_unused})
            changed = True
        if set(new_events) != set(queue.topics):
            unbound = set(queue.topics) - set(new_events)
            engine.set_bindings(queue.name, new_events)
            server.forget_events(unbound)
        consumer = MQKSConsumer(self, consumer_id, queue.name, request.manual_ack)
        server.register(consumer)
        if changed:
            # The issuer of a plain consume already knows its line; with --add it gets the result.
            server.send_updates(queue, queue.name, skip=None if request.add else consumer_id)
        if request.confirm:
            engine.settled(lambda error: self._settled(consumer_id, error))
        consumer.engine_consumer = engine.attach(
            queue.name, self._deliverer(consumer, queue), credit=server.limits.consumer_window,
            auto_ack=not request.manual_ack, on_close=lambda _reason: server.unregister(consumer), tag=consumer,
            client=Client(ORIGIN, self.peer, consumer_id),
        )

    def _rebind(self, request: mqks.Rebind) -> None:
        engine = self.engine
        server = self.server
        queue = engine.queue(request.queue)
        unconsumed = queue is None and not server.limits.keep_unconsumed_rebound
        if queue is not None:
            old_events = list(queue.topics)
        else:
            old_events = server.unconsumed_bindings.get(request.queue, [])
        events = set(request.replace) if request.replace else set(old_events)
        events.difference_update(request.remove)
        if request.remove_masks and events:
            events -= mqks.masked(events, request.remove_masks)
        events.update(request.add)
        if events != set(old_events):
            ordered = [e for e in old_events if e in events] + sorted(events - set(old_events))
            if unconsumed:  # no queue, no consumers: nothing to tell
                if ordered:
                    server.unconsumed_bindings[request.queue] = ordered
                else:
                    server.unconsumed_bindings.pop(request.queue, None)
            else:
                if queue is None:
                    queue = engine.ensure_queue(request.queue, origin=ORIGIN)
                engine.set_bindings(queue.name, ordered)
                server.send_updates(queue, queue.name)
                server.forget_events(set(old_events) - events)
        if request.confirm:
            self._ok(request.request_id)

    def _acknowledge(self, request: mqks.Ack | mqks.Reject, finish: bool) -> None:
        consumer = self.server.consumers.get(request.consumer_id)
        if consumer is None:
            return  # the original answers nothing here, even to --confirm (docs/protocols/mqks.md)
        engine_consumer = consumer.engine_consumer
        if engine_consumer is not None:
            if request.msg_id is None:
                consumer.forget_all()
                if finish:
                    engine_consumer.finish_all()
                else:
                    engine_consumer.requeue_all()
            else:
                engine_id = consumer.take(request.msg_id)
                if engine_id is not None:
                    if finish:
                        # The freed credit is used once at the end of this read, not once per ack.
                        engine_consumer.finish(engine_id, refill=False)
                        self._refill.add(engine_consumer)
                    else:
                        engine_consumer.requeue(engine_id)
        if request.confirm:
            self._ok(request.request_id)

    def _acks(self, request: mqks.Acks) -> None:
        """A run of plain acks: each consumer's in one engine call, its freed credit used at the end of the read."""
        consumers = self.server.consumers
        consumer_id = ""
        consumer: MQKSConsumer | None = None
        engine_ids: list[int] = []
        for acked_by, msg_id in zip(request.consumer_ids, request.msg_ids, strict=True):
            if consumer is None or acked_by != consumer_id:
                if engine_ids:
                    self._finish_many(consumer, engine_ids)
                    engine_ids = []
                consumer_id = acked_by
                consumer = consumers.get(acked_by)
                if consumer is None:
                    continue  # no answer, as for one ack (docs/protocols/mqks.md)
            if consumer.engine_consumer is not None:
                engine_id = consumer.take(msg_id)
                if engine_id is not None:
                    engine_ids.append(engine_id)
        if engine_ids:
            self._finish_many(consumer, engine_ids)

    def _finish_many(self, consumer: MQKSConsumer | None, engine_ids: list[int]) -> None:
        engine_consumer = consumer.engine_consumer if consumer is not None else None
        if engine_consumer is not None:
            engine_consumer.finish_many(engine_ids)
            self._refill.add(engine_consumer)

    def _ack(self, request: mqks.Ack) -> None:
        self._acknowledge(request, finish=True)

    def _reject(self, request: mqks.Reject) -> None:
        self._acknowledge(request, finish=False)

    def _delete_consumer(self, request: mqks.DeleteConsumer) -> None:
        consumer = self.server.consumers.get(request.consumer_id)
        if consumer is None:
            return  # no answer even to --confirm (docs/protocols/mqks.md)
        self.server.delete_consumer(consumer)
        if request.confirm:
            self._ok(request.request_id)

    def _delete_queue(self, request: mqks.DeleteQueue) -> None:
        server = self.server
        queue = self.engine.queue(request.queue)
        server.unconsumed_bindings.pop(request.queue, None)
        if queue is not None:
            # Every consumer hears of it, whether the queue had events or not (as the original does).
            server.send_updates(queue, queue.name, events=[])
            events = list(queue.topics)
            for consumer in list(server.consumers_by_queue.get(queue.name, {}).values()):
                server.unregister(consumer)
                consumer.forget_all()
            self.engine.delete_queue(queue.name)
            server.forget_events(events)
        if request.confirm:
            self._ok(request.request_id)

    def _ping(self, request: mqks.Ping) -> None:
        self._ok(request.request_id, request.data)

    def _eval(self, request: mqks.Eval) -> None:
        if request.worker not in (None, 0):
            self._error(request.request_id, f"no worker {request.worker}: polymq is one worker")
            return
        try:
            result = mqks_stats.answer(request.code, self.server)
        except mqks_stats.UnknownExpression as error:
            self._error(request.request_id, f"_eval answers stats expressions only: {error}")
            return
        self._ok(request.request_id, result.encode())
