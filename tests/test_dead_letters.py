"""Requeueing a queue's dead letters (core/dead_letters.py): back into the queue, once each, durably."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from polymq.core.clock import ManualClock
from polymq.core.dead_letters import Requeued, requeue_dead_letters
from polymq.core.disk_io import CommitJob
from polymq.core.engine import Engine
from polymq.core.message import Message

from support.sync_store import Store


def _dead_lettered(engine: Engine, count: int) -> list[Message]:
    """`count` messages published to `jobs`, delivered from queue `jobs` and dead-lettered."""
    engine.ensure_queue("jobs", origin="phpmq")
    engine.bind("jobs", "jobs")
    delivered: list[Message] = []
    consumer = engine.attach("jobs", delivered.append, credit=count)
    for number in range(count):
        engine.publish("jobs", f"job {number}".encode(), headers={"k": number}, origin="phpmq")
    for message in list(delivered):
        assert engine.queues["jobs"].dead_letter(message.id) is not None
    consumer.detach()
    return delivered


def _ready(engine: Engine, name: str) -> list[tuple[bytes, int, object]]:
    queue = engine.queues[name]
    return [(message.body, message.attempts, message.headers) for message in queue.ready]


def test_dead_letters_of_the_topic_and_its_queues_go_back_once_each() -> None:
    engine = Engine()
    engine.ensure_queue("jobs", origin="phpmq")
    engine.bind("jobs", "jobs")
    delivered: list[Message] = []
    consumer = engine.attach("jobs", delivered.append, credit=3)
    for number in range(3):
        engine.publish("jobs", f"job {number}".encode(), headers={"k": number}, origin="phpmq")
    queue = engine.queues["jobs"]
    queue.dead_letter(delivered[0].id)  # waits in the topic jobs.dead: no queue bound yet
    engine.ensure_queue("jobs.dead/inspect")
    engine.bind("jobs.dead/inspect", "jobs.dead")  # takes the backlog
    engine.ensure_queue("jobs.dead/other")
    engine.bind("jobs.dead/other", "jobs.dead")
    queue.dead_letter(delivered[1].id)  # a copy in each of the two
    reading: list[Message] = []
    engine.attach("jobs.dead/other", reading.append, credit=1)  # holds one in flight: it stays
    engine.topics["jobs.dead"].set_paused(True)
    queue.dead_letter(delivered[2].id)  # waits in the paused topic's backlog
    consumer.detach()
    assert len(reading) == 1 and reading[0].id == delivered[1].id
    assert _ready(engine, "jobs") == []

    assert requeue_dead_letters(engine, queue) == Requeued(moved=3, left=0)

    assert sorted(_ready(engine, "jobs"), key=lambda ready: ready[0]) == [
        (b"job 0", 0, {"k": 0}), (b"job 1", 0, {"k": 1}), (b"job 2", 0, {"k": 2})]
    assert engine.topics["jobs.dead"].depth == 0
    assert engine.queues["jobs.dead/inspect"].depth == 0
    assert engine.queues["jobs.dead/other"].depth == 0
    assert list(engine.queues["jobs.dead/other"].in_flight) == [delivered[1].id]  # in flight stays
    assert requeue_dead_letters(engine, queue) == Requeued(moved=0, left=0)


def test_a_queue_without_dead_letters_moves_nothing() -> None:
    engine = Engine()
    queue = engine.ensure_queue("calm")
    assert requeue_dead_letters(engine, queue) == Requeued(0, 0)


def test_requeued_dead_letters_are_kept_across_a_restart_even_those_spilled_to_disk(tmp_path: Path) -> None:
    clock = ManualClock()
    store = Store(tmp_path, clock, 2)  # two copies in memory per owner: the rest spill to disk
    store.writer.close()
    store.writer = store.storage.files  # the requeue writes through the store's own writer (`write_now`)
    _dead_lettered(store.engine, 5)
    store.commit()
    assert store.engine.topics["jobs.dead"].spilled == 3
    queue = store.queue("jobs")
    assert requeue_dead_letters(store.engine, queue) == Requeued(moved=5, left=0)
    assert queue.depth == 5
    store.close()
    again = Store(tmp_path, clock, 10_000)
    try:
        assert again.engine.topics["jobs.dead"].depth == 0
        taken: list[Message] = []
        again.engine.attach("jobs", taken.append, credit=10)
        # Delivered for the first time again: the dead letter's attempts are not carried back.
        assert [(message.body, message.attempts, message.headers) for message in taken] == [
            (f"job {number}".encode(), 1, {"k": number}) for number in range(5)]
    finally:
        again.close()


def _holders(directory: Path, message_id: int) -> list[str]:
    """The queues and topics that hold a copy of `message_id` after a restart on `directory`."""
    store = Store(directory, ManualClock(), 10_000)
    try:
        engine = store.engine
        found = [name for name, queue in engine.queues.items()
                 if any(message.id == message_id for message in [*queue.ready, *queue.in_flight.values()])]
        found += [f"topic {name}" for name, topic in engine.topics.items()
                  if any(message.id == message_id for message in topic.backlog)]
        return found
    finally:
        store.writer.close()
        store.storage.close()


@pytest.mark.parametrize("read_by", ["nobody yet", "a queue"])
def test_a_crash_between_any_two_writes_of_a_dead_lettering_leaves_the_message_somewhere(
        tmp_path: Path, read_by: str) -> None:
    data = tmp_path / "data"
    store = Store(data, ManualClock(), 10_000)
    engine = store.engine
    if read_by == "a queue":
        engine.ensure_queue("jobs.dead/inspect")
        engine.bind("jobs.dead/inspect", "jobs.dead")
    engine.ensure_queue("jobs", origin="phpmq")
    engine.bind("jobs", "jobs")
    delivered: list[Message] = []
    engine.attach("jobs", delivered.append, credit=1)
    engine.publish("jobs", b"job", origin="phpmq")
    store.commit()
    (message,) = delivered
    engine.queues["jobs"].dead_letter(message.id)
    letter_in = "jobs.dead/inspect" if read_by == "a queue" else "topic jobs.dead"
    crashes = 0
    for commit in range(3):  # the dead-lettering's commits, and one more that has nothing to do
        job, written, callbacks = store.storage.prepare()
        for number, append in enumerate([None, *job.appends]):
            if append is not None:  # one file's write at a time, through the store's own writer
                store.writer.write(one := CommitJob([append]))
                assert one.error is None
                job.sizes.update(one.sizes)
            crashed = tmp_path / f"crash-{commit}-{number}"  # a crash here: the disk as it is now
            shutil.copytree(data, crashed)
            assert set(_holders(crashed, message.id)) in ({"jobs"}, {"jobs", letter_in}, {letter_in}), (commit, number)
            crashes += 1
        sync = store.writer.take_sync(job.unlinks, job.removed_dirs, fsync=job.fsync).run()
        store.writer.sync_finished(sync)
        store.storage.complete(job, written, callbacks)
    assert crashes >= 5  # the writes of the letter and of the copy's end came apart
    store.close()
    assert _holders(data, message.id) == [letter_in]
