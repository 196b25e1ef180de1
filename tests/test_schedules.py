"""Schedules in the engine (core/schedules.py), driven by a ManualClock: intervals, cron
expressions, run counts, the first firing now or later, replacing and removing, and what the
store brings back after a restart."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from polymq.core.clock import ManualClock
from polymq.core.disk_io import FileWriter
from polymq.core.disk_storage import DiskStorage
from polymq.core.engine import Engine
from polymq.core.schedules import InvalidSchedule, next_cron


def make(storage: DiskStorage | None = None, clock: ManualClock | None = None) -> tuple[Engine, ManualClock]:
    clock = clock or ManualClock()
    engine = Engine(clock=clock, storage=storage) if storage is not None else Engine(clock=clock)
    engine.restore()
    engine.ensure_queue("jobs")
    engine.bind("jobs", "jobs")
    return engine, clock


def bodies(engine: Engine) -> list[bytes]:
    queue = engine.queue("jobs")
    assert queue is not None
    return [message.body for message in queue.ready]


def advance(engine: Engine, clock: ManualClock, seconds: float) -> None:
    clock.advance(seconds)
    engine.run_timers()


def commit(storage: DiskStorage) -> None:
    job, written, callbacks = storage.prepare()
    FileWriter().run(job)
    storage.complete(job, written, callbacks)


def test_an_interval_fires_at_once_then_every_interval() -> None:
    engine, clock = make()
    engine.schedules.add("k", "jobs", b"tick", interval=2.0, headers={"h": "v"})
    advance(engine, clock, 0)
    assert bodies(engine) == [b"tick"]
    advance(engine, clock, 1.9)
    assert bodies(engine) == [b"tick"]
    advance(engine, clock, 0.1)
    advance(engine, clock, 2.0)
    assert bodies(engine) == [b"tick"] * 3
    queue = engine.queue("jobs")
    assert queue is not None and {message.headers["h"] for message in queue.ready} == {"v"}  # type: ignore[index]


def test_not_at_once_waits_one_interval_and_a_run_count_stops_it() -> None:
    engine, clock = make()
    engine.schedules.add("k", "jobs", b"x", interval=5.0, run_count=2, at_once=False)
    advance(engine, clock, 4.9)
    assert bodies(engine) == []
    for _ in range(5):
        advance(engine, clock, 5.0)
    assert bodies(engine) == [b"x", b"x"]
    assert "k" not in engine.schedules.by_key


def test_a_cron_expression_fires_at_the_times_it_names() -> None:
    engine, clock = make()  # the clock's wall time starts at 2023-11-14 22:13:20 UTC
    engine.schedules.add("c", "jobs", b"cron", cron="*/5 * * * *", at_once=False)
    advance(engine, clock, 99)
    assert bodies(engine) == []
    advance(engine, clock, 1)  # 22:15:00
    assert bodies(engine) == [b"cron"]
    advance(engine, clock, 299)
    assert bodies(engine) == [b"cron"]
    advance(engine, clock, 1)  # 22:20:00
    assert bodies(engine) == [b"cron", b"cron"]


def test_cron_expressions_name_utc_times_whatever_the_machine_s_time_zone(monkeypatch: pytest.MonkeyPatch) -> None:
    noon_utc = 1_795_608_000.0  # 2026-11-25 12:00:00 UTC
    for zone in ("Asia/Tokyo", "America/New_York", "UTC"):
        monkeypatch.setenv("TZ", zone)
        time.tzset()
        assert next_cron("0 9 * * *", noon_utc) == noon_utc + 21 * 3600  # 09:00 UTC the next day
    monkeypatch.undo()
    time.tzset()


def test_the_same_key_replaces_and_remove_stops() -> None:
    engine, clock = make()
    engine.schedules.add("k", "jobs", b"old", interval=1.0, at_once=False)
    engine.schedules.add("k", "jobs", b"new", interval=1.0, at_once=False)
    advance(engine, clock, 1.0)
    assert bodies(engine) == [b"new"]
    assert engine.schedules.remove("k") and not engine.schedules.remove("k")
    advance(engine, clock, 5.0)
    assert bodies(engine) == [b"new"]


@pytest.mark.parametrize(("options", "error"), [
    ({}, "a schedule needs an interval or a cron expression"),
    ({"cron": "not cron"}, "'not cron' is not a cron expression"),
    ({"interval": -1.0}, "interval -1.0 is negative"),
])
def test_a_schedule_without_a_valid_time_is_refused(options: dict[str, object], error: str) -> None:
    engine, _ = make()
    with pytest.raises(InvalidSchedule, match=error):
        engine.schedules.add("k", "jobs", b"x", **options)  # type: ignore[arg-type]


def test_schedules_survive_a_restart_and_an_overdue_one_fires_once(tmp_path: Path) -> None:
    clock = ManualClock()
    storage = DiskStorage(tmp_path, clock)
    engine, _ = make(storage, clock)
    engine.schedules.add("every10", "jobs", b"\x00binary", interval=10.0, run_count=3, at_once=False)
    engine.schedules.add("gone", "jobs", b"g", interval=1.0, at_once=False)
    engine.schedules.remove("gone")
    engine.schedules.add("cron", "jobs", b"c", cron="0 * * * *", at_once=False)
    advance(engine, clock, 10.0)  # every10 fires once: 2 left
    commit(storage)
    storage.close()

    clock.advance(3600)  # down for an hour
    storage = DiskStorage(tmp_path, clock)
    engine = Engine(clock=clock, storage=storage)
    engine.restore()
    assert sorted(engine.schedules.by_key) == ["cron", "every10"]
    engine.run_timers()
    queue = engine.queue("jobs")
    assert queue is not None
    # The backlog: every10's first firing; then once each for what was due while down.
    assert sorted(message.body for message in queue.ready) == [b"\x00binary", b"\x00binary", b"c"]
    clock.advance(10.0)
    engine.run_timers()
    assert [message.body for message in queue.ready].count(b"\x00binary") == 3
    assert "every10" not in engine.schedules.by_key
    storage.close()
