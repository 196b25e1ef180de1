"""Recovery of the embedded store from damaged files, and a full disk (docs/durability.md).

Unit level: a `DiskStorage` + `Engine` on a temporary dir, committed synchronously the way the
committer does it (`prepare` → `FileWriter.run` → `complete`); the test damages the files the store
wrote (torn or truncated segments, bit flips, bad length fields, garbage, a damaged journal), restores
into a fresh engine and checks the exact set of messages that come back and the warning in the log.
Process level: a gateway on a 2 MiB tmpfs that fills up, and a graceful SIGTERM restart.
"""

from __future__ import annotations

import contextlib
import errno
import http.client
import json
import logging
import os
import shutil
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from polymq.adapters.nsq.tcp import NSQServer, ensure_channel
from polymq.codecs import nsq_client as client
from polymq.codecs.nsq import ServerLimits
from polymq.core import disk_storage, records
from polymq.core.clock import ManualClock
from polymq.core.engine import DEAD_LETTER_TOPIC_OPTION, MADE_BY_OPTION, OWNER_RECORD_KEY, Consumer, Engine, Outcome
from polymq.core.message import Message, shown_headers

from support import storage_files as files
from support.gateway import GatewayProcess, running_gateway
from support.nsq_wire import RawClient
from support.sync_store import _STORES, Store

STORAGE_LOGGER = "polymq.storage"


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
def data_dir(tmp_path: Path) -> Path:
    return tmp_path / "data"


@pytest.fixture
def open_store(data_dir: Path, clock: ManualClock) -> Iterator[Callable[..., Store]]:
    """`open_store(mem_queue_size=N)`: a store on `data_dir` (the previous one must be closed first)."""
    opened: list[Store] = []

    def opener(mem_queue_size: int = 10_000) -> Store:
        store = Store(data_dir, clock, mem_queue_size)
        opened.append(store)
        return store

    yield opener
    for store in opened:
        with contextlib.suppress(Exception):  # a failed test must not leak LOCK fds into the next one
            store.close()


def consume(engine: Engine, queue_name: str, credit: int = 1_000_000) -> tuple[Consumer, list[Message]]:
    """A manual-ack consumer; returns it and the list its deliveries land in."""
    got: list[Message] = []
    consumer = engine.attach(queue_name, got.append, credit=credit)
    return consumer, got


def delivered(engine: Engine, queue_name: str) -> list[Message]:
    """Every message the queue delivers now (ready, then spilled in log order); they go back at once."""
    consumer, got = consume(engine, queue_name)
    consumer.detach()
    return got


def bodies(engine: Engine, queue_name: str) -> list[bytes]:
    return [message.body for message in delivered(engine, queue_name)]


def names(prefix: str, count: int, start: int = 0) -> list[bytes]:
    return [b"%s%03d" % (prefix.encode(), number) for number in range(start, start + count)]


def publish_each(engine: Engine, topic: str, payloads: list[bytes]) -> None:
    """One ADD record each: a commit after every publish (one loop turn's single publishes share a record)."""
    store = _STORES[id(engine)]
    for payload in payloads:
        engine.publish(topic, payload)
        store.commit()


def storage_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [record.getMessage() for record in caplog.records
            if record.name == STORAGE_LOGGER and record.levelno >= logging.WARNING]


def assert_skipped(caplog: pytest.LogCaptureFixture, path: Path, reason: str | None = None) -> None:
    """Recovery said which file it skipped bytes of (and why, when `reason` is given)."""
    found = [text for text in storage_warnings(caplog) if str(path) in text and "skipped" in text]
    assert found, f"no 'skipped' warning naming {path}: {storage_warnings(caplog)}"
    if reason is not None:
        assert any(reason in text for text in found), f"no {reason!r} among {found}"


def assert_nothing_skipped(caplog: pytest.LogCaptureFixture) -> None:
    assert not [text for text in storage_warnings(caplog) if "skipped" in text], storage_warnings(caplog)


@pytest.fixture(autouse=True)
def _capture_storage_warnings(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger=STORAGE_LOGGER)


def queue_segment(data_dir: Path, queue: str = "q") -> Path:
    return files.last_segment(files.queue_dir(data_dir, queue))


def new_bound_store(open_store: Callable[..., Store], mem_queue_size: int = 10_000) -> Store:
    store = open_store(mem_queue_size)
    store.engine.ensure_queue("q")
    store.engine.bind("q", "t")
    return store


# -- torn and truncated segments ---------------------------------------------------------------------


@pytest.mark.parametrize("cut", ["header", "payload"])
def test_torn_last_record_is_dropped_and_cut_off(open_store: Callable[..., Store], data_dir: Path, cut: str,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    store = new_bound_store(open_store)
    publish_each(store.engine, "t", names("m", 10))
    store.close()
    segment = queue_segment(data_dir)
    last = files.add_spans(segment)[-1]
    # A crash in the middle of the last write: part of the header, or all but the last payload byte.
    files.truncate(segment, last.offset + (5 if cut == "header" else last.length - 1))

    store = open_store()
    assert bodies(store.engine, "q") == names("m", 9)
    assert_skipped(caplog, segment, "(tail)")
    # Cut back to the last whole record: nothing new may ever follow the garbage.
    assert segment.stat().st_size == last.offset

    publish_each(store.engine, "t", names("n", 2))
    store.close()
    caplog.clear()
    store = open_store()
    assert bodies(store.engine, "q") == names("m", 9) + names("n", 2)
    assert_nothing_skipped(caplog)


def test_truncated_last_segment_loses_only_its_tail(open_store: Callable[..., Store], data_dir: Path,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    store = new_bound_store(open_store)
    publish_each(store.engine, "t", names("m", 10))
    store.close()
    segment = queue_segment(data_dir)
    spans = files.add_spans(segment)
    files.truncate(segment, spans[4].offset + 3)  # records 4..9 gone, record 4 torn in its header

    store = open_store()
    assert bodies(store.engine, "q") == names("m", 4)
    assert_skipped(caplog, segment, "torn header")
    assert segment.stat().st_size == spans[4].offset


def test_truncated_older_segment_keeps_later_segments(open_store: Callable[..., Store], data_dir: Path,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    store = new_bound_store(open_store)
    publish_each(store.engine, "t", names("m", 10))
    store.close()
    store = open_store()  # a restart: new records go to a new segment
    publish_each(store.engine, "t", names("n", 5))
    store.close()
    queue_dir = files.queue_dir(data_dir, "q")
    first, second = files.segments(queue_dir)[:2]
    assert [len(files.add_spans(path)) for path in (first, second)] == [10, 5]
    spans = files.add_spans(first)
    files.truncate(first, spans[6].offset + 20)  # cut in record 6's payload

    store = open_store()
    assert bodies(store.engine, "q") == names("m", 6) + names("n", 5)
    assert_skipped(caplog, first, "truncated record")


# -- damage in the middle: only the damaged record is lost -----------------------------------------


def build_mixed_log(store: Store) -> None:
    """ADD m000, ADD m001, ADD [b000 b001 b002] (one MPUB record), ADD m002, ADD m003, then STATE and DONE
    records after them: m000 finished, m001 delivered once and returned."""
    engine = store.engine
    publish_each(engine, "t", names("m", 2))
    engine.publish_many("t", names("b", 3))
    publish_each(engine, "t", names("m", 2, start=2))
    store.commit()
    consumer, got = consume(engine, "q", credit=2)
    assert [m.body for m in got] == names("m", 2)
    consumer.set_credit(0)
    consumer.finish(got[0].id)
    consumer.detach()  # m001 back to the front, attempts 1
    store.close()


def batch_span(data_dir: Path) -> files.Span:
    spans = files.add_spans(queue_segment(data_dir))
    assert len(spans) == 5
    return spans[2]


def assert_mixed_log_without_batch(store: Store) -> None:
    got = delivered(store.engine, "q")
    # The batch is lost; m000 stays finished (its DONE came after the damage); m001 keeps its attempt.
    assert [m.body for m in got] == [b"m001", b"m002", b"m003"]
    assert [m.attempts for m in got] == [2, 1, 1]


def test_bad_checksum_in_the_middle_loses_only_that_record(open_store: Callable[..., Store], data_dir: Path,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    build_mixed_log(new_bound_store(open_store))
    span = batch_span(data_dir)
    segment = queue_segment(data_dir)
    size = segment.stat().st_size
    files.flip_byte(segment, span.offset + span.length - 2, 0x01)  # one bit of b002's body

    store = open_store()
    assert_mixed_log_without_batch(store)
    assert_skipped(caplog, segment, "bad checksum")
    assert segment.stat().st_size == size  # damage in the middle is skipped, not cut


@pytest.mark.parametrize("length", [0xFFFF_FFFF, records.MAX_PAYLOAD - 1, 1 << 20, 7, 0],
                         ids=["huge", "max", "past-the-end", "short", "zero"])
def test_bad_length_field_resyncs_on_the_next_record(open_store: Callable[..., Store], data_dir: Path,
                                                      length: int, caplog: pytest.LogCaptureFixture) -> None:
    build_mixed_log(new_bound_store(open_store))
    span = batch_span(data_dir)
    segment = queue_segment(data_dir)
    files.set_length(segment, span, length)

    store = open_store()
    assert_mixed_log_without_batch(store)
    assert_skipped(caplog, segment)


def test_bad_magic_in_the_middle(open_store: Callable[..., Store], data_dir: Path,
                                 caplog: pytest.LogCaptureFixture) -> None:
    build_mixed_log(new_bound_store(open_store))
    span = batch_span(data_dir)
    segment = queue_segment(data_dir)
    files.write_at(segment, span.offset, b"\x00")

    store = open_store()
    assert_mixed_log_without_batch(store)
    assert_skipped(caplog, segment, "bad magic")


def test_damaged_state_and_done_records(open_store: Callable[..., Store], data_dir: Path,
                                        caplog: pytest.LogCaptureFixture) -> None:
    """A lost DONE brings a finished message back (at-least-once); a lost STATE loses only the attempt count."""
    build_mixed_log(new_bound_store(open_store))
    segment = queue_segment(data_dir)
    spans = files.record_spans(segment)
    assert [s.type for s in spans] == [records.ADD] * 5 + [records.STATE, records.DONE]
    files.flip_byte(segment, spans[5].payload_offset)
    files.flip_byte(segment, spans[6].payload_offset)

    store = open_store()
    got = delivered(store.engine, "q")
    assert [m.body for m in got] == [b"m000", b"m001", b"b000", b"b001", b"b002", b"m002", b"m003"]
    assert_skipped(caplog, segment, "bad checksum")


@pytest.mark.parametrize("garbage", [bytes(4096), b"\xa7\x01" + bytes(range(256)) * 3, b"\xa7\x01\xff\xff\xff\x7f"],
                         ids=["zeros", "magic-and-noise", "fake-header"])
def test_garbage_after_the_last_record(open_store: Callable[..., Store], data_dir: Path, garbage: bytes,
                                       caplog: pytest.LogCaptureFixture) -> None:
    store = new_bound_store(open_store)
    publish_each(store.engine, "t", names("m", 5))
    store.close()
    segment = queue_segment(data_dir)
    size = segment.stat().st_size
    files.append(segment, garbage)

    store = open_store()
    assert bodies(store.engine, "q") == names("m", 5)
    if garbage.strip(b"\0"):
        assert_skipped(caplog, segment, "(tail)")
    else:
        assert_nothing_skipped(caplog)  # zeros are what a run that wrote ahead and crashed leaves: no damage
    assert segment.stat().st_size == size

    publish_each(store.engine, "t", names("n", 3))
    store.close()
    caplog.clear()
    store = open_store()
    assert bodies(store.engine, "q") == names("m", 5) + names("n", 3)
    assert_nothing_skipped(caplog)


@pytest.mark.parametrize("body_size", [16, 100_000], ids=["small", "larger-than-half-a-read-chunk"])
def test_damage_among_spilled_messages(open_store: Callable[..., Store], data_dir: Path, body_size: int,
                                       caplog: pytest.LogCaptureFixture) -> None:
    """Spilled messages are read back from the segment after recovery: the reader skips the damage too."""
    store = new_bound_store(open_store, mem_queue_size=3)
    payloads = [name + b"." * (body_size - len(name)) for name in names("m", 12)]
    publish_each(store.engine, "t", payloads)
    store.close()
    segment = queue_segment(data_dir)
    spans = files.add_spans(segment)
    files.flip_byte(segment, spans[7].offset + spans[7].length // 2)  # m007, well inside the spilled part
    files.truncate(segment, spans[11].offset + 12)  # and m011 torn

    store = open_store(mem_queue_size=3)
    queue = store.queue("q")
    assert (len(queue.ready), queue.depth) == (3, 10)
    assert bodies(store.engine, "q") == payloads[:7] + payloads[8:11]
    assert_skipped(caplog, segment, "bad checksum")
    assert_skipped(caplog, segment, "(tail)")


# -- the metadata journal --------------------------------------------------------------------------------


def build_two_queues(open_store: Callable[..., Store]) -> None:
    """First run: q bound to t with m000..m002. Second run (journal compacted at its start): q2 made and
    bound to t (two journal records appended), then m003 to both."""
    store = new_bound_store(open_store)
    publish_each(store.engine, "t", names("m", 3))
    store.close()
    store = open_store()
    store.engine.ensure_queue("q2")
    store.engine.bind("q2", "t")
    publish_each(store.engine, "t", [b"m003"])
    store.close()


def meta_spans(data_dir: Path) -> list[files.Span]:
    spans = files.record_spans(data_dir / files.META_FILE)
    changes = files.meta_changes(data_dir)
    assert [(c["t"], c.get("name"), c.get("topics")) for c in changes[-2:]] == [
        ("queue", "q2", []), ("queue", "q2", ["t"])]
    return spans


@pytest.mark.parametrize("damage", ["torn", "garbage"])
def test_damaged_meta_tail(open_store: Callable[..., Store], data_dir: Path, damage: str,
                           caplog: pytest.LogCaptureFixture) -> None:
    build_two_queues(open_store)
    meta = data_dir / files.META_FILE
    last = meta_spans(data_dir)[-1]
    if damage == "torn":
        files.truncate(meta, last.offset + last.length // 2)  # q2's binding record torn
    else:
        files.append(meta, b"\xa7\x04\x10\x00\x00\x00garbage-garbage!")

    store = open_store()
    assert bodies(store.engine, "q") == names("m", 4)
    q2 = store.queue("q2")
    # Every intact journal record is applied: q2 exists; its binding only if that record survived.
    assert q2.topics == ([] if damage == "torn" else ["t"])
    assert bodies(store.engine, "q2") == [b"m003"]
    assert_skipped(caplog, meta)
    store.close()

    caplog.clear()
    store = open_store()  # the journal was rewritten whole at the start
    assert_nothing_skipped(caplog)
    assert bodies(store.engine, "q") == names("m", 4)


def test_corrupt_meta_record_in_the_middle_keeps_later_records(open_store: Callable[..., Store], data_dir: Path,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    build_two_queues(open_store)
    meta = data_dir / files.META_FILE
    spans = meta_spans(data_dir)
    files.flip_byte(meta, spans[-2].payload_offset + 3)  # q2's first record; the binding record follows

    store = open_store()
    q2 = store.queue("q2")
    assert q2.topics == ["t"]
    assert bodies(store.engine, "q2") == [b"m003"]
    assert bodies(store.engine, "q") == names("m", 4)
    assert_skipped(caplog, meta, "bad checksum")


def test_log_dir_orphaned_by_journal_damage_is_reported(open_store: Callable[..., Store], data_dir: Path,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    """One bit flip in the compacted journal loses the queue's only record: its intact log dir is then
    unknown. Whatever recovery does with it, it must say so (here the dir is deleted without a word)."""
    store = new_bound_store(open_store)
    publish_each(store.engine, "t", names("m", 3))
    store.close()
    open_store().close()  # compacts the journal: one record per queue
    meta = data_dir / files.META_FILE
    queue_dir = files.queue_dir(data_dir, "q")
    (span,) = [s for s, c in zip(files.record_spans(meta), files.meta_changes(data_dir), strict=True)
               if c.get("t") == "queue"]
    files.flip_byte(meta, span.payload_offset + 5)

    store = open_store()
    assert_skipped(caplog, meta, "bad checksum")
    assert "q" not in store.engine.queues
    assert [text for text in storage_warnings(caplog) if str(queue_dir) in text], (
        f"{queue_dir} (3 intact messages) dropped without a report; exists now: {queue_dir.exists()}")


# -- what a restart must bring back exactly ---------------------------------------------------------------


def test_attempts_survive_a_restart(open_store: Callable[..., Store]) -> None:
    store = new_bound_store(open_store)
    publish_each(store.engine, "t", [b"x", b"y"])
    got = consume(store.engine, "q", credit=1)[1]
    assert [(m.body, m.attempts) for m in got] == [(b"x", 1)]
    store.close()  # x in flight: a crash, nobody returned it

    store = open_store()
    queue = store.queue("q")
    assert [(m.body, m.attempts) for m in queue.ready] == [(b"x", 1), (b"y", 0)]
    got = consume(store.engine, "q", credit=1)[1]
    assert [(m.body, m.attempts) for m in got] == [(b"x", 2)]


@pytest.mark.parametrize("how", ["requeue", "deferred-publish"])
def test_deferred_message_keeps_its_due_time(open_store: Callable[..., Store], clock: ManualClock,
                                             how: str) -> None:
    store = new_bound_store(open_store)
    if how == "requeue":
        store.engine.publish("t", b"later")
        consumer, got = consume(store.engine, "q", credit=1)
        consumer.requeue(got[0].id, delay=30.0)
        expected_attempts = 2
    else:
        store.engine.publish("t", b"later", delay=30.0)
        expected_attempts = 1
    store.close()
    clock.advance(10.0)  # down for 10 s: 20 s to go

    store = open_store()
    queue = store.queue("q")
    assert not queue.ready
    assert [m.body for _, _, m in queue.deferred] == [b"later"]
    consumer, got = consume(store.engine, "q", credit=1)
    clock.advance(19.0)
    store.engine.run_timers()
    assert got == [] and queue.deferred_count == 1
    clock.advance(1.5)
    store.engine.run_timers()
    assert [(m.body, m.attempts) for m in got] == [(b"later", expected_attempts)]


def test_deferred_message_due_while_down_comes_back_ready(open_store: Callable[..., Store],
                                                          clock: ManualClock) -> None:
    store = new_bound_store(open_store)
    store.engine.publish("t", b"later", delay=30.0)
    store.close()
    clock.advance(31.0)

    store = open_store()
    queue = store.queue("q")
    assert [m.body for m in queue.ready] == [b"later"] and queue.deferred_count == 0


def test_ids_are_never_reused_after_a_restart(open_store: Callable[..., Store]) -> None:
    # ManualClock's wall time stands still, so a fresh IdSource starts at the same id every time:
    # only the store's high-water mark keeps a restart above what was issued.
    store = new_bound_store(open_store)
    issued = [store.engine.publish("t", b"a"), store.engine.publish_many("t", [b"b", b"c"]) + 1]
    store.close()
    store = open_store()
    assert store.engine.ids.next() > max(issued)
    # Far past the reserve written at start (2**20 ids): the store must extend its mark in time.
    store.engine.ids.reserve(3 << 20)
    issued.append(store.engine.publish("t", b"d"))
    store.close()
    store = open_store()
    assert store.engine.ids.next() > max(issued)


def test_ephemeral_topics_and_queues_leave_no_files(open_store: Callable[..., Store], data_dir: Path) -> None:
    store = open_store()
    engine = store.engine
    engine.ensure_queue("e#ephemeral/c#ephemeral", ephemeral=True)
    engine.bind("e#ephemeral/c#ephemeral", "e#ephemeral", ephemeral_topic=True)
    engine.ensure_queue("t/c#ephemeral", ephemeral=True)
    engine.bind("t/c#ephemeral", "t")  # a durable topic feeding only an ephemeral channel
    publish_each(engine, "e#ephemeral", [b"e1"])
    publish_each(engine, "t", [b"t1"])
    store.close()
    assert files.all_data_files(data_dir) == [data_dir / "LOCK", data_dir / files.META_FILE]
    assert "ephemeral" not in (data_dir / files.META_FILE).read_text(errors="replace")
    assert not [path for path in data_dir.iterdir() if path.is_dir()]

    store = open_store()
    assert set(store.engine.topics) == {"t"} and not store.engine.queues


def test_ephemeral_topic_stays_ephemeral_after_a_restart(open_store: Callable[..., Store], data_dir: Path) -> None:
    """A durable channel on an ephemeral topic (NSQ allows it): the channel's log is kept, but the topic must not
    come back as a durable topic (nsqd never persists an ephemeral topic; it goes with its last channel)."""
    store = open_store()
    engine = store.engine
    engine.ensure_topic("x#ephemeral", ephemeral=True)
    engine.ensure_queue("x#ephemeral/c")
    engine.bind("x#ephemeral/c", "x#ephemeral", ephemeral_topic=True)
    store.close()

    store = open_store()
    topic = store.engine.topics.get("x#ephemeral")
    assert topic is None or (topic.ephemeral and not topic.durable), "the ephemeral topic came back durable"
    store.close()
    assert not [c for c in files.meta_changes(data_dir) if c.get("t") == "topic" and c["name"] == "x#ephemeral"]


def test_pause_state_bindings_and_options_come_back(open_store: Callable[..., Store]) -> None:
    store = open_store()
    engine = store.engine
    engine.ensure_queue("q", options={"max_length": 5})
    engine.set_bindings("q", ["t1", "t2", "t3"])
    engine.unbind("q", "t3")
    engine.ensure_queue("r", auto_delete=120.0)
    engine.bind("r", "t1")
    store.queue("q").set_paused(True)
    engine.topics["t2"].set_paused(True)
    store.close()

    store = open_store()
    engine = store.engine
    assert set(engine.topics) == {"t1", "t2", "t3"}
    q, r = store.queue("q"), store.queue("r")
    assert (q.topics, q.paused, q.options, q.auto_delete) == (["t1", "t2"], True, {"max_length": 5}, None)
    assert (r.topics, r.paused, r.auto_delete) == (["t1"], False, 120.0)
    assert [engine.topics[name].paused for name in ("t1", "t2", "t3")] == [False, True, False]
    assert [x.name for x in engine.topics["t1"].queues] == ["q", "r"]


def test_a_queue_owner_and_dead_letter_topic_come_back(open_store: Callable[..., Store]) -> None:
    store = open_store()
    engine = store.engine
    engine.ensure_topic("t")
    ensure_channel(engine, "t", "c")  # NSQ's channel: owned by "t", dead letters to "t.c.dead"
    engine.ensure_queue("jobs", owner_topic="t", options={"max_attempts": 2})
    engine.bind("jobs", "t")
    engine.ensure_queue("t/other")  # named like a channel, owned by nobody
    engine.bind("t/other", "t")
    publish_each(engine, "t", [b"a"])
    store.close()

    store = open_store()
    engine = store.engine
    channel, jobs, other = store.queue("t/c"), store.queue("jobs"), store.queue("t/other")
    assert [(q.owner_topic, q.owner_topic_recorded, q.dead_letter_topic) for q in (channel, jobs, other)] == [
        ("t", True, "t.c.dead"), ("t", True, "jobs.dead"), (None, True, "t/other.dead")]
    assert (channel.options, jobs.options, other.options) == (
        {DEAD_LETTER_TOPIC_OPTION: "t.c.dead", MADE_BY_OPTION: "nsq"}, {"max_attempts": 2}, {})
    assert engine.delete_topic("t")
    assert other.topics == [] and set(engine.queues) == {"t/other"}
    store.close()

    store = open_store()
    assert set(store.engine.queues) == {"t/other"} and store.queue("t/other").topics == []
    assert "t" not in store.engine.topics


def _forget_owners(data_dir: Path) -> None:
    """Rewrite the journal as stores wrote it before queue records kept an owner (and before NSQ
    channels named their dead-letter topic): the same records without those two keys."""
    changes = files.meta_changes(data_dir)
    for change in changes:
        if change.get("t") == "queue":
            change["options"].pop(OWNER_RECORD_KEY)
            change["options"].pop(DEAD_LETTER_TOPIC_OPTION, None)
    (data_dir / files.META_FILE).write_bytes(b"".join(records.encode_meta(change) for change in changes))


def test_nsq_channels_of_a_store_without_owners_are_claimed_once(open_store: Callable[..., Store],
                                                                  data_dir: Path) -> None:
    store = open_store()
    engine = store.engine
    engine.ensure_topic("t")
    ensure_channel(engine, "t", "c")
    engine.ensure_queue("q")  # another protocol's queue bound to the topic
    engine.bind("q", "t")
    engine.ensure_queue("Foo")
    engine.bind("Foo", "Foo")
    publish_each(engine, "t", [b"kept"])
    store.close()
    _forget_owners(data_dir)

    store = open_store()
    engine = store.engine
    channel = store.queue("t/c")
    owners = [(store.queue(name).owner_topic, store.queue(name).owner_topic_recorded) for name in ("t/c", "q", "Foo")]
    assert owners == [(None, False), (None, False), (None, False)]
    assert channel.dead_letter_topic == "t/c.dead"
    NSQServer(engine, ServerLimits())  # the gateway makes it right after the restore
    assert (channel.owner_topic, channel.owner_topic_recorded, channel.dead_letter_topic) == ("t", True, "t.c.dead")
    assert [(store.queue(name).owner_topic, store.queue(name).owner_topic_recorded) for name in ("q", "Foo")] == [
        (None, False), (None, False)]
    assert bodies(engine, "t/c") == [b"kept"] and bodies(engine, "q") == [b"kept"]
    # Made now, unowned on purpose: not taken for a channel at the next start.
    engine.ensure_queue("t/late")
    engine.bind("t/late", "t")
    store.close()

    store = open_store()
    engine = store.engine
    NSQServer(engine, ServerLimits())
    assert [(store.queue(name).owner_topic, store.queue(name).dead_letter_topic) for name in ("t/c", "t/late")] == [
        ("t", "t.c.dead"), (None, "t/late.dead")]
    assert engine.delete_topic("t")
    assert set(engine.queues) == {"q", "Foo", "t/late"}
    assert store.queue("q").topics == [] and store.queue("t/late").topics == []


def test_deleted_queue_and_topic_do_not_come_back(open_store: Callable[..., Store], data_dir: Path,
                                                   tmp_path: Path) -> None:
    store = new_bound_store(open_store)
    store.engine.ensure_topic("gone")
    publish_each(store.engine, "gone", [b"g"])  # a backlog: no queue bound
    publish_each(store.engine, "t", [b"old"])
    store.commit()
    queue_dir, topic_dir = files.queue_dir(data_dir, "q"), files.topic_dir(data_dir, "gone")
    assert files.segments(queue_dir) and files.segments(topic_dir)
    kept = tmp_path / "kept"
    shutil.copytree(queue_dir, kept)
    assert store.engine.delete_queue("q") and store.engine.delete_topic("gone")
    store.commit()
    assert not queue_dir.exists() and not topic_dir.exists()
    store.close()
    shutil.copytree(kept, queue_dir)  # as if a crash came before the directory was removed

    store = open_store()
    assert "q" not in store.engine.queues and "gone" not in store.engine.topics
    assert not queue_dir.exists()
    store.engine.ensure_queue("q")  # the same name again: a new, empty queue
    store.engine.bind("q", "t")
    assert bodies(store.engine, "q") == []
    publish_each(store.engine, "t", [b"new"])
    store.close()
    store = open_store()
    assert bodies(store.engine, "q") == [b"new"]
    assert files.queue_dir(data_dir, "q") != queue_dir


def test_empty_drops_messages_for_good(open_store: Callable[..., Store]) -> None:
    store = new_bound_store(open_store, mem_queue_size=3)
    engine = store.engine
    publish_each(engine, "t", names("m", 10))  # 3 in memory, 7 spilled
    engine.ensure_topic("backlog")
    publish_each(engine, "backlog", names("b", 10))
    store.commit()
    store.queue("q").empty()
    engine.topics["backlog"].empty()
    assert store.queue("q").depth == 0 and engine.topics["backlog"].depth == 0
    publish_each(engine, "t", [b"after"])
    publish_each(engine, "backlog", [b"b-after"])
    store.close()

    store = open_store(mem_queue_size=3)
    assert bodies(store.engine, "q") == [b"after"]
    assert store.engine.topics["backlog"].depth == 1
    store.engine.ensure_queue("drain")
    store.engine.bind("drain", "backlog")
    store.engine.run_timers()
    assert bodies(store.engine, "drain") == [b"b-after"]


def test_empty_with_a_consumer_delivers_no_emptied_message(open_store: Callable[..., Store]) -> None:
    """nsqd's channel empty with a subscribed consumer: nothing emptied may be delivered afterwards."""
    store = new_bound_store(open_store, mem_queue_size=3)
    engine = store.engine
    publish_each(engine, "t", names("m", 10))  # 3 in memory, 7 spilled
    store.commit()
    consumer, got = consume(engine, "q", credit=2)
    assert [m.body for m in got] == names("m", 2)
    store.queue("q").empty()  # drops the 2 in flight; the consumer's credit is free again
    assert [m.body for m in got] == names("m", 2), "emptied (spilled) messages were delivered after empty()"
    assert consumer.in_flight == {} and store.queue("q").depth == 0
    store.close()
    store = open_store(mem_queue_size=3)
    assert bodies(store.engine, "q") == []


# -- spilling past --mem-queue-size --------------------------------------------------------------------------


@pytest.mark.parametrize("attach", ["after-commit", "before-commit"])
def test_spilled_queue_delivers_everything_in_order(open_store: Callable[..., Store], attach: str) -> None:
    store = new_bound_store(open_store, mem_queue_size=5)
    payloads = names("m", 100)
    for payload in payloads:  # no commit in between: "before-commit" attaches before any of it is written
        store.engine.publish("t", payload)
    queue = store.queue("q")
    assert (len(queue.ready), queue.depth) == (5, 100)
    if attach == "before-commit":
        got = consume(store.engine, "q", credit=1000)[1]
        assert [m.body for m in got] == payloads[:5]  # the rest is not on disk yet: it waits
        store.commit()  # ... and comes once the commit wrote it (`on_readable`)
    else:
        store.commit()  # spilled copies can be read back once they are on disk
        got = consume(store.engine, "q", credit=1000)[1]
    assert [m.body for m in got] == payloads
    assert queue.depth == 0


def test_a_big_spilled_record_is_read_from_disk_once_across_refills(open_store: Callable[..., Store],
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """One MPUB-sized record of 20,000 copies read back 100 at a time (the memory limit): each refill
    goes on in the record it stopped in, in order, passing over finished copies, without reading it again."""
    store = new_bound_store(open_store, mem_queue_size=100)
    payloads = [b"big-%05d-" % number + b"x" * 200 for number in range(20_000)]
    store.engine.publish_many("t", payloads)  # one ADD record, about 4.5 MB
    store.commit()
    consumer, got = consume(store.engine, "q", credit=300)
    finished = set(range(0, 300, 3))
    for number in sorted(finished):
        consumer.finish(got[number].id, refill=False)
    store.close()  # the rest of the 300 in flight come back, attempts 1

    store = open_store(mem_queue_size=100)
    read_back = 0
    pread = os.pread

    def counting_pread(fd: int, length: int, offset: int) -> bytes:
        nonlocal read_back
        data = pread(fd, length, offset)
        read_back += len(data)
        return data

    monkeypatch.setattr(os, "pread", counting_pread)
    got = delivered(store.engine, "q")
    assert [m.body for m in got] == [p for number, p in enumerate(payloads) if number not in finished]
    record_size = sum(len(p) for p in payloads)
    assert read_back < 2 * record_size, f"{read_back} bytes read back for a {record_size}-byte record"


def test_restore_spilled_queue_with_finished_messages(open_store: Callable[..., Store]) -> None:
    store = new_bound_store(open_store, mem_queue_size=5)
    payloads = names("m", 100)
    publish_each(store.engine, "t", payloads)
    store.commit()
    consumer, got = consume(store.engine, "q", credit=10)
    finished = {0, 2, 3, 5, 6, 8, 9}
    consumer.set_credit(0)
    for number in finished:
        consumer.finish(got[number].id)
    consumer.detach()  # 1, 4, 7 back to the front, attempts 1
    store.close()

    store = open_store(mem_queue_size=5)
    queue = store.queue("q")
    assert queue.depth == 93
    assert len(queue.ready) <= 10  # the rest stays on disk
    got = delivered(store.engine, "q")
    assert [m.body for m in got] == [p for number, p in enumerate(payloads) if number not in finished]
    assert [m.attempts for m in got[:3]] == [2, 2, 2] and {m.attempts for m in got[3:]} == {1}


def test_restore_with_scattered_finished_messages(open_store: Callable[..., Store]) -> None:
    store = new_bound_store(open_store, mem_queue_size=5)
    payloads = names("m", 100)
    publish_each(store.engine, "t", payloads)
    store.commit()
    consumer, got = consume(store.engine, "q", credit=100)
    assert len(got) == 100
    finished = {2, 10, 33, 50, 51, 77, 99}
    for number in finished:
        consumer.finish(got[number].id, refill=False)
    store.close()  # a crash with 93 in flight

    store = open_store(mem_queue_size=5)
    assert store.queue("q").depth == 93
    got = delivered(store.engine, "q")
    assert [m.body for m in got] == [p for number, p in enumerate(payloads) if number not in finished]
    assert {m.attempts for m in got} == {2}


def test_restore_spilled_topic_backlog(open_store: Callable[..., Store]) -> None:
    store = open_store(mem_queue_size=5)
    engine = store.engine
    engine.ensure_topic("t")
    publish_each(engine, "t", names("m", 40))
    engine.publish_many("t", names("b", 60))
    assert engine.topics["t"].depth == 100
    store.close()

    store = open_store(mem_queue_size=5)
    engine = store.engine
    assert engine.topics["t"].depth == 100
    engine.ensure_queue("q")
    engine.bind("q", "t")
    for _ in range(10):  # the backlog moves a batch per timer turn; each turn's reads need its commit
        store.commit()
        engine.run_timers()
    assert engine.topics["t"].depth == 0
    store.close()
    store = open_store(mem_queue_size=5)
    assert bodies(store.engine, "q") == names("m", 40) + names("b", 60)


def test_spilled_read_during_a_commit_skips_nothing(open_store: Callable[..., Store],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A consumer reads spilled messages while a commit is running (the committer's thread) and the
    log has rolled to a new segment meanwhile: the reader must wait for the commit, not skip ahead."""
    monkeypatch.setattr(disk_storage, "SEGMENT_BYTES", 300)  # a roll every few records, not every 64 MiB
    store = new_bound_store(open_store, mem_queue_size=2)
    engine = store.engine
    publish_each(engine, "t", names("m", 10))
    job, written, callbacks = store.storage.prepare()  # the commit is taken ...
    publish_each(engine, "t", names("m", 10, start=10))  # ... and the log rolls on while it runs
    got = consume(engine, "q", credit=100)[1]
    store.writer.run(job)
    store.storage.complete(job, written, callbacks)
    store.commit()
    assert [m.body for m in got] == names("m", 20)


def open_files_under(directory: Path) -> list[str]:
    found = []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/self/fd/{fd}")
            if target.startswith(f"{directory}/"):
                found.append(target)
    return found


def test_close_releases_every_file_of_the_data_dir(open_store: Callable[..., Store], data_dir: Path) -> None:
    """After `close()` the dir can be opened again (or unmounted) with nothing of the old store still open."""
    store = new_bound_store(open_store, mem_queue_size=2)
    publish_each(store.engine, "t", names("m", 10))
    store.commit()
    consume(store.engine, "q", credit=5)  # reads spilled copies back: the log opens its segment to read
    store.close()
    assert open_files_under(data_dir) == []


def test_disk_full_commit_fails_cleanly_and_is_retried(tmp_path: Path, clock: ManualClock) -> None:
    """A commit on a full disk: the sync callbacks get the error, no partial record stays behind, later changes
    (a FIN) wait with it, and the next commit after space returns writes it all."""
    with files.small_tmpfs(tmp_path / "tmpfs", "1m") as mount:
        data_dir, filler = mount / "data", mount / "filler"
        store = Store(data_dir, clock, mem_queue_size=3)
        try:
            engine, storage = store.engine, store.storage
            engine.ensure_queue("q")
            engine.bind("q", "t")
            store.commit()
            files.fill_disk(filler, 16 * 1024)
            stored: list[bytes] = []
            outcomes: list[OSError | None] = []
            for number in range(200):
                body = b"m%03d-" % number + bytes(900)
                engine.publish("t", body)
                storage.sync(outcomes.append)
                job, written, callbacks = storage.prepare()
                store.writer.run(job)
                storage.complete(job, written, callbacks)
                if job.error is not None:
                    break
                stored.append(body)
            else:
                pytest.fail("200 commits on a full disk and none failed")
            failed = body
            assert stored, "the disk was full before the first publish"
            assert outcomes[:-1] == [None] * len(stored)
            assert isinstance(outcomes[-1], OSError) and outcomes[-1].errno == errno.ENOSPC
            assert storage.failure == "No space left on device"
            for path in files.all_data_files(data_dir):
                if path.suffix in (".seg", ".log"):
                    files.record_spans(path)  # whole records only: the failed append was cut back

            consumer, got = consume(engine, "q", credit=2)
            consumer.set_credit(0)
            for message in got:
                consumer.finish(message.id)
            job, written, callbacks = storage.prepare()
            assert store.writer.run(job).error is not None  # still full: the FIN's DONE waits too
            storage.complete(job, written, callbacks)

            filler.unlink()
            store.commit()
            assert storage.failure is None
        finally:
            store.close()
        store = Store(data_dir, clock, mem_queue_size=3)
        try:
            # The publish whose commit failed is kept and written by the retry (at-least-once).
            assert bodies(store.engine, "q") == [*stored[2:], failed]
        finally:
            store.close()


# -- process level: a full disk --------------------------------------------------------------------------------

# Left free next to the filler file: room for a few dozen publishes before the disk is full.
HEADROOM = 48 * 1024
BODY_SIZE = 1000
RECOVERY_DEADLINE_S = 10.0


def http_request(gateway: GatewayProcess, method: str, target: str, body: bytes | None = None) -> tuple[int, bytes]:
    host, port = gateway.host_port("nsq-http")
    connection = http.client.HTTPConnection(host, port, timeout=10)
    try:
        connection.request(method, target, body=body)
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


def body_for(number: int) -> bytes:
    head = b"full-%05d-" % number
    return head + bytes((number + i) % 251 for i in range(BODY_SIZE - len(head)))  # exact bytes, checked later


def publish_one(address: str, topic: str, body: bytes) -> bool:
    """PUB on a new connection: True on OK; on E_PUB_FAILED (fatal) False, once the server closed it."""
    with RawClient(address) as conn:
        conn.send(client.pub(topic, body))
        frame = conn.read_frame()
        if frame.is_response:
            assert frame.data == b"OK", frame
            return True
        assert frame.is_error and frame.data.startswith(b"E_PUB_FAILED PUB failed "), frame
        conn.expect_closed()
        return False


def drain_over_nsq(address: str, topic: str, channel: str, wanted: set[bytes],
                   timeout: float = 10.0) -> list[client.Message]:
    """SUB and collect deliveries (FIN each) until every body of `wanted` has come, or fail."""
    seen: list[client.Message] = []
    deadline = time.monotonic() + timeout
    with RawClient(address) as conn:
        conn.send(client.sub(topic, channel))
        conn.expect_response(b"OK")
        conn.send(client.rdy(100))
        while not wanted <= {m.body for m in seen}:
            remaining = deadline - time.monotonic()
            assert remaining > 0, f"{len(wanted - {m.body for m in seen})} acknowledged bodies never came back"
            message = conn.read_message(timeout=remaining)
            seen.append(message)
            conn.send(client.fin(message.msg_id))
        conn.expect_nothing(0.2)  # nothing after the last one either (no phantom, no duplicate)
    return seen


def test_disk_full_fails_publishes_and_recovers(tmp_path: Path) -> None:
    topic, channel = "full", "c"
    with files.small_tmpfs(tmp_path / "tmpfs", "2m") as mount:
        data_dir, filler = mount / "data", mount / "filler"
        acknowledged: list[bytes] = []
        refused: list[bytes] = []  # at-least-once: these may or may not come back
        with running_gateway("--fsync", "always", data_dir=data_dir) as gateway:
            assert http_request(gateway, "POST", f"/topic/create?topic={topic}")[0] == 200
            assert http_request(gateway, "POST", f"/channel/create?topic={topic}&channel={channel}")[0] == 200
            files.fill_disk(filler, HEADROOM)
            with RawClient(gateway.nsq_tcp) as conn:
                for number in range(10 * HEADROOM // BODY_SIZE):
                    body = body_for(number)
                    conn.send(client.pub(topic, body))
                    frame = conn.read_frame()
                    if frame.is_error:
                        refused.append(body)
                        assert frame.data.startswith(b"E_PUB_FAILED PUB failed "), frame
                        assert b"No space left on device" in frame.data, frame
                        conn.expect_closed()  # fatal, like nsqd
                        break
                    assert (frame.frame_type, frame.data) == (0, b"OK"), frame
                    acknowledged.append(body)
                else:
                    pytest.fail(f"{len(acknowledged)} publishes on a full disk and none failed")
            assert acknowledged, "the disk was full before the first publish: HEADROOM too small"

            # While the disk is full: every kind of publish is refused.
            assert not publish_one(gateway.nsq_tcp, topic, b"refused-pub")
            refused.append(b"refused-pub")
            with RawClient(gateway.nsq_tcp) as conn:
                conn.send(client.mpub(topic, [b"refused-mpub-1", b"refused-mpub-2"]))
                frame = conn.read_frame()
                assert frame.is_error and frame.data.startswith(b"E_MPUB_FAILED MPUB failed "), frame
                conn.expect_closed()
            refused += [b"refused-mpub-1", b"refused-mpub-2"]
            assert http_request(gateway, "POST", f"/pub?topic={topic}", b"refused-http") == (
                503, b'{"message":"EXITING"}')
            refused.append(b"refused-http")

            filler.unlink()  # space returns: the store's retry succeeds, publishes work again
            deadline = time.monotonic() + RECOVERY_DEADLINE_S
            attempt = 0
            while True:
                probe = b"probe-%d" % attempt
                if publish_one(gateway.nsq_tcp, topic, probe):
                    acknowledged.append(probe)
                    break
                refused.append(probe)
                assert time.monotonic() < deadline, "publishes still fail after the disk has room again"
                attempt += 1
                time.sleep(0.05)
            assert gateway.stop(signal.SIGTERM) == 0
            log_text = "\n".join(gateway.log_lines)
            assert "storage write failed: No space left on device" in log_text
            assert "storage writes work again" in log_text

        with running_gateway("--fsync", "always", data_dir=data_dir) as gateway:
            got = drain_over_nsq(gateway.nsq_tcp, topic, channel, set(acknowledged))
            log_text = "\n".join(gateway.log_lines)
        bodies_seen = [m.body for m in got]
        assert len(bodies_seen) == len(set(bodies_seen)), "a message came back twice"
        assert set(bodies_seen) <= set(acknowledged) | set(refused), "a body that was never published (corrupted?)"
        # In publish order: the refused ones, if stored at all, only where they were sent.
        assert [b for b in bodies_seen if b in set(acknowledged)] == acknowledged
        assert "skipped" not in log_text, log_text  # nothing stored was damaged


# -- process level: a graceful shutdown ------------------------------------------------------------------------


def channel_stats(gateway: GatewayProcess, topic: str) -> dict[str, dict]:
    status, body = http_request(gateway, "GET", f"/stats?format=json&topic={topic}")
    assert status == 200, body
    (topic_stats,) = json.loads(body)["topics"]
    return {"": topic_stats} | {c["channel_name"]: c for c in topic_stats["channels"]}


def test_sigterm_keeps_in_flight_messages_and_pause_state(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    topic = "graceful"
    with running_gateway(data_dir=data_dir) as gateway:
        assert http_request(gateway, "POST", f"/topic/create?topic={topic}")[0] == 200
        for channel in ("work", "held"):
            assert http_request(gateway, "POST", f"/channel/create?topic={topic}&channel={channel}")[0] == 200
        assert http_request(gateway, "POST", f"/channel/pause?topic={topic}&channel=held")[0] == 200
        assert http_request(gateway, "POST", "/topic/create?topic=paused_topic")[0] == 200
        assert http_request(gateway, "POST", "/topic/pause?topic=paused_topic")[0] == 200
        with RawClient(gateway.nsq_tcp) as publisher:
            for body in (b"g0", b"g1", b"g2"):
                publisher.send(client.pub(topic, body))
                publisher.expect_response(b"OK")
        with RawClient(gateway.nsq_tcp) as conn:
            conn.send(client.sub(topic, "work"))
            conn.expect_response(b"OK")
            conn.send(client.rdy(1))
            message = conn.read_message()
            assert (message.body, message.attempts) == (b"g0", 1)
            # SIGTERM with g0 in flight (not FINed): the session is closed and g0 goes back.
            assert gateway.stop(signal.SIGTERM) == 0

    with running_gateway(data_dir=data_dir) as gateway:
        stats = channel_stats(gateway, topic)
        assert set(stats) == {"", "work", "held"}
        assert (stats["work"]["paused"], stats["held"]["paused"]) == (False, True)
        assert (stats["work"]["depth"], stats["held"]["depth"]) == (3, 3)
        assert channel_stats(gateway, "paused_topic")[""]["paused"] is True
        with RawClient(gateway.nsq_tcp) as conn:
            conn.send(client.sub(topic, "work"))
            conn.expect_response(b"OK")
            conn.send(client.rdy(10))
            got = [conn.read_message() for _ in range(3)]
            assert [(m.body, m.attempts) for m in got] == [(b"g0", 2), (b"g1", 1), (b"g2", 1)]
            conn.expect_nothing(0.2)
        with RawClient(gateway.nsq_tcp) as conn:
            conn.send(client.sub(topic, "held"))
            conn.expect_response(b"OK")
            conn.send(client.rdy(10))
            conn.expect_nothing(0.3)  # still paused: nothing delivered


def test_a_gateway_on_a_data_dir_without_owners_deletes_the_nsq_channels_with_their_topic(
        open_store: Callable[..., Store], data_dir: Path) -> None:
    store = open_store()
    engine = store.engine
    engine.ensure_topic("legacy")
    ensure_channel(engine, "legacy", "c")
    engine.ensure_queue("q")  # another protocol's queue bound to the topic
    engine.bind("q", "legacy")
    publish_each(engine, "legacy", [b"old"])
    store.close()
    _forget_owners(data_dir)

    with running_gateway(data_dir=data_dir) as gateway:
        stats = channel_stats(gateway, "legacy")
        assert set(stats) == {"", "c", "q"} and (stats["c"]["depth"], stats["q"]["depth"]) == (1, 1)
        assert http_request(gateway, "POST", "/topic/delete?topic=legacy") == (200, b"")
        assert gateway.stop(signal.SIGTERM) == 0

    store = open_store()
    assert set(store.engine.queues) == {"q"} and "legacy" not in store.engine.topics
    assert store.queue("q").topics == [] and bodies(store.engine, "q") == [b"old"]


def test_gateway_starts_on_damaged_files(tmp_path: Path) -> None:
    """Damage written into a real gateway's files: it starts, says what it skipped, delivers every intact message."""
    data_dir = tmp_path / "data"
    topic = "damaged"
    payloads = [b"d%02d" % number for number in range(10)]
    with running_gateway(data_dir=data_dir) as gateway:
        assert http_request(gateway, "POST", f"/topic/create?topic={topic}")[0] == 200
        assert http_request(gateway, "POST", f"/channel/create?topic={topic}&channel=c")[0] == 200
        with RawClient(gateway.nsq_tcp) as publisher:
            for body in payloads:
                publisher.send(client.pub(topic, body))
                publisher.expect_response(b"OK")
        assert gateway.stop(signal.SIGTERM) == 0
    segment = files.last_segment(files.queue_dir(data_dir, f"{topic}/c"))
    spans = files.add_spans(segment)
    assert len(spans) == len(payloads)
    files.flip_byte(segment, spans[4].end - 1)  # d04's body: bad checksum in the middle
    files.truncate(segment, spans[9].offset + 7)  # d09 torn
    files.append(data_dir / files.META_FILE, b"\xa7\x04torn")

    with running_gateway(data_dir=data_dir) as gateway:
        got = drain_over_nsq(gateway.nsq_tcp, topic, "c", set(payloads) - {b"d04", b"d09"})
        log_text = "\n".join(gateway.log_lines)
    assert [m.body for m in got] == payloads[:4] + payloads[5:9]
    assert f"{segment}: skipped" in log_text and "(bad checksum)" in log_text and "(tail)" in log_text, log_text
    assert f"{data_dir / files.META_FILE}: skipped" in log_text, log_text


def test_a_copy_added_and_gone_in_one_turn_writes_nothing(open_store: Callable[..., Store]) -> None:
    """Auto-ack pass-through: the ADD is still the last pending record when the copy is delivered."""
    store = open_store()
    engine = store.engine
    engine.ensure_queue("q")
    engine.bind("q", "t")
    engine.publish("t", b"stored before")
    store.commit()
    got: list[Message] = []
    consumer = engine.attach("q", got.append, credit=1_000_000, auto_ack=True)
    store.commit()  # the delivery of "stored before" (a DONE)
    engine.publish("t", b"passing through")
    job, written, callbacks = store.storage.prepare()
    assert [m.body for m in got] == [b"stored before", b"passing through"]
    assert job.appends == []  # nothing to write, so no fdatasync either
    store.storage.complete(job, written, callbacks)
    consumer.set_credit(0)
    engine.publish("t", b"stays")
    engine.publish("t", b"stays too")
    job, written, callbacks = store.storage.prepare()
    assert len(job.appends) == 1
    store.writer.run(job)
    store.storage.complete(job, written, callbacks)
    store.close()
    store = open_store()
    assert [m.body for m in store.queue("q").ready] == [b"stays", b"stays too"]


def test_a_batch_delivered_in_part_keeps_its_record_and_the_done_of_the_part(open_store: Callable[..., Store]) -> None:
    """A batch's ADD is cancelled only when every copy is gone; else the held-back DONEs are written."""
    store = open_store()
    engine = store.engine
    engine.ensure_queue("q")
    engine.bind("q", "t")
    got: list[Message] = []
    consumer = engine.attach("q", got.append, credit=2, auto_ack=True)  # room for 2 of the 3
    engine.publish_many("t", [b"a", b"b", b"c"], each_headers=[{"n": "1"}, {"n": "2"}, {"n": "3"}])
    assert [m.body for m in got] == [b"a", b"b"]
    store.commit()
    consumer.release(2)  # written out: room again, "c" goes too (a later turn: its DONE is written)
    assert [m.body for m in got] == [b"a", b"b", b"c"]
    consumer.set_credit(0)
    engine.publish_many("t", [b"d", b"e"], each_headers=[{"n": "4"}, {"n": "5"}])
    store.close()
    store = open_store()
    assert [(m.body, m.headers) for m in store.queue("q").ready] == [(b"d", {"n": "4"}), (b"e", {"n": "5"})]


def test_a_batch_delivered_whole_in_its_turn_writes_nothing(open_store: Callable[..., Store]) -> None:
    store = open_store()
    engine = store.engine
    engine.ensure_queue("q")
    engine.bind("q", "t")
    store.commit()
    got: list[Message] = []
    engine.attach("q", got.append, credit=100, auto_ack=True)
    engine.publish_many("t", [b"a", b"b", b"c"], each_headers=[{"n": "1"}, {"n": "2"}, {"n": "3"}])
    job, written, callbacks = store.storage.prepare()
    assert [m.body for m in got] == [b"a", b"b", b"c"] and job.appends == []
    store.storage.complete(job, written, callbacks)


def _queue_records(job: object, queue_dir_name: str) -> list[tuple[int, list[bytes]]]:
    """(type, bodies of an ADD) of every record a commit job appends to a queue's log."""
    found = []
    for path, data in job.appends:  # type: ignore[attr-defined]
        if path.parent.name.startswith("q"):
            for _offset, record_type, payload in records.scan(data):
                bodies = [entry.body for entry in records.decode_add(payload)] if record_type == records.ADD else []
                found.append((record_type, bodies))
    return found


def test_a_copy_an_auto_ack_consumer_takes_at_once_is_never_appended(open_store: Callable[..., Store]) -> None:
    """Put in an empty queue on an auto-ack consumer's turn, a copy leaves in the same call: it is not appended
    (`Queue._auto_acked_at_once`), where a manual-ack consumer's turn keeps the ADD and its STATE."""
    store = new_bound_store(open_store)
    engine = store.engine
    store.commit()
    log = store.queue("q").log
    assert log is not None
    start = log.next_position()
    auto: list[Message] = []
    manual: list[Message] = []
    engine.attach("q", auto.append, credit=10, auto_ack=True)
    engine.publish("t", b"a")
    assert [m.body for m in auto] == [b"a"] and auto[0].pos == -1 and log.next_position() == start
    engine.attach("q", manual.append, credit=10)
    engine.publish("t", b"b")  # still the auto-ack consumer's turn; then the consumers take turns
    engine.publish("t", b"c")
    assert [m.body for m in auto] == [b"a", b"b"] and [m.body for m in manual] == [b"c"]
    job, written, callbacks = store.storage.prepare()
    assert _queue_records(job, "q") == [(records.ADD, [b"c"]), (records.STATE, [])]
    store.writer.run(job)
    store.storage.complete(job, written, callbacks)
    store.close()
    store = open_store()
    assert [m.body for m in store.queue("q").ready] == [b"c"]  # in flight at the close: back in its queue


def test_single_publishes_of_one_turn_share_one_add_record(open_store: Callable[..., Store]) -> None:
    store = new_bound_store(open_store)
    store.commit()
    for body in (b"a", b"b", b"c"):
        store.engine.publish("t", body)
    got: list[Message] = []
    consumer = store.engine.attach("q", got.append, credit=1, auto_ack=True)  # takes "a" in this turn
    job, written, callbacks = store.storage.prepare()
    assert _queue_records(job, "q") == [(records.ADD, [b"a", b"b", b"c"]), (records.DONE, [])]
    store.writer.run(job)
    store.storage.complete(job, written, callbacks)
    # All of a turn's copies gone in that turn: neither the shared record nor a DONE is written.
    consumer.set_credit(100)
    consumer.release(1)
    for body in (b"d", b"e"):
        store.engine.publish("t", body)
    job, written, callbacks = store.storage.prepare()
    assert [m.body for m in got] == [b"a", b"b", b"c", b"d", b"e"]
    assert _queue_records(job, "q") == [(records.DONE, [])]  # only the DONE of "b" and "c" (last turn's record)
    store.writer.run(job)
    store.storage.complete(job, written, callbacks)
    store.close()
    assert bodies(open_store().engine, "q") == []


def test_spilled_single_publishes_of_one_turn_share_the_record_and_read_back_in_order(
        open_store: Callable[..., Store]) -> None:
    store = new_bound_store(open_store, mem_queue_size=2)
    store.commit()
    payloads = names("s", 5)
    for payload in payloads:
        store.engine.publish("t", payload)
    queue = store.queue("q")
    assert (len(queue.ready), queue.depth) == (2, 5)  # 3 on disk only, from the middle of the record
    job, written, callbacks = store.storage.prepare()
    assert _queue_records(job, "q") == [(records.ADD, payloads)]
    store.writer.run(job)
    store.storage.complete(job, written, callbacks)
    _consumer, got = consume(store.engine, "q")
    assert [m.body for m in got] == payloads
    store.close()
    store = open_store(mem_queue_size=2)
    assert bodies(store.engine, "q") == payloads  # in flight when closed: back, in order


def test_spilled_copies_read_back_one_at_a_time_keep_their_headers_ttl_and_origin(
        open_store: Callable[..., Store], clock: ManualClock) -> None:
    store = new_bound_store(open_store, mem_queue_size=2)
    store.commit()
    sent = [
        (b"plain", None, None),
        (b"mqks", {"msg_id": "a1"}, None),
        (b"emqp", {"emqp-msgid": "m\u00e9\"1", "emqp-headers": "reply-requested"}, 30.0),
        (b"numbers", {"retry": 3, "nested": {"k": [1, 2]}}, None),
        (b"ttl only", None, 5.5),
        (b"last", {"": ""}, 0.25),
    ]
    published_at = clock.now()
    ids = [store.engine.publish("t", body, headers=headers, ttl=ttl, origin="mqks") for body, headers, ttl in sent]
    store.commit()  # one ADD record: the first two stay in memory, the rest is read from its middle
    clock.advance(0.125)
    consumer, got = consume(store.engine, "q", credit=1)
    for number in range(len(sent)):
        assert len(got) == number + 1
        assert consumer.finish(got[-1].id) is Outcome.OK  # credit 1: each read takes one entry more
    assert [m.id for m in got] == ids
    assert [(m.body, m.headers, m.origin, m.topic, m.attempts) for m in got] == [
        (body, headers, "mqks", "t", 1) for body, headers, _ in sent]
    for message, (_, _, ttl) in zip(got, sent, strict=True):
        if ttl is None:
            assert message.expires_at is None
        else:
            assert message.expires_at == pytest.approx(published_at + ttl, abs=1e-6)
        assert message.due is None



def test_publisher_ids_kept_apart_read_back_the_same_from_a_spill_and_after_a_restart(
        open_store: Callable[..., Store]) -> None:
    store = new_bound_store(open_store, mem_queue_size=2)
    store.commit()
    engine = store.engine
    engine.publish("t", b"one", publisher_id=b"a-1", origin="mqks")
    # A batch with ids is not a run record (a run keeps no ids).
    engine.publish_many("t", [b"two", b"three", b"four"], each_publisher_id=[b"a-2", b"a-3", "\u00e9-4".encode()],
                        origin="mqks")
    engine.publish("t", b"both", headers={"k": "v"}, publisher_id=b"a-5", origin="mqks")
    store.commit()  # the first two stay in memory, the rest is read back from the log
    shown = [(b"one", {"msg_id": "a-1"}), (b"two", {"msg_id": "a-2"}), (b"three", {"msg_id": "a-3"}),
             (b"four", {"msg_id": "\u00e9-4"}), (b"both", {"k": "v", "msg_id": "a-5"})]
    # Read back, an id alone is still no dict: `headers` stays None.
    apart = [(b"one", b"a-1"), (b"two", b"a-2"), (b"three", b"a-3"), (b"four", "\u00e9-4".encode())]

    def check(got: list[Message]) -> None:
        assert [(m.body, shown_headers(m)) for m in got] == shown
        assert [(m.body, m.publisher_id) for m in got if m.headers is None] == apart

    _consumer, got = consume(engine, "q")
    check(got)
    store.close()  # all in flight: back at the restart, the first two read with the log, the rest from it
    store = open_store(mem_queue_size=2)
    _consumer, got = consume(store.engine, "q")
    check(got)
    assert [m.attempts for m in got] == [2] * 5


# -- a spilled topic backlog handed over to its first queue ------------------------------------------


def add_records_under(directory: Path) -> int:
    """ADD records in every segment under `directory` (what copying a backlog would have written)."""
    count = 0
    for path in sorted(directory.glob("*.seg")):
        count += sum(1 for _, record_type, _ in records.scan(path.read_bytes()) if record_type == records.ADD)
    return count


def test_the_first_queue_takes_a_spilled_backlog_over_without_a_copy(open_store: Callable[..., Store],
                                                                      data_dir: Path) -> None:
    store = open_store(mem_queue_size=5)
    engine = store.engine
    engine.publish_many("t", names("m", 40))
    store.commit()
    topic_dir = store.storage._topics["t"]["uid"]
    assert engine.topics["t"].spilled == 35
    engine.ensure_queue("q")
    engine.bind("q", "t")
    store.commit()
    queue = store.queue("q")
    assert queue.log is not None and queue.log.dir == data_dir / f"t{topic_dir}"
    assert engine.topics["t"].depth == 0 and queue.depth == 40
    assert add_records_under(data_dir / f"t{topic_dir}") == 1, "the batch's one ADD record, not copied"
    new_topic_dir = data_dir / f"t{store.storage._topics['t']['uid']}"
    assert new_topic_dir != data_dir / f"t{topic_dir}" and add_records_under(new_topic_dir) == 0
    consumer, got = consume(engine, "q", credit=10)
    consumer.set_credit(0)
    assert [m.body for m in got] == names("m", 10)
    for message in got:
        consumer.finish(message.id)
    consumer.detach()
    store.commit()
    # Later publishes go to the queue's log as usual.
    publish_each(engine, "t", names("n", 3))
    store.close()

    store = open_store(mem_queue_size=5)
    assert bodies(store.engine, "q") == names("m", 30, start=10) + names("n", 3)
    assert store.engine.topics["t"].depth == 0
    store.engine.delete_queue("q")
    store.commit()
    assert not (data_dir / f"t{topic_dir}").exists(), "the queue's log goes with the queue"
    store.close()
    store = open_store(mem_queue_size=5)
    assert "q" not in store.engine.queues and not list(data_dir.glob("orphan-*"))


def test_deferred_copies_of_a_handed_over_backlog_wait_for_their_time(open_store: Callable[..., Store],
                                                                      clock: ManualClock) -> None:
    store = open_store(mem_queue_size=2)
    engine = store.engine
    engine.ensure_topic("t")
    engine.publish_many("t", names("a", 4))
    engine.publish("t", b"later", delay=30)
    engine.publish_many("t", names("b", 4))
    store.commit()
    assert engine.topics["t"].spilled > 0
    engine.ensure_queue("q")
    engine.bind("q", "t")
    store.commit()
    consumer, got = consume(engine, "q")
    store.commit()
    consumer.refill()
    assert [m.body for m in got] == names("a", 4) + names("b", 4)
    clock.advance(31)
    engine.run_timers()
    assert got[-1].body == b"later"


def test_a_backlog_is_copied_as_before_when_the_queue_already_holds_messages(open_store: Callable[..., Store],
                                                                            data_dir: Path) -> None:
    store = open_store(mem_queue_size=3)
    engine = store.engine
    engine.publish_many("t", names("m", 10))
    engine.ensure_queue("q")
    engine.bind("q", "u")
    engine.publish("u", b"first")
    store.commit()
    engine.bind("q", "t")
    for _ in range(5):
        engine.run_timers()
        store.commit()
    assert store.queue("q").log.dir.name.startswith("q")
    assert bodies(engine, "q") == [b"first", *names("m", 10)]


def test_a_torn_hand_over_record_leaves_the_backlog_with_the_topic(open_store: Callable[..., Store],
                                                                   data_dir: Path) -> None:
    """The swap is one journal record: torn, the restart sees no swap, and the backlog is copied as before."""
    store = open_store(mem_queue_size=5)
    engine = store.engine
    engine.publish_many("t", names("m", 40))
    store.commit()
    engine.ensure_queue("q")
    engine.bind("q", "t")
    store.close()
    meta = data_dir / files.META_FILE
    assert files.meta_changes(data_dir)[-1]["t"] == "adopt"
    last = files.record_spans(meta)[-1]
    files.truncate(meta, last.offset + last.length // 2)

    store = open_store(mem_queue_size=5)
    assert store.queue("q").log.dir.name.startswith("q")
    for _ in range(10):
        store.engine.run_timers()
        store.commit()
    assert bodies(store.engine, "q") == names("m", 40)


def test_requeued_ttls_dead_letters_and_max_attempts_survive_a_restart(open_store: Callable[..., Store],
                                                                        clock: ManualClock) -> None:
    store = open_store()
    engine = store.engine
    engine.ensure_queue("Foo", options={"max_attempts": 3})
    engine.bind("Foo", "Foo")
    engine.publish("Foo", b"requeued", ttl=10)
    engine.publish("Foo", b"poison", headers={"msg_id": "p"})
    engine.publish("Foo", b"plain")
    store.commit()
    consumer, got = consume(engine, "Foo", credit=2)
    queue = engine.queue("Foo")
    assert queue is not None and [m.body for m in got] == [b"requeued", b"poison"]
    consumer.set_credit(0)
    assert queue.requeue_to_tail(got[0].id, 600.0) is Outcome.OK
    assert queue.dead_letter(got[1].id) is Outcome.OK
    consumer.detach()
    store.commit()
    store.close()

    clock.advance(20)  # the first TTL (10 s) would have run out; the new one (600 s) has not
    store = open_store()
    engine = store.engine
    queue = engine.queue("Foo")
    assert queue is not None and queue.max_attempts == 3
    _, got = consume(engine, "Foo")
    assert [(m.body, m.attempts) for m in got] == [(b"plain", 1), (b"requeued", 2)]
    assert got[1].expires_at == pytest.approx(clock.now() + 580.0)
    engine.ensure_queue("Foo.dead")
    engine.bind("Foo.dead", "Foo.dead")
    _, letters = consume(engine, "Foo.dead")
    assert [(m.body, m.headers) for m in letters] == [
        (b"poison", {"msg_id": "p", "dead_letter_queue": "Foo", "dead_letter_reason": "rejected"})]
