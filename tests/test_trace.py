"""Tracing in the engine (core/trace.py), driven by a ManualClock: the exact events of a traced
message's life, the flags that keep untraced topics free of it, the bounded ring, search and gaps."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from polymq.core.clock import ManualClock
from polymq.core.dead_letters import requeue_dead_letters
from polymq.core.engine import MAX_ATTEMPTS_OPTION, Engine, Message
from polymq.core.trace import Client, Event, Tracer, event_json, gaps

from support.sync_store import Store

SHOWN = {"hex": lambda message: f"{message.id:016x}", "own": lambda message: str((message.headers or {}).get("k", ""))}


def _engine(**tracer: Any) -> tuple[Engine, Tracer, list[Event]]:
    engine = Engine(clock=ManualClock())
    trace = Tracer(engine, SHOWN, node="n1", **tracer)
    seen: list[Event] = []
    trace.listeners.append(seen.append)
    return engine, trace, seen


def _steps(events: list[Event]) -> list[tuple[Any, ...]]:
    return [(event.kind, event.queue or event.topic, event.attempt) for event in events]


def test_nothing_traced_leaves_the_engine_without_a_tracer() -> None:
    engine, _, seen = _engine()
    engine.ensure_queue("q")
    engine.bind("q", "t")
    engine.publish("t", b"x")
    assert engine.tracer is None
    assert not engine.topics["t"].traced and not engine.queues["q"].traced
    assert seen == []


def test_a_life_with_a_requeue_a_timeout_and_a_dead_letter() -> None:
    engine, trace, seen = _engine()
    trace.trace("orders")
    assert engine.tracer is trace
    engine.ensure_queue("billing", options={MAX_ATTEMPTS_OPTION: 3})
    engine.bind("billing", "orders")
    got: list[Message] = []
    worker = Client("nsq", "127.0.0.1:5000", "worker-1")
    consumer = engine.attach("billing", got.append, credit=5, msg_timeout=10.0, client=worker)
    publisher = Client("mqks", "127.0.0.1:6000", "")
    message_id = engine.publish("orders", b"order 1", headers={"k": "req-1"}, origin="mqks", client=publisher)
    assert consumer.requeue(message_id) .name == "OK"
    engine.clock.advance(10.0)  # type: ignore[attr-defined]
    engine.run_timers()
    assert consumer.touch(message_id).name == "OK"
    engine.clock.advance(10.0)  # type: ignore[attr-defined]
    engine.run_timers()  # third attempt timed out: max attempts, so a dead letter
    assert _steps(seen) == [
        ("published", "orders", None), ("queued", "billing", None), ("delivered", "billing", 1),
        ("requeued", "billing", 1), ("delivered", "billing", 2), ("timed_out", "billing", 2),
        ("delivered", "billing", 3), ("touched", "billing", 3), ("timed_out", "billing", 3),
        ("dead_lettered", "billing", 3), ("kept", "billing.dead", None),
    ]
    assert [event.seq for event in seen] == sorted(event.seq for event in seen)
    assert seen[0].client is publisher and seen[2].client is worker
    first = event_json(seen[0], "n1")
    assert first == {"seq": seen[0].seq, "time_ns": seen[0].time_ns, "event": "published", "node": "n1",
                     "traced_topic": "orders", "message_id": message_id,
                     "ids": {"hex": f"{message_id:016x}", "own": "req-1"}, "topic": "orders", "protocol": "mqks",
                     "client": "127.0.0.1:6000", "client_name": "", "size": 7, "publisher_id": None}
    found = trace.find("req-1")
    assert [traced.id for traced in found] == [message_id]
    assert trace.find(f"{message_id:016x}") == found == trace.find(str(message_id))
    assert Tracer.timeline(found[0]) == seen
    assert gaps(seen) == ["sitting in dead-letter topic billing.dead: no queue reads it",
                          "timed out 2 times in billing"]
    # A queue bound to the dead letters later gets them, traced on.
    engine.ensure_queue("billing.dead")
    engine.bind("billing.dead", "billing.dead")
    assert _steps(seen[11:]) == [("queued", "billing.dead", None)]
    assert gaps(seen) == ["sitting in billing.dead, a queue of dead letters", "timed out 2 times in billing"]
    # The admin page's "requeue dead letters": back in billing, gone from where the letters were.
    assert requeue_dead_letters(engine, engine.queues["billing"]).moved == 1
    assert _steps(seen[12:]) == [("queued", "billing", None), ("delivered", "billing", 1)]
    assert seen[12].reason == "put back from its dead letters"
    consumer.finish(message_id)
    assert gaps(seen) == ["timed out 2 times in billing"]


def test_auto_ack_finishes_at_delivery_and_an_untraced_topic_records_nothing() -> None:
    engine, trace, seen = _engine()
    trace.trace("a")
    engine.ensure_queue("q")
    engine.bind("q", "a")
    engine.bind("q", "b")  # the queue is traced: a copy from the untraced topic is not
    engine.attach("q", lambda message: None, credit=10, auto_ack=True)
    engine.publish("b", b"not traced")
    engine.publish("a", b"traced")
    assert _steps(seen) == [("published", "a", None), ("queued", "q", None), ("delivered", "q", 1),
                            ("finished", "q", 1)]
    assert gaps(seen) == []


def test_delivered_and_never_finished_is_a_gap_and_deleting_the_queue_ends_it() -> None:
    engine, trace, seen = _engine()
    trace.trace("t")
    engine.ensure_queue("q")
    engine.bind("q", "t")
    engine.attach("q", lambda message: None, credit=1, client=Client("phpmq", "127.0.0.1:7000"))
    engine.publish("t", b"x")
    assert gaps(seen) == ["delivered in q to phpmq client 127.0.0.1:7000 (attempt 1) and not finished"]
    engine.delete_queue("q")
    assert _steps(seen)[-1] == ("deleted", "q", None)
    assert gaps(seen) == []


def test_the_ring_is_bounded_and_counts_what_it_dropped() -> None:
    engine, trace, _ = _engine(ring_size=4)
    trace.trace("t")
    for _ in range(3):
        engine.publish("t", b"kept")  # no queue: published and kept, two events each
    ring = trace.rings["t"]
    assert (len(ring.events), ring.recorded, ring.dropped) == (4, 6, 2)
    assert len(trace.recent("t")) == 2


def test_stopping_keeps_the_ring_and_frees_the_flags() -> None:
    engine, trace, seen = _engine()
    trace.trace("t")
    engine.ensure_queue("q")
    engine.bind("q", "t")
    engine.publish("t", b"x")
    trace.untrace("t")
    assert engine.tracer is None
    assert not engine.topics["t"].traced and not engine.queues["q"].traced
    engine.publish("t", b"y")
    assert len(seen) == 2 and len(trace.rings["t"].events) == 2


def test_the_refused_topic_is_never_traced() -> None:
    _, trace, _ = _engine()
    trace.refused.add("polymq.trace")
    with pytest.raises(ValueError):
        trace.trace("polymq.trace")


def test_a_body_prefix_is_kept_only_as_configured_and_found() -> None:
    engine, trace, seen = _engine(body_prefix=4)
    trace.trace("t")
    engine.publish("t", b"invoice 42")
    assert trace.find("invo")[0].body_prefix == b"invo"
    assert event_json(seen[0], "")["body_prefix"] == "invo"
    assert trace.find("other") == []


def test_a_backlog_spilled_to_disk_is_queued_for_the_first_queue_event_by_event(tmp_path: Path) -> None:
    """A topic without a queue keeps what is published (nsqd's rule); past the memory bound it is on disk.
    The first queue takes it all: each traced copy, on disk or not, gets its `queued` event then."""
    store = Store(tmp_path, ManualClock(), mem_queue_size=2)
    engine = store.engine
    trace = Tracer(engine, SHOWN, node="n1")
    seen: list[Event] = []
    trace.listeners.append(seen.append)
    trace.trace("orders")
    ids = [engine.publish("orders", b"order %d" % number) for number in range(5)]
    store.commit()
    assert engine.topics["orders"].log is not None and engine.topics["orders"].log.spilled > 0
    engine.ensure_queue("billing")
    engine.bind("billing", "orders")
    queued = [event.message.id for event in seen if event.kind == "queued"]
    assert sorted(queued) == sorted(ids)
    assert all(event.queue == "billing" for event in seen if event.kind == "queued")
    got: list[Message] = []
    consumer = engine.attach("billing", got.append, credit=10)
    store.commit()
    assert [message.id for message in got] == ids
    for message in got:
        consumer.finish(message.id)
    for message_id in ids:
        [found] = trace.find(str(message_id))
        assert gaps(trace.timeline(found)) == [], trace.timeline(found)
    store.close()


def test_another_nodes_events_join_the_timeline_in_time_order_and_an_older_one_moves_no_place() -> None:
    """Events another node tells (`absorb`): kept in the topic's ring with their node, the timeline in time
    order; an event older than this node's last at a place leaves the place's state; bad ones are refused."""
    engine, trace, _ = _engine()
    trace.adopts = True
    trace.trace("orders")
    engine.ensure_queue("billing")
    engine.bind("billing", "orders")
    got: list[Message] = []
    consumer = engine.attach("billing", got.append, credit=5, client=Client("nsq", "127.0.0.1:5000", "w"))
    message_id = engine.publish("orders", b"order 1")
    remote = {"seq": 7, "event": "requeued", "node": "vm/2", "traced_topic": "orders", "message_id": message_id,
              "ids": {"hex": f"{message_id:016x}"}, "queue": "billing", "protocol": "mqks", "client": "10.0.0.2:1",
              "client_name": "", "attempt": 1, "time_ns": engine.clock.wall_ns() - 1_000}
    assert consumer.finish(message_id).name == "OK"  # this node's finish, after the other node's requeue
    assert trace.absorb(remote)
    [traced] = trace.find(f"{message_id:016x}")
    events = Tracer.timeline(traced)
    assert [(event.kind, event.node) for event in events] == [
        ("requeued", "vm/2"), ("published", None), ("queued", None), ("delivered", None), ("finished", None)]
    assert event_json(events[0], "vm/1")["node"] == "vm/2" and event_json(events[1], "vm/1")["node"] == "vm/1"
    assert gaps(events) == []  # the older requeue did not put the copy back in the queue
    for bad in ({**remote, "event": "exploded"}, {**remote, "message_id": "1"}, {**remote, "traced_topic": "other"},
                {**remote, "queue": 5}, {k: v for k, v in remote.items() if k != "node"}):
        assert not trace.absorb(bad)
