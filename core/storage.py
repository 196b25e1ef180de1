"""The storage seam (ARCHITECTURE §4).

The engine reports every durable change through this interface: metadata (topics, queues,
bindings, options, pause state) and the life of each message copy (added, finished, made
ready again with its attempts, deferred with its due time). An implementation decides how to
make it durable; the engine never waits on it. Acknowledgements that must follow durability
ask for a `sync` ticket and are sent from its callback (group commit: one sync covers every
change made before it).

Ephemeral topics and queues are never reported.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol

import attrs


@attrs.frozen(slots=True)
class StoredMessage:
    """A message copy as storage knows it."""

    id: int
    body: bytes
    timestamp_ns: int
    attempts: int
    headers: Mapping[str, Any] | None
    expires_at_wall_ns: int | None
    deliver_at_wall_ns: int | None  # deferred until then; None = ready


@attrs.frozen(slots=True)
class QueueRecord:
    name: str
    topics: tuple[str, ...]
    paused: bool
    options: Mapping[str, Any]
    messages: tuple[StoredMessage, ...]


@attrs.frozen(slots=True)
class TopicRecord:
    name: str
    paused: bool
    backlog: tuple[StoredMessage, ...]


@attrs.frozen(slots=True)
class Snapshot:
    """Everything a restart brings back."""

    topics: tuple[TopicRecord, ...] = ()
    queues: tuple[QueueRecord, ...] = ()
    last_id: int = 0


class Storage(Protocol):
    # True when changes must be reported at all (an in-memory store can skip the bookkeeping).
    persistent: bool

    def load(self) -> Snapshot: ...

    def topic_saved(self, name: str, paused: bool) -> None: ...

    def topic_deleted(self, name: str) -> None: ...

    def queue_saved(self, name: str, topics: Iterable[str], paused: bool, options: Mapping[str, Any]) -> None: ...

    def queue_deleted(self, name: str) -> None: ...

    def messages_added(self, owner: str, messages: Iterable[StoredMessage], *, topic: bool = False) -> None:
        """New copies in a queue (or, with `topic`, in a topic's backlog)."""
        ...

    def message_removed(self, owner: str, message_id: int, *, topic: bool = False) -> None: ...

    def message_updated(self, owner: str, message: StoredMessage) -> None:
        """Attempts or due time changed (requeue, timeout, deferral)."""
        ...

    def owner_emptied(self, owner: str, *, topic: bool = False) -> None: ...

    def sync(self, callback: Callable[[], None]) -> None:
        """Call `callback` once every change reported so far is durable under the configured policy."""
        ...


class MemoryStorage:
    """Keeps nothing: the engine's own structures are the only copy. A restart starts empty."""

    persistent = False

    def load(self) -> Snapshot:
        return Snapshot()

    def topic_saved(self, name: str, paused: bool) -> None:
        pass

    def topic_deleted(self, name: str) -> None:
        pass

    def queue_saved(self, name: str, topics: Iterable[str], paused: bool, options: Mapping[str, Any]) -> None:
        pass

    def queue_deleted(self, name: str) -> None:
        pass

    def messages_added(self, owner: str, messages: Iterable[StoredMessage], *, topic: bool = False) -> None:
        pass

    def message_removed(self, owner: str, message_id: int, *, topic: bool = False) -> None:
        pass

    def message_updated(self, owner: str, message: StoredMessage) -> None:
        pass

    def owner_emptied(self, owner: str, *, topic: bool = False) -> None:
        pass

    def sync(self, callback: Callable[[], None]) -> None:
        callback()
