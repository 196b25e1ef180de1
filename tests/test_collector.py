"""Full garbage collections on a clock while a gateway runs (`gateway/collector.py`), on trio's
autojump clock: nothing sleeps for real. Each collection is timed by a stopwatch of the test's own,
so a large heap left by earlier tests cannot space the collections out."""

from __future__ import annotations

import gc
import itertools
import weakref
from collections.abc import Callable

import trio
import trio.testing

from polymq.gateway import collector


def collections_take(seconds: float) -> Callable[[], float]:
    """A stopwatch by which every collection takes `seconds`."""
    return itertools.count(0.0, seconds).__next__


class Node:
    def __init__(self) -> None:
        self.itself = self


def _old_cycle() -> weakref.ref[Node]:
    """A reference cycle that reached the oldest generation, then became garbage."""
    node = Node()
    gc.collect()  # survivors of a full collection are in generation 2
    return weakref.ref(node)


async def test_cycles_in_the_oldest_generation_are_collected_on_the_clock(
        autojump_clock: trio.testing.MockClock) -> None:
    young, middle, oldest = gc.get_threshold()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(collector.collect_on_a_clock, collections_take(0.0))
        await trio.sleep(1)
        assert gc.get_threshold() == (collector.YOUNG_THRESHOLD, middle, collector.NEVER)
        garbage = _old_cycle()
        gc.collect(1)  # the young collections CPython still runs leave it
        assert garbage() is not None
        await trio.sleep(collector.FULL_COLLECTION_INTERVAL_S - 2)
        assert garbage() is not None
        await trio.sleep(2)
        assert garbage() is None
        nursery.cancel_scope.cancel()
    assert gc.get_threshold() == (young, middle, oldest)


async def test_cycles_among_objects_that_survived_a_collection_are_found_when_thawed(
        autojump_clock: trio.testing.MockClock) -> None:
    async with trio.open_nursery() as nursery:
        nursery.start_soon(collector.collect_on_a_clock, collections_take(0.0))
        await trio.sleep(1)
        node = Node()
        await trio.sleep(collector.FULL_COLLECTION_INTERVAL_S)  # it survives a collection: frozen
        assert gc.get_freeze_count() > 0
        garbage = weakref.ref(node)
        del node
        await trio.sleep(collector.FULL_COLLECTION_INTERVAL_S)
        assert garbage() is not None  # collections walk only what came since
        await trio.sleep(collector.FULL_COLLECTION_INTERVAL_S * (collector.THAW_EVERY - 2))
        assert garbage() is None  # the thawing one walks everything
        nursery.cancel_scope.cancel()
    assert gc.get_freeze_count() == 0


async def test_the_threshold_comes_back_when_the_last_of_several_gateways_stops(
        autojump_clock: trio.testing.MockClock) -> None:
    before = gc.get_threshold()
    with trio.CancelScope() as first:
        async with trio.open_nursery() as outer:
            outer.start_soon(collector.collect_on_a_clock, collections_take(0.0))
            await trio.sleep(1)
            with trio.CancelScope() as second:
                async with trio.open_nursery() as inner:
                    inner.start_soon(collector.collect_on_a_clock, collections_take(0.0))
                    await trio.sleep(1)
                    assert gc.get_threshold()[2] == collector.NEVER
                    second.cancel()
            assert gc.get_threshold()[2] == collector.NEVER  # the first one still runs
            first.cancel()
    assert gc.get_threshold() == before


def test_a_long_collection_spaces_the_next_ones_out() -> None:
    assert collector.pause_after(0.001) == collector.FULL_COLLECTION_INTERVAL_S
    assert collector.pause_after(0.5) == 0.5 / collector.FULL_COLLECTION_SHARE


async def test_collections_that_take_long_come_less_often(
        autojump_clock: trio.testing.MockClock) -> None:
    spacing = collector.pause_after(0.5)
    assert spacing > collector.FULL_COLLECTION_INTERVAL_S
    async with trio.open_nursery() as nursery:
        nursery.start_soon(collector.collect_on_a_clock, collections_take(0.5))
        await trio.sleep(1)
        garbage = _old_cycle()
        await trio.sleep(spacing - 2)
        assert garbage() is not None
        await trio.sleep(2)
        assert garbage() is None
        nursery.cancel_scope.cancel()
