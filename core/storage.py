"""The storage seam (docs/architecture.md).

The engine reports every durable change through this interface: metadata (topics, queues,
bindings, options, pause state) to the `Storage`, and the life of each message copy (added,
delivered, returned with its attempts and due time, gone) to the `OwnerLog` of its durable queue
or topic backlog. The engine never waits on storage. Acknowledgements that must follow
durability ask for a `sync` ticket and are sent from its callback (group commit: one sync covers
every change made before it).

Ephemeral topics and queues get no log and are never reported. `MemoryStorage` keeps nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import attrs

if TYPE_CHECKING:
    from polymq.core.ids import IdSource
    from polymq.core.message import Message

# Called with None once the changes are stored, or with the error that stopped them.
SyncCallback = Callable[[OSError | None], None]


class DataDirInUse(RuntimeError):
    """Another process holds a store's lock; `pid` is the one it wrote there, if any.

    Defined here, outside the compiled store: mypyc's native classes cannot inherit exceptions.
    """

    def __init__(self, directory: object, pid: int | None) -> None:
        super().__init__(f"{directory} is in use by another polymq process (pid {pid})")
        self.directory = directory
        self.pid = pid


class OwnerLog(Protocol):
    """The durable record of one queue's (or topic backlog's) message copies."""

    # Copies held only on disk, after every copy the owner holds in memory (read back with `read`).
    spilled: int
    # Called when spilled copies that were on their way to the disk can be read.
    on_readable: Callable[[], None] | None
    # Whether spilled copies read back may carry a due time (a topic backlog's log).
    may_hold_deferred: bool
    recovered_ready: list[Message]
    recovered_deferred: list[Message]

    def append(self, messages: Sequence[Message], keep: int | None = None) -> None:
        """New copies; past `keep`, the owner keeps no object (they count in `spilled`)."""
        ...

    def removed(self, message: Message) -> None: ...

    def removed_after_next_write(self, message: Message) -> None:
        """The copy is gone, but the record saying so waits for the write after the next: what took
        its place in another file (a dead letter) reaches the disk first."""
        ...

    def state(self, message: Message, due_wall_ns: int = 0) -> None:
        """Delivered (attempts grew) or returned to the queue (maybe deferred until `due_wall_ns`)."""
        ...

    def emptied(self) -> None: ...

    def next_position(self) -> int:
        """The position the next copy appended will get (every stored copy has a lower one)."""
        ...

    def peek_pages(self, page: int) -> Iterator[list[Message]]:
        """Every spilled copy, `page` at a time, in order, as `read` gives them, without taking
        them: once the pages end or the iterator is closed, the next `read` starts where it did
        (a snapshot of the queue)."""
        ...

    def start_after(self, position: int) -> None:
        """Give new copies positions above `position` (a stream's committed end before a restart)."""
        ...

    def read(self, count: int) -> list[Message]: ...

    def bytes_on_disk(self) -> int: ...


@attrs.frozen(slots=True)
class TopicRecord:
    name: str
    paused: bool
    log: OwnerLog
    made_by: str | None = None  # the origin its maker gave (`Engine.ensure_topic`)


@attrs.frozen(slots=True)
class QueueRecord:
    name: str
    topics: tuple[str, ...]
    paused: bool
    options: Mapping[str, Any]
    log: OwnerLog


@attrs.frozen(slots=True)
class Snapshot:
    """Everything a restart brings back."""

    topics: tuple[TopicRecord, ...] = ()
    queues: tuple[QueueRecord, ...] = ()
    # Records kept by key (`kept_saved`), by kind: "schedule" (core/schedules.py), "dedup" (core/dedup.py).
    kept: Mapping[str, tuple[Mapping[str, Any], ...]] = attrs.Factory(dict)


class Storage(Protocol):
    # True when durable owners get a log (an in-memory store skips the bookkeeping).
    persistent: bool
    # Copies per owner kept as objects before the rest are spilled to disk.
    mem_queue_size: int
    # Why the last commit failed (publishes fail while it is set), or None.
    failure: str | None
    # fdatasyncs run so far.
    syncs: int

    def load(self, ids: IdSource) -> Snapshot: ...

    def open_topic(self, name: str, made_by: str | None = None) -> OwnerLog: ...

    def topic_saved(self, name: str, paused: bool) -> None: ...

    def topic_deleted(self, name: str, log: OwnerLog | None) -> None: ...

    def open_queue(self, name: str, topics: Iterable[str], paused: bool, options: Mapping[str, Any]) -> OwnerLog: ...

    def queue_saved(self, name: str, topics: Iterable[str], paused: bool, options: Mapping[str, Any]) -> None: ...

    def queue_deleted(self, name: str, log: OwnerLog | None) -> None: ...

    def kept_saved(self, kind: str, key: str, record: Mapping[str, Any]) -> None:
        """Keep `record` under (`kind`, `key`), replacing what was there; a restart brings it back."""
        ...

    def kept_deleted(self, kind: str, key: str) -> None: ...

    def adopt(self, topic: str, queue: str, topic_log: OwnerLog, queue_log: OwnerLog) -> OwnerLog | None:
        """The queue takes the topic's log over (its first queue, holding nothing yet): the topic's
        backlog becomes the queue's without a copy. Returns the topic's new, empty log, or None when
        the swap cannot be made (the backlog is then copied as usual)."""
        ...

    def sync(self, callback: SyncCallback) -> None:
        """Call `callback` once every change reported so far is durable under the configured policy."""
        ...

    def write_now(self) -> None:
        """Hand every change reported so far to the OS before returning (it survives a process crash).

        Sessions call it before sending deliveries (their attempts must be on record first) and at the
        end of each read that published (callbacks that need no fdatasync then run before it returns).
        """
        ...

    def hold_work(self) -> None:
        """A session is handling a read: changes reported until `release_work` are written then, by it."""
        ...

    def release_work(self) -> None:
        """The end of `hold_work`: everything reported meanwhile is handed to the OS before this returns."""
        ...


class MemoryStorage:
    """Keeps nothing: the engine's own structures are the only copy. A restart starts empty."""

    persistent = False
    mem_queue_size = 0  # unused: nothing is ever spilled without a disk
    failure: str | None = None
    syncs = 0

    def load(self, ids: IdSource) -> Snapshot:
        return Snapshot()

    def open_topic(self, name: str, made_by: str | None = None) -> OwnerLog:
        raise TypeError("MemoryStorage keeps no logs")

    def topic_saved(self, name: str, paused: bool) -> None:
        pass

    def topic_deleted(self, name: str, log: OwnerLog | None) -> None:
        pass

    def open_queue(self, name: str, topics: Iterable[str], paused: bool, options: Mapping[str, Any]) -> OwnerLog:
        raise TypeError("MemoryStorage keeps no logs")

    def queue_saved(self, name: str, topics: Iterable[str], paused: bool, options: Mapping[str, Any]) -> None:
        pass

    def queue_deleted(self, name: str, log: OwnerLog | None) -> None:
        pass

    def kept_saved(self, kind: str, key: str, record: Mapping[str, Any]) -> None:
        pass

    def kept_deleted(self, kind: str, key: str) -> None:
        pass

    def adopt(self, topic: str, queue: str, topic_log: OwnerLog, queue_log: OwnerLog) -> OwnerLog | None:
        return None

    def sync(self, callback: SyncCallback) -> None:
        callback(None)

    def write_now(self) -> None:
        pass

    def hold_work(self) -> None:
        pass

    def release_work(self) -> None:
        pass
