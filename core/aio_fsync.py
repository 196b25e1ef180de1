"""fdatasync without a thread: Linux AIO (`io_submit` with `IOCB_CMD_FDSYNC`), completions on an eventfd.

The kernel runs each fdatasync in its own worker (Linux 4.18 and later) and signals the eventfd
when one ends, so the event loop waits for it like for a socket: no thread of ours has to wake
up, take the GIL, and wake the loop in turn, which cost more than the fdatasync itself when one
publish waits for each (docs/performance.md). Several syncs may run at once.

Plain system calls through ctypes (the standard library has no binding; libaio is not needed for
these four calls). `AioFsync()` raises `OSError` where Linux AIO is missing or refuses an fdatasync
(another OS, another architecture, a file system without it): the caller then uses a thread.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import platform
from collections.abc import Sequence

# System call numbers of io_setup, io_destroy, io_getevents, io_submit per architecture (the
# kernel's unistd tables); elsewhere AIO is not used.
_SYSCALLS = {
    "x86_64": (206, 207, 208, 209),
    "aarch64": (0, 1, 4, 2),
}
# linux/aio_abi.h
_IOCB_CMD_FDSYNC = 3
_IOCB_FLAG_RESFD = 1
# Operations the kernel context holds at once; more fds than this in one call are submitted in parts.
DEFAULT_DEPTH = 1024


class _Iocb(ctypes.Structure):
    # struct iocb on a little-endian machine (aio_key before aio_rw_flags).
    _fields_ = [
        ("aio_data", ctypes.c_uint64),
        ("aio_key", ctypes.c_uint32),
        ("aio_rw_flags", ctypes.c_int32),
        ("aio_lio_opcode", ctypes.c_uint16),
        ("aio_reqprio", ctypes.c_int16),
        ("aio_fildes", ctypes.c_uint32),
        ("aio_buf", ctypes.c_uint64),
        ("aio_nbytes", ctypes.c_uint64),
        ("aio_offset", ctypes.c_int64),
        ("aio_reserved2", ctypes.c_uint64),
        ("aio_flags", ctypes.c_uint32),
        ("aio_resfd", ctypes.c_uint32),
    ]


class _IoEvent(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_uint64),
        ("obj", ctypes.c_uint64),
        ("res", ctypes.c_int64),
        ("res2", ctypes.c_int64),
    ]


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    return libc


class AioFsync:
    """A kernel AIO context whose fdatasyncs report on one eventfd (`fileno`)."""

    def __init__(self, depth: int = DEFAULT_DEPTH) -> None:
        numbers = _SYSCALLS.get(platform.machine())
        if numbers is None or not hasattr(os, "eventfd"):
            raise OSError(errno.ENOSYS, f"no Linux AIO on {platform.system()} {platform.machine()}")
        self._setup, self._destroy, self._getevents, self._submit = numbers
        self._libc = _libc()
        self._ctx = ctypes.c_ulong(0)
        self._check(self._libc.syscall(self._setup, depth, ctypes.byref(self._ctx)))
        self.depth = depth
        self._eventfd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._events = (_IoEvent * depth)()
        self._no_wait = _Timespec(0, 0)
        # Submitted control blocks, kept alive until the kernel reports them: token -> arrays.
        self._blocks: dict[int, list[ctypes.Array[_Iocb]]] = {}
        self.in_flight = 0  # operations submitted and not reaped

    def _check(self, result: int) -> int:
        if result < 0:
            code = ctypes.get_errno()
            raise OSError(code, os.strerror(code))
        return result

    def fileno(self) -> int:
        return self._eventfd

    def submit(self, fds: Sequence[int], token: int) -> None:
        """One fdatasync per fd, each reported under `token`. Raises OSError if the kernel refuses
        them (then none of those not yet taken is running; `submitted` says how many were)."""
        blocks = (_Iocb * len(fds))()
        pointers = (ctypes.POINTER(_Iocb) * len(fds))()
        for index, fd in enumerate(fds):
            block = blocks[index]
            block.aio_data = token
            block.aio_lio_opcode = _IOCB_CMD_FDSYNC
            block.aio_fildes = fd
            block.aio_flags = _IOCB_FLAG_RESFD
            block.aio_resfd = self._eventfd
            pointers[index] = ctypes.pointer(block)
        self._blocks.setdefault(token, []).append(blocks)
        taken = 0
        while taken < len(fds):
            rest = ctypes.cast(ctypes.byref(pointers, taken * ctypes.sizeof(ctypes.c_void_p)),
                               ctypes.POINTER(ctypes.POINTER(_Iocb)))
            result = self._libc.syscall(self._submit, self._ctx, len(fds) - taken, rest)
            if result <= 0:
                code = ctypes.get_errno() if result < 0 else errno.EAGAIN
                self.in_flight += taken
                if not taken:
                    self._blocks[token].pop()
                    if not self._blocks[token]:
                        del self._blocks[token]
                raise SubmitError(code, os.strerror(code), taken)
            taken += result
        self.in_flight += taken

    def reap(self) -> list[tuple[int, int]]:
        """(token, result) of every fdatasync that ended since the last call: result 0, or -errno."""
        with contextlib.suppress(BlockingIOError):
            os.eventfd_read(self._eventfd)
        ended: list[tuple[int, int]] = []
        while self.in_flight:
            count = self._check(self._libc.syscall(self._getevents, self._ctx, 0, self.depth, self._events,
                                                   ctypes.byref(self._no_wait)))
            if not count:
                break
            self._collect(count, ended)
        return ended

    def wait_all(self) -> list[tuple[int, int]]:
        """Block until every submitted fdatasync ended (at shutdown); their (token, result)."""
        ended: list[tuple[int, int]] = []
        while self.in_flight:
            count = self._libc.syscall(self._getevents, self._ctx, 1, self.depth, self._events, None)
            if count < 0:
                if ctypes.get_errno() == errno.EINTR:
                    continue
                self._check(count)
            self._collect(count, ended)
        return ended

    def _collect(self, count: int, ended: list[tuple[int, int]]) -> None:
        self.in_flight -= count
        for index in range(count):
            event = self._events[index]
            ended.append((int(event.data), int(event.res)))

    def forget(self, token: int) -> None:
        """Every operation of `token` was reaped: its control blocks can go."""
        self._blocks.pop(token, None)

    def close(self) -> None:
        if self._eventfd < 0:
            return
        self.wait_all()
        self._libc.syscall(self._destroy, self._ctx)
        os.close(self._eventfd)
        self._eventfd = -1


class SubmitError(OSError):
    """`io_submit` refused part of a call: the first `submitted` fds were taken, the rest were not."""

    def __init__(self, code: int, text: str, submitted: int) -> None:
        super().__init__(code, text)
        self.submitted = submitted
