"""Publishes of several messages at once (NSQ `MPUB` and nsqd's `/mpub`, a stream's row batch, an MQKS or eMQP
burst handed over together) as JetStream atomic batches: all of a batch is stored, or none of it, which is
nsqd's promise for an MPUB, and the servers pay their quorum's wait once per batch, not per message.

A batch is its messages on the topic's subject with `Nats-Batch-Id` and `Nats-Batch-Sequence` (1, 2, …), the
last one with `Nats-Batch-Commit: 1` sent as a request: JetStream answers it with one publish ack for the batch
(`{"batch", "count", "seq"}`, seq the last message's), or an error, and stores nothing without a commit (a
batch whose link broke midway is dropped by the server after 10 s). Its first message keeps its `Nats-Msg-Id`,
so a batch asked again after its answer was lost is refused as a duplicate (`10201`), which means it is stored.
JetStream keeps the batch headers with each message: a node's batch id ends with its first message's id and
origin (`api.batch_tag`), and a message whose id is the first's plus its place, of the same origin, goes
without its id and origin, with no header at all if it needs no other (each costs the servers:
docs/performance.md).
Streams need `allow_atomic` (nats-server 2.12+; `api.stream_config`); a stream without it (made by an older
release and not updated) is published to one message at a time.

Limits are nats-server's defaults: BATCH_MAX messages a batch, and a stream takes 50 batches in flight from all
its publishers; a node keeps IN_FLIGHT per topic and queues the rest. `polymq bench jetstream` publishes with
the same class straight to a stream, as a client that batches.
"""

from __future__ import annotations

import itertools
import logging
import secrets
from collections import deque
from collections.abc import Callable
from typing import Any

from polymq.core.clock import Clock
from polymq.jetstream import api
from polymq.jetstream.nats_connection import (
    ConnectionLost,
    Msg,
    NatsConnection,
    NatsError,
    NoResponders,
    RequestTimeout,
)

log = logging.getLogger("polymq.jetstream")

HEADER_BATCH_ID = api.HEADER_BATCH_ID
HEADER_BATCH_SEQUENCE = api.HEADER_BATCH_SEQUENCE
HEADER_BATCH_COMMIT = "Nats-Batch-Commit"
# nats-server's `jetstream.limits.batch.max_msgs` default: a batch of more is refused (10199).
BATCH_MAX = 1000
# Batches in flight per topic from one node: several, so the servers' replication of one overlaps the next one's
# arrival, well under a stream's 50 (`max_inflight_per_stream`) with a few nodes publishing.
IN_FLIGHT = 8
# JetStream's refusals of a batch (err_code): its start never reached the server (the link broke midway), the
# stream has its 50 batches in flight (other nodes' too): both asked again; the stream does not take batches;
# a message of it was stored before (the batch asked again after its answer was lost: stored).
ERR_BATCH_INCOMPLETE = 10176
ERR_BATCH_TOO_MANY = 10210
ERR_BATCH_DISABLED = 10174
ERR_BATCH_DUPLICATE = 10201
RETRY_S = 0.1

Item = tuple[bytes, dict[str, str]]  # a message's body and headers
# What a batch's publisher is told once: how many messages it stored now (0 for one stored before), or why not.
Answered = Callable[[int, Exception | None], None]
# Runs a function with its arguments at a time of the clock (the engine's timers); None: a batch is not asked again.
Schedule = Callable[..., Any] | None


class Batches:
    """One node's atomic batches, by topic (see the module's text)."""

    def __init__(self, connection: NatsConnection, clock: Clock, schedule: Callable[[], Schedule],
                 in_flight: int = IN_FLIGHT) -> None:
        self.connection = connection
        self.clock = clock
        self._schedule = schedule  # asked at each retry: the node's engine may come after the link
        self.in_flight = in_flight
        self._prefix = secrets.token_hex(6)  # batch ids are unique per node and per life of it
        self._numbers = itertools.count(1)
        self._in_flight: dict[str, int] = {}
        self._waiting: dict[str, deque[tuple[list[Item], float, Answered, str]]] = {}
        self.plain: set[str] = set()  # topics whose stream takes no batches
        self.sent = 0  # batches committed
        self.retried = 0  # batches asked again (no answer, or incomplete at the server)

    def publish(self, topic: str, items: list[Item], deadline: float, answered: Answered, tag: str = "") -> None:
        """Store `items` (at most BATCH_MAX) as one batch on the topic's stream, asked again until `deadline`;
        `tag` ends the batch's id (`api.batch_tag`: what its messages without headers of their own are)."""
        if self._in_flight.get(topic, 0) >= self.in_flight:
            self._waiting.setdefault(topic, deque()).append((items, deadline, answered, tag))
            return
        self._in_flight[topic] = self._in_flight.get(topic, 0) + 1

        def done(stored: int, error: Exception | None) -> None:
            self._in_flight[topic] -= 1
            waiting = self._waiting.get(topic)
            if waiting:
                self.publish(topic, *waiting.popleft())
                if not waiting:
                    del self._waiting[topic]
            answered(stored, error)

        self._attempt(topic, items, deadline, done, tag)

    def _attempt(self, topic: str, items: list[Item], deadline: float, done: Answered, tag: str) -> None:
        connection = self.connection
        subject = api.topic_subject(topic)
        batch = f"{self._prefix}-{next(self._numbers)}{tag}"

        def again() -> bool:
            retry_at = self.clock.now() + RETRY_S
            schedule = self._schedule()
            if retry_at >= deadline or schedule is None:
                return False
            self.retried += 1
            schedule(retry_at, self._attempt, topic, items, deadline, done, tag)
            return True

        def answer(reply: Msg | NatsError) -> None:
            if isinstance(reply, NoResponders | RequestTimeout | ConnectionLost):
                if not again():
                    done(0, reply)
                return
            try:
                ack = api.parse_batch_ack(reply.payload)
            except api.JetStreamError as error:
                if error.err_code == ERR_BATCH_DUPLICATE:
                    done(0, None)  # an earlier try of it was stored
                elif error.err_code in (ERR_BATCH_INCOMPLETE, ERR_BATCH_TOO_MANY) and again():
                    pass
                elif error.err_code == ERR_BATCH_DISABLED:
                    log.warning("the stream of topic %r takes no atomic batches (made by an older release): its "
                                "publishes of several messages are stored one at a time", topic)
                    self.plain.add(topic)
                    done(0, error)
                else:
                    done(0, error)
                return
            except (ValueError, KeyError) as error:
                done(0, error)
                return
            self.sent += 1
            done(ack, None)

        last = len(items)
        try:
            for number, (body, headers) in enumerate(items, 1):
                marked = {**headers, HEADER_BATCH_ID: batch, HEADER_BATCH_SEQUENCE: str(number)}
                if number < last:
                    connection.publish(subject, body, headers=marked)
                else:
                    marked[HEADER_BATCH_COMMIT] = "1"
                    connection.request_nowait(subject, body, answer, headers=marked,
                                              timeout=max(deadline - self.clock.now(), 0.001))
        except NatsError as error:  # refused before it left (over max_payload, or closed): no commit, nothing stored
            done(0, error)
