"""Requeueing a queue's dead letters: what its dead-letter topic (`Queue.dead_letter_topic`) and the queues
bound to that hold goes back into the queue, for its consumers to try again.

Each message goes back once, however many dead-letter queues hold a copy of it: as a new copy with
its id, body, timestamp, origin and its own headers (the dead-letter ones dropped), no attempts, so
`max_attempts` counts afresh. Ready and deferred copies move (a deferred one keeps its due time);
copies in flight stay with the consumer reading them, and streams bound to the topic keep theirs
(a stream's copies are its reader's record). The new copies are handed to the OS before the old
ones are reported gone, so a process crash in between leaves a message twice, never nowhere.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from polymq.core.engine import (
    DEAD_LETTER_QUEUE_HEADER,
    DEAD_LETTER_REASON_HEADER,
    Engine,
    Queue,
)
from polymq.core.message import Message
from polymq.core.storage import OwnerLog

# Spilled copies read back from the disk at a time.
READ_BATCH = 4096


@attrs.frozen(slots=True)
class Requeued:
    moved: int  # messages put back into the queue
    left: int  # copies on their way to the disk, not readable yet: asking again moves them


def requeue_dead_letters(engine: Engine, queue: Queue) -> Requeued:
    topic = engine.topics.get(queue.dead_letter_topic)
    if topic is None:
        return Requeued(0, 0)
    engine.storage.write_now()  # spilled copies are read back from the disk: what is pending goes there first
    taken: list[tuple[Message, OwnerLog | None]] = [(message, topic.log) for message in topic.backlog]
    topic.backlog.clear()
    left = 0
    if topic.log is not None:
        taken += [(message, topic.log) for message in _read_spilled(topic.log)]
        left += topic.log.spilled
    for source in list(topic.queues):
        if source is queue or source.stream:
            continue
        taken += [(message, source.log) for message in _take_queued(source)]
        if source.log is not None:
            left += source.log.spilled
    moved: dict[int, Message] = {}
    for message, _ in taken:
        moved.setdefault(message.id, message)
    if engine.tracer is not None:  # before they go in: a consumer with credit takes one at once
        holders = [("topic", topic.name), *(("queue", source.name) for source in topic.queues if source is not queue)]
        engine.tracer.revived(queue, moved.values(), holders)
    for message in moved.values():
        queue._put(returned(message), message.due)
    engine.storage.write_now()  # the new copies before the old ones' end (see the module's doc)
    for message, log in taken:
        if log is not None:
            log.removed(message)
    return Requeued(len(moved), left)


def _read_spilled(log: OwnerLog) -> list[Message]:
    messages: list[Message] = []
    while log.spilled:
        batch = log.read(READ_BATCH)
        if not batch:
            break  # the rest is not on the disk yet
        messages += batch
    return messages


def _take_queued(queue: Queue) -> list[Message]:
    """Every ready and deferred copy of `queue`, taken out of it (those in flight stay)."""
    messages = list(queue.ready)
    queue.ready.clear()
    messages += [message for _, _, message in sorted(queue.deferred)]
    queue.deferred.clear()
    if queue._deferred_timer is not None:
        queue._deferred_timer.cancel()
        queue._deferred_timer = None
    if queue.log is not None:
        messages += _read_spilled(queue.log)
    return messages


def returned(letter: Message) -> Message:
    """A dead letter back as a message of its own: its id, body, time, origin and own headers, no attempts."""
    headers: dict[str, Any] = dict(letter.headers) if isinstance(letter.headers, Mapping) else {}
    headers.pop(DEAD_LETTER_QUEUE_HEADER, None)
    headers.pop(DEAD_LETTER_REASON_HEADER, None)
    # The topic it was first published to is not kept with a dead letter: None lets each protocol
    # show the queue's own (MQKS's `event=`).
    return Message(letter.id, letter.body, letter.timestamp_ns, headers or None, None, 0, None, letter.origin,
                   letter.publisher_id)
