"""The engine's TimerService and ManualClock, driven by hand (no sleeping)."""

from __future__ import annotations

from polymq.core.clock import ManualClock
from polymq.core.timers import TimerService


def test_manual_clock_moves_only_when_told() -> None:
    clock = ManualClock(start=50.0, wall_start_ns=10**18)
    assert clock.now() == 50.0
    assert clock.wall_ns() == 10**18
    clock.advance(1.5)
    assert clock.now() == 51.5
    assert clock.wall_ns() == 10**18 + 1_500_000_000


def test_run_due_runs_in_due_order_then_schedule_order() -> None:
    timers = TimerService()
    ran: list[str] = []
    timers.schedule(3.0, ran.append, "c")
    timers.schedule(1.0, ran.append, "a1")
    timers.schedule(2.0, ran.append, "b")
    timers.schedule(1.0, ran.append, "a2")  # same due: schedule order
    assert timers.next_due() == 1.0
    assert len(timers) == 4
    assert timers.run_due(0.5) == 0
    assert ran == []
    assert timers.run_due(2.0) == 3  # due at or before `now`
    assert ran == ["a1", "a2", "b"]
    assert timers.next_due() == 3.0
    assert timers.run_due(10.0) == 1
    assert ran == ["a1", "a2", "b", "c"]
    assert timers.next_due() is None
    assert len(timers) == 0


def test_cancel_skips_and_next_due_ignores_cancelled() -> None:
    timers = TimerService()
    ran: list[int] = []
    first = timers.schedule(1.0, ran.append, 1)
    timers.schedule(2.0, ran.append, 2)
    first.cancel()
    assert len(timers) == 1
    assert timers.next_due() == 2.0
    assert timers.run_due(5.0) == 1
    assert ran == [2]


def test_a_timer_runs_once_and_cancel_after_run_is_harmless() -> None:
    timers = TimerService()
    ran: list[int] = []
    timer = timers.schedule(1.0, ran.append, 1)
    timers.run_due(1.0)
    timers.run_due(1.0)
    timer.cancel()
    assert ran == [1]


def test_callback_scheduling_a_due_timer_runs_in_the_same_pass() -> None:
    timers = TimerService()
    ran: list[str] = []

    def first() -> None:
        ran.append("first")
        timers.schedule(0.5, ran.append, "now-due")  # already due
        timers.schedule(9.0, ran.append, "later")

    timers.schedule(1.0, first)
    assert timers.run_due(1.0) == 2
    assert ran == ["first", "now-due"]
    assert timers.next_due() == 9.0


def test_callback_can_cancel_a_later_timer_of_the_same_pass() -> None:
    timers = TimerService()
    ran: list[str] = []
    second = timers.schedule(2.0, ran.append, "second")
    timers.schedule(1.0, second.cancel)
    assert timers.run_due(3.0) == 1
    assert ran == []


def test_on_new_earliest_fires_only_for_a_new_earliest_timer() -> None:
    timers = TimerService()
    woke: list[float | None] = []
    timers.on_new_earliest = lambda: woke.append(timers.next_due())
    timers.schedule(5.0, lambda: None)
    assert woke == [5.0]
    timers.schedule(7.0, lambda: None)  # later: no wake-up
    timers.schedule(5.0, lambda: None)  # equal: no wake-up
    assert woke == [5.0]
    timers.schedule(2.0, lambda: None)
    assert woke == [5.0, 2.0]
    timers.run_due(10.0)
    timers.schedule(20.0, lambda: None)  # heap empty again: earliest
    assert woke == [5.0, 2.0, 20.0]
