"""The store's commit path: writes on the loop, fdatasyncs in sync jobs, acknowledgements in order.

Unit level on the real store and files: `write_now` (what sessions and the committer call on the
loop), the sync jobs it hands out (`on_sync_job`), their merging in the sync thread, and the order
in which callbacks come back under each `--fsync` policy, including a write that fails on a full
disk while earlier callbacks still wait for their fdatasync. Then the committer's thread itself.
"""

from __future__ import annotations

import errno
import os
import socket
from pathlib import Path

import pytest
import trio

from polymq.adapters import host_loop
from polymq.adapters.host_loop import HostLoop
from polymq.core.aio_fsync import AioFsync
from polymq.core.clock import ManualClock, SystemClock
from polymq.core.disk_io import PREZERO_BYTES, PREZERO_MAX_WRITE, CommitJob, FileWriter, SyncJob
from polymq.core.disk_storage import DiskStorage, FsyncPolicy
from polymq.core.engine import Engine
from polymq.gateway import committer
from polymq.gateway.committer import AioSyncs, SyncThread

from support import storage_files as files


def open_store(directory: Path, policy: str) -> tuple[DiskStorage, Engine, list[SyncJob]]:
    storage = DiskStorage(directory, ManualClock(), policy=FsyncPolicy.parse(policy))
    engine = Engine(clock=storage.clock, storage=storage)
    engine.restore()
    submitted: list[SyncJob] = []
    storage.on_sync_job = submitted.append
    engine.ensure_queue("q")
    engine.bind("q", "t")
    return storage, engine, submitted


def settle(storage: DiskStorage, submitted: list[SyncJob]) -> None:
    """Write and sync everything so far, as the committer and its thread would."""
    storage.write_now()
    for job in submitted:
        storage.sync_done(job.run())
    submitted.clear()


def segment_bytes(directory: Path) -> bytes:
    return b"".join(path.read_bytes() for path in sorted(directory.glob("q*/*.seg")))


def test_never_answers_inside_write_now_with_the_record_in_the_file(tmp_path: Path) -> None:
    storage, engine, submitted = open_store(tmp_path, "never")
    outcomes: list[OSError | None] = []
    engine.publish("t", b"first-body")
    storage.sync(outcomes.append)
    assert outcomes == []
    storage.write_now()
    assert outcomes == [None]
    assert b"first-body" in segment_bytes(tmp_path)
    assert [job for job in submitted if job.fsync] == []  # never: no fdatasync is ever asked for


def test_always_answers_only_after_the_sync_job_that_covers_the_write(tmp_path: Path) -> None:
    storage, engine, submitted = open_store(tmp_path, "always")
    settle(storage, submitted)  # the queue's creation
    outcomes: list[str] = []
    engine.publish("t", b"a")
    storage.sync(lambda error: outcomes.append(f"a {error}"))
    storage.write_now()
    assert b"a" in segment_bytes(tmp_path) and outcomes == []
    [first] = submitted
    assert first.fsync and first.fds, "the written segment is in the job"
    # While the first job runs, another connection's publish is written: it waits for a second job.
    engine.publish("t", b"b")
    storage.sync(lambda error: outcomes.append(f"b {error}"))
    storage.write_now()
    assert len(submitted) == 1, "the thread is busy: the next job waits for the committer's turn"
    storage.submit_sync()
    second = submitted[1]
    storage.sync_done(first.run())
    assert outcomes == ["a None"]
    storage.sync_done(second.run())
    assert outcomes == ["a None", "b None"]


def test_a_held_read_wakes_no_committer_and_writes_everything_when_released(tmp_path: Path) -> None:
    storage, engine, submitted = open_store(tmp_path, "never")
    settle(storage, submitted)
    wakes: list[str] = []
    storage.on_work = lambda: wakes.append("wake")
    outcomes: list[OSError | None] = []
    storage.hold_work()
    engine.publish("t", b"held-body")
    storage.sync(outcomes.append)
    assert wakes == [] and outcomes == [] and b"held-body" not in segment_bytes(tmp_path)
    storage.release_work()
    assert outcomes == [None], "acknowledged from the release, on the loop"
    assert b"held-body" in segment_bytes(tmp_path)
    assert wakes == [], "nothing left for the committer"
    # Outside a hold, a change wakes the committer at once.
    engine.publish("t", b"free")
    assert wakes == ["wake"]


def test_a_release_under_always_leaves_the_busy_sync_thread_to_the_committer(tmp_path: Path) -> None:
    storage, engine, submitted = open_store(tmp_path, "always")
    settle(storage, submitted)
    wakes: list[str] = []
    storage.on_work = lambda: wakes.append("wake")
    outcomes: list[str] = []
    for body in (b"one", b"two"):
        storage.hold_work()
        engine.publish("t", body)
        storage.sync(lambda error, body=body: outcomes.append(f"{body.decode()} {error}"))
        storage.release_work()
    # The first release started a sync job at once; the second found the thread busy and woke the
    # committer to queue the next job in its turn.
    assert len(submitted) == 1 and wakes == ["wake"] and storage.has_work()
    storage.submit_sync()
    first, second = submitted
    storage.sync_done(first.run())
    storage.sync_done(second.run())
    assert outcomes == ["one None", "two None"]


def test_an_awaited_write_under_always_whose_job_takes_it_all_starts_no_sync_timer(tmp_path: Path) -> None:
    """A PUB per round trip: each write follows a sync and goes into a sync job at once, so the
    committer's timer of unawaited writes (`on_unsynced`) is not woken; a write no one waits for is."""
    storage, engine, submitted = open_store(tmp_path, "always")
    settle(storage, submitted)
    unsynced: list[str] = []
    storage.on_unsynced = lambda: unsynced.append("timer")
    outcomes: list[OSError | None] = []
    for body in (b"one", b"two", b"three"):
        storage.hold_work()
        engine.publish("t", body)
        storage.sync(outcomes.append)
        storage.release_work()
        [job] = submitted
        storage.sync_done(job.run())
        submitted.clear()
    assert outcomes == [None, None, None] and unsynced == []
    engine.publish("t", b"no one waits")  # a write without an acknowledgement: the timer syncs it
    storage.write_now()
    assert submitted == [] and unsynced == ["timer"]


def test_interval_answers_after_the_write_and_syncs_on_the_timer(tmp_path: Path) -> None:
    storage, engine, submitted = open_store(tmp_path, "interval:50")
    storage.write_now()
    outcomes: list[OSError | None] = []
    engine.publish("t", b"x")
    storage.sync(outcomes.append)
    storage.write_now()
    assert outcomes == [None]
    assert [job for job in submitted if job.fsync] == [], "interval: no fdatasync before the timer"
    due = storage.fsync_due()
    assert due is not None and due <= storage.clock.now() + 0.05
    job = storage.take_sync()
    assert job.fsync and job.fds
    storage.sync_done(job.run())
    assert storage.fsync_due() is None


def test_merged_jobs_sync_each_file_once_then_close_and_remove(tmp_path: Path) -> None:
    kept = tmp_path / "kept"
    gone = tmp_path / "gone"
    kept.write_bytes(b"k")
    gone.write_bytes(b"g")
    kept_fd = os.open(kept, os.O_WRONLY)
    gone_fd = os.open(gone, os.O_WRONLY)
    first = SyncJob(fds=[kept_fd], paths=[kept], gen=1)
    second = SyncJob(fds=[kept_fd, gone_fd], paths=[kept, gone], unlinks=[gone], close_fds=[gone_fd], gen=2,
                     dirs=[tmp_path])
    first.merge(second)
    assert first.fds == [kept_fd, gone_fd] and first.gen == 2 and first.dirs == [tmp_path]
    assert first.run().error is None
    assert not gone.exists() and kept.exists()
    with pytest.raises(OSError):
        os.fstat(gone_fd)  # closed by the job, after its fdatasync
    os.close(kept_fd)


def test_a_failed_write_is_answered_after_the_callbacks_given_before_it(tmp_path: Path) -> None:
    """Sessions pair answers with commands in order: an error must not overtake an earlier success."""
    with files.small_tmpfs(tmp_path / "tmpfs", "1m") as mount:
        storage, engine, submitted = open_store(mount / "data", "always")
        filler = mount / "filler"
        settle(storage, submitted)
        outcomes: list[str] = []
        engine.publish("t", b"small")
        storage.sync(lambda error: outcomes.append(f"small {error is None}"))
        storage.write_now()
        assert len(submitted) == 1  # its fdatasync is still running
        files.fill_disk(filler, 16 * 1024)
        for number in range(400):
            engine.publish("t", b"%04d" % number + bytes(4000))
            storage.sync(lambda error: outcomes.append(f"big {error is None or error.errno}"))
            storage.write_now()
            if storage.failure is not None:
                break
        else:
            pytest.fail("400 writes on a full disk and none failed")
        assert outcomes == [], "nothing is answered before the fdatasync of the first publish"
        storage.submit_sync()
        for job in submitted:
            storage.sync_done(job.run())
        written = len(outcomes) - 2
        assert written > 0
        assert outcomes == ["small True"] + ["big True"] * written + [f"big {errno.ENOSPC}"]
        filler.unlink()
        assert storage.retry_writes()
        storage.close()
        storage.close_files()


async def test_the_sync_thread_reports_every_job_and_merges_a_queue(tmp_path: Path) -> None:
    path = tmp_path / "f"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    thread = SyncThread()
    try:
        for gen in range(1, 21):
            os.write(fd, b"x")
            thread.submit(SyncJob(fds=[fd], paths=[path], gen=gen))
        ended: list[SyncJob] = []
        with trio.fail_after(10):
            while not ended or ended[-1].gen < 20:
                await trio.lowlevel.wait_readable(thread.fileno())
                ended += thread.finished()
        assert [job.error for job in ended] == [None] * len(ended)
        gens = [job.gen for job in ended]
        assert gens == sorted(gens) and gens[-1] == 20
    finally:
        assert thread.stop() == []
        os.close(fd)


async def test_a_removal_that_fails_leaves_the_sync_thread_running(tmp_path: Path,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    """A file the store removes that cannot be removed (here a folder in its place: EISDIR, which even
    root gets) is logged and left; the jobs after it are still synced and reported."""
    path, blocked = tmp_path / "f", tmp_path / "not-a-file"
    blocked.mkdir()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    thread = SyncThread(merge=False)
    try:
        thread.submit(SyncJob(fds=[fd], paths=[path], unlinks=[blocked], gen=1))
        thread.submit(SyncJob(fds=[fd], paths=[path], gen=2))
        ended: list[SyncJob] = []
        with trio.fail_after(10):
            while len(ended) < 2:
                await trio.lowlevel.wait_readable(thread.fileno())
                ended += thread.finished()
        assert [(job.gen, job.error) for job in ended] == [(1, None), (2, None)]
        assert blocked.is_dir()
        assert any(f"could not remove {blocked}" in record.getMessage() for record in caplog.records)
    finally:
        thread.stop()
        os.close(fd)


async def _reports(syncs: AioSyncs, count: int) -> list[SyncJob]:
    """Run the driver's watcher until `count` jobs were reported; they come back in report order."""
    reported: list[SyncJob] = []
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            done = trio.Event()

            def report(jobs: list[SyncJob]) -> None:
                reported.extend(jobs)
                if len(reported) >= count:
                    done.set()

            nursery.start_soon(syncs.watch, report)
            await done.wait()
            nursery.cancel_scope.cancel()
    return reported


async def test_aio_syncs_report_in_submission_order_whatever_ends_first(tmp_path: Path) -> None:
    """A job with nothing to sync ends at once, yet waits for the kernel's fdatasync of the job before it;
    a job with more files than one submission takes goes to the thread, in its turn too."""
    syncs = AioSyncs(AioFsync())
    paths = [tmp_path / f"f{number}" for number in range(committer.AIO_MAX_FILES_PER_JOB + 1)]
    fds = [os.open(path, os.O_WRONLY | os.O_CREAT) for path in paths]
    try:
        for fd in fds:
            os.write(fd, b"record")
        syncs.submit(SyncJob(fds=fds[:1], paths=paths[:1], gen=1))
        syncs.submit(SyncJob(fsync=False, gen=2))
        syncs.submit(SyncJob(fds=fds, paths=paths, gen=3))  # too many files for one submission: the thread
        syncs.submit(SyncJob(fds=fds[:2], paths=paths[:2], dirs=[tmp_path], gen=4))
        reported = await _reports(syncs, 4)
        assert [job.gen for job in reported] == [1, 2, 3, 4]
        assert [job.error for job in reported] == [None] * 4
    finally:
        assert syncs.stop() == []
        for fd in fds:
            os.close(fd)


async def test_aio_syncs_fail_a_job_whose_fdatasync_fails_and_remove_after_the_sync(tmp_path: Path) -> None:
    syncs = AioSyncs(AioFsync())
    kept, gone = tmp_path / "kept", tmp_path / "gone"
    kept_fd = os.open(kept, os.O_WRONLY | os.O_CREAT)
    gone_fd = os.open(gone, os.O_WRONLY | os.O_CREAT)
    closed_fd = os.open(tmp_path / "closed", os.O_WRONLY | os.O_CREAT)
    os.close(closed_fd)  # the kernel refuses it (EBADF): the job goes to the thread, which fails it too
    try:
        syncs.submit(SyncJob(fds=[closed_fd], paths=[tmp_path / "closed"], gen=1))
        syncs.submit(SyncJob(fds=[kept_fd, gone_fd], paths=[kept, gone], unlinks=[gone], close_fds=[gone_fd], gen=2))
        first, second = await _reports(syncs, 2)
        assert isinstance(first.error, OSError) and first.error.errno == errno.EBADF
        assert second.error is None
        assert not syncs._refused, "a bad descriptor says nothing about AIO"
    finally:
        syncs.stop()  # the removals ran in the thread before it stopped
        os.close(kept_fd)
    assert kept.exists() and not gone.exists()


def test_segments_get_zeros_ahead_of_small_records_and_lose_them_at_close(tmp_path: Path) -> None:
    """Small records land in blocks written beforehand (their fdatasync journals no metadata); large
    batches are appended as they are; a clean close leaves each file exactly as long as its records."""
    writer = FileWriter()
    small, large = tmp_path / "q1" / "0000000000.seg", tmp_path / "q2" / "0000000000.seg"
    journal = tmp_path / "meta.log"
    writer.write(CommitJob(appends=[(small, b"a" * 100), (large, b"b" * PREZERO_MAX_WRITE), (journal, b"c" * 100)]))
    writer.write(CommitJob(appends=[(small, b"d" * 100)]))
    assert small.stat().st_size == PREZERO_BYTES
    assert small.read_bytes()[:200] == b"a" * 100 + b"d" * 100 and not small.read_bytes()[200:].strip(b"\0")
    assert large.stat().st_size == PREZERO_MAX_WRITE and journal.stat().st_size == 100
    writer.write(CommitJob(appends=[(small, b"e" * (PREZERO_BYTES - 250))]))  # large: into the zeros, none added
    assert small.stat().st_size == PREZERO_BYTES
    writer.write(CommitJob(appends=[(small, b"f" * 100)]))  # small, past the zeros: the next stretch of them
    assert small.stat().st_size == 2 * PREZERO_BYTES
    writer.close()
    assert small.read_bytes() == b"a" * 100 + b"d" * 100 + b"e" * (PREZERO_BYTES - 250) + b"f" * 100


@pytest.mark.parametrize("policy", ["interval:20", "always"])
async def test_writes_no_acknowledgement_waits_for_are_synced_soon_by_the_committer(tmp_path: Path,
                                                                                    policy: str) -> None:
    """`interval:MS` syncs MS after a write; `always` syncs what no acknowledgement waits for (a
    consumer's finish, here a publish nobody confirms) within UNAWAITED_SYNC_S, on its own."""
    storage = DiskStorage(tmp_path, SystemClock(), policy=FsyncPolicy.parse(policy))
    engine = Engine(clock=storage.clock, storage=storage)
    engine.restore()
    engine.ensure_queue("q")
    engine.bind("q", "t")
    commit = committer.Committer(storage)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(commit.run)
        await trio.sleep(0.01)
        syncs = commit.syncs
        engine.publish("t", b"unconfirmed")
        storage.write_now()
        assert storage.fsync_due() is not None, "written, not synced yet"
        with trio.fail_after(20):  # an fdatasync on a busy disk
            while storage.fsync_due() is not None or commit.syncs == syncs:
                await trio.sleep(0.005)
        nursery.cancel_scope.cancel()
    await commit.flush()


def test_on_the_host_loop_a_change_outside_a_read_is_committed_at_the_end_of_the_loops_pass(tmp_path: Path) -> None:
    """A change no session holds (here from a callback of the loop, as a sync completion's or a timer's
    answer would make one) is written and its sync job handed out at the end of that pass, by the
    loop itself: no trio task runs between the change and the write."""
    storage = DiskStorage(tmp_path, SystemClock(), policy=FsyncPolicy.parse("always"))
    engine = Engine(clock=storage.clock, storage=storage)
    engine.restore()
    engine.ensure_queue("q")
    engine.bind("q", "t")
    commit = committer.Committer(storage)
    seen: dict[str, object] = {}

    async def main() -> None:
        host = host_loop.current()
        assert host is not None
        ours, theirs = socket.socketpair()
        ours.setblocking(False)
        confirmed = trio.Event()

        def after_the_pass() -> None:
            try:
                trio.lowlevel.current_task()
                seen["in a task"] = True
            except RuntimeError:
                seen["in a task"] = False
            seen["work left"] = storage.has_work()
            seen["in the file"] = b"from the loop" in segment_bytes(tmp_path)

        def on_readable(_events: int) -> None:
            ours.recv(16)
            engine.publish("t", b"from the loop")
            storage.sync(lambda error: (seen.setdefault("error", error), confirmed.set()))
            host.after_batch(after_the_pass)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(commit.run)
            await trio.sleep(0.01)
            host.add_reader(ours.fileno(), on_readable)
            theirs.send(b"x")
            with trio.fail_after(20):  # an fdatasync on a busy disk
                await confirmed.wait()
            host.remove_reader(ours.fileno())
            nursery.cancel_scope.cancel()
        await commit.flush()
        ours.close()
        theirs.close()

    HostLoop().run(main)
    assert seen == {"in a task": False, "work left": False, "in the file": True, "error": None}


async def test_aio_syncs_fall_back_to_the_thread_for_good_when_the_kernel_cannot(tmp_path: Path) -> None:
    """A file without fdatasync through AIO (a pipe stands in for such a file system): that job and
    every later one run in the thread, and all are still reported in order."""
    syncs = AioSyncs(AioFsync())
    read_end, write_end = os.pipe()
    path = tmp_path / "f"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT)
    try:
        syncs.submit(SyncJob(fds=[write_end], paths=[tmp_path / "pipe"], gen=1))
        assert syncs._refused
        syncs.submit(SyncJob(fds=[fd], paths=[path], gen=2))
        assert syncs.aio.in_flight == 0, "the later job went to the thread too"
        first, second = await _reports(syncs, 2)
        assert isinstance(first.error, OSError) and first.error.errno == errno.EINVAL
        assert second.error is None and (first.gen, second.gen) == (1, 2)
    finally:
        syncs.stop()
        for descriptor in (read_end, write_end, fd):
            os.close(descriptor)
