"""The file work of the store: appends on the event loop, fdatasync and removals off it.

A `CommitJob` is built by the store on the loop (`DiskStorage.prepare`). Its appends are written
on the loop (`FileWriter.write`): a `write` into the page cache costs microseconds, far less than
handing the bytes to a thread and back, and it is all a process crash needs. The slow part, the
fdatasync that a power loss needs, runs as a `SyncJob` in the committer's thread while the loop
goes on writing (`FileWriter.take_sync` → `SyncJob.run`): whatever was written before a sync job
started is durable when it ends, so every publish of every connection written meanwhile shares
the next one (group commit across connections). Removals (segments, deleted owners) run in the
sync job too, after its fdatasync. `FileWriter.run` does it all inline (start-up, tests).

Order of appends: the order given (the meta journal first, then queues, then topic backlogs: a
record that moves messages is never on disk before the records that received them). A failed
append is cut back to the file's previous size, so a full disk never leaves a torn record behind;
the store keeps the job's records and offers them again with the next job.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import logging
import os
import shutil
from pathlib import Path
from typing import Final

log = logging.getLogger("polymq.storage")


# The jobs are built once per commit: plain dataclasses with their own `__init__`, which mypyc
# compiles as native classes (an attrs class is built by its interpreted `__init__`).
@dataclasses.dataclass(init=False)
class CommitJob:
    appends: list[tuple[Path, bytes]]
    fsync: bool
    unlinks: list[Path]
    removed_dirs: list[Path]
    # Filled by the run: bytes of each file after its appends, and how many appends succeeded.
    sizes: dict[Path, int]
    appended: int
    error: OSError | None

    def __init__(self, appends: list[tuple[Path, bytes]] | None = None, fsync: bool = True,
                 unlinks: list[Path] | None = None, removed_dirs: list[Path] | None = None) -> None:
        self.appends = appends if appends is not None else []
        self.fsync = fsync
        self.unlinks = unlinks if unlinks is not None else []
        self.removed_dirs = removed_dirs if removed_dirs is not None else []
        self.sizes = {}
        self.appended = 0
        self.error = None


@dataclasses.dataclass(init=False)
class SyncJob:
    """An fdatasync of what was written before it started, then removals; safe to run in a thread.

    It owns its descriptors: those of removed files were taken out of the writer, so nothing on the
    loop can close or reuse them while the job runs.
    """

    fds: list[int]  # files written since their last sync
    dirs: list[Path]  # directories that gained or lost an entry
    unlinks: list[Path]
    removed_dirs: list[Path]
    close_fds: list[int]  # of removed files, closed after the sync
    fsync: bool
    error: OSError | None
    # Kept for the writer to mark them unsynced again if the sync failed.
    paths: list[Path]
    # The store's count of jobs handed out: when this one ends, every job up to `gen` has ended.
    gen: int

    def __init__(self, fds: list[int] | None = None, dirs: list[Path] | None = None,
                 unlinks: list[Path] | None = None, removed_dirs: list[Path] | None = None,
                 close_fds: list[int] | None = None, fsync: bool = True, error: OSError | None = None,
                 paths: list[Path] | None = None, gen: int = 0) -> None:
        self.fds = fds if fds is not None else []
        self.dirs = dirs if dirs is not None else []
        self.unlinks = unlinks if unlinks is not None else []
        self.removed_dirs = removed_dirs if removed_dirs is not None else []
        self.close_fds = close_fds if close_fds is not None else []
        self.fsync = fsync
        self.error = error
        self.paths = paths if paths is not None else []
        self.gen = gen

    def merge(self, later: SyncJob) -> None:
        """Take `later`'s work too (a sync thread runs the jobs queued while it was busy as one)."""
        known = set(self.fds)
        for fd, path in zip(later.fds, later.paths, strict=True):
            if fd not in known:
                self.fds.append(fd)
                self.paths.append(path)
        self.dirs += [directory for directory in later.dirs if directory not in self.dirs]
        self.unlinks += later.unlinks
        self.removed_dirs += later.removed_dirs
        self.close_fds += later.close_fds
        self.fsync = self.fsync or later.fsync
        self.gen = max(self.gen, later.gen)

    def run(self) -> SyncJob:
        try:
            if self.fsync:
                for fd in self.fds:
                    os.fdatasync(fd)
                for directory in self.dirs:
                    _fsync_dir(directory)
        except OSError as error:
            self.error = error
        # Removals go ahead even after a failed sync: what they remove is finished with either way.
        for fd in self.close_fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        for path in self.unlinks:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
            except OSError as error:  # left behind, nothing more: its records were finished with
                log.warning("could not remove %s: %s", path, error.strerror)
        for directory in self.removed_dirs:
            shutil.rmtree(directory, ignore_errors=True)
        return self

    def removals(self) -> SyncJob | None:
        """This job's removals as a job of their own (no sync), or None if it has none."""
        if not (self.unlinks or self.removed_dirs or self.close_fds):
            return None
        return SyncJob(unlinks=self.unlinks, removed_dirs=self.removed_dirs, close_fds=self.close_fds, fsync=False)

    @property
    def idle(self) -> bool:
        return not (self.fds or self.dirs or self.unlinks or self.removed_dirs or self.close_fds)


def open_dir(directory: Path) -> int | None:
    """A descriptor to fsync a directory's entries with; None if it was removed meanwhile."""
    try:
        return os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    except FileNotFoundError:
        return None


def _fsync_dir(directory: Path) -> None:
    fd = open_dir(directory)
    if fd is None:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# Segment files (`*.seg`) are written ahead of their records with zeros, this much at a time: an
# fdatasync of records that land in blocks already written changes no file metadata, so ext4 need
# not commit its journal for it (measured here: a 250-byte record's fdatasync took 0.10-0.11 ms
# instead of 0.16-0.18 ms when appended); one sync in about 250 of 250-byte records pays the
# metadata. Small, because each durable queue's active segment carries its own zeros. Recovery and
# shutdown cut the zeros off again.
PREZERO_BYTES: Final = 64 * 1024
# Only writes smaller than this extend the zeros: large batches (MPUB) would write every byte
# twice for a gain that small records alone see.
PREZERO_MAX_WRITE: Final = 16 * 1024
PREZERO_SUFFIX: Final = ".seg"
_ZEROS: Final = bytes(PREZERO_BYTES)


class FileWriter:
    """Open descriptors of the store's files; `write` and `take_sync` run on the loop only.

    Records go at each file's logical end (`_sizes`); a segment's file may be longer, its tail
    zeros written ahead (`_zeroed`: the end of what was zero-filled).
    """

    def __init__(self) -> None:
        self._fds: dict[Path, int] = {}
        self._sizes: dict[Path, int] = {}
        self._zeroed: dict[Path, int] = {}
        self._unsynced: set[Path] = set()  # written since their last fsync
        self._new_dirs: set[Path] = set()  # gained an entry since their last fsync
        self.bytes_written = 0  # records appended so far (the zeros written ahead not counted)

    def run(self, job: CommitJob) -> CommitJob:
        """The whole commit inline: appends, then (if `job.fsync`) the sync, then removals."""
        self.write(job)
        if job.error is None:
            sync = self.take_sync(job.unlinks, job.removed_dirs, fsync=job.fsync).run()
            self.sync_finished(sync)
            job.error = sync.error
        return job

    def write(self, job: CommitJob) -> CommitJob:
        """The job's appends only (on the loop); its removals are for `take_sync`."""
        try:
            for path, data in job.appends:
                self._append(path, data)
                job.sizes[path] = self._sizes[path]
                job.appended += 1
                self.bytes_written += len(data)
        except OSError as error:
            job.error = error
        return job

    @property
    def unsynced(self) -> bool:
        return bool(self._unsynced or self._new_dirs)

    def take_sync(self, unlinks: list[Path], removed_dirs: list[Path], *, fsync: bool = True) -> SyncJob:
        """A job syncing everything written so far, then removing `unlinks` and `removed_dirs`."""
        job = SyncJob(fsync=fsync, unlinks=list(unlinks), removed_dirs=list(removed_dirs))
        for path in unlinks:
            self._release(path, job)
        for directory in removed_dirs:
            for path in [p for p in self._fds if p.parent == directory]:
                self._release(path, job)
        if fsync:
            job.paths = [path for path in self._unsynced if path in self._fds]
            job.fds = [self._fds[path] for path in job.paths]
            job.dirs = list(self._new_dirs)
            self._unsynced.clear()
            self._new_dirs.clear()
        # Their entries are gone: the next sync makes that durable.
        self._new_dirs.update(path.parent for path in unlinks)
        self._new_dirs.update(directory.parent for directory in removed_dirs)
        return job

    def sync_finished(self, job: SyncJob) -> None:
        """Back on the loop: after a failed sync, what it covered is synced again next time."""
        if job.error is not None:
            self._unsynced.update(path for path in job.paths if path in self._fds)
            self._new_dirs.update(job.dirs)

    def close(self) -> None:
        """Close every file, cutting the zeros written ahead off each segment (a clean stop leaves none)."""
        for path in list(self._fds):
            fd = self._fds[path]
            if self._zeroed.get(path, 0) > self._sizes[path]:
                with contextlib.suppress(OSError):
                    os.ftruncate(fd, self._sizes[path])
                    os.fdatasync(fd)
            self._close(path)

    def _append(self, path: Path, data: bytes) -> None:
        fd = self._fds.get(path)
        if fd is None:
            if not path.parent.exists():
                path.parent.mkdir(parents=True, exist_ok=True)
                self._new_dirs.add(path.parent.parent)
            existed = path.exists()
            fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
            self._fds[path] = fd
            self._sizes[path] = os.fstat(fd).st_size  # a file written before has no zeros ahead: recovery cut them
            if not existed:
                self._new_dirs.add(path.parent)
        size = self._sizes[path]
        end = size + len(data)
        zeroed = self._zeroed.get(path, 0)
        if end > zeroed and len(data) < PREZERO_MAX_WRITE and path.name.endswith(PREZERO_SUFFIX):
            zeroed = self._zero_ahead(fd, path, max(size, zeroed))
        view = memoryview(data)
        written = 0
        try:
            while written < len(view):
                count = os.pwrite(fd, view[written:], size + written)
                if count == 0:
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                written += count
        except OSError:
            # Cut the partial record off, and the zeros ahead (a full disk wants the room): what is
            # on disk stays a sequence of whole records.
            self._zeroed.pop(path, None)
            with contextlib.suppress(OSError):
                os.ftruncate(fd, size)
            raise
        self._sizes[path] = end
        self._unsynced.add(path)

    def _zero_ahead(self, fd: int, path: Path, start: int) -> int:
        """Fill the file with zeros from `start` for `PREZERO_BYTES`; the new end of the zeros.

        A disk too full for them is no error: the record is then appended as before."""
        try:
            if os.pwrite(fd, _ZEROS, start) == len(_ZEROS):
                self._zeroed[path] = start + len(_ZEROS)
                return start + len(_ZEROS)
        except OSError:
            pass
        with contextlib.suppress(OSError):
            os.ftruncate(fd, start)  # no room for all of them: none, the disk needs the space
        return self._zeroed.get(path, 0)

    def _release(self, path: Path, job: SyncJob) -> None:
        """Hand the descriptor of a file to be removed to `job`: synced if unsynced, then closed."""
        fd = self._fds.pop(path, None)
        self._sizes.pop(path, None)
        self._zeroed.pop(path, None)
        self._unsynced.discard(path)
        if fd is not None:
            job.close_fds.append(fd)

    def _close(self, path: Path) -> None:
        fd = self._fds.pop(path, None)
        self._sizes.pop(path, None)
        self._zeroed.pop(path, None)
        self._unsynced.discard(path)
        if fd is not None:
            os.close(fd)
