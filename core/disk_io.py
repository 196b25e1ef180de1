"""The file work of one group commit, run off the event loop (the committer's worker thread).

A `CommitJob` is built by the store on the loop (`DiskStorage.prepare`) and owns everything it
writes, so the loop can go on changing the logs while the thread works. `FileWriter` keeps the
open file descriptors between jobs; only one job runs at a time.

Order inside a job: appends in the order given (the meta journal first, then queues, then topic
backlogs: a record that moves messages is never on disk before the records that received them),
then fsync of every file written and of every directory that gained an entry, then unlinks.
A failed append is cut back to the file's previous size, so a full disk never leaves a torn
record behind; the store keeps the job's records and offers them again with the next job.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
from pathlib import Path

import attrs


@attrs.define(slots=True)
class CommitJob:
    appends: list[tuple[Path, bytes]] = attrs.Factory(list)
    fsync: bool = True
    unlinks: list[Path] = attrs.Factory(list)
    removed_dirs: list[Path] = attrs.Factory(list)
    # Filled by the run: bytes of each file after its appends, and how many appends succeeded.
    sizes: dict[Path, int] = attrs.Factory(dict)
    appended: int = 0
    error: OSError | None = None


class FileWriter:
    def __init__(self) -> None:
        self._fds: dict[Path, int] = {}
        self._sizes: dict[Path, int] = {}
        self._unsynced: set[Path] = set()  # written since their last fsync
        self._new_dirs: set[Path] = set()  # gained an entry since their last fsync

    def run(self, job: CommitJob) -> CommitJob:
        try:
            for path, data in job.appends:
                self._append(path, data)
                job.sizes[path] = self._sizes[path]
                job.appended += 1
            if job.fsync:
                self.sync_all()
            for path in job.unlinks:
                self._close(path)
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
                self._new_dirs.add(path.parent)
            for directory in job.removed_dirs:
                for path in [p for p in self._fds if p.parent == directory]:
                    self._close(path)
                shutil.rmtree(directory, ignore_errors=True)
                self._new_dirs.add(directory.parent)
        except OSError as error:
            job.error = error
        return job

    def sync_all(self) -> None:
        for path in list(self._unsynced):
            fd = self._fds.get(path)
            if fd is not None:
                os.fdatasync(fd)
            self._unsynced.discard(path)
        for directory in list(self._new_dirs):
            if directory.exists():
                fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
            self._new_dirs.discard(directory)

    def close(self) -> None:
        for path in list(self._fds):
            self._close(path)

    def _append(self, path: Path, data: bytes) -> None:
        fd = self._fds.get(path)
        if fd is None:
            if not path.parent.exists():
                path.parent.mkdir(parents=True, exist_ok=True)
                self._new_dirs.add(path.parent.parent)
            existed = path.exists()
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            self._fds[path] = fd
            self._sizes[path] = os.fstat(fd).st_size
            if not existed:
                self._new_dirs.add(path.parent)
        size = self._sizes[path]
        view = memoryview(data)
        written = 0
        try:
            while written < len(view):
                count = os.write(fd, view[written:])
                if count == 0:
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                written += count
        except OSError:
            # Cut the partial record off: what is on disk stays a sequence of whole records.
            with contextlib.suppress(OSError):
                os.ftruncate(fd, size)
            raise
        self._sizes[path] = size + written
        self._unsynced.add(path)

    def _close(self, path: Path) -> None:
        fd = self._fds.pop(path, None)
        self._sizes.pop(path, None)
        self._unsynced.discard(path)
        if fd is not None:
            os.close(fd)
