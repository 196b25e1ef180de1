"""Tracing across the nodes that share their queues (docs/operations.md, "Tracing a topic"): a topic traced on
one node is traced on every node, and each node tells the others its events, so any node's timeline shows a
message's whole path, each event naming the node it happened on (`<host>/<node number>`: two nodes on one
machine told apart).

Switches and events go to every node as the engine tells them (`Engine.tell_every_node`: plain NATS, at most
once, so a node whose link is down misses what was told meanwhile); a node that starts asks the others what
they trace, and says what it traces itself. Events go in batches, one a tick (the trace topic's), at most
TOLD_BATCH a message. Each node publishes only its own events to the trace topic, which the nodes share: a
reader of it on any node gets every node's.
"""

from __future__ import annotations

import json
import logging
from collections import deque

import trio

from polymq.core.engine import Engine
from polymq.core.trace import Event, Tracer, event_json
from polymq.gateway.tracing import MAX_PENDING, PUBLISH_TICK_S

log = logging.getLogger("polymq.trace")

SWITCH_KIND = "trace-switch"  # [b"1" on | b"0" off, topic, node]
ASK_KIND = "trace-ask"  # [node]: every node says what it traces
EVENTS_KIND = "trace-events"  # [node, event JSON, ...]
# Events in one told message: each a few hundred bytes, the batch well under NATS's 1 MB max_payload.
TOLD_BATCH = 500
# A topic name another node tells is cut to this (nsqd's, MQKS's and the admin API's names are shorter).
MAX_NAME = 1000


class ClusterTrace:
    """This node's part in tracing across the nodes (see the module's text)."""

    def __init__(self, engine: Engine, tracer: Tracer, node: int) -> None:
        self.engine = engine
        self.tracer = tracer
        tracer.node = f"{tracer.node}/{node}"
        tracer.adopts = True
        self.pending: deque[Event] = deque()
        self.told = 0  # events told to the other nodes
        self.dropped = 0  # events past MAX_PENDING, not told
        self.absorbed = 0  # other nodes' events taken in
        engine.listeners[SWITCH_KIND] = self._on_switch
        engine.listeners[ASK_KIND] = self._on_ask
        engine.listeners[EVENTS_KIND] = self._on_events
        tracer.switched.append(self._switched)
        tracer.listeners.append(self._add)

    @classmethod
    def attach(cls, engine: Engine, tracer: Tracer) -> ClusterTrace | None:
        """For a node sharing its queues with others; None for a node on its own."""
        view = engine.cluster()
        return None if view is None else cls(engine, tracer, view.node)

    def start(self) -> None:
        self.engine.tell_every_node(ASK_KIND, [self._own()])
        for name in sorted(self.tracer.topics):
            self._switched(name, True)

    async def run(self) -> None:
        while True:
            await trio.sleep(PUBLISH_TICK_S)
            self.flush()

    def _own(self) -> bytes:
        return self.tracer.node.encode()

    # -- switches --------------------------------------------------------------------------------

    def _switched(self, name: str, on: bool) -> None:
        self.engine.tell_every_node(SWITCH_KIND, [b"1" if on else b"0", name.encode(), self._own()])

    def _on_switch(self, frames: list[bytes]) -> None:
        if len(frames) != 3 or frames[2] == self._own() or frames[0] not in (b"0", b"1"):
            return
        name = frames[1].decode("utf-8", "replace")[:MAX_NAME]
        if name in self.tracer.refused:
            return
        if frames[0] == b"1":
            if name not in self.tracer.topics:
                log.info("tracing topic %r (node %s)", name, frames[2].decode("utf-8", "replace")[:MAX_NAME])
            self.tracer.trace(name, told=True)
        elif name in self.tracer.topics:
            log.info("tracing topic %r off (node %s)", name, frames[2].decode("utf-8", "replace")[:MAX_NAME])
            self.tracer.untrace(name, told=True)

    def _on_ask(self, frames: list[bytes]) -> None:
        if frames and frames[0] != self._own():
            for name in sorted(self.tracer.topics):
                self._switched(name, True)

    # -- events ----------------------------------------------------------------------------------

    def _add(self, event: Event) -> None:
        if len(self.pending) >= MAX_PENDING:
            self.dropped += 1
            return
        self.pending.append(event)

    def flush(self) -> int:
        """Tell the other nodes what waits; returns how many events were told."""
        node, own, told = self.tracer.node, self._own(), 0
        while self.pending:
            batch = [self.pending.popleft() for _ in range(min(TOLD_BATCH, len(self.pending)))]
            self.engine.tell_every_node(EVENTS_KIND, [own, *(json.dumps(event_json(event, node),
                                                                         separators=(",", ":")).encode()
                                                              for event in batch)])
            told += len(batch)
        self.told += told
        return told

    def _on_events(self, frames: list[bytes]) -> None:
        if not frames or frames[0] == self._own():
            return  # this node's own, handed back by the engine
        for frame in frames[1:]:
            try:
                found = json.loads(frame)
            except ValueError:
                continue
            if isinstance(found, dict) and self.tracer.absorb(found):
                self.absorbed += 1
