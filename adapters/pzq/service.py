"""PZQ over ZeroMQ: the receive ROUTER (producers), the send DEALER (consumers), the monitor ROUTER.

Model (docs/architecture.md): producers publish to the topic of the configured queue name
(`pzq` by default), whose queue `pzq` is bound to it; PZQ consumers read that queue, so they
compete with PHPMQ consumers of the same name, and NSQ channels and MQKS queues of the topic get
copies. Several body frames travel as one engine body (`codecs.pzq.join_frames`) and come back to
PZQ consumers frame for frame.

What polymq keeps of the original and what it fixes (docs/protocols/pzq.md):
- A producer gets `1` only once its message is stored under `--fsync` (group commit across
  producers), and every ACK is sent: the receive socket is ROUTER_MANDATORY, so a full pipe makes
  the ACK wait in the pump instead of being dropped.
- Consumers are served through one DEALER (it picks the peer, round robin) by one engine consumer
  whose window is `window` times the connected consumers: the ACK timeout only runs for messages a
  consumer can hold, so a slow consumer causes no redelivery storm.
- A message whose ACK timed out, or came as anything but `1`, is sent again first (the original's
  order). Every delivery of a message has the same key, the original's way; a `1` ends the message
  whoever sends it, and a `0` is honoured once per delivery and not from a superseded one
  (`answers.py`: the DEALER shows no peer, so answers are counted).
- The monitor answers `MONITOR` with the six keys and real values, and anything else with an
  error text instead of silence.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import attrs
import zmq
import zmq.utils.monitor

from polymq.adapters.named_queue import named_queue
from polymq.adapters.pzq.answers import NackRule
from polymq.adapters.zmq_pump import Frames
from polymq.adapters.zmq_service import ZmqService
from polymq.adapters.zmq_sockets import PEER_CONNECTED, PEER_GONE, ZmqSockets
from polymq.codecs import pzq
from polymq.core.engine import Consumer, Engine, Message, Outcome, Queue
from polymq.core.trace import Client

ORIGIN = "pzq"  # the protocol the engine keeps with what comes in here
# Its consumers as traces show them: the DEALER hides which peer took a message.
CONSUMERS = Client(ORIGIN, "", "pzq-send")


def shown_id(message: Message) -> str:
    """The key a PZQ consumer sees for a message (every delivery of it has the same)."""
    return pzq.delivery_key(message.id).decode()


def _producer(peer: bytes) -> Client:
    """A producer as traces show it: its ROUTER identity, in hex (ZeroMQ hides its address)."""
    return Client(ORIGIN, "", peer.hex())

log = logging.getLogger("polymq.pzq")

# The original's ack timeout (its --ack-timeout, 5,000,000 µs).
DEFAULT_ACK_TIMEOUT_S = 5.0
# Deliveries each connected consumer may hold unacknowledged (the original has no bound; see the module doc).
DEFAULT_WINDOW = 100
# The largest producer message (all its frames) accepted; libzmq drops a larger one as it arrives.
DEFAULT_MAX_MESSAGE = 16 * 1024 * 1024
# Sent to a monitor request that is not `MONITOR` (the original sends nothing and the REQ hangs).
UNKNOWN_REQUEST = b"ERROR: unknown request, send MONITOR"
# The errors as the metrics count them: a producer's message answered `0`, a monitor request not known.
REFUSED = "refused"
UNKNOWN = "unknown request"
# A monitor request is one short word.
MONITOR_MAX_MESSAGE = 64 * 1024


@attrs.frozen
class PZQLimits:
    queue: str = "pzq"
    ack_timeout: float = DEFAULT_ACK_TIMEOUT_S
    window: int = DEFAULT_WINDOW
    max_message: int = DEFAULT_MAX_MESSAGE


class PZQServer(ZmqService):
    log = log

    def __init__(self, engine: Engine, sockets: ZmqSockets, limits: PZQLimits | None = None) -> None:
        super().__init__(engine)
        self.limits = limits or PZQLimits()
        self.consumers_connected = 0
        self.stale_acks = 0  # `1`s of no delivery in flight, `0`s not honoured (answers.py)
        self.nacks = NackRule(grace=self.limits.ack_timeout)
        self.consumer: Consumer | None = None
        self.receive_pump = self.add_pump("pzq-receive", sockets.get("pzq-receive"), self._produced)
        self.send_pump = self.add_pump("pzq-send", sockets.get("pzq-send"), self._answered)
        self.monitor_pump = self.add_pump("pzq-monitor", sockets.get("pzq-monitor"), self._monitor)
        # The send socket's connection events count the consumers. The queue and its consumer come
        # with the first consumer to connect (or the first message): a gateway whose PZQ sockets
        # nobody uses holds no PZQ queue.
        self._send_events = sockets.peer_events.get("pzq-send") if self.send_pump is not None else None
        self.add_pump("pzq-send-peers", self._send_events, self._peer_events)

    @property
    def queue(self) -> Queue:
        return named_queue(self.engine, self.limits.queue, origin=ORIGIN)

    def _attach(self) -> None:
        """The engine consumer that serves the send socket's consumers (the queue made if missing)."""
        self.consumer = self.engine.attach(self.queue.name, self._deliver, credit=self._credit(),
                                           msg_timeout=self.limits.ack_timeout, retry_first=True,
                                           on_close=self._queue_gone, tag=self, client=CONSUMERS)

    def _queue_gone(self, reason: str) -> None:
        """The queue was deleted (another protocol's admin): a new one when consumers are there."""
        self.consumer = None
        self.nacks.clear()
        if self.consumers_connected:
            self._attach()

    def shutdown(self) -> None:
        if self.consumer is not None:
            self.consumer.detach()
            self.consumer = None
        if self.send_pump is not None and self._send_events is not None:
            self.send_pump.sock.disable_monitor()
        super().shutdown()

    # -- producers -----------------------------------------------------------------------------

    def _produced(self, batch: list[Frames]) -> None:
        engine = self.engine
        storage = engine.storage
        topic = self.queue.name  # the queue of that name exists and is bound to its topic
        replies: list[Frames] = []
        for frames in batch:
            peer, rest = frames[0], frames[1:]
            parsed = pzq.parse_produce(rest)
            if isinstance(parsed, pzq.Ignored):
                log.info("receive socket: %s", parsed.reason)
                continue
            if isinstance(parsed, pzq.ProduceRefused):
                self.traffic.error(REFUSED)
                replies.append([peer, *pzq.producer_refusal(parsed.producer_id, parsed.reason)])
                continue
            refusal = storage.failure or engine.publish_refusal(topic)
            if refusal is not None:
                self.refusals.note("refused", f"producer message refused with 0: {refusal}")
                self.traffic.error(REFUSED)
                replies.append([peer, *pzq.producer_refusal(parsed.producer_id, refusal.encode())])
                continue
            # Who published is looked up only while something is traced.
            engine.publish(topic, pzq.join_frames(parsed.bodies), origin=ORIGIN, traced_id=parsed.producer_id,
                           client=None if engine.tracer is None else _producer(peer))
            replies.append([peer, *pzq.producer_ack(parsed.producer_id)])
        if replies:
            assert self.receive_pump is not None
            # Answered in order, once every publish of the burst is stored.
            self.send_when_stored(self.receive_pump, replies, _not_stored)

    # -- consumers -----------------------------------------------------------------------------

    def _credit(self) -> int:
        return self.limits.window * self.consumers_connected

    def _peer_events(self, batch: list[Frames]) -> None:
        for frames in batch:
            event = zmq.utils.monitor.parse_monitor_message(frames)["event"]
            if event == PEER_CONNECTED:
                self.consumers_connected += 1
            elif event == PEER_GONE:
                self.consumers_connected = max(0, self.consumers_connected - 1)
        if self.consumer is not None:
            self.consumer.set_credit(self._credit())
        elif self.consumers_connected:
            self._attach()

    def _deliver(self, message: Message) -> None:
        pump = self.send_pump
        assert pump is not None
        owner = message.owner
        assert isinstance(owner, Consumer)
        self.nacks.delivered(message.id, message.attempts, self.engine.clock.now(), owner.in_flight)
        self.deliver(pump, pzq.delivery(pzq.delivery_key(message.id), time.time_ns() // 1000,
                                        int(self.limits.ack_timeout * 1_000_000), pzq.split_frames(message.body)),
                     owner.queue.durable)

    def _answered(self, batch: list[Frames]) -> None:
        consumer = self.consumer
        nacks = self.nacks
        now = self.engine.clock.now()
        refill = False
        for frames in batch:
            answer = pzq.parse_consumer_ack(frames)
            if isinstance(answer, pzq.Ignored):
                log.info("send socket: %s", answer.reason)
                continue
            message_id = pzq.parse_key(answer.key)
            if consumer is None or message_id is None:
                self.stale_acks += 1  # no delivery of ours
                continue
            in_flight = message_id in consumer.in_flight
            if answer.done:
                # Whoever sends it, as the original; between its timeout and its next delivery
                # the message is in no one's hands, and the `1` is ignored (the original too).
                if not in_flight:
                    self.stale_acks += 1
                    continue
                nacks.forget(message_id)
                refill = consumer.finish(message_id, refill=False) is Outcome.OK or refill
            elif nacks.nack(message_id, now) and in_flight:
                consumer.requeue(message_id)  # sent again first (retry_first)
            else:
                # A superseded delivery's, a second of one delivery, or the late one of a delivery
                # that timed out already (the message goes again anyway).
                self.stale_acks += 1
        if refill and consumer is not None:
            consumer.refill()

    # -- the monitor ---------------------------------------------------------------------------

    def monitor_values(self) -> dict[str, int]:
        queue = self.engine.queue(self.limits.queue)
        if queue is None:
            return dict.fromkeys(pzq.MONITOR_KEYS, 0) | {"syncs": self.engine.storage.syncs}
        in_flight = queue.in_flight.values()
        return {
            "messages": queue.depth + len(queue.in_flight) + queue.deferred_count,
            "messages_inflight": len(queue.in_flight),
            "db_size": queue.log.bytes_on_disk() if queue.log is not None else 0,
            "inflight_db_size": sum(len(message.body) for message in in_flight),
            "syncs": self.engine.storage.syncs,
            "expired_messages": queue.timeout_count,
        }

    def _monitor(self, batch: list[Frames]) -> None:
        pump = self.monitor_pump
        assert pump is not None
        for frames in batch:
            peer, rest = frames[0], frames[1:]
            # A REQ's envelope (its empty frame) comes back with the answer; a DEALER gets one too.
            envelope: Sequence[bytes] = rest[:-1] if len(rest) > 1 else [pzq.DELIMITER]
            if pzq.is_monitor_request(rest):
                pump.send([peer, *envelope, pzq.monitor_text(self.monitor_values())])
            else:
                log.info("monitor: unknown request %r", rest[-1:] if rest else rest)
                self.traffic.error(UNKNOWN)
                pump.send([peer, *envelope, UNKNOWN_REQUEST])


def _not_stored(reply: Frames, error: OSError) -> Frames:
    """A producer's `1` whose message the store failed to store becomes a `0` with the error."""
    if reply[2] != pzq.ACK_OK:
        return reply
    return [reply[0], *pzq.producer_refusal(reply[1], str(error).encode())]
