"""Log lines for repeated refusals without a line per refusal: the first of a kind is logged at once,
the ones that follow within `window` are counted, and one line sums them up when the window ends.

A flood of refused connections or publishes thus writes a line every `window` seconds per kind, not
one per client or message; a kind is a short string the caller chooses (the error code, say). The
summary is written by `run`, a task of the service's nursery that wakes when a window with
something counted ends (`flush` does the work, on the clock the log was given), so the last burst of
a flood is reported even when no refusal follows it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import attrs
import trio

# How long repeated refusals of one kind are counted before a line sums them up: short enough for an
# operator watching the log, long enough that a flood writes a handful of lines a minute.
REPEAT_WINDOW_S = 10.0
# Kinds remembered at once; the callers use a handful (error codes), so this only guards a mistake.
MAX_KINDS = 1024


@attrs.define(slots=True)
class _Kind:
    logged_at: float
    suppressed: int = 0
    last: str = ""


@attrs.define(slots=True)
class RateLimitedLog:
    log: logging.Logger
    level: int = logging.INFO
    window: float = REPEAT_WINDOW_S
    clock: Callable[[], float] = time.monotonic
    _kinds: dict[str, _Kind] = attrs.field(factory=dict)
    _counted: trio.Event | None = None  # set when a refusal is counted, for `run`

    def note(self, kind: str, text: str) -> None:
        """Log `text` now, or count it when a line of this kind went out less than `window` ago."""
        now = self.clock()
        seen = self._kinds.get(kind)
        if seen is not None and now - seen.logged_at < self.window:
            seen.suppressed += 1
            seen.last = text
            if self._counted is not None:
                self._counted.set()
            return
        if seen is not None and seen.suppressed:
            self._summarize(seen, now)  # `run` is not running (or not yet woken): the summary first
        self.log.log(self.level, "%s", text)
        if len(self._kinds) > MAX_KINDS:
            self._kinds.clear()  # a bounded memory: forgetting only means one more line
        self._kinds[kind] = _Kind(now)

    def flush(self) -> float | None:
        """Write the summary of every kind whose window ended with refusals counted; returns the clock's
        time at which the next window with refusals counted ends (None: nothing is counted)."""
        now = self.clock()
        next_due: float | None = None
        for kind, seen in list(self._kinds.items()):
            due = seen.logged_at + self.window
            if due > now:
                if seen.suppressed:
                    next_due = due if next_due is None else min(next_due, due)
                continue
            if seen.suppressed:
                # A line went out now: refusals that follow within a window are counted again.
                self._summarize(seen, now)
                seen.logged_at = now
            else:
                del self._kinds[kind]  # quiet for a whole window: its next refusal is logged at once
        return next_due

    def _summarize(self, seen: _Kind, now: float) -> None:
        self.log.log(self.level, "%d more like it in the last %.0f s, the last: %s", seen.suppressed,
                     now - seen.logged_at, seen.last)
        seen.suppressed = 0
        seen.last = ""

    async def run(self) -> None:
        """Write each summary when its window ends; runs until cancelled."""
        while True:
            self._counted = trio.Event()
            due = self.flush()
            if due is None:
                await self._counted.wait()
            else:
                await trio.sleep(max(0.0, due - self.clock()))
