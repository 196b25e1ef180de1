"""Messages a topic's stream keeps that no consumer's leader owes anyone, and what a node does about them.

In a stream with interest retention a message stays while some consumer has not acknowledged it, each server
deciding on its own replica of each consumer. The replicas of a consumer can come apart: seen with nats-server
2.15.1 after one server was SIGKILLed three times within seconds, a consumer's new leader held none of nine
deliveries that its two followers still had pending. The leader said it owed nothing, so nothing gave them
again, while the stream's leader, on its own replica's word, kept them: lost to every client, and kept for good.

A node's reading of the cluster (`Topology`) sees every consumer of a topic as its leader reports it. When all
of them owe nothing (nothing pending, nothing given out) and the stream still holds a message at or below every
consumer's acknowledged floor, and the same holds at the next check `CHECK_EVERY_S` later, the node steps down
the leaders of the stream's consumers: a follower that still holds the deliveries takes over and gives them
again (an attempt more, never a loss). A consistent cluster never shows this: what every consumer acknowledged
leaves an interest stream at once on every replica.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Any

import attrs

from polymq.core.clock import Clock
from polymq.jetstream import api
from polymq.jetstream.nats_connection import NatsConnection, NatsError

log = logging.getLogger("polymq.jetstream")

# A topic whose consumers owe nothing is checked at most this often (one STREAM.INFO), and its consumers'
# leaders are stepped down only when two checks this far apart found the same kept message: replicas apply an
# acknowledgement a moment apart, and a lagging one catches up within seconds.
CHECK_EVERY_S = 10.0
# Retentions under which a stream keeps only what some consumer still owes (JetStream's names).
OWED_RETENTIONS = frozenset({"interest", "workqueue"})


@attrs.frozen(slots=True)
class Owed:
    """What a topic's consumers, as their leaders report them, still owe."""

    anything: bool  # some consumer has messages not given yet, or given and not acknowledged
    floor: int  # the lowest acknowledged floor among them (stream sequence): everything at or below is done
    signature: tuple[tuple[str, str, int], ...]  # (consumer, leader, floor) each: what a new check looks for


def owed(infos: Iterable[Mapping[str, Any]]) -> Owed | None:
    """What the consumers of a CONSUMER.LIST owe; None when there are none."""
    floors: list[tuple[str, str, int]] = []
    anything = False
    for info in infos:
        if int(info.get("num_pending", 0)) or int(info.get("num_ack_pending", 0)):
            anything = True
        floor = int((info.get("ack_floor") or {}).get("stream_seq", 0))
        floors.append((str(info.get("name", "")), str((info.get("cluster") or {}).get("leader", "")), floor))
    if not floors:
        return None
    return Owed(anything, min(floor for _, _, floor in floors), tuple(sorted(floors)))


def kept_unowed(stream_info: Mapping[str, Any], floor: int) -> int:
    """The first sequence of a message the stream keeps at or below `floor` that no consumer owes; 0 if none."""
    config = stream_info.get("config") or {}
    if config.get("retention") not in OWED_RETENTIONS:
        return 0
    state = stream_info.get("state") or {}
    first = int(state.get("first_seq", 0))
    if int(state.get("messages", 0)) and 0 < first <= floor:
        return first
    return 0


@attrs.define(slots=True)
class Orphans:
    connection: NatsConnection
    clock: Clock
    clean: dict[str, tuple[tuple[str, str, int], ...]] = attrs.Factory(dict)  # topic -> what was checked clean
    checked_at: dict[str, float] = attrs.Factory(dict)
    suspected: dict[str, int] = attrs.Factory(dict)  # topic -> the kept message's sequence found last check
    stepped_down: int = 0  # times this node stepped a stream's consumers' leaders down

    def forget(self, topic: str) -> None:
        self.clean.pop(topic, None)
        self.checked_at.pop(topic, None)
        self.suspected.pop(topic, None)

    async def check(self, topic: str, listing: api.ConsumerListing) -> None:
        """After a read of the topic's consumers: check the stream when they owe nothing (`CHECK_EVERY_S`, and
        again only when a consumer's leader or floor changed since it was found clean)."""
        found = owed(listing.infos)
        if found is None or found.anything or listing.unread:
            self.suspected.pop(topic, None)
            self.clean.pop(topic, None)
            return
        now = self.clock.now()
        if self.clean.get(topic) == found.signature or now - self.checked_at.get(topic, -CHECK_EVERY_S) < CHECK_EVERY_S:
            return
        self.checked_at[topic] = now
        stream = api.topic_stream(topic)
        try:
            info = await api.api(self.connection, f"STREAM.INFO.{stream}", timeout=api.API_ATTEMPT_S)
            first = kept_unowed(info, found.floor)
        except NatsError:
            return  # read again at the next check
        if not first:
            self.clean[topic] = found.signature
            self.suspected.pop(topic, None)
            return
        if self.suspected.get(topic) != first:
            self.suspected[topic] = first
            return
        del self.suspected[topic]
        self.stepped_down += 1
        log.warning("JetStream keeps messages of topic %r from sequence %d that none of its consumers' leaders "
                    "owes: the leaders are stepped down, so a replica that still owes them gives them again",
                    topic, first)
        for name, _, _ in found.signature:
            try:
                await api.api(self.connection, f"CONSUMER.LEADER.STEPDOWN.{stream}.{name}",
                              timeout=api.API_ATTEMPT_S)
            except NatsError as error:  # one replica, or a leader already moving: the others still go
                log.info("stepping down the leader of consumer %r of topic %r: %s", name, topic, error)
