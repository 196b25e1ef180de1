"""Requeueing a queue's dead letters on JetStream (`POST /api/queue/requeue-dead` on a node of a cluster).

The letters are the cluster's: whatever its dead-letter topic's stream keeps, whichever node made them and
whether or not a node fetched them. Each message goes back once, however many letters of it there are, as
with the embedded store (core/dead_letters.py): a copy with its id, body, time, origin and own headers, no
attempts, stored at the queue's tail (the queue's own subject of its first topic's stream) before any letter
goes. Only then are the letters read purged from the stream, so a node that dies in between leaves a message
twice, never nowhere. Unlike the embedded store, a letter a reader of the dead-letter topic holds in flight
goes back too (JetStream does not say which sequences a consumer holds), and one a node fetched for such a
reader before the purge may still reach it; its ack then finds it gone.

One request holds at most MAX_REQUEUE_BYTES of letters: it moves those first in the stream, purges only them,
and says how many it left (`left`); asking again moves the next ones.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import trio

from polymq.core.dead_letters import Requeued, returned
from polymq.core.message import Message
from polymq.core.shared import SharedQueue
from polymq.jetstream import api
from polymq.jetstream.nats_connection import Msg, NatsError
from polymq.jetstream.streams import DIRECT_BATCH, allow_direct, direct_get

if TYPE_CHECKING:
    from polymq.jetstream.backend import JetStreamLink

# The letters' bodies and headers one request reads into memory: with nsqd's largest message (1 MiB) at least
# 64 letters, with the 200-byte messages of the benches some 300,000.
MAX_REQUEUE_BYTES = 64 * 1024 * 1024


class RequeueFailed(OSError):
    """The cluster did not answer, or a copy could not be stored: no letter went (asking again moves them, each
    once)."""


async def requeue_dead(link: JetStreamLink, queue: SharedQueue) -> Requeued:
    try:
        return await _requeue_dead(link, queue)
    except NatsError as error:  # JetStream's refusals included
        raise RequeueFailed(f"the JetStream cluster: {error}") from None


async def _requeue_dead(link: JetStreamLink, queue: SharedQueue) -> Requeued:
    dead_topic = queue.dead_letter_topic
    if not queue.topics:
        raise RequeueFailed(f"queue {queue.name[:80]!r} is bound to no topic: its copies have nowhere to be stored")
    home = queue.topics[0]
    stream = api.topic_stream(dead_topic)
    try:
        state = (await api.api(link.connection, f"STREAM.INFO.{stream}"))["state"]
    except api.JetStreamError as error:
        if error.err_code == api.ERR_STREAM_NOT_FOUND:
            return Requeued(0, 0)
        raise
    last = int(state["last_seq"])
    if not state["messages"]:
        return Requeued(0, 0)
    await allow_direct(link.connection, stream)
    letters: dict[int, tuple[Message, int]] = {}
    seq = int(state["first_seq"])
    read = size = 0
    while seq <= last and size < MAX_REQUEUE_BYTES:
        # A page stops at the bytes left (nats-server gives at least one message).
        request = {"seq": seq, "batch": DIRECT_BATCH, "max_bytes": MAX_REQUEUE_BYTES - size}
        page = [(msg, at) for msg, at in await direct_get(link.connection, stream, request, f"topic {dead_topic}")
                if at <= last]
        if not page:
            break
        for msg, at in page:
            letter = link.message_of(dead_topic, msg, attempts=0, fallback_id=at, fallback_timestamp=0)
            letters.setdefault(letter.id, (letter, at))
            size += len(msg.payload) + sum(len(key) + len(value) for key, value in (msg.headers or {}).items())
        read += len(page)
        seq = page[-1][1] + 1
    await _store_copies(link, queue, home, letters.values())
    # Up to the last letter read: what is after it (past the request's bytes, or made meanwhile) stays for the
    # next request.
    await api.api(link.connection, f"STREAM.PURGE.{stream}", {"seq": seq})
    return Requeued(len(letters), max(int(state["messages"]) - read, 0))


async def _store_copies(link: JetStreamLink, queue: SharedQueue, home: str,
                        letters: Iterable[tuple[Message, int]]) -> None:
    """Each letter's message stored at the queue's tail; raises RequeueFailed unless every one is."""
    subject = api.requeue_subject(home, queue.name)
    consumer = api.queue_consumer(queue.name)
    failures: list[Exception] = []
    left = 0
    done = trio.Event()

    def answered(reply: Msg | NatsError) -> None:
        nonlocal left
        failure = api.publish_failure(reply)
        if failure is not None:
            failures.append(failure)
        left -= 1
        if left == 0:
            done.set()

    deadline = link.clock.now() + link.settings.publish_timeout_s
    for letter, at in letters:
        left += 1
        # Keyed by the letter it comes from: asked again after a failure, it is stored once.
        headers = link.kept_headers(returned(letter), f"revived-{consumer}-{at}")
        link.publish_one(subject, letter.body, headers, deadline, answered)
    if left:
        await done.wait()
    if failures:
        raise RequeueFailed(f"{len(failures)} cop{'y' if len(failures) == 1 else 'ies'} not stored: {failures[0]}")
