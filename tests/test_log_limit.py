"""Repeated refusals summed up in one line when their window ends (`adapters/log_limit.py`), on an
injected clock and on trio's autojump clock: nothing sleeps for real."""

from __future__ import annotations

import logging

import pytest
import trio

from polymq.adapters.log_limit import RateLimitedLog


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [record.getMessage() for record in caplog.records if record.name == "test.refusals"]


def test_the_first_is_logged_the_rest_summed_when_the_window_ends(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="test.refusals")
    clock = FakeClock()
    refusals = RateLimitedLog(logging.getLogger("test.refusals"), window=10.0, clock=clock)
    refusals.note("E_PUB_FAILED", "refused 1")
    assert refusals.flush() is None  # nothing counted yet
    for number in range(2, 6):
        clock.now += 1
        refusals.note("E_PUB_FAILED", f"refused {number}")
    assert _lines(caplog) == ["refused 1"]
    assert refusals.flush() == 110.0  # the window of the first line ends then
    clock.now = 110.0
    assert refusals.flush() is None
    assert _lines(caplog) == ["refused 1", "4 more like it in the last 10 s, the last: refused 5"]
    # Still within a window of the summary: counted again, summed at its end.
    clock.now = 115.0
    refusals.note("E_PUB_FAILED", "refused 6")
    assert refusals.flush() == 120.0
    clock.now = 120.0
    refusals.flush()
    assert _lines(caplog)[-1] == "1 more like it in the last 10 s, the last: refused 6"
    # A whole quiet window: the kind is forgotten and its next refusal is logged at once.
    clock.now = 131.0
    assert refusals.flush() is None
    refusals.note("E_PUB_FAILED", "refused 7")
    assert _lines(caplog)[-1] == "refused 7"
    assert len(_lines(caplog)) == 4


def test_kinds_are_counted_apart(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="test.refusals")
    clock = FakeClock()
    refusals = RateLimitedLog(logging.getLogger("test.refusals"), window=10.0, clock=clock)
    for kind in ("a", "b", "a", "b", "b"):
        refusals.note(kind, f"{kind} refused")
    clock.now += 10
    refusals.flush()
    assert sorted(_lines(caplog)) == sorted(["a refused", "b refused", "1 more like it in the last 10 s, the last: "
                                             "a refused", "2 more like it in the last 10 s, the last: b refused"])


async def test_run_writes_the_summary_when_the_window_ends_without_another_refusal(
        caplog: pytest.LogCaptureFixture, autojump_clock: trio.testing.MockClock) -> None:
    caplog.set_level(logging.INFO, logger="test.refusals")
    refusals = RateLimitedLog(logging.getLogger("test.refusals"), window=10.0, clock=trio.current_time)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(refusals.run)
        start = trio.current_time()
        refusals.note("too many connections", "refused 1")
        refusals.note("too many connections", "refused 2")
        refusals.note("too many connections", "refused 3")
        await trio.sleep(9.5)
        assert _lines(caplog) == ["refused 1"]
        await trio.sleep(1.0)  # the window ended at 10 s: `run` wrote the line, no refusal needed it
        assert _lines(caplog) == ["refused 1", "2 more like it in the last 10 s, the last: refused 3"]
        assert trio.current_time() - start == pytest.approx(10.5)
        await trio.sleep(100)  # nothing more is counted: nothing more is written
        assert len(_lines(caplog)) == 2
        nursery.cancel_scope.cancel()
