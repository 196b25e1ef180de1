"""Streams (core/streams.py): queues read by position. Ranges read again give the same copies until
committed; positions only grow, across spills, deferred copies and restarts of the real store."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from polymq.core import streams
from polymq.core.clock import ManualClock
from polymq.core.engine import Engine
from polymq.core.message import Message

from support.sync_store import Store


def bodies(messages: list[Message]) -> list[bytes]:
    return [message.body for message in messages]


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
def open_store(tmp_path: Path, clock: ManualClock) -> Iterator[Callable[..., Store]]:
    opened: list[Store] = []

    def opener(mem_queue_size: int = 10_000) -> Store:
        store = Store(tmp_path / "data", clock, mem_queue_size)
        opened.append(store)
        return store

    yield opener
    for store in opened:
        with contextlib.suppress(Exception):
            store.close()


def test_a_stream_gets_its_own_copy_and_ranges_read_again_until_committed(clock: ManualClock) -> None:
    engine = Engine(clock=clock)
    engine.ensure_queue("workers")
    engine.bind("workers", "orders")
    got: list[Message] = []
    engine.attach("workers", got.append, credit=100)
    stream = streams.open_stream(engine, "spark", ["orders"])
    assert streams.start(stream) == streams.end(stream) == 0
    engine.publish_many("orders", [b"a", b"b", b"c"])
    engine.publish("orders", b"d")
    assert bodies(got) == [b"a", b"b", b"c", b"d"]  # the other queue's consumer is served as ever
    end = streams.end(stream)
    assert end == 4
    assert bodies(streams.read(stream, 0, end)) == [b"a", b"b", b"c", b"d"]
    assert bodies(streams.read(stream, 1, 3)) == [b"b", b"c"]
    assert bodies(streams.read(stream, 1, 3)) == [b"b", b"c"]  # again: the same copies
    assert [m.pos for m in streams.read(stream, 0, end, limit=2)] == [0, 1]
    assert streams.end_after(stream, 0, 3) == 3 and streams.end_after(stream, 2, 10) == 4
    assert streams.end_after(stream, 0, None) == 4
    assert streams.commit(engine, stream, 2) == 2
    assert streams.start(stream) == 2
    with pytest.raises(streams.StreamError, match="below 2"):
        streams.read(stream, 0, end)
    assert bodies(streams.read(stream, 2, end)) == [b"c", b"d"]
    assert streams.commit(engine, stream, 1) == 0  # a lower end changes nothing
    engine.publish("orders", b"e")
    assert [(m.pos, m.body) for m in streams.read(stream, 2, streams.end(stream))] == [(2, b"c"), (3, b"d"),
                                                                                       (4, b"e")]


def test_a_stream_has_no_consumers_and_an_ordinary_queue_is_no_stream(clock: ManualClock) -> None:
    engine = Engine(clock=clock)
    stream = streams.open_stream(engine, "spark", ["t"])
    got: list[Message] = []
    engine.attach("spark", got.append, credit=10)
    engine.publish("t", b"x")
    assert got == [] and bodies(streams.read(stream, 0, 1)) == [b"x"]
    engine.ensure_queue("plain")
    with pytest.raises(streams.StreamError, match="not a stream"):
        streams.open_stream(engine, "plain", ["t"])
    with pytest.raises(streams.StreamError, match="no stream"):
        streams.stream(engine, "missing")


def test_a_deferred_copy_takes_a_position_after_what_was_readable_when_it_became_due(clock: ManualClock) -> None:
    engine = Engine(clock=clock)
    stream = streams.open_stream(engine, "spark", ["t"])
    engine.publish("t", b"later", delay=5)
    engine.publish("t", b"now")
    end = streams.end(stream)
    assert bodies(streams.read(stream, 0, end)) == [b"now"]
    streams.commit(engine, stream, end)
    clock.advance(5)
    engine.run_timers()
    assert [m.body for m in streams.read(stream, end, streams.end(stream))] == [b"later"]


def test_positions_survive_a_restart_and_never_go_back(open_store: Callable[..., Store]) -> None:
    store = open_store()
    stream = streams.open_stream(store.engine, "spark", ["t"])
    store.engine.publish_many("t", [b"%d" % number for number in range(5)])
    store.commit()
    before = [(m.pos, m.body) for m in streams.read(stream, 0, streams.end(stream))]
    store.close()

    store = open_store()
    stream = streams.stream(store.engine, "spark")
    end = streams.end(stream)
    assert [(m.pos, m.body) for m in streams.read(stream, streams.start(stream), end)] == before
    streams.commit(store.engine, stream, end)  # everything: the store deletes its segments
    store.commit()
    store.close()

    store = open_store()
    stream = streams.stream(store.engine, "spark")
    assert streams.committed(stream) == end and streams.start(stream) >= end
    store.engine.publish("t", b"new")
    store.commit()
    fresh = streams.read(stream, end, streams.end(stream))
    assert bodies(fresh) == [b"new"] and fresh[0].pos >= end


def test_a_restart_moves_the_end_to_a_new_segment_and_the_count_says_the_range_is_empty(
        open_store: Callable[..., Store]) -> None:
    store = open_store()
    stream = streams.open_stream(store.engine, "spark", ["t"])
    store.engine.publish_many("t", [b"%d" % number for number in range(5)])
    store.commit()
    assert streams.range_after(stream, 0, 3) == (3, 3) and streams.range_after(stream, 3, 10) == (5, 2)
    assert streams.range_after(stream, 5, 10) == (5, 0) and streams.range_after(stream, 0, None) == (5, -1)
    store.close()

    store = open_store()
    stream = streams.stream(store.engine, "spark")
    # Nothing published: each run of the store writes a log's copies to a new segment, and a
    # position is `segment << 32 | index`, so the end is the new segment's first position.
    new_segment = 1 << 32
    assert streams.end(stream) == new_segment
    assert streams.range_after(stream, 5, 10) == (new_segment, 0)  # nothing to read between
    assert streams.range_after(stream, 0, 10) == (new_segment, 5)
    store.engine.publish("t", b"new")
    store.commit()
    assert streams.range_after(stream, 5, 10) == (new_segment + 1, 1)
    assert [(m.pos, m.body) for m in streams.read(stream, 5, new_segment + 1)] == [(new_segment, b"new")]


def test_spilled_copies_are_read_back_in_order_and_commit_past_memory(open_store: Callable[..., Store]) -> None:
    store = open_store(mem_queue_size=3)
    stream = streams.open_stream(store.engine, "spark", ["t"])
    sent = [b"%02d" % number for number in range(12)]
    for body in sent:
        store.engine.publish("t", body)
        store.commit()
    assert stream.spilled > 0
    begin = streams.start(stream)
    assert streams.end_after(stream, begin, 7) == streams.read(stream, begin, streams.end(stream))[7].pos
    everything = streams.read(stream, begin, streams.end(stream))
    assert bodies(everything) == sent
    middle = everything[8].pos
    assert streams.commit(store.engine, stream, middle) == 8
    store.commit()
    store.close()

    store = open_store(mem_queue_size=3)
    stream = streams.stream(store.engine, "spark")
    assert bodies(streams.read(stream, streams.start(stream), streams.end(stream))) == sent[8:]


def test_dedup_publishes_only_the_rows_a_group_has_not_had(clock: ManualClock) -> None:
    engine = Engine(clock=clock)
    dedup = engine.dedup
    assert dedup.unseen("w/1/0", 0, 5) == [(0, 5)]
    dedup.remember("w/1/0", [(0, 3)])
    assert dedup.unseen("w/1/0", 0, 5) == [(3, 5)] and dedup.duplicates == 3
    dedup.remember("w/1/0", [(6, 8), (3, 5)])
    assert dedup.groups["w/1/0"][0] == [0, 5, 6, 8]
    assert dedup.unseen("w/1/0", 0, 10) == [(5, 6), (8, 10)]
    dedup.remember("w/1/0", [(5, 6)])
    assert dedup.groups["w/1/0"][0] == [0, 8]
    assert dedup.unseen("w/1/1", 0, 2) == [(0, 2)]  # another group
    clock.advance(dedup.window_s + 1)
    assert dedup.unseen("w/1/0", 0, 2) == [(0, 2)]  # forgotten after the window


def test_dedup_groups_survive_a_restart_within_the_window(open_store: Callable[..., Store],
                                                         clock: ManualClock) -> None:
    store = open_store()
    store.engine.dedup.remember("w/7/0", [(0, 100)])
    store.engine.dedup.remember("w/7/1", [(0, 4)])
    store.commit()
    store.close()
    store = open_store()
    assert store.engine.dedup.unseen("w/7/0", 0, 120) == [(100, 120)]
    assert store.engine.dedup.unseen("w/7/1", 2, 6) == [(4, 6)]
    store.close()
    clock.advance(store.engine.dedup.window_s + 1)
    store = open_store()
    assert store.engine.dedup.groups == {}


def test_a_snapshot_past_its_memory_is_refused_and_takes_nothing(open_store: Callable[..., Store],
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(streams, "SNAPSHOT_PAGE", 3)  # read back 3 at a time, checking after each
    store = open_store(mem_queue_size=2)
    engine = store.engine
    engine.ensure_queue("jobs")
    engine.bind("jobs", "t")
    payloads = [b"job %02d " % number + b"x" * 93 for number in range(20)]  # 100 bytes each
    engine.publish_many("t", payloads)
    store.commit()
    queue = engine.queue("jobs")
    assert queue is not None and queue.log is not None and queue.log.spilled == 18
    cost = 100 + streams.MESSAGE_OVERHEAD
    taken, read_back = streams.snapshot(queue, 18 * cost)
    assert bodies(taken) == payloads and read_back == 18 * cost
    with pytest.raises(streams.SnapshotTooLarge, match="jobs would read back more than"):
        streams.snapshot(queue, 18 * cost - 1)
    got: list[Message] = []
    engine.attach("jobs", got.append, credit=100)
    assert bodies(got) == payloads  # the refused snapshot left the reader where it was


def test_a_snapshot_holds_every_message_of_any_queue_and_takes_none(open_store: Callable[..., Store],
                                                                   clock: ManualClock) -> None:
    store = open_store(mem_queue_size=2)
    engine = store.engine
    engine.ensure_queue("jobs")
    engine.bind("jobs", "t")
    for number in range(6):
        engine.publish("t", b"%d" % number)
        store.commit()
    engine.publish("t", b"later", delay=30)
    got: list[Message] = []
    consumer = engine.attach("jobs", got.append, credit=1)  # one in flight
    assert bodies(got) == [b"0"] and engine.queue("jobs").spilled  # type: ignore[union-attr]
    queue = engine.queue("jobs")
    assert queue is not None
    spilled = queue.log.spilled  # type: ignore[union-attr]
    taken, read_back = streams.snapshot(queue, 1 << 20)
    assert bodies(taken) == [b"0", b"1", b"2", b"3", b"4", b"5", b"later"]
    assert spilled and read_back == spilled * (1 + streams.MESSAGE_OVERHEAD)  # one-byte bodies from disk
    assert bodies(streams.snapshot(queue, 1 << 20)[0]) == bodies(taken)  # again: nothing was taken
    consumer.set_credit(10)
    consumer.finish(got[0].id)
    assert bodies(got) == [b"0", b"1", b"2", b"3", b"4", b"5"]  # the consumer still gets every one
