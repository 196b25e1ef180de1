"""Full garbage collections on a clock, not on CPython's heap-growth rule.

CPython runs a full (generation 2) collection whenever the objects promoted since the last one
pass a quarter of those that survived it. A gateway holding a backlog in memory promotes a
`Message` per copy it reads back, so while a backlog is read the rule fires every quarter of
growth and each collection walks every message held: 19 full collections took 1.15 s of the
gateway's 5.0 s of CPU while `polymq bench spark --scenario endpoints` published and read a
million rows (docs/performance.md). Messages form no reference cycles; what does (tasks,
connections, requests) is nearly always collected young, by the generation 0 and 1 collections,
which stay as CPython runs them, but for the youngest's threshold (`YOUNG_THRESHOLD`).

So while the gateway runs, generation 2 is collected by this task instead, every
`FULL_COLLECTION_INTERVAL_S`. What survives a collection is then frozen (`gc.freeze`): the next
ones walk only what came since, not every message held again (a million held messages take
~120 ms to walk). Every `THAW_EVERY` collections the frozen objects are thawed and everything is
walked, so that cycles among old objects are found too; those collections are spaced so that
their time stays under `FULL_COLLECTION_SHARE` of the time between two. The process's
thresholds are put back, and its objects thawed, when the last gateway of the process stops.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable

import trio

# Cyclic garbage that reached the oldest generation lives about this long, if none of it was
# frozen: short next to any client's timeout, long next to a collection of what came since.
FULL_COLLECTION_INTERVAL_S = 10.0
# Every this many collections, one walks everything (frozen objects too): cycles among objects
# that had survived a collection wait at most this many intervals (5 minutes).
THAW_EVERY = 30
# A collection's time is at most this share of the time until the next (a heap so large that
# walking it takes 0.5 s is walked at most every 50 s).
FULL_COLLECTION_SHARE = 0.01
# The youngest generation is collected once this many more container objects were allocated than
# freed (CPython's default: 700). At 700, messages held in flight (a manual-ack window of 10,000
# per MQKS consumer) outlive several young collections and are promoted; at this many, most are
# acknowledged before a collection ever walks them: the collector's time under `polymq bench mqks
# --scenario manual` fell from 410-513 ms to 233-323 ms per 400,000 messages (docs/performance.md).
YOUNG_THRESHOLD = 10_000
# A generation-2 threshold the count of generation-1 collections never passes: no automatic full
# collection (gc.set_threshold takes a C int).
NEVER = 2**31 - 1

# Gateways running in this process (tests run several) and the thresholds the first one found.
_running: list[tuple[int, int]] = []


def pause_after(took: float) -> float:
    """Seconds until the next full collection, after one that took `took` seconds."""
    return max(FULL_COLLECTION_INTERVAL_S, took / FULL_COLLECTION_SHARE)


async def collect_on_a_clock(stopwatch: Callable[[], float] = time.perf_counter) -> None:
    """Run the process's full collections until cancelled; CPython's own rule again afterwards.

    `stopwatch` times each collection (tests give one that does not depend on the heap they run in).
    """
    young, middle, oldest = gc.get_threshold()
    if not _running:
        _running.append((young, oldest))
        gc.set_threshold(YOUNG_THRESHOLD, middle, NEVER)
    else:
        _running.append(_running[0])
    rounds = 0
    try:
        while True:
            rounds += 1
            started = stopwatch()
            if rounds % THAW_EVERY == 0:
                gc.unfreeze()
            gc.collect(2)
            gc.freeze()
            took = stopwatch() - started
            await trio.sleep(pause_after(took))
    finally:
        found_young, found_oldest = _running.pop()
        if not _running:
            gc.unfreeze()
            gc.set_threshold(found_young, gc.get_threshold()[1], found_oldest)
