"""One timer service for the whole engine: a heap of deadlines serviced by one task.

The engine schedules callbacks; the gateway's timer task sleeps until `next_due()` and calls
`run_due(now)`. Cancelled timers stay in the heap until their time and are skipped (cheap
cancellation); callers keep at most a few live timers per queue or consumer, so the heap stays
small whatever the message rate.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from typing import Any


class Timer:
    __slots__ = ("args", "callback", "cancelled", "due")

    def __init__(self, due: float, callback: Callable[..., Any], args: tuple[Any, ...]) -> None:
        self.due = due
        self.callback = callback
        self.args = args
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class TimerService:
    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Timer]] = []
        self._sequence = itertools.count()
        # Called when a new timer is due earlier than every other one (the task must wake sooner).
        self.on_new_earliest: Callable[[], None] | None = None

    def schedule(self, due: float, callback: Callable[..., Any], *args: Any) -> Timer:
        timer = Timer(due, callback, args)
        earliest = self._heap[0][0] if self._heap else None
        heapq.heappush(self._heap, (due, next(self._sequence), timer))
        if (earliest is None or due < earliest) and self.on_new_earliest is not None:
            self.on_new_earliest()
        return timer

    def next_due(self) -> float | None:
        heap = self._heap
        while heap and heap[0][2].cancelled:
            heapq.heappop(heap)
        return heap[0][0] if heap else None

    def run_due(self, now: float) -> int:
        """Run every timer due at or before `now`, in due order. Returns how many ran."""
        heap = self._heap
        ran = 0
        while heap and heap[0][0] <= now:
            _, _, timer = heapq.heappop(heap)
            if timer.cancelled:
                continue
            timer.cancelled = True
            timer.callback(*timer.args)
            ran += 1
        return ran

    def __len__(self) -> int:
        return sum(1 for _, _, timer in self._heap if not timer.cancelled)
