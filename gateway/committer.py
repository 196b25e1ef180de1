"""The committer: drives the store's writes on the loop and its fdatasyncs in one worker thread.

Writes: the store hands changes (publishes, acks, metadata) to the OS on the loop
(`DiskStorage.write_now`): a `write` into the page cache costs microseconds, less than any
hand-off. Sessions call `write_now` at the end of a read that published; the write task here
catches everything else once per loop turn.

Syncs: under `--fsync=always` every write is followed by a sync job, queued to one long-lived
thread. The thread takes every job queued while it was busy as one (`SyncJob.merge`) and runs one
fdatasync per file for all of them, so the publishes of every connection written while one sync
ran share the next (group commit across connections), and syncs follow each other without a trip
through the loop. The loop only hears, through a pipe, which jobs ended, and releases their
acknowledgements. Nothing else waits for a sync: not reads, not deliveries, not the loop.
`interval:MS` queues a job every MS; `never` queues only removals. See docs/performance.md.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import queue
import sys
import threading

import trio

from polymq.core.disk_io import SyncJob
from polymq.core.disk_storage import DiskStorage

log = logging.getLogger("polymq.storage")

# After a failed commit (disk full), wait this long before offering the work again.
RETRY_DELAY_S = 0.2
# How long a thread that finished an fdatasync may wait for the GIL while the loop runs Python
# (CPython's default is 5 ms, longer than the sync itself): the acknowledgements wait on it.
GIL_SWITCH_INTERVAL_S = 0.0005


class SyncThread:
    """One long-lived thread running sync jobs; it reports their ends through a pipe.

    Measured here against `trio.to_thread.run_sync` per job (which reports through trio's entry
    queue): an fdatasync of ~155 µs took 307 µs through that, 205 µs through this pipe; and a
    thread that merges what queued up starts the next sync without waiting for the loop.
    """

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[SyncJob | None] = queue.SimpleQueue()
        self._done: queue.SimpleQueue[SyncJob] = queue.SimpleQueue()
        self._done_r, self._done_w = os.pipe()
        os.set_blocking(self._done_r, False)
        self._thread = threading.Thread(target=self._work, name="polymq-sync", daemon=True)
        self._thread.start()
        self._stopped = False

    def submit(self, job: SyncJob) -> None:
        self._jobs.put(job)

    def _work(self) -> None:
        jobs = self._jobs
        while True:
            job = jobs.get()
            if job is None:
                return
            stop = False
            while not jobs.empty():
                later = jobs.get()
                if later is None:
                    stop = True
                    break
                job.merge(later)
            self._done.put(job.run())
            os.write(self._done_w, b"\0")
            if stop:
                return

    def finished(self) -> list[SyncJob]:
        """The jobs that ended since the last call (empty if none)."""
        with contextlib.suppress(BlockingIOError):
            os.read(self._done_r, 4096)
        ended = []
        while not self._done.empty():
            ended.append(self._done.get())
        return ended

    async def wait(self) -> None:
        await trio.lowlevel.wait_readable(self._done_r)

    def stop(self) -> list[SyncJob]:
        """Let the queued jobs end, stop the thread; returns the jobs that ended meanwhile."""
        if not self._stopped:
            self._stopped = True
            self._jobs.put(None)
            self._thread.join()
        ended = self.finished()
        for fd in (self._done_r, self._done_w):
            os.close(fd)
        return ended


class Committer:
    def __init__(self, storage: DiskStorage) -> None:
        self.storage = storage
        self._wake = trio.Event()
        storage.on_work = self._wake.set
        self.thread = SyncThread()
        storage.on_sync_job = self.thread.submit
        self.syncs = 0  # sync jobs that ended (merged ones count once)
        if sys.getswitchinterval() > GIL_SWITCH_INTERVAL_S:
            sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)

    async def run(self) -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._write_loop)
            await self._sync_loop()

    async def _write_loop(self) -> None:
        storage = self.storage
        while True:
            if not storage.has_work():
                await self._wake.wait()
            self._wake = trio.Event()
            storage.on_work = self._wake.set
            try:
                if storage.failure is not None:
                    storage.retry_writes()
                else:
                    storage.write_now()
                # One sync for every connection's writes of this turn (sessions write at the end of their reads).
                storage.submit_sync()
            except Exception:
                # A bug must not stop the gateway: the work stays pending and is offered again.
                log.exception("the store's commit failed; trying again in %.1f s", RETRY_DELAY_S)
                await trio.sleep(RETRY_DELAY_S)
                continue
            if storage.failure is not None:
                await trio.sleep(RETRY_DELAY_S)
            else:
                await trio.lowlevel.checkpoint()  # let this turn's other tasks report more first

    async def _sync_loop(self) -> None:
        storage = self.storage
        clock = storage.clock
        while True:
            due = storage.fsync_due()  # the interval policy's next sync
            delay = math.inf if due is None else max(0.0, due - clock.now())
            with trio.move_on_after(delay) as waited:
                await self.thread.wait()
            if waited.cancelled_caught:
                storage.take_sync()
            self._finish(self.thread.finished())

    def _finish(self, jobs: list[SyncJob]) -> None:
        for job in jobs:
            self.syncs += 1
            self.storage.sync_done(job)

    async def flush(self) -> None:
        """The last commit, at shutdown: everything written and fdatasynced whatever the policy."""
        storage = self.storage
        if storage.failure is not None:
            storage.retry_writes()
        else:
            storage.write_now()
        storage.take_sync(force_fsync=True)
        self._finish(self.thread.stop())  # blocks the loop: nothing else runs any more
        if storage.failure is not None:
            log.error("the last commit failed: %s", storage.failure)
        storage.close_files()
