"""The committer: runs the store's group commits off the event loop.

Whatever the loop reported during one turn (publishes, acks, metadata) goes into one `CommitJob`;
the job's writes and its one fdatasync per file run in a worker thread while the loop goes on
collecting the next turn's changes. The sync callbacks (publish acknowledgements) run back on the
loop once the job is done.
"""

from __future__ import annotations

import logging
import math

import trio

from polymq.core.disk_io import FileWriter
from polymq.core.disk_storage import DiskStorage

log = logging.getLogger("polymq.storage")

# After a failed commit (disk full), wait this long before offering the work again.
RETRY_DELAY_S = 0.2


class Committer:
    def __init__(self, storage: DiskStorage) -> None:
        self.storage = storage
        self.writer = FileWriter()
        self._wake = trio.Event()
        storage.on_work = self._wake.set
        self.commits = 0

    def _rearm(self) -> None:
        self._wake = trio.Event()
        self.storage.on_work = self._wake.set

    async def run(self) -> None:
        storage = self.storage
        clock = storage.clock
        while True:
            force_fsync = False
            if not storage.has_work():
                due = storage.fsync_due()
                delay = math.inf if due is None else max(0.0, due - clock.now())
                with trio.move_on_after(delay) as waited:
                    await self._wake.wait()
                force_fsync = waited.cancelled_caught
            self._rearm()
            with trio.CancelScope(shield=True):
                # Shielded: a commit that started finishes and calls back, even during shutdown.
                failed = await self._commit(force_fsync=force_fsync)
            if failed:
                await trio.sleep(RETRY_DELAY_S)

    async def _commit(self, *, force_fsync: bool = False) -> bool:
        job, written, callbacks = self.storage.prepare(force_fsync=force_fsync)
        if job.appends or job.unlinks or job.removed_dirs or (job.fsync and force_fsync):
            await trio.to_thread.run_sync(self.writer.run, job)
        self.storage.complete(job, written, callbacks)
        self.commits += 1
        return job.error is not None

    async def flush(self) -> None:
        """The last commit, at shutdown: everything written and fdatasynced whatever the policy."""
        with trio.CancelScope(shield=True):
            if await self._commit(force_fsync=True):
                log.error("the last commit failed: %s", self.storage.failure)
            self.writer.close()
