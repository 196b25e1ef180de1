"""The committer: drives the store's writes on the loop and its fdatasyncs off it.

Writes: the store hands changes (publishes, acks, metadata) to the OS on the loop
(`DiskStorage.write_now`): a `write` into the page cache costs microseconds, less than any
hand-off. Sessions write what a read changed at its end; the write task here catches everything
else once per loop turn. Under the host loop (adapters/host_loop.py) that turn is the end of the
loop's pass, from the loop itself (`after_batch`): a trio event set from a callback of the loop costs
a guest tick of trio, and a durable PUB arriving while the sync thread is busy needs one such turn.
The task then only retries after a failure.

Syncs: under `--fsync=always` every write is followed by a sync job: an fdatasync of every file
written since the last job. One long-lived thread runs them (`ThreadSyncs`): it takes every job
queued while it was busy as one and runs one fdatasync per file for all of them, so the publishes
of every connection written meanwhile share the next (group commit across connections). With
`POLYMQ_SYNC_AIO=1`, where Linux AIO can run them (`AioSyncs`), the kernel does instead, several at
once, reporting on an eventfd the loop waits on like a socket: each read's publishes start their
own fdatasync at once, and no thread of ours takes the GIL between the disk and the
acknowledgement; but concurrent fdatasyncs of one file queue in the kernel, and the group commit
gains more. Either way the loop releases acknowledgements in the order the jobs were handed out,
and nothing else waits for a sync: not reads, not deliveries, not the loop.
Removals (finished segments, deleted queues) run in the thread after the sync that preceded them.
`interval:MS` queues a job every MS; `never` queues only removals. See docs/performance.md.
"""

from __future__ import annotations

import bisect
import contextlib
import errno
import logging
import os
import queue
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Protocol

import attrs
import trio

from polymq.adapters import host_loop
from polymq.adapters.host_loop import HostLoop, serve_readable
from polymq.core.aio_fsync import AioFsync, SubmitError
from polymq.core.disk_io import SyncJob, open_dir
from polymq.core.disk_storage import DiskStorage

log = logging.getLogger("polymq.storage")

# After a failed commit (disk full), wait this long before offering the work again.
RETRY_DELAY_S = 0.2
# How long a thread that finished an fdatasync may wait for the GIL while the loop runs Python
# (CPython's default is 5 ms, longer than the sync itself): the acknowledgements wait on it.
GIL_SWITCH_INTERVAL_S = 0.0005
# Sync jobs running at once under AIO. Two publishers that each wait for their own fdatasync no
# longer wait for the other's too; past a few, more concurrent fdatasyncs of the same files only
# queue in the kernel (measured: docs/performance.md).
AIO_JOBS_IN_FLIGHT = 4
# A job with more files than this goes to the thread (bounded kernel context, one call per job).
AIO_MAX_FILES_PER_JOB = 64

Report = Callable[[list[SyncJob]], None]


class Syncs(Protocol):
    """Runs sync jobs off the loop and reports them ended, in the order they were submitted."""

    # How many jobs may run at once: the store queues further writes' syncs for the next turn.
    max_in_flight: int
    name: str  # for the start-up log line

    def submit(self, job: SyncJob) -> None: ...

    async def watch(self, report: Report) -> None:
        """Forever: call `report` on the loop with the jobs that ended, in submission order."""
        ...

    def stop(self) -> list[SyncJob]:
        """Let every submitted job end (blocking), stop; the jobs that ended and were not reported."""
        ...


class SyncThread:
    """One long-lived thread running sync jobs; it reports their ends through a pipe.

    Measured here against `trio.to_thread.run_sync` per job (which reports through trio's entry
    queue): an fdatasync of ~155 µs took 307 µs through that, 205 µs through this pipe; and a
    thread that merges what queued up (`merge`) starts the next sync without waiting for the loop.
    """

    def __init__(self, *, merge: bool = True) -> None:
        self._merge = merge
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
            while self._merge and not jobs.empty():
                later = jobs.get()
                if later is None:
                    stop = True
                    break
                job.merge(later)
            try:
                self._done.put(job.run())
            except Exception as error:  # a bug here must not leave every later acknowledgement waiting
                log.exception("a sync job failed")
                job.error = OSError(errno.EIO, f"the sync job failed: {error!r}")
                self._done.put(job)
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

    def fileno(self) -> int:
        """Readable when jobs have ended (`finished`)."""
        return self._done_r

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


class ThreadSyncs:
    """Every sync job in the thread, one at a time, merged while it is busy (group commit)."""

    max_in_flight = 1
    name = "fdatasync in a thread"

    def __init__(self) -> None:
        self.thread = SyncThread()

    def submit(self, job: SyncJob) -> None:
        self.thread.submit(job)

    async def watch(self, report: Report) -> None:
        await serve_readable(self.thread.fileno(), lambda: report(self.thread.finished()))

    def stop(self) -> list[SyncJob]:
        return self.thread.stop()


class AioSyncs:
    """fdatasyncs run by the kernel (Linux AIO), several jobs at once; removals, and jobs too large
    for one submission, in a thread. Jobs are reported in the order they were submitted."""

    max_in_flight = AIO_JOBS_IN_FLIGHT
    name = "fdatasync by kernel AIO"

    def __init__(self, aio: AioFsync) -> None:
        self.aio = aio
        self.thread = SyncThread(merge=False)
        self._order: deque[SyncJob] = deque()  # submitted, not reported yet, in order
        self._ended: set[int] = set()  # gens of jobs in `_order` that ended
        self._pending: dict[int, tuple[SyncJob, list[int]]] = {}  # gen -> (job, directory fds opened)
        self._left: dict[int, int] = {}  # gen -> its kernel fdatasyncs not reaped yet
        self._by_thread: set[int] = set()  # gens the thread runs whole (their AIO parts are ignored)
        self._refused = False  # the kernel refused an fdatasync (not for lack of room): AIO is not used again

    def submit(self, job: SyncJob) -> None:
        self._order.append(job)
        gen = job.gen
        if not job.fsync or not (job.fds or job.dirs):
            self._ended_now(job)
            return
        dir_fds = [fd for fd in map(open_dir, job.dirs) if fd is not None]
        fds = job.fds + dir_fds
        self._pending[gen] = (job, dir_fds)
        if self._refused or len(fds) > AIO_MAX_FILES_PER_JOB or self.aio.in_flight + len(fds) > self.aio.depth:
            self._to_thread(job)
            return
        try:
            self.aio.submit(fds, gen)
        except SubmitError as error:
            if error.errno in (errno.EINVAL, errno.EOPNOTSUPP, errno.ENOSYS):  # it cannot here: the thread from now on
                self._refused = True
                log.warning("io_submit refused an fdatasync (%s); fdatasync in a thread from now on", error.strerror)
            if error.submitted:
                self._left[gen] = error.submitted
            self._to_thread(job)
            return
        self._left[gen] = len(fds)

    def _to_thread(self, job: SyncJob) -> None:
        self._by_thread.add(job.gen)
        self.thread.submit(job)

    def _ended_now(self, job: SyncJob) -> None:
        """A job with nothing to sync: ended at once, reported in its turn (the eventfd wakes the watcher)."""
        self._ended.add(job.gen)
        removals = job.removals()
        if removals is not None:
            self.thread.submit(removals)
        os.eventfd_write(self.aio.fileno(), 1)

    def _reaped(self, results: list[tuple[int, int]]) -> None:
        for gen, result in results:
            by_thread = gen in self._by_thread  # the thread's run of the whole job reports it
            if result < 0 and not by_thread:
                job = self._pending[gen][0]
                if job.error is None:  # any file's failure fails the job
                    job.error = OSError(-result, os.strerror(-result))
            left = self._left[gen] - 1
            if left:
                self._left[gen] = left
                continue
            del self._left[gen]
            self.aio.forget(gen)
            if by_thread:
                continue
            job, dir_fds = self._pending.pop(gen)
            self._close(dir_fds)
            self._ended.add(gen)
            removals = job.removals()
            if removals is not None:
                self.thread.submit(removals)

    def _from_thread(self, jobs: list[SyncJob]) -> None:
        for job in jobs:
            gen = job.gen
            if gen not in self._by_thread or gen not in self._pending:
                continue  # removals of a job reported already
            self._by_thread.discard(gen)
            _, dir_fds = self._pending.pop(gen)
            self._close(dir_fds)
            self._ended.add(gen)

    @staticmethod
    def _close(fds: list[int]) -> None:
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)

    def _take_reportable(self) -> list[SyncJob]:
        order, ended = self._order, self._ended
        ready = []
        while order and order[0].gen in ended:
            job = order.popleft()
            ended.discard(job.gen)
            ready.append(job)
        return ready

    async def watch(self, report: Report) -> None:
        def from_aio() -> None:
            self._reaped(self.aio.reap())
            ready = self._take_reportable()
            if ready:
                report(ready)

        def from_thread() -> None:
            self._from_thread(self.thread.finished())
            ready = self._take_reportable()
            if ready:
                report(ready)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(serve_readable, self.thread.fileno(), from_thread)
            await serve_readable(self.aio.fileno(), from_aio)

    def stop(self) -> list[SyncJob]:
        self._reaped(self.aio.wait_all())
        self._from_thread(self.thread.stop())
        self.aio.close()
        return self._take_reportable()


def open_syncs() -> Syncs:
    """The sync thread; with `POLYMQ_SYNC_AIO=1`, kernel AIO where this system runs fdatasync
    through it. The thread merges every job queued while it was busy into one fdatasync per file,
    which AIO's jobs in flight do not: with 8 publishing connections 15.6-16.5k PUBs/s against
    10.5-11.4k, with 2 a median of 6.6k against 6.0k, with one the same (docs/performance.md)."""
    if not os.environ.get("POLYMQ_SYNC_AIO"):
        return ThreadSyncs()
    try:
        aio = AioFsync()
    except OSError as error:
        log.info("fdatasync in a thread: Linux AIO is not available here (%s)", error.strerror)
        return ThreadSyncs()
    return AioSyncs(aio)


# fdatasync latency buckets, seconds: one into zeros written ahead takes about 0.1 ms on this
# machine's disk, a loaded or rotating disk's tens of ms.
SYNC_BUCKETS_S = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)


@attrs.define(slots=True)
class SyncLatencies:
    """How long sync jobs with an fdatasync took, from their hand-over to the driver to their end."""

    counts: list[int] = attrs.Factory(lambda: [0] * (len(SYNC_BUCKETS_S) + 1))  # the last: above them all
    total_s: float = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(SYNC_BUCKETS_S, seconds)] += 1
        self.total_s += seconds


class Committer:
    def __init__(self, storage: DiskStorage, syncs: Syncs | None = None) -> None:
        self.storage = storage
        self._wake = trio.Event()
        storage.on_work = self._wake_task  # `_commit_at_end_of_pass` under a host loop (`run`)
        self._host: HostLoop | None = None
        self._commit_queued = False
        self.driver = syncs if syncs is not None else open_syncs()
        storage.on_sync_job = self._submit
        self.latencies = SyncLatencies()
        self._submitted: dict[int, float] = {}  # a sync job's gen → when it went to the driver
        storage.max_syncs_in_flight = self.driver.max_in_flight
        storage.on_unsynced = self._unsynced
        self.syncs = 0  # sync jobs that ended (merged ones count once)
        self._unsynced_event = trio.Event()
        if sys.getswitchinterval() > GIL_SWITCH_INTERVAL_S:
            sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)

    async def run(self) -> None:
        self._host = host_loop.current()
        if self._host is not None:
            self.storage.on_work = self._commit_at_end_of_pass
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._write_loop)
            nursery.start_soon(self.driver.watch, self._finish)
            await self._due_sync_loop()

    def _wake_task(self) -> None:
        self._wake.set()

    def _commit_at_end_of_pass(self) -> None:
        """`on_work` under a host loop: one commit turn at the end of the loop's pass."""
        if not self._commit_queued and self._host is not None:
            self._commit_queued = True
            self._host.after_batch(self._commit_turn)

    def _commit_turn(self) -> None:
        """The write task's turn, run by the host loop; a failure goes to the task, which retries."""
        self._commit_queued = False
        if self.storage.failure is None:
            try:
                self._commit_once()
            except Exception:
                log.exception("the store's commit failed on the loop; the committer's task tries again")
                self._wake_task()
                return
        if self.storage.failure is not None:
            self._wake_task()

    def _commit_once(self) -> None:
        """Hand every pending change to the OS (after a failure, what failed first) and queue one sync
        for every connection's writes of this turn (sessions write at the end of their reads)."""
        storage = self.storage
        if storage.failure is not None:
            storage.retry_writes()
        else:
            storage.write_now()
        storage.submit_sync()

    async def _write_loop(self) -> None:
        storage = self.storage
        while True:
            if not storage.has_work():
                await self._wake.wait()
            self._wake = trio.Event()
            try:
                self._commit_once()
            except Exception:
                # A bug must not stop the gateway: the work stays pending and is offered again.
                log.exception("the store's commit failed; trying again in %.1f s", RETRY_DELAY_S)
                await trio.sleep(RETRY_DELAY_S)
                continue
            if storage.failure is not None:
                await trio.sleep(RETRY_DELAY_S)
            else:
                await trio.lowlevel.checkpoint()  # let this turn's other tasks report more first

    async def _due_sync_loop(self) -> None:
        """fdatasyncs no acknowledgement asked for: `interval:MS`'s, and under `always` those of
        records no one waits for (`DiskStorage.fsync_due`)."""
        storage = self.storage
        clock = storage.clock
        while True:
            due = storage.fsync_due()
            if due is None:
                self._unsynced_event = trio.Event()
                await self._unsynced_event.wait()  # `on_unsynced`: a write after a sync
                continue
            delay = due - clock.now()
            if delay > 0:
                await trio.sleep(delay)
            else:
                storage.take_sync()
                await trio.lowlevel.checkpoint()

    def _unsynced(self) -> None:
        self._unsynced_event.set()

    def _submit(self, job: SyncJob) -> None:
        if job.fsync and job.fds:
            self._submitted[job.gen] = time.perf_counter()
        self.driver.submit(job)

    def _finish(self, jobs: list[SyncJob]) -> None:
        now = time.perf_counter()
        submitted = self._submitted
        for job in jobs:
            self.syncs += 1
            started = submitted.pop(job.gen, None)
            if started is not None:
                self.latencies.observe(now - started)
            # A driver that merged jobs ends the last of them only: forget the ones it covered.
            while submitted and next(iter(submitted)) < job.gen:
                del submitted[next(iter(submitted))]
            self.storage.sync_done(job)

    async def flush(self) -> None:
        """The last commit, at shutdown: everything written and fdatasynced whatever the policy."""
        storage = self.storage
        if storage.failure is not None:
            storage.retry_writes()
        else:
            storage.write_now()
        storage.take_sync(force_fsync=True)
        self._finish(self.driver.stop())  # blocks the loop: nothing else runs any more
        if storage.failure is not None:
            log.error("the last commit failed: %s", storage.failure)
        storage.close_files()
