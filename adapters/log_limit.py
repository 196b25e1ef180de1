"""Log lines for repeated refusals without a line per refusal: the first of a kind is logged at once,
the ones that follow within `window` are counted and summed up in one line when the next comes later.

A flood of refused connections or publishes thus writes a line every `window` seconds per kind, not
one per client or message; a kind is a short string the caller chooses (the error code, say).
"""

from __future__ import annotations

import logging
import time

import attrs

# How long repeated refusals of one kind are counted before a line sums them up: short enough for an
# operator watching the log, long enough that a flood writes a handful of lines a minute.
REPEAT_WINDOW_S = 10.0


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
    _kinds: dict[str, _Kind] = attrs.field(factory=dict)

    def note(self, kind: str, text: str) -> None:
        """Log `text` now, or count it when a line of this kind went out less than `window` ago."""
        now = time.monotonic()
        seen = self._kinds.get(kind)
        if seen is not None and now - seen.logged_at < self.window:
            seen.suppressed += 1
            seen.last = text
            return
        if seen is not None and seen.suppressed:
            self.log.log(self.level, "%s (and %d more like it in the last %.0f s, the last: %s)", text,
                         seen.suppressed, now - seen.logged_at, seen.last)
        else:
            self.log.log(self.level, "%s", text)
        if len(self._kinds) > MAX_KINDS:
            self._kinds.clear()  # a bounded memory: forgetting only means one more line
        self._kinds[kind] = _Kind(now)


# Kinds remembered at once; the callers use a handful (error codes), so this only guards a mistake.
MAX_KINDS = 1024
