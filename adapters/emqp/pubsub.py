"""EventMQ's pub/sub device: PUBLISH in on a ROUTER, `[topic, body]` out on a PUB socket.

As the original `emq-pubsub`: no ACK, no heartbeats, subscribers filter by topic prefix (ZeroMQ's
SUB), and nothing is kept for a subscriber that is not there. On top of it, each PUBLISH is also
published to the engine topic of that name, so NSQ channels, MQKS queues and PHPMQ, PZQ or eMQP
consumers of it get their copy; a topic no queue is bound to keeps nothing (fan-out only).
"""

from __future__ import annotations

import logging

import trio

from polymq.adapters.emqp.broker import ORIGIN as EMQP_ORIGIN
from polymq.adapters.zmq_pump import Frames, ZmqPump
from polymq.adapters.zmq_sockets import ZmqSockets
from polymq.codecs import emqp
from polymq.core.engine import Engine

log = logging.getLogger("polymq.emqp")


class EMQPPubSub:
    def __init__(self, engine: Engine, sockets: ZmqSockets) -> None:
        self.engine = engine
        self.published = 0
        self.invalid = 0
        incoming, outgoing = sockets.get("emqp-pubsub-in"), sockets.get("emqp-pubsub-out")
        self.incoming = ZmqPump(incoming, self._publish) if incoming is not None else None
        self.outgoing = ZmqPump(outgoing, lambda batch: None) if outgoing is not None else None

    @property
    def pumps(self) -> list[ZmqPump]:
        return [pump for pump in (self.incoming, self.outgoing) if pump is not None]

    async def run(self) -> None:
        async with trio.open_nursery() as nursery:
            for pump in self.pumps:
                nursery.start_soon(pump.run)

    def _publish(self, batch: list[Frames]) -> None:
        engine = self.engine
        storage = engine.storage
        storage.hold_work()  # the burst's copies: one write
        try:
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
                if self.outgoing is not None:
                    self.outgoing.send(emqp.published(publish.topic, publish.payload))
                name = emqp.queue_name(publish.topic)
                if isinstance(name, str) and storage.failure is None:
                    engine.publish(name, publish.payload, drop_if_unbound=True, origin=EMQP_ORIGIN)
        finally:
            storage.release_work()

    def shutdown(self) -> None:
        for pump in self.pumps:
            pump.close(linger_ms=200)
