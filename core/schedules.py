"""Schedules: a message published to a topic on an interval or a cron expression, kept in the store.

Any protocol adds one under a key of its own (eMQP: its job identity), and a new one under the
same key replaces it. Each firing is an ordinary publish; a schedule with a run count stops
after that many firings. Times are wall-clock (a cron expression names wall times); the engine's
timers run on the monotonic clock, so each firing is set as "that many seconds from now".
After a restart a schedule whose time passed while the gateway was down fires once, at once.

Where schedules are kept, and which node fires them, is the `ScheduleKeeper`'s: the embedded store
keeps them and its one node fires them all (`StoreKeeper`); a shared engine keeps them for every node
and lets one fire at a time (`polymq.jetstream.schedules`).
"""

from __future__ import annotations

import base64
import logging
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, Protocol

import attrs
from croniter import croniter

if TYPE_CHECKING:
    from polymq.core.engine import Engine
    from polymq.core.timers import Timer

log = logging.getLogger("polymq.schedules")

FOREVER = -1  # a run count without end
KEPT_SCHEDULE = "schedule"  # the store's kind of kept record for a schedule
# An interval of 0 (the original accepts it: every turn of its 1 ms loop) fires this often, not in a busy loop.
MIN_INTERVAL_S = 0.001
# A node that may not fire a due schedule (another node fires them) looks again this often.
NOT_MINE_RETRY_S = 1.0


class InvalidSchedule(ValueError):
    """A cron expression croniter cannot read, or neither an interval nor a cron expression."""


@attrs.define(eq=False)
class Schedule:
    key: str
    topic: str
    body: bytes
    headers: dict[str, Any] | None
    interval: float | None  # seconds between firings, or None: the cron expression says when
    cron: str | None
    runs_left: int  # FOREVER, or firings still to come
    next_wall: float  # wall-clock seconds of the next firing
    fired: int = 0  # firings since it was added (or the gateway started)
    timer: Timer | None = None
    origin: str | None = None  # the protocol that added it, kept with each firing's message

    def to_record(self) -> dict[str, Any]:
        return {"key": self.key, "topic": self.topic, "body": base64.b64encode(self.body).decode(),
                "headers": self.headers, "interval": self.interval, "cron": self.cron,
                "runs_left": self.runs_left, "next_wall": self.next_wall, "origin": self.origin}

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> Schedule:
        return cls(record["key"], record["topic"], base64.b64decode(record["body"]), record.get("headers"),
                   record.get("interval"), record.get("cron"), record["runs_left"], record["next_wall"],
                   origin=record.get("origin"))


def next_cron(expression: str, after_wall: float) -> float:
    """The first time after `after_wall` the expression names (evaluated in UTC)."""
    start = datetime.fromtimestamp(after_wall, tz=UTC)
    return float(croniter(expression, start).get_next(float))


class ScheduleKeeper(Protocol):
    def may_fire(self) -> bool:
        """This node fires the schedules now (the others keep them, ready to take over)."""
        ...

    def saved(self, schedule: Schedule) -> None:
        """The schedule was added or fired: keep its state."""
        ...

    def deleted(self, key: str) -> None:
        """The schedule was removed, or ran its last firing."""
        ...


class StoreKeeper:
    """The engine's own store keeps the schedules (when it is durable); its node fires them all."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def may_fire(self) -> bool:
        return True

    def saved(self, schedule: Schedule) -> None:
        if self.engine.storage.persistent:
            self.engine.storage.kept_saved(KEPT_SCHEDULE, schedule.key, schedule.to_record())

    def deleted(self, key: str) -> None:
        if self.engine.storage.persistent:
            self.engine.storage.kept_deleted(KEPT_SCHEDULE, key)


class Schedules:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.by_key: dict[str, Schedule] = {}
        # Called at each firing with the schedule, before it publishes (an adapter makes its queue).
        self.on_fire: Callable[[Schedule], None] | None = None
        self.keeper: ScheduleKeeper = StoreKeeper(engine)

    def _wall(self) -> float:
        return self.engine.clock.wall_ns() / 1e9

    def add(self, key: str, topic: str, body: bytes, *, headers: dict[str, Any] | None = None,
            interval: float | None = None, cron: str | None = None, run_count: int = FOREVER,
            at_once: bool = True, origin: str | None = None) -> Schedule:
        """Add (or replace) the schedule `key`. `at_once`: the first firing is now, else after one
        interval (or at the cron expression's next time). Raises InvalidSchedule."""
        if interval is None and not cron:
            raise InvalidSchedule("a schedule needs an interval or a cron expression")
        if interval is None and cron is not None and not croniter.is_valid(cron):
            raise InvalidSchedule(f"{cron!r} is not a cron expression")
        if interval is not None and interval < 0:
            raise InvalidSchedule(f"interval {interval} is negative")
        self.remove(key)
        now = self._wall()
        if at_once:
            first = now
        elif interval is not None:
            first = now + interval
        else:
            assert cron is not None
            first = next_cron(cron, now)
        schedule = Schedule(key, topic, body, headers, interval, cron if interval is None else None,
                            run_count, first, origin=origin)
        if run_count == 0:
            return schedule  # nothing to run
        self.by_key[key] = schedule
        self._save(schedule)
        self._arm(schedule)
        return schedule

    def remove(self, key: str) -> bool:
        if not self.forget(key):
            return False
        self.keeper.deleted(key)
        return True

    def forget(self, key: str) -> bool:
        """Drop the schedule here only (the keeper says it was removed)."""
        schedule = self.by_key.pop(key, None)
        if schedule is None:
            return False
        if schedule.timer is not None:
            schedule.timer.cancel()
        return True

    def restore(self, records: tuple[Mapping[str, Any], ...]) -> None:
        for record in records:
            self.known(record)

    def known(self, record: Mapping[str, Any]) -> None:
        """A schedule as the keeper has it (at start, or as another node added or fired it): it replaces
        this node's copy, which is not saved again."""
        self.forget(record["key"])
        schedule = Schedule.from_record(record)
        self.by_key[schedule.key] = schedule
        self._arm(schedule)

    def _save(self, schedule: Schedule) -> None:
        self.keeper.saved(schedule)

    def _arm(self, schedule: Schedule) -> None:
        engine = self.engine
        delay = max(0.0, schedule.next_wall - self._wall())
        schedule.timer = engine.timers.schedule(engine.clock.now() + delay, self._fire, schedule)

    def _fire(self, schedule: Schedule) -> None:
        if self.by_key.get(schedule.key) is not schedule:
            return  # removed or replaced meanwhile
        if not self.keeper.may_fire():
            # Another node fires it and saves its next time; this one looks again, to take over if it must.
            engine = self.engine
            schedule.timer = engine.timers.schedule(engine.clock.now() + NOT_MINE_RETRY_S, self._fire, schedule)
            return
        now = self._wall()
        schedule.fired += 1
        if self.on_fire is not None:
            self.on_fire(schedule)
        if self.engine.storage.failure is None:
            self.engine.publish(schedule.topic, schedule.body, headers=schedule.headers, origin=schedule.origin)
        else:
            log.warning("schedule %s: firing skipped, the store failed: %s", schedule.key, self.engine.storage.failure)
        if schedule.runs_left != FOREVER:
            schedule.runs_left -= 1
            if schedule.runs_left <= 0:
                self.remove(schedule.key)
                return
        if schedule.interval is not None:
            # From the planned time, not the late one; a gateway that was down does not catch up.
            planned = schedule.next_wall + schedule.interval
            schedule.next_wall = planned if planned > now else now + max(schedule.interval, MIN_INTERVAL_S)
        else:
            assert schedule.cron is not None
            schedule.next_wall = next_cron(schedule.cron, now)
        self._save(schedule)
        self._arm(schedule)
