"""PHPMQ sessions: client messages to engine calls, engine deliveries to 003 messages.

One `PHPMQSession` per TCP connection, on the shared session skeleton (`adapters/session.py`).
Model (docs/architecture.md): `001 Foo` publishes to topic `Foo` and makes sure queue `Foo` exists
and is bound to it (the original stores a message under its queue name even before anyone
consumes), so NSQ channels and MQKS queues of topic `Foo` get their own copies; `002 Foo N`
attaches the connection to queue `Foo` with a window of N unacknowledged messages.

The original's semantics (docs/protocols/phpmq.md): one standing window per connection, replaced
by each 002 (the previous window's unacknowledged messages go back ahead of newer ones, as they do
on disconnect); oldest first; an ack from any connection finishes the message and frees the
holder's window slot (the original left the slot taken); no ack timeout unless configured; ids are
32 lowercase hex characters. On top of the original: TTLs (never delivered once run out, the
remaining seconds in each current-generation 003), 005 requeue to the tail with a new TTL, 006 and
a maximum of attempts move a message to the dead-letter topic `<queue>.dead`. Bad framing closes
only the offending connection, with a log line saying why.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any

import attrs

from polymq.adapters.named_queue import named_queue
from polymq.adapters.session import Listener, StreamSession
from polymq.adapters.transport import Transport
from polymq.codecs import phpmq
from polymq.core.engine import Consumer, Engine, Message, Queue
from polymq.core.trace import Client

ORIGIN = "phpmq"  # the protocol the engine keeps with what comes in here


def shown_id(message: Message) -> str:
    """The id a PHPMQ client sees for a message: 32 hex digits."""
    return phpmq.format_message_id(message.id).decode()

log = logging.getLogger("polymq.phpmq")

# PHPMQ has no error replies, only a connection that ends: why it ended, as the metrics count it.
BAD_FRAMING = "bad framing"
SEND_REFUSED = "send refused"
INTERNAL_ERROR = "internal error"


# How long an empty queue nobody consumes is kept: long enough for a consumer to reconnect
# without its queue being made again, short enough that throwaway queue names do not pile up.
FORGET_EMPTY_AFTER_S = 60.0


@attrs.frozen
class PHPMQLimits:
    max_content: int = phpmq.MAX_CONTENT
    # The largest 002 window honoured (a larger N is taken as this): the original has no cap, but
    # each unacknowledged delivery is held in memory.
    max_window: int = 10_000
    # Write every 003 in the current generation's form (with the TTL packet), not only to clients
    # that showed they speak it (a TTL packet, 005 or 006). The only published client pins the other.
    current_generation: bool = False
    # Seconds a delivery may stay unacknowledged before it goes back to the queue; None: forever (as
    # the original).
    ack_timeout: float | None = None
    # Deliveries after which a message that comes back is dead-lettered (0: no limit); set on the
    # queues PHPMQ creates.
    max_attempts: int = 0
    # Seconds after its last consumer left that a queue PHPMQ created is forgotten if it is empty
    # (the original keeps no empty queue: a queue is its rows); None: kept forever.
    forget_empty_after: float | None = FORGET_EMPTY_AFTER_S


class PHPMQServer(Listener):
    """Everything the PHPMQ listener shares: the engine, limits, the sessions."""

    log = log

    def __init__(self, engine: Engine, limits: PHPMQLimits | None = None) -> None:
        super().__init__()
        self.engine = engine
        self.limits = limits or PHPMQLimits()

    def new_session(self, transport: Transport) -> PHPMQSession:
        return PHPMQSession(self, transport)

    def queue(self, name: str) -> Queue:
        """Queue `name`, bound to topic `name`, made (with this listener's max_attempts) if missing."""
        return named_queue(self.engine, name, origin=ORIGIN, max_attempts=self.limits.max_attempts,
                           forget_empty_after=self.limits.forget_empty_after)


class PHPMQSession(StreamSession):
    log = log

    def __init__(self, server: PHPMQServer, transport: Transport) -> None:
        super().__init__(server.engine, transport)
        self.server = server
        self.codec = phpmq.ServerConnection(server.limits.max_content)
        self.consumer: Consumer | None = None
        # As traces show it; PHPMQ answers no publish, so its publishes keep their order across queues.
        self.client = Client(ORIGIN, self.peer, publishes_in_order=True)
        self._handlers: dict[type, Callable[[Any], None]] = {
            phpmq.Send: self._send,
            phpmq.Consume: self._consume,
            phpmq.Ack: self._ack,
            phpmq.Requeue: self._requeue,
            phpmq.DeadLetter: self._dead_letter,
        }

    @property
    def current_generation(self) -> bool:
        return self.server.limits.current_generation or self.codec.current_generation

    def closed(self) -> None:
        # Unacknowledged messages go back ahead of newer ones, as in the original (docs/protocols/phpmq.md).
        if self.consumer is not None:
            self.consumer.detach()
            self.consumer = None

    # -- reading -------------------------------------------------------------------------------

    def handle(self, data: bytes) -> None:
        codec = self.codec
        codec.receive_data(data)
        handlers = self._handlers
        while True:
            event = codec.next_event()
            if event is phpmq.NEED_DATA:
                if not data and codec.pending:
                    log.info("%s: connection closed in the middle of a message", self.peer)
                return
            if isinstance(event, phpmq.ProtocolError):
                # PHPMQ has no error replies: the connection ends, and the log says why.
                log.warning("%s: closing the connection: %s", self.peer, event.reason)
                self.traffic.error(BAD_FRAMING)
                self.stop(event.reason)
                return
            try:
                handlers[type(event)](event)
            except Exception:
                # A bug must cost this connection, not the gateway or another client's messages.
                log.exception("%s: closing the connection: a %s failed", self.peer, type(event).__name__)
                self.traffic.error(INTERNAL_ERROR)
                self.stop("internal error")
                return
            if self._stopping is not None:
                return

    def _send(self, request: phpmq.Send) -> None:
        refusal = self.engine.storage.failure or self.engine.publish_refusal(request.queue, client=self.client)
        if refusal is not None:
            # No reply exists to refuse it with: the producer sees its connection end instead.
            self.server.refusals.note(SEND_REFUSED, f"{self.peer}: send to {request.queue} refused, "
                                                    f"closing the connection: {refusal}")
            self.traffic.error(SEND_REFUSED)
            self.stop(f"send refused: {refusal}")
            return
        self.server.queue(request.queue)
        self.engine.publish(request.queue, request.content, ttl=request.ttl, origin=ORIGIN, client=self.client)
        self.traffic.messages_in += 1

    def _consume(self, request: phpmq.Consume) -> None:
        # One standing window per connection: a new 002 replaces it, even for another queue.
        if self.consumer is not None:
            self.consumer.detach()
            self.consumer = None
        queue = self.server.queue(request.queue)
        window = min(max(request.count, 0), self.server.limits.max_window)
        self.consumer = self.engine.attach(queue.name, self._deliverer(queue), credit=window,
                                           msg_timeout=self.server.limits.ack_timeout, on_close=self._queue_gone,
                                           tag=self, client=self.client)

    def _queue_gone(self, reason: str) -> None:
        self.consumer = None

    def _target(self, queue_name: str, raw_id: bytes) -> tuple[Queue, int] | None:
        queue = self.engine.queue(queue_name)
        message_id = phpmq.parse_message_id(raw_id)
        if queue is None or message_id is None:
            return None  # silent, as the original answers nothing
        return queue, message_id

    def _ack(self, request: phpmq.Ack) -> None:
        target = self._target(request.queue, request.message_id)
        if target is not None:
            target[0].finish_any(target[1])

    def _requeue(self, request: phpmq.Requeue) -> None:
        target = self._target(request.queue, request.message_id)
        if target is not None:
            target[0].requeue_to_tail(target[1], request.ttl)

    def _dead_letter(self, request: phpmq.DeadLetter) -> None:
        target = self._target(request.queue, request.message_id)
        if target is not None:
            target[0].dead_letter(target[1])

    # -- delivering ----------------------------------------------------------------------------

    def _deliverer(self, queue: Queue) -> Callable[[Message], None]:
        name = queue.name.encode()
        durable = queue.durable
        clock = self.engine.clock

        def deliver(message: Message) -> None:
            ttl: int | None = None
            if self.current_generation:
                expires = message.expires_at
                # Whole seconds left, rounded up: 0 only for a message without a TTL.
                ttl = 0 if expires is None else max(1, math.ceil(expires - clock.now()))
            frame = phpmq.delivery(name, message.body, phpmq.format_message_id(message.id), ttl)
            self.traffic.messages_out += 1
            self.send_delivery(frame, unstored=durable)

        return deliver
