"""Deferred publishes (NSQ `DPUB`) on JetStream: kept in one work-queue stream until they are due.

A deferred message is published to `polymq.deferred.<topic>` in the stream `POLYMQ_DEFERRED`, with its
due time and its topic as headers. Every node reads that stream's one consumer (they compete for its
messages): one not due yet is handed back with `-NAK` and the delay left, so JetStream itself keeps
the time; one that is due is published to its topic (with its own `Nats-Msg-Id`, so a node that dies
between the two steps and the next one that moves it store it once) and then acknowledged. The
topic's queues get it as a fresh publish: its first delivery is its first attempt, as on nsqd.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import trio

from polymq.core.message import Message
from polymq.jetstream import api
from polymq.jetstream.nats_connection import NO_RESPONDERS, Msg, NatsError

if TYPE_CHECKING:
    from polymq.jetstream.backend import JetStreamLink

log = logging.getLogger("polymq.jetstream")

STREAM = "POLYMQ_DEFERRED"
SUBJECT_PREFIX = "polymq.deferred."
CONSUMER = "polymq-mover"
HEADER_DUE = "Polymq-Due"  # wall-clock ns when it is due
HEADER_TOPIC = "Polymq-Topic"
# Messages one pull asks for, and how long it waits for them before asking again.
BATCH = 64
PULL_EXPIRES_S = 5.0
# A move whose publish failed, or a pull that found the consumer electing a leader, is tried again
# after this long.
RETRY_S = 1.0
# A message whose mover died (its node went) is moved by another after this long.
ACK_WAIT_S = 30.0


def stream_config(replicas: int) -> dict[str, Any]:
    return {"name": STREAM, "subjects": [SUBJECT_PREFIX + ">"], "retention": "workqueue", "storage": "file",
            "num_replicas": replicas, "discard": "old", "allow_msg_ttl": True}


def consumer_config() -> dict[str, Any]:
    return {"durable_name": CONSUMER, "ack_policy": "explicit", "ack_wait": int(ACK_WAIT_S * 1e9),
            "max_deliver": -1, "deliver_policy": "all", "max_waiting": 512, "max_ack_pending": -1}


class DeferredMover:
    def __init__(self, link: JetStreamLink) -> None:
        self.link = link
        self.connection = link.connection
        self.moved = 0
        self._request_done = trio.Event()
        self._received = 0
        self._no_leader = False  # the last request found the consumer without a leader

    async def prepare(self, replicas: int) -> None:
        try:
            await api.api(self.connection, f"STREAM.CREATE.{STREAM}", stream_config(replicas))
        except api.JetStreamError as error:
            if error.err_code != api.ERR_STREAM_NAME_IN_USE:
                raise
        await api.api(self.connection, f"CONSUMER.CREATE.{STREAM}.{CONSUMER}",
                      {"stream_name": STREAM, "config": consumer_config()})

    def defer(self, topic: str, message: Message, due_wall_ns: int, stored: Callable[[Exception | None], None],
              headers: dict[str, str]) -> None:
        """Keep `message` until `due_wall_ns`; `stored` is told once it is kept."""
        headers = {**headers, HEADER_DUE: str(due_wall_ns), HEADER_TOPIC: topic,
                   api.HEADER_MSG_ID: f"deferred-{message.id}"}

        def answered(reply: Msg | NatsError) -> None:
            stored(api.publish_failure(reply))

        try:
            self.connection.request_nowait(SUBJECT_PREFIX + api.token(topic), message.body, answered, headers=headers,
                                           timeout=self.link.settings.publish_timeout_s)
        except NatsError as error:
            stored(error)

    async def run(self) -> None:
        """Pull the due messages, a request at a time, for as long as the node runs."""
        inbox = self.connection.new_inbox()
        self.connection.subscribe(inbox, self._on_message)
        subject = f"$JS.API.CONSUMER.MSG.NEXT.{STREAM}.{CONSUMER}"
        while True:
            self._request_done = trio.Event()
            self._received = 0
            self._no_leader = False
            try:
                self.connection.publish(subject, api.pull_request(BATCH, PULL_EXPIRES_S), reply=inbox)
            except NatsError:
                await trio.sleep(RETRY_S)
                continue
            with trio.move_on_after(PULL_EXPIRES_S + 1.0):  # the request's end, or a link lost meanwhile
                await self._request_done.wait()
            if self._no_leader:  # answered at once while a leader is elected: not a loop as fast as the link
                await trio.sleep(RETRY_S)

    def _on_message(self, msg: Msg) -> None:
        if msg.status is not None:
            if msg.status != 100:  # not a heartbeat: the request ended
                self._no_leader = msg.status == NO_RESPONDERS
                self._request_done.set()
            return
        self._received += 1
        if self._received >= BATCH:
            self._request_done.set()
        if msg.reply is None:
            return
        headers = msg.headers or {}
        try:
            due = int(headers[HEADER_DUE])
            topic = headers[HEADER_TOPIC]
        except (KeyError, ValueError):
            self.connection.publish(msg.reply, api.TERM)  # not polymq's: nothing to move it to
            return
        left_ns = due - self.link.clock.wall_ns()
        if left_ns > 0:
            self.connection.publish(msg.reply, api.nak(left_ns / 1e9))  # JetStream keeps the time
            return
        message = self.link.message_of(topic, msg, attempts=0, fallback_id=0, fallback_timestamp=due)
        reply = msg.reply

        def stored(error: Exception | None) -> None:
            if error is None:
                self.moved += 1
                self.link.moved(topic)
                self.connection.publish(reply, api.ACK)
            else:
                log.warning("a deferred message of %r was not moved yet: %r", topic, str(error))
                self.connection.publish(reply, api.nak(RETRY_S))

        self.link.publish_to(topic, [message], stored)
