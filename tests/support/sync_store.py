"""A `DiskStorage` + `Engine` on a directory, committed synchronously the way the committer does
it (`prepare` -> `FileWriter.run` -> `complete`): unit tests of what the store keeps across a restart."""

from __future__ import annotations

from pathlib import Path

from polymq.core.clock import ManualClock
from polymq.core.disk_io import FileWriter
from polymq.core.disk_storage import DiskStorage, FsyncPolicy
from polymq.core.engine import Engine, Queue

_STORES: dict[int, Store] = {}  # by id of its engine, for `publish_each`


class Store:
    """One `DiskStorage` + `Engine` over a data dir, restored at open, as `polymq serve` wires them."""

    def __init__(self, directory: Path, clock: ManualClock, mem_queue_size: int) -> None:
        self.dir = directory
        self.clock = clock
        self.storage = DiskStorage(directory, clock, policy=FsyncPolicy("always"), mem_queue_size=mem_queue_size)
        self.engine = Engine(clock=clock, storage=self.storage)
        self.engine.restore()
        self.writer = FileWriter()
        self.closed = False
        _STORES[id(self.engine)] = self

    def commit(self) -> None:
        """One group commit, run inline (the committer runs `FileWriter.run` in a thread)."""
        job, written, callbacks = self.storage.prepare()
        self.writer.run(job)
        self.storage.complete(job, written, callbacks)
        assert job.error is None, job.error

    def close(self) -> None:
        """Commit what is pending and release the dir (its LOCK), like a crash right after a commit."""
        if self.closed:
            return
        self.closed = True
        try:
            self.commit()
        finally:
            self.writer.close()
            self.storage.close()

    def queue(self, name: str) -> Queue:
        queue = self.engine.queue(name)
        assert queue is not None, f"queue {name!r} did not come back"
        return queue


