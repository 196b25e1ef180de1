"""The skeleton PZQ, the eMQP broker and eMQP's pub/sub device share: their ZeroMQ sockets, one pump
each (`adapters/zmq_pump.py`), held to the same store barrier as the TCP sessions (`adapters/session.py`).

- **Bursts.** Each socket's handler gets everything that was waiting on it at once, with the store
  held (`Storage.hold_work`): what the burst changed is written in one go at its end
  (`release_work`), and right after that the output the burst queued on any of the service's pumps
  is sent from here, without waiting for the pumps' turns (a round trip costs no task switch). A
  pump waiting for its socket is woken only when EVENTS says it has something to do: a send from
  elsewhere wakes no pump that would only find nothing and wait again (`ZmqPump.settle`).
- **The store barrier.** A delivery of a durable queue is queued with `deliver`: it leaves only
  once the store has written its attempt record, and with it the ADD records of what was published
  before it (the pump calls `Storage.write_now` before it sends; a no-op when nothing waits). So a
  process crash never brings a message back with fewer attempts than a consumer saw, and never
  forgets a message a consumer got.
- **Answers that promise durability** (a PZQ producer's ACK, eMQP's "dispatched" REPLY) are sent
  from the store's callback (`send_when_stored`), once what the burst published is stored under
  `--fsync`. The burst asks for that callback after its deliveries are out, so they do not wait
  for the start of the fdatasync.
- **Order.** Answers and deliveries on one socket leave in the order they were queued.

A protocol subclasses `ZmqService`, makes its pumps with `add_pump` and turns frames into engine
calls; `run` and `shutdown` are the gateway's.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import trio
import zmq

from polymq.adapters.log_limit import RateLimitedLog
from polymq.adapters.traffic import Traffic
from polymq.adapters.zmq_pump import Frames, ZmqPump
from polymq.core.engine import Engine
from polymq.core.storage import SyncCallback

Handler = Callable[[list[Frames]], None]
# Turns an answer that promised durability into what is sent when the store failed to store.
Refusal = Callable[[Frames, OSError], Frames]


class ZmqService:
    # What a socket still tries to send for a peer after `shutdown` closed it, in ms.
    linger_ms = 0
    log = logging.getLogger("polymq.zmq")  # a protocol's service names its own

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.refusals = RateLimitedLog(self.log)  # refused requests, summed up when they repeat
        self.pumps: dict[str, ZmqPump] = {}  # by socket name, in the order they were made
        self.traffic = Traffic()  # its errors by code (the pumps count the messages)
        # The store callbacks a burst asked for, registered once its deliveries are out (`_held`).
        self._when_stored: list[SyncCallback] | None = None

    def add_pump(self, name: str, sock: zmq.Socket | None, handler: Handler) -> ZmqPump | None:
        """The pump of `sock` (None when that socket was not made): `handler` gets its bursts with the
        store held, and its queued deliveries wait for the store's write."""
        if sock is None:
            return None
        pump = ZmqPump(sock, self._held(handler), barrier=self.engine.storage.write_now)
        self.pumps[name] = pump
        return pump

    def _held(self, handler: Handler) -> Handler:
        storage = self.engine.storage
        pumps = self.pumps.values()  # a view: pumps added later are flushed too

        def handle(batch: list[Frames]) -> None:
            when_stored: list[SyncCallback] = []
            self._when_stored = when_stored
            for pump in pumps:
                pump.held = True  # a send wakes no pump before the flush below
            storage.hold_work()  # one write for the whole burst
            try:
                handler(batch)
            finally:
                self._when_stored = None
                for pump in pumps:
                    pump.held = False
                storage.release_work()  # the burst's records are written here
            for pump in pumps:
                if pump.outgoing:
                    pump.flush()
                if pump.settle_due:
                    pump.settle()  # wakes it only if it has something left to do
            if when_stored:
                # Only now, after the deliveries: they wait for the records' write, not for the
                # fdatasync these answers wait for, whose start costs more than the write.
                storage.hold_work()
                for callback in when_stored:
                    storage.sync(callback)
                storage.release_work()

        return handle

    async def run(self) -> None:
        async with trio.open_nursery() as summaries:
            summaries.start_soon(self.refusals.run)  # the summaries of repeated refusals
            async with trio.open_nursery() as nursery:
                for pump in self.pumps.values():
                    nursery.start_soon(pump.run)
            summaries.cancel_scope.cancel()  # the sockets are closed: nothing more is refused

    def shutdown(self) -> None:
        """Close every socket (their pumps end); what is queued gets `linger_ms` to go out."""
        for pump in self.pumps.values():
            pump.close(self.linger_ms)

    @staticmethod
    def deliver(pump: ZmqPump, frames: Frames, durable: bool) -> None:
        """A delivery: of a durable queue, once its attempt record is written; else at once."""
        if durable:
            pump.send_delivery(frames)
        else:
            pump.send(frames)

    def send_when_stored(self, pump: ZmqPump, answers: list[Frames], refusal: Refusal) -> None:
        """Send `answers` on `pump`, in order, once every change reported so far (in a burst: the
        whole burst) is stored under `--fsync`; if the store failed, what `refusal` makes of each instead."""

        def stored(error: OSError | None) -> None:
            if error is None:
                for answer in answers:
                    pump.send(answer)
            else:
                for answer in answers:
                    pump.send(refusal(answer, error))

        if self._when_stored is not None:
            self._when_stored.append(stored)
        else:
            self.engine.storage.sync(stored)
