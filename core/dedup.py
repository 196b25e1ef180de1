"""De-duplication of publishes by a deterministic id, within a window, kept in the store.

A writer that may publish the same rows again (a Spark micro-batch replayed after a crash) names
each row by a group and a sequence number, the same on every try: (`writer/batch/partition`, row).
The engine remembers, per group, the ranges of sequence numbers published, so a replay
publishes only the rows the first try did not. One record per group (its ranges, merged), not
one per row: a group is a writer's batch partition, whose rows are numbered from 0 in order.
Groups not written to for the window are forgotten.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from polymq.core.engine import Engine

KEPT_DEDUP = "dedup"  # the store's kind of kept record for a group
# How long a group is remembered after its last publish (a Spark query restarted later than this
# may publish a replayed batch again): an hour, far beyond a restart after a crash.
DEFAULT_WINDOW_S = 3600.0
# Ranges one group may hold: a writer numbers its rows in order, so a group holds one or a few;
# past this, the oldest go (a defence against ids that are not a writer's sequence).
MAX_RANGES = 1024


class Dedup:
    def __init__(self, engine: Engine, window_s: float = DEFAULT_WINDOW_S) -> None:
        self.engine = engine
        self.window_s = window_s
        # group → (sorted, disjoint, merged [start, end) pairs, wall seconds of its last publish);
        # oldest last publish first.
        self.groups: dict[str, tuple[list[int], float]] = {}
        self.duplicates = 0  # rows not published again

    def unseen(self, group: str, start: int, end: int) -> list[tuple[int, int]]:
        """The parts of `[start, end)` not published yet under `group`."""
        self._expire()
        found = self.groups.get(group)
        if found is None:
            return [(start, end)] if start < end else []
        bounds = found[0]
        parts = []
        cursor = start
        index = bisect.bisect_right(bounds, cursor)
        if index % 2:  # inside a published range: skip to its end
            cursor = bounds[index]
            index += 1
        while cursor < end:
            next_start = bounds[index] if index < len(bounds) else end
            if next_start > cursor:
                parts.append((cursor, min(next_start, end)))
            if index + 1 >= len(bounds):
                break
            cursor = bounds[index + 1]
            index += 2
        self.duplicates += (end - start) - sum(high - low for low, high in parts)
        return parts

    def remember(self, group: str, ranges: Iterable[tuple[int, int]], *, store: bool = True) -> None:
        """`ranges` of `group` are published. `store=False` leaves the record for `store_group`
        (after the rows themselves are on disk)."""
        bounds = list(self.groups.pop(group, ([], 0.0))[0])
        for start, end in ranges:
            bounds = _merged(bounds, start, end)
        if len(bounds) > 2 * MAX_RANGES:
            bounds = bounds[-2 * MAX_RANGES:]
        self.groups[group] = (bounds, self.engine.clock.wall_ns() / 1e9)
        if store:
            self.store_group(group)

    def store_group(self, group: str) -> None:
        found = self.groups.get(group)
        if found is not None:
            self.engine.storage.kept_saved(KEPT_DEDUP, group, {"group": group, "bounds": found[0], "at": found[1]})

    def restore(self, kept: Iterable[Mapping[str, Any]]) -> None:
        for record in sorted(kept, key=lambda record: float(record.get("at", 0.0))):
            self.groups[str(record["group"])] = ([int(bound) for bound in record["bounds"]], float(record["at"]))
        self._expire()

    def _expire(self) -> None:
        limit = self.engine.clock.wall_ns() / 1e9 - self.window_s
        groups = self.groups
        while groups:
            group, (_, at) = next(iter(groups.items()))
            if at > limit:
                return
            del groups[group]
            self.engine.storage.kept_deleted(KEPT_DEDUP, group)


def _merged(bounds: list[int], start: int, end: int) -> list[int]:
    """`bounds` (flat sorted [start, end) pairs) with `[start, end)` added, touching ranges joined."""
    if start >= end:
        return bounds
    low = bisect.bisect_left(bounds, start)
    high = bisect.bisect_right(bounds, end)
    if low % 2:  # start falls inside a range: extend that one
        start = bounds[low - 1]
        low -= 1
    if high % 2:  # end falls inside a range
        end = bounds[high]
        high += 1
    return [*bounds[:low], start, end, *bounds[high:]]
