"""Time for the engine. Injected, so tests drive timeouts without sleeping."""

from __future__ import annotations

import time
from typing import Final, Protocol

# Bound once: compiled, a call through the `time` module looks the function up every time.
_MONOTONIC: Final = time.monotonic
_TIME_NS: Final = time.time_ns


class Clock(Protocol):
    def now(self) -> float:
        """Monotonic seconds: what deadlines are measured in."""
        ...

    def wall_ns(self) -> int:
        """Unix time in nanoseconds: what message timestamps show."""
        ...


class SystemClock:
    def now(self) -> float:
        return _MONOTONIC()

    def wall_ns(self) -> int:
        return _TIME_NS()


class ManualClock:
    """A clock that moves only when told to."""

    def __init__(self, start: float = 1000.0, wall_start_ns: int = 1_700_000_000_000_000_000) -> None:
        self._now = start
        self._start = start
        self._wall_start_ns = wall_start_ns

    def now(self) -> float:
        return self._now

    def wall_ns(self) -> int:
        return self._wall_start_ns + int((self._now - self._start) * 1e9)

    def advance(self, seconds: float) -> None:
        self._now += seconds
