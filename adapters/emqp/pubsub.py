"""EventMQ's pub/sub device: PUBLISH in on a ROUTER, `[topic, body]` out on a PUB socket.

As the original `emq-pubsub`: no ACK, no heartbeats, subscribers filter by topic prefix (ZeroMQ's
SUB), and nothing is kept for a subscriber that is not there. Nodes sharing their queues (JetStream) tell
each other every PUBLISH, so a subscriber of any node hears what any node's publishers send, at most once,
as the original's subscribers do. On top of it, each PUBLISH is also
published to the engine topic of that name, so NSQ channels, MQKS queues and PHPMQ, PZQ or eMQP
consumers of it get their copy; a topic no queue is bound to keeps nothing (fan-out only). The depth
policy (`--max-queue-depth`) applies to those copies: with `reject` a PUBLISH that would take a queue
past it is not queued (it has no answer to refuse it with), with `drop-oldest` the oldest go.
"""

from __future__ import annotations

import logging

from polymq.adapters.emqp.broker import ORIGIN as EMQP_ORIGIN
from polymq.adapters.emqp.broker import identity_client
from polymq.adapters.zmq_pump import Frames
from polymq.adapters.zmq_service import ZmqService
from polymq.adapters.zmq_sockets import ZmqSockets
from polymq.codecs import emqp
from polymq.core.engine import Engine

log = logging.getLogger("polymq.emqp")

# What the pub/sub device tells every node (`Engine.tell_every_node`): the `[topic, body]` it sends out.
TOLD_KIND = "emqp-pubsub"


class EMQPPubSub(ZmqService):
    # At shutdown what is queued for the subscribers gets this long to go out, in ms.
    linger_ms = 200

    def __init__(self, engine: Engine, sockets: ZmqSockets) -> None:
        super().__init__(engine)
        self.published = 0
        self.invalid = 0
        self.rejected = 0  # PUBLISHes not queued: a queue of their topic was full (the depth policy)
        self.incoming = self.add_pump("emqp-pubsub-in", sockets.get("emqp-pubsub-in"), self._publish)
        self.outgoing = self.add_pump("emqp-pubsub-out", sockets.get("emqp-pubsub-out"), _nothing_comes_in)
        if self.outgoing is not None:
            engine.listeners[TOLD_KIND] = self.outgoing.send_delivery

    def _publish(self, batch: list[Frames]) -> None:
        engine = self.engine
        storage = engine.storage
        for frames in batch:
            message = emqp.parse(frames)
            if isinstance(message, emqp.Invalid) or message.command != emqp.PUBLISH:
                self.invalid += 1
                log.info("pub/sub: %s", message.reason if isinstance(message, emqp.Invalid)
                         else f"{message.command[:20]!r} ignored (only PUBLISH comes here)")
                continue
            publish = emqp.parse_publish(message.body)
            if isinstance(publish, emqp.Invalid):
                self.invalid += 1
                log.info("pub/sub: %s", publish.reason)
                continue
            self.published += 1
            # Out once the burst's copies for the queues are written: a subscriber never sees a message the
            # queues then forget in a crash. Every node's subscribers hear it.
            engine.tell_every_node(TOLD_KIND, emqp.published(publish.topic, publish.payload))
            name = emqp.queue_name(publish.topic)
            if not isinstance(name, str) or storage.failure is not None:
                continue
            # The depth policy: PUBLISH has no answer, so a queue kept full (reject) drops the copy for the
            # queues (counted in its rejected total, the subscribers still get it); drop-oldest is the engine's.
            refusal = engine.publish_refusal(name)
            if refusal is not None:
                self.rejected += 1
                self.refusals.note("publish rejected", f"pub/sub: PUBLISH to {name} not queued: {refusal}")
                continue
            # Who published is looked up only while something is traced.
            engine.publish(name, publish.payload, drop_if_unbound=True, origin=EMQP_ORIGIN, traced_id=message.msgid,
                           client=None if engine.tracer is None else identity_client(message.identity))


def _nothing_comes_in(batch: list[Frames]) -> None:
    """A PUB socket receives nothing."""
