"""An epoll loop that owns the gateway's thread, with trio as its guest.

trio waits for every descriptor with a one-shot `epoll_ctl` and wakes the task that waited: on a
request/response round trip that is a re-arm, a scheduler pass and a task switch per request,
most of the CPU it costs (profiled: NSQ PUB one per round trip). Here the hot sockets stay
registered, edge-triggered, with the loop that owns the thread, which calls their session back
to read, handle and answer in one go; trio runs everything else (HTTP, timers, the ZeroMQ
services, the store's committer) as a guest (`trio.lowlevel.start_guest_run`): it waits for its
own events in a thread of its own and runs its steps on this loop when they come.

Between trio's steps its run stays current on this thread, so a callback may read
`trio.current_time()` or set an `Event` (which makes trio take a step soon: a hop through its
thread, so the hot path avoids it). A session whose output is queued from outside its own read
asks for `after_batch`: it is sent once the callbacks of this pass have run, one write however
many deliveries the pass gave it.
"""

from __future__ import annotations

import collections
import contextlib
import os
import select
import time
from collections.abc import Awaitable, Callable
from typing import Any, Final

import outcome
import trio

# After a pass that served sockets the loop polls without sleeping for this long before it waits:
# on loopback a client's next request often comes sooner than a sleep in epoll_wait and the
# wake-up after it take (a context switch each way). Measured with NSQ PUB one per round trip,
# 0 / 50 / 100 / 200 µs: 27-30k / 42-44k / 36-43k / 38-41k PUBs/s, CPU per message not higher.
DEFAULT_SPIN_S: Final = 50e-6
# The loop spins only while the waits it measures are shorter than the spin on average (a moving
# average over about this many waits): under paced, light traffic a spin would only burn CPU.
GAP_AVERAGE_OVER: Final = 8

# epoll_wait's batch: ready descriptors taken per pass (the rest come in the next pass).
MAX_EVENTS: Final = 512
_EDGE_READ: Final = select.EPOLLIN | select.EPOLLRDHUP | select.EPOLLET
# The events that say a socket's input has ended (or failed): after them a short read does not mean
# the socket is empty, since the end of the stream brings no new edge once it was reported.
ENDED: Final = select.EPOLLRDHUP | select.EPOLLHUP | select.EPOLLERR
# What a reader called again (`read_again`) is told: read until the socket says it would block.
READ_AGAIN: Final = select.EPOLLIN | ENDED

# A reader gets the events epoll reported (a mask of select.EPOLL*).
Reader = Callable[[int], None]

_host_of_run: Final[trio.lowlevel.RunVar[HostLoop | None]] = trio.lowlevel.RunVar("polymq.host_loop", default=None)


def current() -> HostLoop | None:
    """The loop hosting the trio run this is called in; None under a plain `trio.run`."""
    return _host_of_run.get()


async def serve_readable(fd: int, callback: Callable[[], None]) -> None:
    """Forever: call `callback` whenever `fd` is readable; it must read it until it would block.

    Under a host loop, from the loop's pass (no trio step between the descriptor and the callback);
    under plain trio, from this task. An error of the callback is raised here, in either case."""
    host = current()
    if host is None:
        while True:
            await trio.lowlevel.wait_readable(fd)
            callback()
    failed: list[BaseException] = []
    woken = trio.Event()

    def guarded(_events: int) -> None:
        try:
            callback()
        except BaseException as error:  # raised in the task, which ends the loop's run cleanly
            host.remove_reader(fd)
            failed.append(error)
            woken.set()

    host.add_reader(fd, guarded)
    try:
        await woken.wait()
    finally:
        host.remove_reader(fd)
    raise failed[0]


class HostLoop:
    """Readers (descriptor → callback), trio's steps, and the flushes asked for during a pass."""

    def __init__(self, spin_s: float = DEFAULT_SPIN_S) -> None:
        self._spin_s = spin_s
        self._spin_due = False  # the last pass served sockets: poll a while before sleeping
        self._gap_s = 0.0  # moving average of the waits after a pass that served sockets
        self._epoll = select.epoll()
        self._readers: dict[int, Reader] = {}
        self._again: list[Reader] = []  # readers to call next pass (their read was full)
        self._steps: collections.deque[Callable[[], object]] = collections.deque()
        self._flushes: list[Callable[[], None]] = []
        self._wakeup = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._epoll.register(self._wakeup, select.EPOLLIN)
        self._outcome: outcome.Outcome[Any] | None = None

    # -- what sessions use ------------------------------------------------------------------------

    def add_reader(self, fd: int, callback: Reader) -> None:
        """Call `callback(events)` when `fd` has bytes (edge-triggered: it must read until the socket is
        empty, or `read_again`). Bytes already waiting count: the first pass calls it at once."""
        self._readers[fd] = callback
        self._epoll.register(fd, _EDGE_READ)

    def remove_reader(self, fd: int) -> None:
        callback = self._readers.pop(fd, None)
        if callback is None:
            return
        with contextlib.suppress(OSError):  # closed already: the kernel forgot it
            self._epoll.unregister(fd)
        if self._again:
            self._again = [again for again in self._again if again is not callback]

    def read_again(self, callback: Reader) -> None:
        """A reader that stopped with bytes left (fairness) is called again in the next pass, with
        `READ_AGAIN`."""
        self._again.append(callback)

    def after_batch(self, flush: Callable[[], None]) -> None:
        """Call `flush` once the callbacks of this pass have run (output queued outside its own read)."""
        self._flushes.append(flush)

    # -- trio as the guest ------------------------------------------------------------------------

    def _run_soon_threadsafe(self, step: Callable[[], object]) -> None:
        self._steps.append(step)
        os.eventfd_write(self._wakeup, 1)

    def _run_soon(self, step: Callable[[], object]) -> None:
        self._steps.append(step)  # from this thread: the pass sees it before it waits

    def _done(self, result: outcome.Outcome[Any]) -> None:
        self._outcome = result

    def run(self, async_fn: Callable[..., Awaitable[Any]], *args: Any) -> Any:
        """`trio.run(async_fn, *args)`, with this loop owning the thread."""

        async def main() -> Any:
            _host_of_run.set(self)
            return await async_fn(*args)

        trio.lowlevel.start_guest_run(main, run_sync_soon_threadsafe=self._run_soon_threadsafe,
                                      run_sync_soon_not_threadsafe=self._run_soon, done_callback=self._done)
        try:
            while self._outcome is None:
                self._pass()
        finally:
            self._epoll.close()
            os.close(self._wakeup)
        return self._outcome.unwrap()

    def _pass(self) -> None:
        epoll = self._epoll
        if self._steps or self._again or self._flushes:
            ready = epoll.poll(0.0, MAX_EVENTS)
        elif self._spin_due:
            started = time.perf_counter()
            ready = epoll.poll(0.0, MAX_EVENTS)
            if not ready:
                if self._gap_s < self._spin_s:
                    until = started + self._spin_s
                    while not ready and time.perf_counter() < until:
                        ready = epoll.poll(0.0, MAX_EVENTS)
                if not ready:
                    ready = epoll.poll(-1.0, MAX_EVENTS)
            self._gap_s += (time.perf_counter() - started - self._gap_s) / GAP_AVERAGE_OVER
        else:
            ready = epoll.poll(-1.0, MAX_EVENTS)
        served = False
        readers = self._readers
        for fd, events in ready:
            callback = readers.get(fd)
            if callback is not None:
                callback(events)
                served = True
            elif fd == self._wakeup:
                with contextlib.suppress(BlockingIOError):
                    os.eventfd_read(self._wakeup)
        self._spin_due = served and self._spin_s > 0
        if self._again:
            again = self._again
            self._again = []
            for callback in again:
                callback(READ_AGAIN)
        steps = self._steps
        for _ in range(len(steps)):  # the steps these add wait for the next pass
            steps.popleft()()
        while self._flushes:
            flushes = self._flushes
            self._flushes = []
            for flush in flushes:
                flush()
