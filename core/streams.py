"""Streams: queues read by position, for readers that replay (a Spark streaming query).

A stream is an ordinary queue bound to topics (so it gets its own copy of what they publish, like
an NSQ channel) with the `stream` option: nothing is dispatched to consumers. Each copy gets a
position as it becomes readable, higher than every earlier one; the store's own place for the copy
is its position, so positions survive a restart and never go back (the committed end is kept
with the queue, and new positions start above it). A reader asks where the stream ends, reads any
range `[start, end)` as often as it wants (the same copies each time), and commits an end: the
copies below it are finished. Nothing else removes a copy from a stream: no TTL, no timeout.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterable
from typing import Any, Protocol

from polymq.core.engine import STREAM_COMMITTED_OPTION, STREAM_OPTION, Engine, Queue
from polymq.core.message import Message

# Copies a snapshot reads back from disk at a time, checking its memory budget after each page.
SNAPSHOT_PAGE = 4096
# What one message read back costs besides its body: its object and list slot come to 187 bytes
# for 200-byte messages without headers (tracemalloc, 10,000 read back); rounded up for headers.
MESSAGE_OVERHEAD = 256


class StreamError(Exception):
    """A stream operation that cannot be done: the message says why, for the reader to show."""


class PositionsGone(StreamError):
    """A read below the committed end: those positions are gone."""

    def __init__(self, committed: int, message: str) -> None:
        super().__init__(message)
        self.committed = committed


class SharedStreams(Protocol):
    """Streams kept by a shared engine rather than in the node's queues: the same positions and rows on
    every node (`polymq.jetstream.streams`). Each call awaits the shared engine."""

    async def open(self, name: str, topics: Iterable[str]) -> dict[str, Any]: ...

    async def positions(self, name: str) -> dict[str, Any]: ...

    async def range_after(self, name: str, begin: int, rows: int | None) -> tuple[dict[str, Any], int, int]: ...

    async def split(self, name: str, begin: int, until: int, parts: int) -> tuple[list[int], int]: ...

    async def read(self, name: str, begin: int, until: int, limit: int) -> tuple[str, list[Message], list[int]]: ...

    async def commit(self, name: str, until: int) -> tuple[dict[str, Any], int]: ...

    async def load_dedup(self, group: str) -> None:
        """What every node published under a de-duplication group, known here before a publish decides."""

    async def snapshot(self, name: str, max_read_back: int) -> tuple[list[Message], int, str]:
        """Every message queue (or stream) `name` holds now, whichever node holds it, the memory the copies read
        back take, and the key every node of the cluster answers for it; SnapshotTooLarge past `max_read_back`
        bytes."""


def open_stream(engine: Engine, name: str, topics: Iterable[str], origin: str | None = None) -> Queue:
    """The stream `name`, made if missing (by `origin`), bound to `topics` as well (bindings are only
    added: a reader naming fewer topics leaves the others' copies coming)."""
    if engine.streams_refused is not None:
        raise StreamError(engine.streams_refused)
    queue = engine.queue(name)
    if queue is None:
        queue = engine.ensure_queue(name, options={STREAM_OPTION: True}, origin=origin)
    elif not queue.stream:
        raise StreamError(f"queue {name} exists and is not a stream (it has consumers, not positions)")
    for topic in topics:
        engine.bind(name, topic)
    return queue


def stream(engine: Engine, name: str) -> Queue:
    if engine.streams_refused is not None:
        raise StreamError(engine.streams_refused)
    queue = engine.queue(name)
    if queue is None:
        raise StreamError(f"no stream {name}")
    if not queue.stream:
        raise StreamError(f"queue {name} is not a stream")
    return queue


def committed(queue: Queue) -> int:
    return int(queue.options.get(STREAM_COMMITTED_OPTION, 0))


def end(queue: Queue) -> int:
    """The position after every copy readable now (copies that come later get this one or higher)."""
    if queue.log is not None:
        return queue.log.next_position()
    return queue.next_memory_position


def start(queue: Queue) -> int:
    """The lowest position that may still be read: the committed end, or the first copy above it."""
    _drop_committed(queue)  # what is left in memory now starts the stream, unless nothing is
    return queue.ready[0].pos if queue.ready else max(committed(queue), end(queue))


def _drop_committed(queue: Queue) -> None:
    """Finish copies below the committed end still held (a crash between a commit's two records)."""
    floor = committed(queue)
    ready, log = queue.ready, queue.log
    while True:
        while ready and ready[0].pos < floor:
            message = ready.popleft()
            if log is not None:
                log.removed(message)
        if ready or not queue._refill():
            return


# Copies read back from disk at a time for a reader's range: a whole batch in one pass over the
# segment (a big record, a publish of thousands of rows, is read and checked once, not per 1,024).
STREAM_REFILL = 65_536


def _load_until(queue: Queue, begin: int, until: int, limit: int | None) -> None:
    """Read spilled copies back until every copy below `until` is in memory, or `limit` copies from
    `begin` are (a reader's batch, not the whole backlog), or none is left."""
    ready = queue.ready
    while queue.spilled and (not ready or ready[-1].pos < until - 1):
        wanted = STREAM_REFILL
        if limit is not None:
            wanted = limit - (len(ready) - bisect.bisect_left(ready, begin, key=_position))
            if wanted <= 0:
                return
        if not queue._refill(min(wanted, STREAM_REFILL)):
            return


def end_after(queue: Queue, begin: int, rows: int | None) -> int:
    """The end of a range from `begin` holding at most `rows` copies (None: all there are)."""
    return range_after(queue, begin, rows)[0]


def range_after(queue: Queue, begin: int, rows: int | None) -> tuple[int, int]:
    """The end of a range from `begin` holding at most `rows` copies, and how many it holds (None:
    every copy there is, not counted: -1). Positions are not dense (a restart starts a new segment,
    core/disk_storage.py), so only the count says whether a range holds anything."""
    latest = end(queue)
    if rows is None:
        return latest, -1
    _drop_committed(queue)
    ready = queue.ready
    first = bisect.bisect_left(ready, begin, key=_position)
    while len(ready) - first <= rows and queue.spilled:  # the copy after the range too: its position
        if not queue._refill(min(STREAM_REFILL, rows + 1 - (len(ready) - first))):
            break
    if len(ready) - first <= rows:
        return latest, len(ready) - first
    return ready[first + rows].pos, rows


def read(queue: Queue, begin: int, until: int, limit: int | None = None) -> list[Message]:
    """The copies with `begin <= position < until`, in order; at most `limit` of them."""
    if begin < committed(queue):
        raise StreamError(f"positions below {committed(queue)} of stream {queue.name} were committed "
                          f"(asked from {begin})")
    _drop_committed(queue)
    _load_until(queue, begin, until, limit)
    ready = queue.ready
    first = bisect.bisect_left(ready, begin, key=_position)
    last = bisect.bisect_left(ready, until, lo=first, key=_position)
    if limit is not None:
        last = min(last, first + limit)
    return list(itertools.islice(ready, first, last))  # a deque: indexing walks, slicing does not


def commit(engine: Engine, queue: Queue, until: int) -> int:
    """Finish every copy below `until`; returns how many. A lower end than before changes nothing."""
    if until <= committed(queue):
        return 0
    queue.options[STREAM_COMMITTED_OPTION] = until
    engine._save_queue(queue)
    ready, log = queue.ready, queue.log
    finished = 0
    while True:
        while ready and ready[0].pos < until:
            message = ready.popleft()
            finished += 1
            if log is not None:
                log.removed(message)
        if ready or not queue._refill():
            return finished


class SnapshotTooLarge(StreamError):
    pass


def snapshot(queue: Queue, max_read_back: int) -> tuple[list[Message], int]:
    """Every message the queue holds now, without taking any: in flight, ready (in order, those on
    disk read back as copies), then deferred. Any queue, not only streams (a batch read).

    Returns the messages and the memory the copies read back from disk take (bodies plus
    `MESSAGE_OVERHEAD` each); past `max_read_back` bytes it stops reading and raises
    SnapshotTooLarge (what is in memory already costs a snapshot nothing but references)."""
    held = [*queue.in_flight.values(), *queue.ready]
    read_back = 0
    log = queue.log
    if log is not None and log.spilled:
        pages = log.peek_pages(SNAPSHOT_PAGE)
        try:
            for page in pages:
                read_back += sum(len(message.body) for message in page) + MESSAGE_OVERHEAD * len(page)
                if read_back > max_read_back:
                    raise SnapshotTooLarge(
                        f"a snapshot of {queue.name} would read back more than {max_read_back >> 20} MiB from disk")
                held += page
        finally:
            pages.close()  # the log's reader goes back to where it was
    held += [message for _, _, message in sorted(queue.deferred)]
    return held, read_back


def _position(message: Message) -> int:
    return message.pos
