"""The embedded durable store (docs/architecture.md): a meta journal and one segmented log per owner.

Layout under the data dir:
- `meta.log`: JSON records of topics, queues, bindings, options, pause state and the id high-water
  mark; rewritten compactly at every start.
- `t<uid>/` (a topic's backlog) and `q<uid>/` (a queue): segment files `0000000000.seg`, … of
  checksummed records (`records.py`): ADD (message copies with body), STATE (attempts and due time
  after a delivery or a return), DONE (copies gone). A queue deleted and made again gets a new uid,
  so records of the old one can never come back.

Why this design (measured, see docs/durability.md): appends of whole batches are cheap in Python (one
record per MPUB and queue, one `write` per file per commit) and one fdatasync per file per loop
turn covers every publish of that turn (group commit); SQLite spent more time per message in
the interpreter and loses later intact frames after a bad one, which recovery must never do.

Segments are deleted oldest first, once every copy they added is done; a record can only refer to
positions in its own or earlier segments, so deleting in that order never drops a record that a
live message still needs. Past `mem_queue_size` messages a queue keeps no objects: they stay in
the log and are read back in order (`OwnerLog.read`).

The store does bookkeeping on the loop and hands file work to the committer (`prepare` →
`CommitJob` run in a thread → `complete`), which calls the `sync` callbacks after the job's
fdatasync (`--fsync=always`) or after its writes (`interval`, `never`).
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
from array import array
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Final

import attrs

from polymq.core import records
from polymq.core.clock import Clock
from polymq.core.disk_io import CommitJob, FileWriter, SyncJob
from polymq.core.ids import IdSource
from polymq.core.message import Message, shown_headers
from polymq.core.storage import DataDirInUse, QueueRecord, Snapshot, SyncCallback, TopicRecord

log = logging.getLogger("polymq.storage")

# nsqd rolls its diskqueue files at 100 MiB (--max-bytes-per-file); smaller segments are freed sooner.
SEGMENT_BYTES = 64 * 1024 * 1024
# Bytes of an ADD record besides its entries: framing and the ADD head.
_ADD_OVERHEAD: Final = records.HEADER.size + records.ADD_HEAD.size
# Bytes read per `pread` when reading spilled messages back (nsqd reads through a 4 KiB bufio; bigger
# reads mean fewer system calls per message).
READ_CHUNK: Final = 256 * 1024
# Ids reserved ahead in the meta journal, so no id is reused after a restart without a journal write
# per publish.
ID_RESERVE: Final = 1 << 20
# Messages per queue (and topic backlog) kept as objects; the rest live on disk only (nsqd's --mem-queue-size).
MEM_QUEUE_SIZE: Final = 10_000
# A due time within this of now counts as reached: float seconds ↔ integer ns conversions round by a few ns.
DUE_TOLERANCE_NS: Final = 1_000
# Under `--fsync=always`, records no acknowledgement waits for (a consumer's finishes, delivery
# attempts, metadata) are fdatasynced at most this long after their write, with the next sync
# that a publish asks for or on their own: syncing each read of FINs cost a quarter of durable
# consume (docs/performance.md). A power loss in between brings such messages back (at least once).
UNAWAITED_SYNC_S: Final = 0.05
META_FILE: Final = "meta.log"
# Kinds of records kept by key in the meta journal (`kept_saved`): schedules, publish de-duplication.
KEPT_KINDS: Final = ("schedule", "dedup")
LOCK_FILE: Final = "LOCK"


@attrs.frozen(slots=True)
class FsyncPolicy:
    """`--fsync`: always (ack after fdatasync), interval:MS (ack after write, fdatasync every MS), never."""

    mode: str = "always"
    interval: float = 0.0

    @classmethod
    def parse(cls, text: str) -> FsyncPolicy:
        if text in ("always", "never"):
            return cls(text)
        if text.startswith("interval:"):
            milliseconds = text.removeprefix("interval:")
            if milliseconds.isdigit() and int(milliseconds) > 0:
                return cls("interval", int(milliseconds) / 1000)
        raise ValueError(f"--fsync must be always, never or interval:MS (MS > 0), not {text!r}")

    def __str__(self) -> str:
        return f"interval:{round(self.interval * 1000)}" if self.mode == "interval" else self.mode


def _segment_name(segment: int) -> str:
    return f"{segment:010d}.seg"


class OwnerLog:
    """The log of one durable queue or topic backlog: positions, live counts, spilled read-back."""

    def __init__(self, store: DiskStorage, directory: Path, *, is_topic: bool) -> None:
        self.store = store
        self.dir = directory
        # A topic backlog's log (written after the queues' logs in a commit); a queue that took a
        # topic's log over keeps its directory name but not this.
        self.is_topic = is_topic
        # Spilled copies may be deferred (a topic backlog spills them; a queue never does, unless it
        # took a topic's log over): its reader must check their due times.
        self.may_hold_deferred = is_topic
        self.segment = 0  # the active segment: new records go there
        self.segment_bytes = 0
        self.next_index = 0
        self.retained: deque[int] = deque([0])  # segments that exist (or will), oldest first
        self.live: dict[int, int] = {0: 0}  # copies added by each segment and not done yet
        # Records not yet handed to a commit; the last may be the open ADD record (`_OpenAdd`).
        self.pending: list[tuple[int, bytes | _OpenAdd]] = []
        self.done = array("Q")
        # Positions whose DONE goes in the commit after the next (`removed_after_next_write`).
        self.done_later = array("Q")
        # (position, attempts, due wall ns) triples: a list, whose extend is a few times cheaper per
        # delivery than an array's; made an array once per commit.
        self.states: list[int] = []
        self.unlinks: list[int] = []
        self.flushed: dict[int, int] = {}  # bytes of each segment on disk
        self.final_size: dict[int, int] = {}  # bytes of each segment that will get no more records
        self.dirty = False
        self.destroyed = False
        # Spilled: copies in the log only, read back in order from `cursor` (segment, record offset,
        # entries of that record already taken).
        self.spilled = 0
        self.cursor: tuple[int, int, int] | None = None
        # The ADD record the cursor stands in (segment, offset, payload): a refill takes at most a
        # batch of its copies, and a big record (an MPUB, a stream's publish) would be read and
        # CRC-checked again for every batch otherwise.
        self._held: tuple[int, int, bytes] | None = None  # the ADD record the cursor stands in, as read
        self.skip_bits: dict[int, bytearray] = {}  # positions the reader must pass over
        self._read_fd: tuple[int, int] | None = None  # (segment, fd)
        self.on_readable: Callable[[], None] | None = None
        # What recovery found, for the engine to take (`take_recovered`).
        self.recovered_ready: list[Message] = []
        self.recovered_deferred: list[Message] = []
        # (first position, copies, bytes) of a batch's ADD that is still the last pending record, and
        # the positions of the copies of the last pending ADD already gone: their DONE is held back
        # (see `removed`). A STATE naming one of its copies ends that (`_pin`).
        self._cancellable: tuple[int, int, int] | None = None
        self._withheld: list[int] = []
        # The ADD record single-copy appends of this loop turn share (publishers of one message at a
        # time); encoded at `_take`. Its size is counted in `segment_bytes` as it grows.
        self._open: _OpenAdd | None = None
        self._open_cancellable = False  # no STATE names a copy of it yet
        self._active_path: tuple[int, Path] | None = None

    def path(self, segment: int) -> Path:
        # The active segment's path is asked for at every commit: one object, whose hash the file
        # writer's dicts then find cached (building and hashing a new Path cost more than the write).
        cached = self._active_path
        if cached is not None and cached[0] == segment:
            return cached[1]
        path = self.dir / _segment_name(segment)
        if segment == self.segment:
            self._active_path = (segment, path)
        return path

    def bytes_on_disk(self) -> int:
        """The bytes of this log's records written to its segment files."""
        return sum(self.flushed.values())

    def is_blank(self) -> bool:
        """Nothing was ever added or reported: a log that can be swapped for another."""
        return (self.segment == 0 and self.next_index == 0 and not self.pending and not self.spilled
                and not self.done and not self.done_later and not self.states and not self.flushed
                and not self.destroyed)

    # -- writing -------------------------------------------------------------------------------

    def _mark_dirty(self) -> None:
        if not self.dirty:
            self.dirty = True
            self.store._dirty_log(self)

    def _emit(self, record: bytes) -> int:
        offset = self.segment_bytes
        self.pending.append((self.segment, record))
        self.segment_bytes += len(record)
        self._mark_dirty()
        return offset

    def _roll(self) -> None:
        self.final_size[self.segment] = self.segment_bytes
        self.segment += 1
        self.segment_bytes = 0
        self.next_index = 0
        self.retained.append(self.segment)
        self.live[self.segment] = 0
        self._collect()

    def append(self, messages: Sequence[Message], keep: int | None = None) -> None:
        """Store new copies. With `keep`, only the first `keep` stay in memory; the rest are spilled."""
        if len(messages) == 1 and not self.destroyed:
            if keep == 0:
                self._append_open(messages[0], spill=True)
                return
            if not self.spilled:
                self._append_open(messages[0], spill=False)
                return
        self._settle()
        if self.destroyed or not messages:
            return
        record = _run_record(messages)
        if record is None:
            record = self._entries_record(messages)
        if self.segment_bytes and self.segment_bytes + record.size > SEGMENT_BYTES:
            self._roll()
        first = self.next_index
        offset = self._emit(record.encode(first))
        base = (self.segment << records.SEGMENT_SHIFT) | first
        for number, message in enumerate(messages):
            message.pos = base + number
        self.next_index = first + len(messages)
        self.live[self.segment] += len(messages)
        if keep is None or keep >= len(messages):
            self._cancellable = (base, len(messages), record.size)
            if self.spilled:
                for message in messages:  # kept in memory, yet after the cursor: the reader skips them
                    self._skip(message.pos)
            return
        if self.spilled:
            for message in messages[:keep]:
                self._skip(message.pos)
        else:
            self.cursor = (self.segment, offset, keep)
        self.spilled += len(messages) - keep

    def _append_open(self, message: Message, *, spill: bool) -> None:
        """One copy into the open record; with `spill`, on disk only (read back from the cursor)."""
        entry = self._entry(message, None)  # one copy: nothing to share its headers' encoding with
        size = records.ADD_ENTRY.size + len(entry[5]) + len(entry[6])
        record = self._open
        if (record is None or record.topic != message.topic or record.origin != message.origin
                or self.segment_bytes + size > SEGMENT_BYTES):
            self._settle()
            topic = records.topic_part(message.topic) + records.origin_part(message.origin)
            if self.segment_bytes and self.segment_bytes + _ADD_OVERHEAD + len(topic) + size > SEGMENT_BYTES:
                self._roll()
            record = self._open = _OpenAdd(self.next_index, (self.segment << records.SEGMENT_SHIFT) | self.next_index,
                                           message.topic, message.origin, self.segment_bytes)
            self.pending.append((self.segment, record))
            self.segment_bytes += record.size
            self._open_cancellable = True
            self._mark_dirty()
        if spill:
            if not self.spilled:
                # The reader starts at this entry of the record once it is on disk.
                self.cursor = (self.segment, record.offset, len(record.entries))
            self.spilled += 1
        record.entries.append(entry)
        record.size += size
        self.segment_bytes += size
        message.pos = (self.segment << records.SEGMENT_SHIFT) | self.next_index
        self.next_index += 1
        self.live[self.segment] += 1

    def _entry(self, message: Message, header_cache: dict[int, bytes] | None) -> records.AddEntry:
        expires = due = 0
        if message.expires_at is not None or message.due is not None:
            clock = self.store.clock
            now, wall = clock.now(), clock.wall_ns()
            if message.expires_at is not None:
                expires = int(wall + (message.expires_at - now) * 1e9)
            if message.due is not None:
                due = int(wall + (message.due - now) * 1e9)
        headers = message.headers
        encoded = b""
        if message.publisher_id is not None:
            # Alone: the id as it came, no JSON either way; beside headers: among them, as readers see it.
            encoded = (records.PUBLISHER_ID_PREFIX + message.publisher_id if headers is None
                       else records.encode_headers(shown_headers(message)))
        elif headers is not None:
            if header_cache is None:
                encoded = records.encode_headers(headers)
            else:
                cached = header_cache.get(id(headers))
                if cached is None:
                    cached = header_cache[id(headers)] = records.encode_headers(headers)
                encoded = cached
        return (message.id, message.timestamp_ns, message.attempts, expires, due, encoded, message.body)

    def _entries_record(self, messages: Sequence[Message]) -> _PendingAdd:
        header_cache: dict[int, bytes] = {}
        entries = [self._entry(message, header_cache) for message in messages]
        topic = records.topic_part(_common_topic(messages))
        first_origin = messages[0].origin
        origin = records.origin_part(first_origin if all(m.origin == first_origin for m in messages) else None)
        size = _ADD_OVERHEAD + len(topic) + len(origin) + sum(records.ADD_ENTRY.size + len(entry[5]) + len(entry[6])
                                                for entry in entries)
        return _PendingAdd(size, lambda first: records.encode_add(first, entries, topic, origin))

    def _skip(self, position: int) -> None:
        _set_bit(self.skip_bits, position)

    def _cancel_candidate(self) -> tuple[int, int, int] | None:
        """(first position, copies, bytes) of the last pending ADD while it may still be cancelled."""
        record = self._open
        if record is not None:
            return (record.base, len(record.entries), record.size) if self._open_cancellable else None
        return self._cancellable

    def _settle(self) -> None:
        """The last pending ADD is complete: no more appends to it, no cancelling."""
        self._open = None
        self._pin()

    def _pin(self) -> None:
        """The last pending ADD will be written (a STATE names a copy): the copies gone get their DONE."""
        self._cancellable = None
        self._open_cancellable = False
        if self._withheld:
            self.done.extend(self._withheld)
            self._withheld.clear()

    def removed(self, message: Message) -> None:
        """The copy is gone (finished, expired, dropped)."""
        position = message.pos
        if position < 0 or self.destroyed:
            return
        message.pos = -1
        candidate = self._cancel_candidate()
        if candidate is not None and 0 <= position - candidate[0] < candidate[1]:
            # Added and gone in the same loop turn (an auto-ack consumer was waiting). While its ADD
            # is the last pending record, the DONE waits; once every copy of it is gone, neither the
            # ADD nor a DONE is ever written. Positions are explicit in ADD records, so the unused
            # indexes shift nothing.
            self.live[position >> records.SEGMENT_SHIFT] -= 1
            withheld = self._withheld
            withheld.append(position)
            if len(withheld) == candidate[1]:
                self._open = self._cancellable = None
                withheld.clear()
                self.pending.pop()
                self.segment_bytes -= candidate[2]
            return
        self.done.append(position)
        segment = position >> records.SEGMENT_SHIFT
        live = self.live.get(segment)
        if live is not None:
            self.live[segment] = live - 1
            if live == 1 and segment == self.retained[0]:
                self._collect()
        self._mark_dirty()

    def removed_after_next_write(self, message: Message) -> None:
        """As `removed`, but the DONE waits for the commit after the next one: a crash between the
        writes of one commit (one file at a time) leaves the copy here and its replacement in another
        file, twice rather than nowhere."""
        position = message.pos
        if position < 0 or self.destroyed:
            return
        candidate = self._cancel_candidate()
        if candidate is not None and 0 <= position - candidate[0] < candidate[1]:
            self.removed(message)  # its ADD is not on the disk yet: it may never be
            return
        done = self.done
        self.done = self.done_later
        self.removed(message)
        self.done_later = self.done
        self.done = done

    def state(self, message: Message, due_wall_ns: int = 0) -> None:
        """Attempts changed (a delivery) or the copy went back to the queue, maybe deferred."""
        if message.pos < 0 or self.destroyed:
            return
        self._pin()  # a manual-ack delivery: the record stays open for this turn's next publishes
        self.states.extend((message.pos, message.attempts, due_wall_ns))
        self._mark_dirty()

    def next_position(self) -> int:
        return (self.segment << records.SEGMENT_SHIFT) | self.next_index

    def peek_pages(self, page: int) -> Iterator[list[Message]]:
        """Every spilled copy, `page` at a time, without taking any: the reader's place is back
        where it was once the pages end or the caller closes the iterator. Consume it in one go:
        nothing may read this log in between."""
        cursor, spilled = self.cursor, self.spilled
        try:
            while self.spilled:
                taken = self.read(page)
                if not taken:
                    break
                yield taken
        finally:
            self.cursor, self.spilled = cursor, spilled

    def start_after(self, position: int) -> None:
        segment = (position >> records.SEGMENT_SHIFT) + 1
        if self.destroyed or self.segment >= segment:
            return
        # A jump, as a roll: the segments between never exist, so positions only grow.
        self._settle()
        self.final_size[self.segment] = self.segment_bytes
        self.segment = segment
        self.segment_bytes = 0
        self.next_index = 0
        self.retained.append(segment)
        self.live[segment] = 0
        self._collect()

    def emptied(self) -> None:
        """Every copy is gone: start a new segment and drop the old ones."""
        if self.destroyed:
            return
        self._cancellable = None
        self._open = None
        self._withheld.clear()
        self.pending.clear()
        del self.done[:]
        del self.done_later[:]
        del self.states[:]
        old = list(self.retained)
        self.final_size.clear()
        self.segment += 1
        self.segment_bytes = 0
        self.next_index = 0
        self.retained = deque([self.segment])
        self.live = {self.segment: 0}
        self.unlinks.extend(old)
        self.spilled = 0
        self.cursor = None
        self._held = None
        self.skip_bits.clear()
        self._close_reader()
        self._mark_dirty()

    def _collect(self) -> None:
        """Delete the oldest segments once every copy they added is done (oldest first, see the module doc)."""
        retained = self.retained
        while len(retained) > 1 and retained[0] != self.segment and self.live[retained[0]] == 0:
            segment = retained.popleft()
            del self.live[segment]
            self.skip_bits.pop(segment, None)
            self.flushed.pop(segment, None)
            self.final_size.pop(segment, None)
            if self._read_fd is not None and self._read_fd[0] == segment:
                self._close_reader()
            self.unlinks.append(segment)
            self._mark_dirty()

    def destroy(self) -> None:
        self.destroyed = True
        self._open = None
        self.pending.clear()
        self.spilled = 0
        self._close_reader()
        self.store._destroyed_log(self)

    def _take(self, job: CommitJob, written: list[tuple[OwnerLog, int, Path]]) -> None:
        """Move this log's pending records and file removals into `job`."""
        self.dirty = False
        self._settle()
        if self.states:
            # STATE before DONE: recovery reads in order, and a DONE ends a copy for good.
            encoded = records.encode_states(array("q", self.states))
            self.pending.append((self.segment, encoded))
            self.segment_bytes += len(encoded)
            self.states = []
        if self.done:
            encoded = records.encode_positions(self.done)
            self.pending.append((self.segment, encoded))
            self.segment_bytes += len(encoded)
            self.done = array("Q")
        if self.done_later:
            self.done, self.done_later = self.done_later, self.done
            self._mark_dirty()  # in the next commit
        pending = self.pending
        start = 0
        while start < len(pending):
            segment = pending[start][0]
            end = start
            while end < len(pending) and pending[end][0] == segment:
                end += 1
            path = self.path(segment)
            parts = [item if isinstance(item, bytes) else item.encode() for _, item in pending[start:end]]
            data = parts[0] if len(parts) == 1 else b"".join(parts)
            job.appends.append((path, data))
            written.append((self, segment, path))
            start = end
        self.pending = []
        job.unlinks.extend(self.path(segment) for segment in self.unlinks)
        self.unlinks = []

    # -- reading spilled copies back -----------------------------------------------------------

    def _close_reader(self) -> None:
        if self._read_fd is not None:
            os.close(self._read_fd[1])
            self._read_fd = None

    def _reader(self, segment: int) -> int:
        if self._read_fd is None or self._read_fd[0] != segment:
            self._close_reader()
            self._read_fd = (segment, os.open(self.path(segment), os.O_RDONLY))
        return self._read_fd[1]

    def _sealed(self, segment: int) -> bool:
        """Every record of `segment` is on disk and no more will come (not merely handed to a commit)."""
        final = self.final_size.get(segment)
        return final is not None and self.flushed.get(segment, 0) >= final

    def read(self, count: int) -> list[Message]:
        """Up to `count` spilled copies, in order; fewer when the rest is not written yet."""
        taken: list[Message] = []
        if not self.spilled or self.cursor is None:
            return taken
        segment, offset, skip = self.cursor
        clock = self.store.clock
        now, wall = clock.now(), clock.wall_ns()
        while self.spilled and len(taken) < count:
            end = self.flushed.get(segment, 0)
            if offset >= end:
                if not self._sealed(segment):
                    break  # the rest is still on its way to the disk
                later = next((s for s in self.retained if s > segment), None)
                if later is not None:
                    segment, offset, skip = later, 0, 0
                    continue
                log.error("%s: %d spilled messages not found in the log", self.dir, self.spilled)
                self.spilled = 0
                break
            stopped = False
            for record_offset, record_type, payload in self._records_from(segment, offset, end, skip):
                offset = record_offset
                if record_type == records.ADD:
                    # One copy of the record, its entries then sliced from `bytes`: a memoryview slice
                    # and a `bytes` of it cost 2.5 times a slice of `bytes`, twice per message.
                    data = payload if type(payload) is bytes else bytes(payload)
                    skip = self._take_entries(data, segment, skip, count, now, wall, taken)
                    if skip:
                        stopped = True  # part of this record is still to come
                        self._held = (segment, record_offset, data)
                        break
                offset = record_offset + records.HEADER.size + len(payload)
                skip = 0
                if len(taken) >= count or not self.spilled:
                    stopped = True
                    break
            if not stopped:
                offset, skip = end, 0
        self.cursor = (segment, offset, skip)
        if not skip:
            self._held = None
        return taken

    def _records_from(self, segment: int, offset: int, end: int,
                      skip: int) -> Iterator[tuple[int, int, bytes | memoryview]]:
        """`_records`, starting with the held record when the cursor stands in it (records never change)."""
        held = self._held
        if skip and held is not None and held[0] == segment and held[1] == offset:
            payload = held[2]
            yield offset, records.ADD, payload
            offset += records.HEADER.size + len(payload)
        yield from self._records(segment, offset, end)

    def _take_entries(self, payload: bytes, segment: int, skip: int, count: int, now: float, wall: int,
                      taken: list[Message]) -> int:
        """Take the wanted entries of one ADD record; returns how many of its entries are used, or 0 if all.
        One Message per copy, straight from the record: no entry object between."""
        bits = self.skip_bits.get(segment)
        first, entry_count, flags = records.add_head(payload)
        if flags & records.ADD_RUN:
            return self._take_run(payload, segment, first, entry_count, flags, skip, count, taken)
        topic, origin, offset = records.add_source(payload, flags)
        unpack = records.ADD_ENTRY.unpack_from
        entry_size = records.ADD_ENTRY.size
        base = segment << records.SEGMENT_SHIFT
        used = skip
        for number in range(entry_count):
            message_id, timestamp, attempts, expires, due, headers_len, body_len = unpack(payload, offset)
            offset += entry_size
            end = offset + headers_len + body_len
            if number < skip:
                offset = end
                continue
            used += 1
            index = first + number
            if bits is not None and len(bits) > index >> 3 and bits[index >> 3] & (1 << (index & 7)):
                offset = end
                continue
            if headers_len and payload[offset] == records.PUBLISHER_ID_MARK:
                headers, publisher_id = None, payload[offset + 1 : offset + headers_len]
            else:
                headers, publisher_id = records.decode_headers_at(payload, offset, headers_len), None
            taken.append(_message(message_id, payload[offset + headers_len : end], timestamp, headers,
                                  attempts, expires, due, topic, origin, base | index, now, wall, publisher_id))
            self.spilled -= 1
            if len(taken) >= count or not self.spilled:
                break
            offset = end
        return used if used < entry_count else 0

    def _take_run(self, payload: bytes, segment: int, first: int, entry_count: int, flags: int, skip: int,
                  count: int, taken: list[Message]) -> int:
        """`_take_entries` of a run record (an MPUB-like batch: no headers, attempts, TTL or due time):
        one Message per copy, straight from the record, no entry object between."""
        topic, origin, first_id, timestamp, lengths, offset = records.run_layout(payload, flags)
        bits = self.skip_bits.get(segment)
        base = segment << records.SEGMENT_SHIFT
        for number in range(skip):
            offset += lengths[number]
        used = skip
        for number in range(skip, entry_count):
            end = offset + lengths[number]
            used += 1
            index = first + number
            if bits is None or len(bits) <= index >> 3 or not bits[index >> 3] & (1 << (index & 7)):
                message = Message(first_id + number, payload[offset:end], timestamp, None, None, 0, topic,
                                  origin)
                message.pos = base | index
                taken.append(message)
                self.spilled -= 1
                if len(taken) >= count or not self.spilled:
                    break
            offset = end
        return used if used < entry_count else 0

    def _records(self, segment: int, offset: int, end: int) -> Iterator[tuple[int, int, memoryview]]:
        """The intact records of `segment` between `offset` and `end`, read a chunk at a time."""
        fd = self._reader(segment)
        while offset < end:
            chunk = os.pread(fd, min(READ_CHUNK, end - offset), offset)
            if not chunk:
                return
            whole_end = 0
            for relative, record_type, payload in records.scan(chunk):
                yield offset + relative, record_type, payload
                whole_end = relative + records.HEADER.size + len(payload)
            if whole_end == len(chunk):
                offset += len(chunk)
                continue
            rest = offset + whole_end
            if offset + len(chunk) < end:
                # Usually a record cut by the chunk's end: read it whole.
                head = chunk[whole_end : whole_end + records.HEADER.size]
                if len(head) < records.HEADER.size:
                    offset = rest
                    continue
                magic, _, length, _ = records.HEADER.unpack(head)
                if magic == records.MAGIC and rest + records.HEADER.size + length <= end:
                    whole = os.pread(fd, records.HEADER.size + length, rest)
                    if records.intact_length(whole, 0):
                        yield rest, whole[1], memoryview(whole)[records.HEADER.size :]
                        offset = rest + len(whole)
                        continue
            # Damage (recovery reported it already): scan everything after it to find what is intact.
            damage: list[records.Damage] = []
            remainder = os.pread(fd, end - rest, rest)
            for relative, record_type, payload in records.scan(remainder, 0, damage):
                yield rest + relative, record_type, payload
            return

class _OpenAdd:
    """An ADD record still growing: single-copy appends of one loop turn, consecutive indexes from `first`."""

    __slots__ = ("base", "entries", "first", "offset", "origin", "origin_part", "size", "topic", "topic_part")

    def __init__(self, first: int, base: int, topic: str | None, origin: str | None, offset: int) -> None:
        self.first = first
        self.base = base  # position of the first entry
        self.offset = offset  # where the record starts in its segment
        self.topic = topic
        self.origin = origin
        self.topic_part = records.topic_part(topic)
        self.origin_part = records.origin_part(origin)
        self.entries: list[records.AddEntry] = []
        self.size = _ADD_OVERHEAD + len(self.topic_part) + len(self.origin_part)

    def encode(self) -> bytes:
        return records.encode_add(self.first, self.entries, self.topic_part, self.origin_part)


class _PendingAdd:
    """An ADD record whose size is known before its first index (the segment may roll first)."""

    __slots__ = ("encode", "size")

    def __init__(self, size: int, encode: Callable[[int], bytes]) -> None:
        self.size = size
        self.encode = encode


def _run_record(messages: Sequence[Message]) -> _PendingAdd | None:
    """The compact record of an MPUB-like batch, or None when some message needs the general one."""
    first = messages[0]
    timestamp = first.timestamp_ns
    expected = first.id
    topic_name, origin_name = first.topic, first.origin
    size = records.HEADER.size + records.ADD_HEAD.size + records.RUN_HEAD.size
    for message in messages:
        if (message.id != expected or message.attempts or message.headers is not None
                or message.publisher_id is not None or message.expires_at is not None or message.due is not None
                or message.timestamp_ns != timestamp or message.topic != topic_name or message.origin != origin_name):
            return None
        expected += 1
        size += 4 + len(message.body)
    bodies = [message.body for message in messages]
    topic, origin = records.topic_part(topic_name), records.origin_part(origin_name)
    return _PendingAdd(size + len(topic) + len(origin),
                       lambda index: records.encode_run(index, first.id, timestamp, bodies, topic, origin))


def _common_topic(messages: Sequence[Message]) -> str | None:
    topic = messages[0].topic
    return topic if all(message.topic == topic for message in messages) else None


def _message(message_id: int, body: bytes, timestamp_ns: int, headers: object, attempts: int, expires_wall_ns: int,
             due_wall_ns: int, topic: str | None, origin: str | None, pos: int, now: float, wall: int,
             publisher_id: bytes | None = None) -> Message:
    """A copy read back from its ADD entry; wall-clock times (0: none) made times of `now`'s clock."""
    expires = None if not expires_wall_ns else now + (expires_wall_ns - wall) / 1e9
    message = Message(message_id, body, timestamp_ns, headers, expires, attempts, topic, origin,  # type: ignore[arg-type]
                      publisher_id)
    message.pos = pos
    if due_wall_ns and due_wall_ns > wall + DUE_TOLERANCE_NS:
        message.due = now + (due_wall_ns - wall) / 1e9
    return message


def _lock(path: Path) -> int:
    """Takes the data dir's lock and writes this process's pid into it, for the error of the next one."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).strip()
        os.close(fd)
        raise DataDirInUse(path.parent, int(holder) if holder.isdigit() else None) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, str(os.getpid()).encode(), 0)
    return fd


class DiskStorage:
    """The embedded store: `persistent`, restores everything at `load`, group-commits through a committer."""

    persistent = True

    def __init__(self, directory: Path, clock: Clock, *, policy: FsyncPolicy | None = None,
                 mem_queue_size: int = MEM_QUEUE_SIZE) -> None:
        self.dir = Path(directory)
        self.clock = clock
        self.policy = policy or FsyncPolicy()
        self.mem_queue_size = mem_queue_size
        self.dir.mkdir(parents=True, exist_ok=True)
        self._lock_fd = _lock(self.dir / LOCK_FILE)
        self.ids: IdSource | None = None
        self._id_high_water = 0
        self._next_uid = 1
        self._topics: dict[str, dict[str, Any]] = {}  # name → meta (uid, paused)
        self._queues: dict[str, dict[str, Any]] = {}  # name → meta (uid, topics, paused, options)
        self._kept: dict[str, dict[str, dict[str, Any]]] = {kind: {} for kind in KEPT_KINDS}  # kind → key → record
        self._meta_pending: list[bytes] = []
        self._dirty: list[OwnerLog] = []
        self._removed_dirs: list[Path] = []
        self._callbacks: list[SyncCallback] = []
        # A failed job's remaining file work (and the logs it wrote for), offered again first.
        self._retry: CommitJob | None = None
        self._retry_written: list[tuple[OwnerLog, int, Path]] = []
        self._last_fsync = clock.now()
        self._unsynced = False
        self.failure: str | None = None  # the last commit's error, None once a commit succeeds
        # The failure the log last told of: a retry clears `failure` before it tries, so this is what
        # keeps a full disk to one line, not one per retry, and says when writes work again.
        self._reported: str | None = None
        self.on_work: Callable[[], None] | None = None  # the committer's wake-up
        self._held = 0  # `hold_work` calls not yet released
        self.syncs = 0  # fdatasync jobs that ended (a merged job counts once)
        # Sync jobs that may run at once (the committer's driver says; one for a thread that merges them).
        self.max_syncs_in_flight = 1
        # Called when a write follows a sync: the committer then times the next one (`fsync_due`).
        self.on_unsynced: Callable[[], None] | None = None
        self._wake_held = False  # work was reported while held
        # Takes each sync job for the committer's thread; the thread's `sync_done` comes back on the loop.
        self.on_sync_job: Callable[[SyncJob], None] | None = None
        # Loop-side appends (`write_now`).
        self.files = FileWriter()
        self._sync_gen = 0  # sync jobs handed out
        self._synced_gen = 0  # sync jobs ended
        self._sync_wanted = False  # written since the last job: one more job this turn (`submit_sync`)
        # (gen, callback, write error): written, waiting for the end of sync job `gen`, in the order given.
        self._awaiting_sync: list[tuple[int, SyncCallback, OSError | None]] = []
        # Removals of written jobs, for the next sync job (after its fdatasync).
        self._unlinks: list[Path] = []
        self._rmdirs: list[Path] = []
        self._logs: list[OwnerLog] = []  # to close their readers
        self._deleted_uids: set[int] = set()

    # -- the metadata journal ------------------------------------------------------------------

    def _meta(self, change: dict[str, Any]) -> None:
        self._meta_pending.append(records.encode_meta(change))
        self._wake()

    def _wake(self) -> None:
        if self._held:
            self._wake_held = True  # the holder writes it all when it lets go (`release_work`)
        elif self.on_work is not None:
            self.on_work()

    def hold_work(self) -> None:
        """A session handles a read synchronously and writes what it changed at the end (`release_work`).

        Until then nothing wakes the committer: its task switch cost more than the write it would
        make, on every publish of a client publishing one message per round trip.
        """
        self._held += 1

    def release_work(self) -> None:
        """The end of a `hold_work`: write everything reported meanwhile now, on the loop."""
        self._held -= 1
        if self._held or not self._wake_held:
            return
        self._wake_held = False
        self.write_now()  # wakes the committer itself when a sync job must wait for the busy thread
        if self.failure is not None:
            self._wake()  # the committer retries the writes on its schedule

    def _dirty_log(self, owner: OwnerLog) -> None:
        self._dirty.append(owner)
        self._wake()

    def _destroyed_log(self, owner: OwnerLog) -> None:
        self._removed_dirs.append(owner.dir)
        self._wake()

    def _new_log(self, prefix: str) -> tuple[int, OwnerLog]:
        uid = self._next_uid
        self._next_uid += 1
        owner = OwnerLog(self, self.dir / f"{prefix}{uid}", is_topic=prefix == "t")
        self._logs.append(owner)
        return uid, owner

    def open_topic(self, name: str, made_by: str | None = None) -> OwnerLog:
        uid, owner = self._new_log("t")
        meta: dict[str, Any] = {"uid": uid, "paused": False}
        if made_by is not None:
            meta["made_by"] = made_by
        self._topics[name] = meta
        self._meta({"t": "topic", "name": name, **meta})
        return owner

    def topic_saved(self, name: str, paused: bool) -> None:
        meta = self._topics.get(name)
        if meta is not None and meta["paused"] != paused:
            meta["paused"] = paused
            self._meta({"t": "topic", "name": name, **meta})

    def topic_deleted(self, name: str, owner: OwnerLog | None) -> None:
        meta = self._topics.pop(name, None)
        if meta is not None:
            self._meta({"t": "topic-", "name": name, "uid": meta["uid"]})
        if owner is not None:
            owner.destroy()

    def open_queue(self, name: str, topics: Iterable[str], paused: bool, options: Mapping[str, Any]) -> OwnerLog:
        uid, owner = self._new_log("q")
        self._queues[name] = {"uid": uid}
        self.queue_saved(name, topics, paused, options)
        return owner

    def queue_saved(self, name: str, topics: Iterable[str], paused: bool, options: Mapping[str, Any]) -> None:
        meta = self._queues.get(name)
        if meta is None:
            return
        meta.update(topics=list(topics), paused=paused, options=dict(options))
        self._meta({"t": "queue", "name": name, **meta})

    def adopt(self, topic: str, queue: str, topic_log: OwnerLog, queue_log: OwnerLog) -> OwnerLog | None:
        """`queue` takes `topic_log` over as its own log (with every copy in it); the topic gets a new,
        empty log, returned. Only for a queue whose log is blank; None when the swap cannot be made.

        One journal record says both, so a restart sees the swap whole or not at all; the queue's
        journal entries name the directory it took over from then on.
        """
        topic_meta = self._topics.get(topic)
        queue_meta = self._queues.get(queue)
        if topic_meta is None or queue_meta is None or not queue_log.is_blank() or topic_log.destroyed:
            return None
        directory = topic_log.dir.name
        uid, new_log = self._new_log("t")
        topic_meta["uid"] = uid
        queue_meta["dir"] = directory
        self._meta({"t": "adopt", "topic": topic, "uid": uid, "queue": queue, "dir": directory})
        queue_log.destroy()
        topic_log.is_topic = False
        return new_log

    def queue_deleted(self, name: str, owner: OwnerLog | None) -> None:
        meta = self._queues.pop(name, None)
        if meta is not None:
            self._meta({"t": "queue-", "name": name, "uid": meta["uid"], **_dir_of(meta)})
        if owner is not None:
            owner.destroy()

    def kept_saved(self, kind: str, key: str, record: Mapping[str, Any]) -> None:
        kept = self._kept[kind][key] = dict(record)
        self._meta({"t": kind, "key": key, "s": kept})

    def kept_deleted(self, kind: str, key: str) -> None:
        if self._kept[kind].pop(key, None) is not None:
            self._meta({"t": kind + "-", "key": key})

    # -- commits on the loop: writes now, fdatasync in the committer's thread ---------------------

    def write_now(self) -> None:
        """Hand every change reported so far to the OS now, on the loop (a process crash keeps it).

        Callbacks that need no fdatasync (`interval`, `never`) run before this returns. Under `always`
        a sync job follows every write (`on_sync_job`) and the callbacks wait for its end (`sync_done`).
        While the store is failing this does nothing: the committer retries on its own schedule.
        """
        if self.failure is not None or not self._has_writes():
            return
        job, written, callbacks = self.prepare(write_only=True)
        was_synced = not (self._unsynced or self.files.unsynced)
        self.files.write(job)
        self._unlinks += job.unlinks
        self._rmdirs += job.removed_dirs
        job.unlinks = []
        job.removed_dirs = []
        self.complete(job, written, [])
        error = job.error
        always = self.policy.mode == "always"
        if error is None and not always:
            _call_each(callbacks, None)
        elif error is not None and not self._awaiting_sync:
            _call_each(callbacks, error)
        else:
            # Behind the callbacks given before them, whatever their outcome: sessions answer in order.
            gen = self._sync_gen + 1
            self._awaiting_sync.extend((gen, callback, error) for callback in callbacks)
        # A sync job now only when an acknowledgement waits for it (or removals do): records no one
        # waits for (finishes, delivery attempts, metadata) go with the next one (`fsync_due`).
        awaited = bool(self._awaiting_sync) and self._awaiting_sync[-1][0] > self._sync_gen
        if awaited or self._unlinks or self._rmdirs:
            if self._sync_gen - self._synced_gen < self.max_syncs_in_flight:
                self._submit_sync(fsync=always)  # room for another sync job: start at once
            elif not self._sync_wanted:
                self._sync_wanted = True  # all busy: one job for this turn's writes (`submit_sync`)
                self._wake()
        # Left unsynced (no job now, or one without fdatasync): the clock of `fsync_due` starts. Not
        # asked when a job just took it all: the committer's wake-up costs more than the PUB's write.
        if was_synced and self.on_unsynced is not None and (self._unsynced or self.files.unsynced):
            self.on_unsynced()

    def submit_sync(self) -> None:
        """Queue one sync job for what this loop turn wrote (the committer calls it once per turn)."""
        if self._sync_wanted:
            self._sync_wanted = False
            self._submit_sync(fsync=self.policy.mode == "always")

    def retry_writes(self) -> bool:
        """The committer's attempt after a failure (`write_now` skips while failing); True if it worked."""
        self._clear_failure()  # a call, not `self.failure = None`: a checker would narrow the attribute to None
        self.write_now()
        return self.failure is None

    def _clear_failure(self) -> None:
        self.failure = None

    def _submit_sync(self, *, fsync: bool) -> SyncJob:
        self._sync_wanted = False
        self._sync_gen += 1
        job = self.files.take_sync(self._unlinks, self._rmdirs, fsync=fsync)
        job.gen = self._sync_gen
        self._unlinks = []
        self._rmdirs = []
        if fsync:
            self._last_fsync = self.clock.now()  # the interval counts from a sync's start
            self._unsynced = False
        if self.on_sync_job is not None:
            self.on_sync_job(job)
        return job

    def take_sync(self, *, force_fsync: bool = False) -> SyncJob:
        """A sync job of everything written so far (the interval timer, the last commit at shutdown)."""
        self._sync_wanted = False
        return self._submit_sync(fsync=force_fsync or self.policy.mode != "never")

    def sync_done(self, job: SyncJob) -> None:
        """Back on the loop after a sync job (and every job before it): release the callbacks it covers."""
        self.files.sync_finished(job)
        if job.fsync and job.fds:
            self.syncs += 1
        self._synced_gen = max(self._synced_gen, job.gen)
        if job.error is not None:
            self._unsynced = True
            message = f"fdatasync: {job.error.strerror or job.error}"
            if self._reported != message:
                log.error("storage sync failed: %s; publishes fail until it works again", message)
                self._reported = message
            self.failure = message
        awaiting = self._awaiting_sync
        released = 0
        while released < len(awaiting) and awaiting[released][0] <= job.gen:
            released += 1
        if released:
            ready = awaiting[:released]
            del awaiting[:released]
            for _, callback, error in ready:
                _call_each((callback,), error or job.error)

    def close_files(self) -> None:
        self.files.close()

    # -- commits ---------------------------------------------------------------------------------

    def sync(self, callback: SyncCallback) -> None:
        """`callback(None)` once everything reported so far is stored under the policy; `callback(error)` if not."""
        self._callbacks.append(callback)
        self._wake()

    def has_work(self) -> bool:
        return self._sync_wanted or self._has_writes()

    def _has_writes(self) -> bool:
        return bool(self._callbacks or self._dirty or self._meta_pending or self._removed_dirs or self._retry)

    def fsync_due(self) -> float | None:
        """When what was written without an fdatasync must get one: MS after the last under `interval`,
        `UNAWAITED_SYNC_S` under `always` (only records no acknowledgement waits for are left so)."""
        mode = self.policy.mode
        if mode == "never" or not (self._unsynced or self.files.unsynced):
            return None
        return self._last_fsync + (self.policy.interval if mode == "interval" else UNAWAITED_SYNC_S)

    def prepare(self, *, force_fsync: bool = False, write_only: bool = False) -> tuple[
            CommitJob, list[tuple[OwnerLog, int, Path]], list[SyncCallback]]:
        """Take everything pending into one job (`write_only`: its appends are written, never synced)."""
        ids = self.ids
        if ids is not None and ids.last >= self._id_high_water - ID_RESERVE // 2:
            self._id_high_water = ids.last + ID_RESERVE
            self._meta_pending.append(records.encode_meta({"t": "ids", "hw": self._id_high_water}))
        job = CommitJob()
        if self._retry is not None:
            job.appends.extend(self._retry.appends)
            job.unlinks.extend(self._retry.unlinks)
            job.removed_dirs.extend(self._retry.removed_dirs)
            self._retry = None
        written: list[tuple[OwnerLog, int, Path]] = self._retry_written
        self._retry_written = []
        if self._meta_pending:
            job.appends.append((self.dir / META_FILE, b"".join(self._meta_pending)))
            self._meta_pending = []
        dirty = self._dirty
        self._dirty = []
        # Queues before topic backlogs: a backlog's DONE must not reach the disk before the copies it moved.
        for owner in sorted(dirty, key=lambda o: o.is_topic):
            if not owner.destroyed:
                owner._take(job, written)
        job.removed_dirs.extend(self._removed_dirs)
        self._removed_dirs = []
        mode = self.policy.mode
        job.fsync = not write_only and (force_fsync or mode == "always" or (
            mode == "interval" and self.clock.now() - self._last_fsync >= self.policy.interval))
        callbacks = self._callbacks
        self._callbacks = []
        return job, written, callbacks

    def complete(self, job: CommitJob, written: list[tuple[OwnerLog, int, Path]],
                 callbacks: list[SyncCallback]) -> None:
        """Back on the loop after the job ran: note what is on disk, call the callbacks."""
        for owner, segment, path in written:
            size = job.sizes.get(path)
            if size is not None and not owner.destroyed and segment in owner.live:
                owner.flushed[segment] = size
        if job.error is None:
            if job.fsync:
                self._unsynced = False
                self._last_fsync = self.clock.now()
            elif job.appends:
                self._unsynced = True
            if self._reported is not None:
                log.warning("storage writes work again")
                self._reported = None
            self.failure = None
        else:
            message = f"{job.error.strerror or job.error}"
            if self._reported != message:
                log.error("storage write failed: %s; publishes fail until it works again", message)
                self._reported = message
            self.failure = message
            self._retry = CommitJob(appends=job.appends[job.appended:], unlinks=job.unlinks,
                                    removed_dirs=job.removed_dirs)
            self._retry_written = written
        for owner, _, _ in written:
            if owner.spilled and owner.on_readable is not None and not owner.destroyed:
                owner.on_readable()
        _call_each(callbacks, job.error)

    # -- start-up ----------------------------------------------------------------------------

    def load(self, ids: IdSource) -> Snapshot:
        """Read the journal and every log back; compact the journal. Reports damage in the log."""
        self.ids = ids
        meta_path = self.dir / META_FILE
        if meta_path.exists():
            damage: list[records.Damage] = []
            data = meta_path.read_bytes()
            for _, record_type, payload in records.scan(data, 0, damage):
                if record_type == records.META:
                    self._replay_meta(records.decode_meta(payload))
            for item in damage:
                log.warning("%s: skipped %d bytes at %d (%s)", meta_path, item.length, item.offset, item.reason)
        self._id_high_water = max(self._id_high_water, ids.last + 1)
        ids.advance_past(self._id_high_water)
        self._id_high_water = ids.last + ID_RESERVE
        self._rewrite_meta()
        known = {f"t{meta['uid']}" for meta in self._topics.values()} | {_queue_dir(m) for m in self._queues.values()}
        for entry in sorted(self.dir.iterdir()):
            if not entry.is_dir() or entry.name[:1] not in ("t", "q") or entry.name in known:
                continue
            if entry.name[1:].isdigit() and int(entry.name[1:]) in self._deleted_uids:
                shutil.rmtree(entry, ignore_errors=True)  # deleted just before a crash: its removal was pending
            else:
                # Its journal record is damaged or gone: keep the messages for a human, out of the way.
                orphan = self.dir / f"orphan-{entry.name}"
                entry.rename(orphan)
                log.warning("%s is not in the journal (damaged?): moved to %s with its messages", entry, orphan)
        topics = []
        for name, meta in self._topics.items():
            owner = OwnerLog(self, self.dir / f"t{meta['uid']}", is_topic=True)
            self._logs.append(owner)
            _recover(owner, self.clock)
            topics.append(TopicRecord(name, meta["paused"], owner, meta.get("made_by")))
        queues = []
        for name, meta in self._queues.items():
            owner = OwnerLog(self, self.dir / _queue_dir(meta), is_topic=False)
            self._logs.append(owner)
            _recover(owner, self.clock)
            queues.append(QueueRecord(name, tuple(meta["topics"]), meta["paused"], meta["options"], owner))
        return Snapshot(tuple(topics), tuple(queues), {kind: tuple(kept.values()) for kind, kept in self._kept.items()})

    def _replay_meta(self, change: dict[str, Any]) -> None:
        kind = change.get("t")
        name: str = change.get("name", "")
        if kind == "topic":
            self._topics[name] = {key: change[key] for key in ("uid", "paused", "made_by") if key in change}
            self._next_uid = max(self._next_uid, change["uid"] + 1)
        elif kind == "topic-":
            self._topics.pop(name, None)
            self._deleted_uids.add(change.get("uid", 0))
        elif kind == "queue":
            self._queues[name] = {key: change[key] for key in ("uid", "topics", "paused", "options")}
            self._queues[name].update(_dir_of(change))
            self._next_uid = max(self._next_uid, change["uid"] + 1)
        elif kind == "queue-":
            self._queues.pop(name, None)
            self._deleted_uids.add(change.get("uid", 0))
            if "dir" in change:
                self._deleted_uids.add(_uid_of_dir(change["dir"]))
        elif kind == "adopt":
            topic_meta = self._topics.get(change.get("topic", ""))
            queue_meta = self._queues.get(change.get("queue", ""))
            if topic_meta is not None and queue_meta is not None:
                topic_meta["uid"] = change["uid"]
                queue_meta["dir"] = change["dir"]
                self._next_uid = max(self._next_uid, change["uid"] + 1)
        elif kind == "ids":
            self._id_high_water = max(self._id_high_water, change["hw"])
        elif kind in self._kept:
            self._kept[kind][change["key"]] = change["s"]
        elif kind is not None and kind[:-1] in self._kept and kind.endswith("-"):
            self._kept[kind[:-1]].pop(change.get("key", ""), None)

    def _rewrite_meta(self) -> None:
        changes = [{"t": "ids", "hw": self._id_high_water}]
        changes += [{"t": "topic", "name": name, **meta} for name, meta in self._topics.items()]
        changes += [{"t": "queue", "name": name, **meta} for name, meta in self._queues.items()]
        changes += [{"t": kind, "key": key, "s": record} for kind, kept in self._kept.items()
                    for key, record in kept.items()]
        temporary = self.dir / (META_FILE + ".tmp")
        with open(temporary, "wb") as file:
            file.write(b"".join(records.encode_meta(change) for change in changes))
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, self.dir / META_FILE)
        fd = os.open(self.dir, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def close(self) -> None:
        """Release the data dir: every reader and the lock (a process that exits releases them too)."""
        for owner in self._logs:
            owner._close_reader()
        os.close(self._lock_fd)


def _queue_dir(meta: Mapping[str, Any]) -> str:
    """A queue's log directory: its own, or the topic backlog's it took over (`DiskStorage.adopt`)."""
    return meta.get("dir") or f"q{meta['uid']}"


def _dir_of(meta: Mapping[str, Any]) -> dict[str, str]:
    return {"dir": meta["dir"]} if meta.get("dir") else {}


def _uid_of_dir(name: str) -> int:
    return int(name[1:]) if name[1:].isdigit() else 0


def _call_each(callbacks: Iterable[SyncCallback], error: OSError | None) -> None:
    """Run sync callbacks; one that raises (a bug) is logged and costs nobody else their answer."""
    for callback in callbacks:
        try:
            callback(error)
        except Exception:
            log.exception("a storage callback failed")


def _recover(owner: OwnerLog, clock: Clock) -> None:
    """Rebuild one log's state from its segments: live copies, attempts, due times, what is spilled.

    Pass 1 reads every record and collects what ended (DONE) and each copy's last STATE; pass 2 walks
    the ADD records in order and keeps the first `mem_queue_size` ready copies (plus every copy with
    a state or a due time, which were in memory before the restart) as objects; the rest stays
    spilled. Damage is reported and skipped; a torn tail of the last segment is cut off.
    """
    segments = sorted(int(path.stem) for path in owner.dir.glob("*.seg") if path.stem.isdigit())
    if not segments:
        return
    done: dict[int, bytearray] = {}
    states: dict[int, tuple[int, int]] = {}
    add_offsets: dict[int, array] = {}
    for segment in segments:
        path = owner.path(segment)
        data = path.read_bytes()
        damage: list[records.Damage] = []
        offsets = add_offsets[segment] = array("Q")
        for offset, record_type, payload in records.scan(data, 0, damage):
            if record_type == records.ADD:
                offsets.append(offset)
            elif record_type == records.STATE:
                for position, attempts, due in records.decode_states(payload):
                    states[position] = (attempts, due)
            elif record_type == records.DONE:
                for position in records.decode_positions(payload):
                    states.pop(position, None)
                    _set_bit(done, position)
        if damage and damage[-1].offset + damage[-1].length == len(data) and not data[damage[-1].offset :].strip(b"\0"):
            # Zeros written ahead of the records (`disk_io.PREZERO_BYTES`) by a run that did not stop cleanly.
            os.truncate(path, damage.pop().offset)
        for item in damage:
            log.warning("%s: skipped %d bytes at %d (%s)", path, item.length, item.offset, item.reason)
        if damage and segment == segments[-1] and damage[-1].offset + damage[-1].length == len(data):
            os.truncate(path, damage[-1].offset)  # a torn tail: new records must not follow garbage
            log.warning("%s: cut the torn tail at %d", path, damage[-1].offset)
    now, wall = clock.now(), clock.wall_ns()
    limit = owner.store.mem_queue_size
    ready: list[Message] = []
    deferred: list[Message] = []
    owner.retained = deque(segments)
    owner.live = {}
    owner.skip_bits = done
    for segment in segments:
        live = 0
        path = owner.path(segment)
        offsets = add_offsets.pop(segment)
        data = path.read_bytes() if offsets else b""
        owner.flushed[segment] = owner.final_size[segment] = os.path.getsize(path)
        bits = done.get(segment)
        base = segment << records.SEGMENT_SHIFT
        for offset in offsets:
            payload = memoryview(data)[offset + records.HEADER.size : offset + records.HEADER.size
                                       + records.HEADER.unpack_from(data, offset)[2]]
            first, count, flags = records.add_head(payload)
            wanted = owner.spilled == 0 and len(ready) < limit
            if not wanted and not flags & records.ADD_HAS_DEFERRED and not any(
                    base | index in states for index in range(first, first + count)):
                alive = sum(1 for index in range(first, first + count) if not _bit(bits, index))
                if alive and owner.spilled == 0:
                    owner.cursor = (segment, offset, 0)
                owner.spilled += alive
                live += alive
                continue
            for entry in records.decode_add(payload):
                index = entry.index
                if _bit(bits, index):
                    continue
                live += 1
                position = base | index
                state = states.get(position)
                if state is not None:
                    entry.attempts, entry.due_wall_ns = state
                if state is None and not entry.due_wall_ns and (owner.spilled or len(ready) >= limit):
                    if owner.spilled == 0:
                        owner.cursor = (segment, offset, entry.index - first)
                    owner.spilled += 1
                    continue
                headers, publisher_id = records.decode_entry_headers(entry.headers)
                message = _message(entry.id, entry.body, entry.timestamp_ns, headers, entry.attempts,
                                   entry.expires_wall_ns, entry.due_wall_ns, entry.topic, entry.origin, position, now,
                                   wall, publisher_id)
                (deferred if message.due is not None else ready).append(message)
                if owner.spilled:
                    _set_bit(done, position)  # in memory already: the spilled reader passes over it
                    bits = done.get(segment)
        owner.live[segment] = live
    last = segments[-1]
    owner.segment = last + 1
    owner.retained.append(owner.segment)
    owner.live[owner.segment] = 0
    owner.recovered_ready = ready
    owner.recovered_deferred = deferred
    owner._collect()  # segments whose every copy is done go with the first commit


def _set_bit(bitmaps: dict[int, bytearray], position: int) -> None:
    segment, index = position >> records.SEGMENT_SHIFT, position & records.INDEX_MASK
    bits = bitmaps.get(segment)
    if bits is None:
        bits = bitmaps[segment] = bytearray()
    if len(bits) <= index >> 3:
        bits.extend(bytes((index >> 3) + 1 - len(bits)))
    bits[index >> 3] |= 1 << (index & 7)


def _bit(bits: bytearray | None, index: int) -> bool:
    return bits is not None and len(bits) > index >> 3 and bool(bits[index >> 3] & (1 << (index & 7)))
