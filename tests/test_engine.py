"""The queue engine, driven by an injected ManualClock (never by sleeping).

Each test builds an `Engine(clock=ManualClock())`, moves time with `clock.advance(...)` followed
by `engine.run_timers()`, and asserts exactly which bodies each consumer got, in what order, with
what attempts, and what every counter says.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from polymq.adapters.nsq.tcp import ensure_channel, sampler
from polymq.core import records
from polymq.core.clock import ManualClock
from polymq.core.disk_io import FileWriter
from polymq.core.disk_storage import DiskStorage
from polymq.core.engine import (
    AUTO_DELETE_EMPTY_OPTION,
    DEAD_LETTER_TOPIC_OPTION,
    Consumer,
    CreditMode,
    CreditPool,
    Engine,
    Message,
    Outcome,
)
from polymq.core.message import shown_headers

from support.sync_store import Store


class Recorder:
    """A consumer's deliver callback: remembers each delivery as (body, attempts) at that moment."""

    def __init__(self) -> None:
        self.messages: list[Message] = []
        self.log: list[tuple[bytes, int]] = []

    def __call__(self, message: Message) -> None:
        self.messages.append(message)
        self.log.append((message.body, message.attempts))

    @property
    def bodies(self) -> list[bytes]:
        return [body for body, _ in self.log]

    def id_of(self, body: bytes) -> int:
        """The id of the latest delivery of `body`."""
        for message in reversed(self.messages):
            if message.body == body:
                return message.id
        raise KeyError(body)

    def clear(self) -> None:
        self.messages.clear()
        self.log.clear()


def make() -> tuple[Engine, ManualClock]:
    clock = ManualClock()
    return Engine(clock=clock), clock


def advance(engine: Engine, clock: ManualClock, seconds: float) -> int:
    clock.advance(seconds)
    return engine.run_timers()


def sub(engine: Engine, topic: str, channel: str, **options: Any) -> tuple[Consumer, Recorder]:
    """NSQ's way (adapters/nsq/tcp.py): queue `topic/channel`, owned by `topic` and bound to it, a consumer."""
    engine.ensure_topic(topic, ephemeral=topic.endswith("#ephemeral"))
    queue = ensure_channel(engine, topic, channel)
    return attach(engine, queue.name, **options)


def attach(engine: Engine, queue: str, **options: Any) -> tuple[Consumer, Recorder]:
    recorder = Recorder()
    consumer = engine.attach(queue, recorder, **options)
    return consumer, recorder


def pub(engine: Engine, topic: str, *bodies: bytes, **options: Any) -> list[int]:
    return [engine.publish(topic, body, **options) for body in bodies]


def bodies(prefix: str, count: int) -> list[bytes]:
    return [f"{prefix}{index}".encode() for index in range(count)]


# -- publish and deliver ------------------------------------------------------------------------


def test_publish_then_deliver_with_attempts_one_and_counters() -> None:
    engine, _ = make()
    consumer, got = sub(engine, "t", "c", credit=10)
    ids = pub(engine, "t", b"a", b"b")
    assert got.log == [(b"a", 1), (b"b", 1)]
    assert [m.id for m in got.messages] == ids
    queue = engine.queue("t/c")
    assert queue is not None
    assert queue.message_count == 2
    assert queue.depth == 0
    assert set(queue.in_flight) == set(ids)
    assert list(consumer.in_flight) == ids
    assert consumer.message_count == 2
    topic = engine.topic("t")
    assert topic is not None
    assert topic.message_count == 2
    assert topic.message_bytes == 2
    assert topic.depth == 0
    assert got.messages[0].timestamp_ns == engine.clock.wall_ns()


def test_publish_before_subscribe_is_delivered_on_credit() -> None:
    engine, _ = make()
    engine.ensure_queue("t/c")
    engine.bind("t/c", "t")
    pub(engine, "t", b"a", b"b", b"c")
    queue = engine.queue("t/c")
    assert queue is not None and queue.depth == 3
    consumer, got = attach(engine, "t/c")  # credit 0 after SUB: nothing
    assert got.log == []
    consumer.set_credit(2)
    assert got.bodies == [b"a", b"b"]
    assert queue.depth == 1


def test_message_timestamp_is_kept_across_redelivery() -> None:
    engine, clock = make()
    consumer, got = sub(engine, "t", "c", credit=1)
    pub(engine, "t", b"a")
    stamp = got.messages[0].timestamp_ns
    advance(engine, clock, 5)
    consumer.requeue(got.id_of(b"a"))
    assert got.log == [(b"a", 1), (b"a", 2)]
    assert got.messages[1].timestamp_ns == stamp


# -- credit: window mode (RDY) ------------------------------------------------------------------


def test_window_credit_caps_in_flight_and_fin_frees_a_slot() -> None:
    engine, _ = make()
    consumer, got = sub(engine, "t", "c", credit=2)
    pub(engine, "t", *bodies("m", 5))
    assert got.bodies == [b"m0", b"m1"]
    assert len(consumer.in_flight) == 2
    assert consumer.available() == 0
    queue = engine.queue("t/c")
    assert queue is not None and queue.depth == 3
    assert consumer.finish(got.id_of(b"m0")) is Outcome.OK
    assert got.bodies == [b"m0", b"m1", b"m2"]
    assert consumer.finish_count == 1
    assert len(consumer.in_flight) == 2
    assert queue.depth == 2


def test_credit_zero_pauses_and_raising_credit_dispatches_backlog() -> None:
    engine, _ = make()
    consumer, got = sub(engine, "t", "c", credit=1)
    pub(engine, "t", b"a")
    consumer.set_credit(0)
    pub(engine, "t", b"b", b"c", b"d")
    assert consumer.finish(got.id_of(b"a")) is Outcome.OK
    assert got.bodies == [b"a"]  # RDY 0: nothing more even with a free slot
    consumer.set_credit(2)
    assert got.bodies == [b"a", b"b", b"c"]
    consumer.set_credit(5)
    assert got.bodies == [b"a", b"b", b"c", b"d"]
    assert len(consumer.in_flight) == 3


def test_lowering_credit_below_in_flight_delivers_nothing_until_under_it() -> None:
    engine, _ = make()
    consumer, got = sub(engine, "t", "c", credit=3)
    pub(engine, "t", *bodies("m", 6))
    assert got.bodies == [b"m0", b"m1", b"m2"]
    consumer.set_credit(1)
    consumer.finish(got.id_of(b"m0"))
    consumer.finish(got.id_of(b"m1"))
    assert got.bodies == [b"m0", b"m1", b"m2"]  # 1 in flight == credit 1
    consumer.finish(got.id_of(b"m2"))
    assert got.bodies == [b"m0", b"m1", b"m2", b"m3"]


def test_add_credit_in_window_mode_widens_the_window() -> None:
    engine, _ = make()
    consumer, got = sub(engine, "t", "c", credit=1)
    pub(engine, "t", *bodies("m", 3))
    consumer.add_credit(1)
    assert got.bodies == [b"m0", b"m1"]
    assert consumer.credit == 2


# -- credit: tokens mode (eMQP READY) -----------------------------------------------------------


def test_tokens_mode_each_delivery_spends_one_token() -> None:
    engine, _ = make()
    engine.ensure_queue("email")
    engine.bind("email", "email")
    consumer, got = attach(engine, "email", credit=0, mode=CreditMode.TOKENS, auto_ack=True)
    pub(engine, "email", *bodies("job", 4))
    assert got.log == []
    consumer.add_credit()  # READY
    assert got.log == [(b"job0", 1)]
    assert consumer.credit == 0
    consumer.add_credit()
    consumer.add_credit()
    assert got.bodies == [b"job0", b"job1", b"job2"]
    assert consumer.credit == 0
    consumer.add_credit(3)  # more tokens than messages: the rest stays as credit
    assert got.bodies == [b"job0", b"job1", b"job2", b"job3"]
    assert consumer.credit == 2
    pub(engine, "email", b"job4", b"job5", b"job6")
    assert got.bodies[-2:] == [b"job4", b"job5"]
    assert consumer.credit == 0
    queue = engine.queue("email")
    assert queue is not None and queue.depth == 1 and not queue.in_flight


def test_tokens_mode_is_not_refilled_by_finish() -> None:
    engine, _ = make()
    engine.ensure_queue("q")
    engine.bind("q", "q")
    consumer, got = attach(engine, "q", credit=1, mode=CreditMode.TOKENS)
    pub(engine, "q", b"a", b"b")
    assert got.bodies == [b"a"]
    assert consumer.finish(got.id_of(b"a")) is Outcome.OK
    assert got.bodies == [b"a"]  # a token is spent by the delivery, not returned by the ack
    consumer.add_credit()
    assert got.bodies == [b"a", b"b"]


# -- auto-ack ---------------------------------------------------------------------------------


def test_auto_ack_window_counts_outstanding_until_release() -> None:
    engine, _ = make()
    engine.ensure_queue("q")
    engine.bind("q", "e1")
    consumer, got = attach(engine, "q", credit=2, auto_ack=True)
    pub(engine, "e1", *bodies("m", 5))
    assert got.log == [(b"m0", 1), (b"m1", 1)]
    queue = engine.queue("q")
    assert queue is not None
    assert queue.in_flight == {} and consumer.in_flight == {}
    assert consumer.outstanding == 2
    consumer.release()
    assert got.bodies == [b"m0", b"m1", b"m2"]
    consumer.release(2)
    assert got.bodies == [b"m0", b"m1", b"m2", b"m3", b"m4"]
    assert consumer.outstanding == 2
    # Nothing to acknowledge: finish/requeue/touch find nothing in flight.
    message_id = got.id_of(b"m4")
    assert consumer.finish(message_id) is Outcome.NOT_IN_FLIGHT
    assert consumer.requeue(message_id) is Outcome.NOT_IN_FLIGHT
    assert consumer.touch(message_id) is Outcome.NOT_IN_FLIGHT


def test_auto_ack_deliveries_do_not_come_back_on_detach() -> None:
    engine, _ = make()
    engine.ensure_queue("q")
    engine.bind("q", "e")
    consumer, _got = attach(engine, "q", credit=5, auto_ack=True)
    pub(engine, "e", b"a", b"b")
    consumer.detach()
    _other, got2 = attach(engine, "q", credit=5, auto_ack=True)
    assert got2.log == []
    pub(engine, "e", b"c")
    assert got2.log == [(b"c", 1)]


# -- competing consumers and several queues ----------------------------------------------------


def test_competing_consumers_get_each_message_exactly_once() -> None:
    engine, _ = make()
    engine.ensure_queue("t/c")
    engine.bind("t/c", "t")
    recorders = [attach(engine, "t/c", credit=3) for _ in range(3)]
    pub(engine, "t", *bodies("m", 9))
    got = [body for _, rec in recorders for body in rec.bodies]
    assert sorted(got) == sorted(bodies("m", 9))
    # Round robin while everyone has credit.
    assert [rec.bodies for _, rec in recorders] == [
        [b"m0", b"m3", b"m6"],
        [b"m1", b"m4", b"m7"],
        [b"m2", b"m5", b"m8"],
    ]
    pub(engine, "t", b"extra")  # everyone is full
    queue = engine.queue("t/c")
    assert queue is not None and queue.depth == 1
    second, rec2 = recorders[1]
    second.finish(rec2.id_of(b"m4"))
    assert rec2.bodies[-1] == b"extra"
    assert sum(len(c.in_flight) for c, _ in recorders) == len(queue.in_flight) == 9


def test_several_queues_on_one_topic_each_get_a_copy_with_independent_attempts() -> None:
    engine, clock = make()
    first, got1 = sub(engine, "t", "c1", credit=5, msg_timeout=10)
    second, got2 = sub(engine, "t", "c2", credit=5, msg_timeout=10)
    [message_id] = pub(engine, "t", b"a")
    assert got1.log == [(b"a", 1)] and got2.log == [(b"a", 1)]
    assert got1.messages[0] is not got2.messages[0]
    assert got1.messages[0].id == got2.messages[0].id == message_id
    first.requeue(message_id)
    first.requeue(message_id)
    assert got1.log == [(b"a", 1), (b"a", 2), (b"a", 3)]
    assert got2.log == [(b"a", 1)]
    assert second.finish(message_id) is Outcome.OK
    assert first.finish(message_id) is Outcome.OK
    advance(engine, clock, 60)
    assert got1.log == [(b"a", 1), (b"a", 2), (b"a", 3)]
    assert got2.log == [(b"a", 1)]


def test_one_queue_bound_to_several_topics_mqks_style() -> None:
    engine, _ = make()
    engine.ensure_queue("q1")
    engine.set_bindings("q1", ["e1", "e2"])
    _consumer, got = attach(engine, "q1", credit=10, auto_ack=True)
    pub(engine, "e1", b"one", drop_if_unbound=True)
    pub(engine, "e2", b"two", drop_if_unbound=True)
    pub(engine, "e3", b"three", drop_if_unbound=True)
    assert got.bodies == [b"one", b"two"]
    assert engine.dropped_count == 1
    engine.set_bindings("q1", ["e2"])
    pub(engine, "e1", b"four", drop_if_unbound=True)
    assert got.bodies == [b"one", b"two"]
    assert engine.dropped_count == 2
    queue = engine.queue("q1")
    assert queue is not None and queue.topics == ["e2"]


# -- the backlog rule ---------------------------------------------------------------------------


def test_topic_without_queue_keeps_backlog_for_the_first_bound_queue_only() -> None:
    engine, _ = make()
    ids = pub(engine, "t", b"a", b"b", b"c")
    topic = engine.topic("t")
    assert topic is not None and topic.depth == 3 and topic.message_count == 3
    _first, got1 = sub(engine, "t", "c1", credit=10)
    assert got1.log == [(b"a", 1), (b"b", 1), (b"c", 1)]
    assert [m.id for m in got1.messages] == ids
    assert topic.depth == 0
    _second, got2 = sub(engine, "t", "c2", credit=10)
    assert got2.log == []
    pub(engine, "t", b"d")
    assert got1.bodies[-1] == b"d" and got2.bodies == [b"d"]


def test_backlog_waits_in_the_queue_when_no_consumer_yet() -> None:
    engine, _ = make()
    pub(engine, "t", b"a", b"b")
    engine.ensure_queue("t/c")
    engine.bind("t/c", "t")
    queue = engine.queue("t/c")
    assert queue is not None and queue.depth == 2 and queue.message_count == 2
    _consumer, got = attach(engine, "t/c", credit=1)
    assert got.bodies == [b"a"]


def test_backlog_comes_back_when_a_topic_loses_its_last_queue() -> None:
    engine, _ = make()
    engine.ensure_queue("t/c")
    engine.bind("t/c", "t")
    engine.delete_queue("t/c")
    pub(engine, "t", b"kept")
    topic = engine.topic("t")
    assert topic is not None and topic.depth == 1
    _consumer, got = sub(engine, "t", "c2", credit=1)
    assert got.bodies == [b"kept"]


def test_drop_if_unbound_drops_without_creating_a_topic() -> None:
    engine, _ = make()
    first = engine.publish("e1", b"x", drop_if_unbound=True)
    assert engine.dropped_count == 1
    assert engine.topic("e1") is None
    engine.ensure_topic("e1")  # a topic without queue still drops under this rule
    second = engine.publish("e1", b"y", drop_if_unbound=True)
    assert engine.dropped_count == 2
    topic = engine.topic("e1")
    assert topic is not None and topic.depth == 0 and topic.message_count == 0
    assert second > first  # the id is spent all the same
    engine.ensure_queue("q")
    engine.bind("q", "e1")
    queue = engine.queue("q")
    assert queue is not None and queue.depth == 0


def test_mpub_backlog_and_mixed_with_single_publishes_keeps_order() -> None:
    engine, _ = make()
    pub(engine, "t", b"a")
    engine.publish_many("t", [b"b", b"c"])
    pub(engine, "t", b"d")
    _consumer, got = sub(engine, "t", "c", credit=10)
    assert got.bodies == [b"a", b"b", b"c", b"d"]


# -- FIN / REQ / outcomes -----------------------------------------------------------------------


def test_fin_outcomes_ok_not_in_flight_not_owned() -> None:
    engine, _ = make()
    engine.ensure_queue("t/c")
    engine.bind("t/c", "t")
    first, got1 = attach(engine, "t/c", credit=1)
    second, got2 = attach(engine, "t/c", credit=1)
    a, _b = pub(engine, "t", b"a", b"b")
    assert got1.bodies == [b"a"] and got2.bodies == [b"b"]
    assert second.finish(a) is Outcome.NOT_OWNED
    assert second.requeue(a) is Outcome.NOT_OWNED
    assert second.touch(a) is Outcome.NOT_OWNED
    assert first.finish(a) is Outcome.OK
    assert first.finish(a) is Outcome.NOT_IN_FLIGHT
    assert first.requeue(a) is Outcome.NOT_IN_FLIGHT
    assert first.touch(a) is Outcome.NOT_IN_FLIGHT
    assert first.finish(123) is Outcome.NOT_IN_FLIGHT
    assert first.finish_count == 1 and second.finish_count == 0


def test_req_zero_puts_the_message_at_the_tail() -> None:
    engine, _ = make()
    consumer, got = sub(engine, "t", "c", credit=1)
    pub(engine, "t", b"a", b"b", b"c")
    assert consumer.requeue(got.id_of(b"a"), 0) is Outcome.OK
    assert got.log == [(b"a", 1), (b"b", 1)]
    consumer.finish(got.id_of(b"b"))
    consumer.finish(got.id_of(b"c"))
    assert got.log == [(b"a", 1), (b"b", 1), (b"c", 1), (b"a", 2)]
    queue = engine.queue("t/c")
    assert queue is not None
    assert consumer.requeue_count == 1 and queue.requeue_count == 1
    assert queue.message_count == 3  # a requeue is not a new message


def test_req_with_delay_is_deferred_and_released_exactly_at_due_time() -> None:
    engine, clock = make()
    consumer, got = sub(engine, "t", "c", credit=5)
    [message_id] = pub(engine, "t", b"a")
    queue = engine.queue("t/c")
    assert queue is not None
    assert consumer.requeue(message_id, 2.0) is Outcome.OK
    assert queue.deferred_count == 1 and queue.depth == 0 and not queue.in_flight
    assert engine.timers.next_due() == clock.now() + 2.0
    advance(engine, clock, 1.999)
    assert got.log == [(b"a", 1)]
    assert queue.deferred_count == 1
    advance(engine, clock, 0.001)
    assert got.log == [(b"a", 1), (b"a", 2)]
    assert queue.deferred_count == 0
    assert queue.requeue_count == 1


def test_deferred_messages_are_released_in_due_order() -> None:
    engine, clock = make()
    consumer, got = sub(engine, "t", "c", credit=10)
    a, b, c = pub(engine, "t", b"a", b"b", b"c")
    consumer.requeue(a, 3.0)
    consumer.requeue(b, 1.0)
    consumer.requeue(c, 2.0)
    got.clear()
    advance(engine, clock, 1.0)
    assert got.bodies == [b"b"]
    advance(engine, clock, 1.0)
    assert got.bodies == [b"b", b"c"]
    advance(engine, clock, 5.0)
    assert got.bodies == [b"b", b"c", b"a"]


def test_deferred_messages_due_at_the_same_advance_come_in_due_order() -> None:
    engine, clock = make()
    consumer, got = sub(engine, "t", "c", credit=10)
    a, b = pub(engine, "t", b"a", b"b")
    consumer.requeue(a, 2.0)
    consumer.requeue(b, 1.0)
    got.clear()
    advance(engine, clock, 10)
    assert got.bodies == [b"b", b"a"]


def test_dpub_is_deferred_then_delivered_with_attempts_one() -> None:
    engine, clock = make()
    _consumer, got = sub(engine, "t", "c", credit=5)
    engine.publish("t", b"later", delay=1.5)
    pub(engine, "t", b"now")
    queue = engine.queue("t/c")
    assert queue is not None
    assert got.bodies == [b"now"]
    assert queue.deferred_count == 1 and queue.message_count == 2
    advance(engine, clock, 1.0)
    assert got.bodies == [b"now"]
    advance(engine, clock, 0.5)
    assert got.log == [(b"now", 1), (b"later", 1)]
    assert queue.deferred_count == 0


def test_dpub_to_several_channels_defers_in_each() -> None:
    engine, clock = make()
    _first, got1 = sub(engine, "t", "c1", credit=5)
    _second, got2 = sub(engine, "t", "c2", credit=5)
    engine.publish("t", b"x", delay=1.0)
    queue1, queue2 = engine.queue("t/c1"), engine.queue("t/c2")
    assert queue1 is not None and queue2 is not None
    assert queue1.deferred_count == queue2.deferred_count == 1
    advance(engine, clock, 1.0)
    assert got1.log == [(b"x", 1)] and got2.log == [(b"x", 1)]


def test_dpub_to_a_topic_without_queue_keeps_its_due_time() -> None:
    engine, clock = make()
    engine.publish("t", b"late", delay=5.0)
    engine.publish("t", b"early", delay=1.0)
    pub(engine, "t", b"now")
    topic = engine.topic("t")
    assert topic is not None and topic.depth == 3
    advance(engine, clock, 2.0)  # no queue: nothing to release yet, nothing lost
    _consumer, got = sub(engine, "t", "c", credit=5)
    # "early" was due already when the queue came: ready at once, in publish order.
    assert got.bodies == [b"early", b"now"]
    queue = engine.queue("t/c")
    assert queue is not None and queue.deferred_count == 1
    advance(engine, clock, 2.999)
    assert got.bodies == [b"early", b"now"]
    advance(engine, clock, 0.001)
    assert got.log == [(b"early", 1), (b"now", 1), (b"late", 1)]


def test_dpub_single_deferred_message_in_backlog() -> None:
    engine, clock = make()
    engine.publish("t", b"x", delay=3.0)
    _consumer, got = sub(engine, "t", "c", credit=1)
    assert got.log == []
    advance(engine, clock, 3.0)
    assert got.log == [(b"x", 1)]


def test_requeue_with_delay_then_detach_keeps_it_deferred() -> None:
    engine, clock = make()
    consumer, _got = sub(engine, "t", "c", credit=5)
    [message_id] = pub(engine, "t", b"a")
    consumer.requeue(message_id, 1.0)
    consumer.detach()
    _other, got2 = attach(engine, "t/c", credit=5)
    assert got2.log == []
    advance(engine, clock, 1.0)
    assert got2.log == [(b"a", 2)]


# -- TOUCH and in-flight timeouts ----------------------------------------------------------------


def test_in_flight_timeout_redelivers_with_attempts_plus_one() -> None:
    engine, clock = make()
    consumer, got = sub(engine, "t", "c", credit=1, msg_timeout=10.0)
    [message_id] = pub(engine, "t", b"a")
    advance(engine, clock, 9.999)
    assert got.log == [(b"a", 1)]
    advance(engine, clock, 0.001)
    assert got.log == [(b"a", 1), (b"a", 2)]
    queue = engine.queue("t/c")
    assert queue is not None
    assert consumer.timeout_count == 1 and queue.timeout_count == 1
    assert consumer.requeue_count == 0
    advance(engine, clock, 10.0)
    assert got.log == [(b"a", 1), (b"a", 2), (b"a", 3)]
    assert consumer.finish(message_id) is Outcome.OK
    advance(engine, clock, 100.0)
    assert len(got.log) == 3 and consumer.timeout_count == 2


def test_timeout_returns_to_the_tail_and_another_consumer_can_take_it() -> None:
    engine, clock = make()
    engine.ensure_queue("t/c")
    engine.bind("t/c", "t")
    slow, got_slow = attach(engine, "t/c", credit=1, msg_timeout=5.0)
    pub(engine, "t", b"a", b"b")
    fast, got_fast = attach(engine, "t/c", credit=5, msg_timeout=5.0)
    assert got_slow.bodies == [b"a"] and got_fast.bodies == [b"b"]
    fast.finish(got_fast.id_of(b"b"))
    advance(engine, clock, 5.0)
    # "a" timed out from slow; slow rejoins the ring behind fast, which takes the redelivery.
    assert got_slow.log == [(b"a", 1)]
    assert got_fast.log == [(b"b", 1), (b"a", 2)]
    assert slow.timeout_count == 1 and slow.in_flight == {}


def test_late_fin_after_timeout_fails_and_fin_from_new_owner_succeeds() -> None:
    engine, clock = make()
    engine.ensure_queue("t/c")
    engine.bind("t/c", "t")
    first, _got1 = attach(engine, "t/c", credit=1, msg_timeout=5.0)
    [message_id] = pub(engine, "t", b"a")
    first.set_credit(0)
    second, got2 = attach(engine, "t/c", credit=1, msg_timeout=5.0)
    advance(engine, clock, 5.0)
    assert got2.log == [(b"a", 2)]
    assert first.finish(message_id) is Outcome.NOT_OWNED
    assert second.finish(message_id) is Outcome.OK


def test_timeouts_of_many_messages_fire_in_delivery_order() -> None:
    engine, clock = make()
    consumer, got = sub(engine, "t", "c", credit=3, msg_timeout=10.0)
    pub(engine, "t", b"a")
    advance(engine, clock, 1.0)
    pub(engine, "t", b"b")
    advance(engine, clock, 1.0)
    pub(engine, "t", b"c")
    consumer.set_credit(0)
    advance(engine, clock, 8.0)  # t=10: a times out
    queue = engine.queue("t/c")
    assert queue is not None
    assert list(queue.ready) and [m.body for m in queue.ready] == [b"a"]
    advance(engine, clock, 1.0)  # t=11: b
    assert [m.body for m in queue.ready] == [b"a", b"b"]
    advance(engine, clock, 5.0)
    assert [m.body for m in queue.ready] == [b"a", b"b", b"c"]
    assert consumer.timeout_count == 3 and consumer.in_flight == {}
    consumer.set_credit(3)
    assert got.log[3:] == [(b"a", 2), (b"b", 2), (b"c", 2)]


def test_touch_extends_the_deadline() -> None:
    engine, clock = make()
    consumer, got = sub(engine, "t", "c", credit=1, msg_timeout=10.0, max_msg_timeout=100.0)
    [message_id] = pub(engine, "t", b"a")
    advance(engine, clock, 8.0)
    assert consumer.touch(message_id) is Outcome.OK  # deadline now t0+18
    advance(engine, clock, 9.999)
    assert got.log == [(b"a", 1)]
    advance(engine, clock, 0.001)
    assert got.log == [(b"a", 1), (b"a", 2)]
    assert consumer.timeout_count == 1


def test_touch_is_capped_at_delivered_at_plus_max_msg_timeout() -> None:
    engine, clock = make()
    consumer, got = sub(engine, "t", "c", credit=1, msg_timeout=10.0, max_msg_timeout=15.0)
    [message_id] = pub(engine, "t", b"a")
    start = clock.now()
    advance(engine, clock, 9.0)
    consumer.touch(message_id)  # min(19, 15) = 15
    assert got.messages[0].deadline == start + 15.0
    advance(engine, clock, 5.0)  # t0+14
    consumer.touch(message_id)  # still capped at 15
    advance(engine, clock, 0.999)
    assert got.log == [(b"a", 1)]
    advance(engine, clock, 0.001)
    assert got.log == [(b"a", 1), (b"a", 2)]
    # The redelivery has a fresh delivered_at and a fresh cap.
    assert got.messages[1].deadline == start + 25.0


def test_capped_touch_reorders_deadlines_so_the_right_message_times_out_first() -> None:
    engine, clock = make()
    consumer, got = sub(engine, "t", "c", credit=5, msg_timeout=10.0, max_msg_timeout=12.0)
    start = clock.now()
    [a] = pub(engine, "t", b"a")  # deadline 10
    advance(engine, clock, 1.0)
    [b] = pub(engine, "t", b"b")  # deadline 11
    advance(engine, clock, 8.0)  # t=9
    consumer.touch(b)  # b: min(19, 13) = 13
    advance(engine, clock, 0.5)  # t=9.5
    consumer.touch(a)  # a: min(19.5, 12) = 12 < 13: a must stay before b
    assert [m.deadline for m in consumer.in_flight.values()] == [start + 12.0, start + 13.0]
    advance(engine, clock, 2.5)  # t=12
    assert got.bodies == [b"a", b"b", b"a"]
    advance(engine, clock, 1.0)  # t=13
    assert got.bodies == [b"a", b"b", b"a", b"b"]
    assert consumer.timeout_count == 2


def test_touch_of_a_capped_message_to_the_front_moves_the_timer_earlier() -> None:
    engine, clock = make()
    consumer, got = sub(engine, "t", "c", credit=5, msg_timeout=10.0, max_msg_timeout=10.5)
    [a] = pub(engine, "t", b"a")  # deadline 10, cap 10.5
    advance(engine, clock, 0.2)
    [_b] = pub(engine, "t", b"b")  # deadline 10.2
    advance(engine, clock, 5.0)
    consumer.touch(a)  # min(15.2, 10.5) = 10.5 > 10.2: after b
    advance(engine, clock, 5.0)  # t=10.2
    assert got.bodies == [b"a", b"b", b"b"]
    advance(engine, clock, 0.3)  # t=10.5
    assert got.bodies == [b"a", b"b", b"b", b"a"]


def test_touch_without_msg_timeout_is_ok_and_nothing_times_out() -> None:
    engine, clock = make()
    consumer, got = sub(engine, "t", "c", credit=1)
    [message_id] = pub(engine, "t", b"a")
    assert consumer.touch(message_id) is Outcome.OK
    advance(engine, clock, 10_000.0)
    assert got.log == [(b"a", 1)]
    assert consumer.timeout_count == 0


def test_requeued_then_redelivered_message_gets_a_fresh_deadline() -> None:
    engine, clock = make()
    consumer, got = sub(engine, "t", "c", credit=1, msg_timeout=10.0)
    [message_id] = pub(engine, "t", b"a")
    advance(engine, clock, 9.0)
    consumer.requeue(message_id)  # redelivered at once at t=9
    advance(engine, clock, 9.999)
    assert got.log == [(b"a", 1), (b"a", 2)]
    advance(engine, clock, 0.001)
    assert got.log == [(b"a", 1), (b"a", 2), (b"a", 3)]


# -- detach -----------------------------------------------------------------------------------


def test_detach_returns_in_flight_at_once_at_the_front_in_order() -> None:
    engine, _ = make()
    engine.ensure_queue("t/c")
    engine.bind("t/c", "t")
    first, got1 = attach(engine, "t/c", credit=3, msg_timeout=60.0)
    pub(engine, "t", *bodies("m", 5))
    assert got1.bodies == [b"m0", b"m1", b"m2"]
    queue = engine.queue("t/c")
    assert queue is not None
    first.detach()
    assert [m.body for m in queue.ready] == [b"m0", b"m1", b"m2", b"m3", b"m4"]
    assert queue.in_flight == {} and queue.consumers == []
    assert queue.requeue_count == 0
    _second, got2 = attach(engine, "t/c", credit=10)
    assert got2.log == [(b"m0", 2), (b"m1", 2), (b"m2", 2), (b"m3", 1), (b"m4", 1)]
    assert first.finish(got1.id_of(b"m0")) is Outcome.NOT_OWNED
    first.detach()  # twice: harmless


def test_detach_to_tail_returns_in_flight_behind_the_queued_ones() -> None:
    """MQKS: a manual-ack consumer's disconnect rejects its messages to the tail (docs/protocols/mqks.md)."""
    engine, _ = make()
    engine.ensure_queue("q")
    engine.bind("q", "e")
    first, got1 = attach(engine, "q", credit=2)
    pub(engine, "e", *bodies("m", 4))
    assert got1.bodies == [b"m0", b"m1"]
    first.detach(to_tail=True)
    queue = engine.queue("q")
    assert queue is not None
    assert [m.body for m in queue.ready] == [b"m2", b"m3", b"m0", b"m1"]
    _second, got2 = attach(engine, "q", credit=10)
    assert got2.log == [(b"m2", 1), (b"m3", 1), (b"m0", 2), (b"m1", 2)]


def test_messages_know_their_topic_in_every_copy() -> None:
    engine, _ = make()
    engine.ensure_queue("q")
    engine.bind("q", "e1")
    engine.bind("q", "e2")
    _c1, got = attach(engine, "q", credit=10)
    _c2, got_other = sub(engine, "e2", "c", credit=10)
    pub(engine, "e1", b"a")
    engine.publish_many("e2", [b"b", b"c"])
    assert [(m.body, m.topic) for m in got.messages] == [(b"a", "e1"), (b"b", "e2"), (b"c", "e2")]
    assert [(m.body, m.topic) for m in got_other.messages] == [(b"b", "e2"), (b"c", "e2")]


def test_detach_hands_in_flight_to_a_waiting_consumer() -> None:
    engine, clock = make()
    engine.ensure_queue("t/c")
    engine.bind("t/c", "t")
    first, _got1 = attach(engine, "t/c", credit=2, msg_timeout=5.0)
    second, got2 = attach(engine, "t/c", credit=0, msg_timeout=5.0)
    pub(engine, "t", b"a", b"b")
    second.set_credit(5)
    first.detach()
    assert got2.log == [(b"a", 2), (b"b", 2)]
    advance(engine, clock, 10.0)  # the detached consumer's timer must not fire
    assert first.timeout_count == 0
    assert got2.log[-2:] == [(b"a", 3), (b"b", 3)]


def test_detached_consumer_receives_nothing_more() -> None:
    engine, _ = make()
    consumer, got = sub(engine, "t", "c", credit=5)
    consumer.detach()
    consumer.set_credit(10)
    pub(engine, "t", b"a")
    assert got.log == []


def test_requeue_all_and_finish_all() -> None:
    engine, _ = make()
    consumer, got = sub(engine, "t", "c", credit=3)
    pub(engine, "t", b"a", b"b", b"c", b"d")
    assert consumer.finish_all() == 3
    assert got.bodies == [b"a", b"b", b"c", b"d"]
    assert consumer.requeue_all() == 1
    assert got.log[-1] == (b"d", 2)
    assert consumer.finish_count == 3 and consumer.requeue_count == 1


# -- pause ----------------------------------------------------------------------------------


def test_pause_and_unpause_queue() -> None:
    engine, clock = make()
    consumer, got = sub(engine, "t", "c", credit=5, msg_timeout=5.0)
    queue = engine.queue("t/c")
    assert queue is not None
    queue.set_paused(True)
    pub(engine, "t", b"a", b"b")
    assert got.log == [] and queue.depth == 2
    consumer.set_credit(6)
    assert got.log == []
    queue.set_paused(False)
    assert got.bodies == [b"a", b"b"]
    queue.set_paused(True)
    advance(engine, clock, 5.0)  # timeouts return messages but a paused queue does not resend
    assert got.bodies == [b"a", b"b"] and queue.depth == 2
    consumer.requeue(123)
    queue.set_paused(False)
    assert got.log[2:] == [(b"a", 2), (b"b", 2)]


def test_paused_queue_keeps_deferred_messages_until_unpause() -> None:
    engine, clock = make()
    _consumer, got = sub(engine, "t", "c", credit=5)
    queue = engine.queue("t/c")
    assert queue is not None
    engine.publish("t", b"x", delay=1.0)
    queue.set_paused(True)
    advance(engine, clock, 2.0)
    assert got.log == [] and queue.depth == 1 and queue.deferred_count == 0
    queue.set_paused(False)
    assert got.log == [(b"x", 1)]


def test_pause_and_unpause_topic() -> None:
    engine, _ = make()
    _first, got1 = sub(engine, "t", "c1", credit=5)
    _second, got2 = sub(engine, "t", "c2", credit=5)
    topic = engine.topic("t")
    assert topic is not None
    topic.set_paused(True)
    pub(engine, "t", b"a")
    engine.publish_many("t", [b"b", b"c"])
    assert got1.log == [] and got2.log == [] and topic.depth == 3
    topic.set_paused(False)
    assert got1.bodies == [b"a", b"b", b"c"] and got2.bodies == [b"a", b"b", b"c"]
    assert topic.depth == 0


def test_paused_topic_without_queue_gives_backlog_only_on_unpause() -> None:
    engine, _ = make()
    engine.ensure_topic("t").set_paused(True)
    pub(engine, "t", b"a")
    _consumer, got = sub(engine, "t", "c", credit=5)
    assert got.log == []
    topic = engine.topic("t")
    assert topic is not None
    topic.set_paused(False)
    assert got.bodies == [b"a"]


# -- empty ------------------------------------------------------------------------------------


def test_empty_queue_drops_ready_deferred_and_in_flight() -> None:
    engine, clock = make()
    consumer, got = sub(engine, "t", "c", credit=2, msg_timeout=5.0)
    a, b, _c, _d = pub(engine, "t", b"a", b"b", b"c", b"d")
    consumer.requeue(a, 10.0)  # deferred; c comes in its slot
    queue = engine.queue("t/c")
    assert queue is not None
    assert queue.deferred_count == 1 and len(queue.in_flight) == 2 and queue.depth == 1
    queue.empty()
    assert queue.depth == 0 and queue.deferred_count == 0 and queue.in_flight == {}
    assert consumer.in_flight == {}
    assert consumer.finish(b) is Outcome.NOT_IN_FLIGHT
    advance(engine, clock, 20.0)
    assert got.bodies == [b"a", b"b", b"c"]
    pub(engine, "t", b"e", b"f", b"g")
    assert got.bodies[-2:] == [b"e", b"f"]  # the window was freed by empty


def test_empty_topic_drops_backlog() -> None:
    engine, _ = make()
    pub(engine, "t", b"a")
    topic = engine.topic("t")
    assert topic is not None
    topic.empty()
    _consumer, got = sub(engine, "t", "c", credit=5)
    assert got.log == []


# -- deleting -----------------------------------------------------------------------------------


def test_delete_queue_closes_consumers_and_drops_messages() -> None:
    engine, clock = make()
    closed: list[str] = []
    deleted: list[tuple[str, list[str]]] = []
    engine.on_queue_deleted.append(lambda queue, bound: deleted.append((queue.name, bound)))
    engine.ensure_queue("t/c")
    engine.bind("t/c", "t")
    consumer, got = attach(engine, "t/c", credit=1, msg_timeout=5.0, on_close=closed.append)
    a, _b = pub(engine, "t", b"a", b"b")
    consumer.requeue(a, 1.0)
    assert engine.delete_queue("t/c") is True
    assert closed == ["queue deleted"]
    assert deleted == [("t/c", ["t"])]  # with the topics it was bound to
    assert engine.queue("t/c") is None
    assert consumer.closed
    assert engine.delete_queue("t/c") is False
    topic = engine.topic("t")
    assert topic is not None and topic.queues == []
    advance(engine, clock, 10.0)  # no timer of the dead queue fires
    assert got.bodies == [b"a", b"b"]
    pub(engine, "t", b"c")  # back to backlog
    assert topic.depth == 1


def test_delete_topic_deletes_its_channels_and_unbinds_other_queues() -> None:
    engine, _ = make()
    topic_deleted: list[str] = []
    engine.on_topic_deleted.append(topic_deleted.append)
    channel, got_channel = sub(engine, "t", "c", credit=5)
    engine.ensure_queue("q")
    engine.set_bindings("q", ["t", "u"])
    other, got_other = attach(engine, "q", credit=5)
    closed: list[str] = []
    channel.on_close = closed.append
    assert engine.delete_topic("t") is True
    assert topic_deleted == ["t"]
    assert engine.topic("t") is None
    assert engine.queue("t/c") is None and closed == ["queue deleted"]
    queue = engine.queue("q")
    assert queue is not None and queue.topics == ["u"] and not other.closed
    assert engine.delete_topic("t") is False
    pub(engine, "t", b"a")  # a new topic "t" without queues: backlog
    new_topic = engine.topic("t")
    assert new_topic is not None and new_topic.depth == 1
    assert got_other.log == [] and got_channel.log == []
    pub(engine, "u", b"b")
    assert got_other.bodies == [b"b"]


def test_topology_observers_see_every_topic_and_binding_made_and_removed() -> None:
    engine, _ = make()
    seen: list[tuple[str, ...]] = []
    engine.on_topic_created.append(lambda topic: seen.append(("topic", topic.name)))
    engine.on_topic_deleted.append(lambda name: seen.append(("topic deleted", name)))
    engine.on_bound.append(lambda queue, topic: seen.append(("bound", queue.name, topic)))
    engine.on_unbound.append(lambda queue, topic: seen.append(("unbound", queue.name, topic)))
    engine.ensure_topic("t")
    engine.ensure_topic("t")  # already there: nothing
    engine.ensure_queue("q")
    engine.bind("q", "t")
    engine.bind("q", "t")  # already bound: nothing
    engine.ensure_queue("t/c")
    engine.bind("t/c", "t")
    engine.set_bindings("q", ["u"])
    engine.unbind("q", "t")  # no longer bound: nothing
    assert seen == [("topic", "t"), ("bound", "q", "t"), ("bound", "t/c", "t"), ("unbound", "q", "t"),
                    ("topic", "u"), ("bound", "q", "u")]
    seen.clear()
    engine.delete_topic("t")  # its channel's binding goes first, then the topic
    engine.delete_queue("q")
    assert seen == [("unbound", "t/c", "t"), ("topic deleted", "t"), ("unbound", "q", "u")]
    seen.clear()
    engine.ensure_queue("e/c")
    engine.bind("e/c", "e#ephemeral", ephemeral_topic=True)
    engine.delete_queue("e/c")  # an ephemeral topic goes with its last queue, after the unbinding
    assert seen == [("topic", "e#ephemeral"), ("bound", "e/c", "e#ephemeral"), ("unbound", "e/c", "e#ephemeral"),
                    ("topic deleted", "e#ephemeral")]


def test_delete_topic_deletes_the_queues_it_owns_and_only_those_whatever_their_names() -> None:
    engine, _ = make()
    engine.ensure_queue("jobs", owner_topic="t")
    engine.ensure_queue("t/stranger")  # named like a channel of "t", but nobody said "t" owns it
    engine.set_bindings("jobs", ["t", "u"])
    engine.bind("t/stranger", "t")
    engine.ensure_queue("u-owned", owner_topic="u")
    engine.bind("u-owned", "t")  # owned by another topic: only unbound from this one
    assert engine.delete_topic("t") is True
    assert engine.queue("jobs") is None
    stranger, u_owned = engine.queue("t/stranger"), engine.queue("u-owned")
    assert stranger is not None and stranger.topics == [] and stranger.owner_topic is None
    assert u_owned is not None and u_owned.topics == [] and u_owned.owner_topic == "u"


def test_delete_topic_keeps_a_channel_of_another_topic_with_a_similar_name() -> None:
    engine, _ = make()
    sub(engine, "t", "c")
    sub(engine, "tt", "c")
    engine.ensure_queue("tt/x")
    engine.bind("tt/x", "t")  # not named after "t/": unbound, not deleted
    engine.delete_topic("t")
    assert engine.queue("tt/c") is not None
    queue = engine.queue("tt/x")
    assert queue is not None and queue.topics == []


def test_ephemeral_queue_is_deleted_when_its_last_consumer_leaves() -> None:
    engine, _ = make()
    first, _ = sub(engine, "t", "c#ephemeral", credit=1)
    second, got2 = attach(engine, "t/c#ephemeral", credit=1)
    pub(engine, "t", b"a", b"b", b"c")
    first.detach()
    assert engine.queue("t/c#ephemeral") is not None
    assert got2.log == [(b"b", 1)]
    second.detach()
    assert engine.queue("t/c#ephemeral") is None
    topic = engine.topic("t")
    assert topic is not None and topic.queues == []


def test_ephemeral_topic_is_deleted_when_its_last_queue_goes() -> None:
    engine, _ = make()
    _first, _ = sub(engine, "t#ephemeral", "c1", credit=1)
    second, _ = sub(engine, "t#ephemeral", "c2#ephemeral", credit=1)
    engine.delete_queue("t#ephemeral/c1")
    assert engine.topic("t#ephemeral") is not None
    second.detach()  # ephemeral channel gone → ephemeral topic has no queue left
    assert engine.topic("t#ephemeral") is None
    assert engine.queues == {}


def test_auto_delete_after_n_seconds_and_cancel_on_reattach() -> None:
    engine, clock = make()
    engine.ensure_queue("q1", auto_delete=5.0)
    engine.bind("q1", "e1")
    consumer, _ = attach(engine, "q1", credit=5, auto_ack=True)
    consumer.detach()
    advance(engine, clock, 4.0)
    assert engine.queue("q1") is not None
    again, got = attach(engine, "q1", credit=5, auto_ack=True)  # cancels the deletion
    advance(engine, clock, 10.0)
    assert engine.queue("q1") is not None
    pub(engine, "e1", b"kept", drop_if_unbound=True)
    assert got.bodies == [b"kept"]
    again.detach()
    advance(engine, clock, 4.999)
    assert engine.queue("q1") is not None
    advance(engine, clock, 0.001)
    assert engine.queue("q1") is None
    pub(engine, "e1", b"dropped", drop_if_unbound=True)
    assert engine.dropped_count == 1


def test_auto_delete_zero_deletes_at_once_when_the_last_consumer_goes() -> None:
    engine, _ = make()
    engine.ensure_queue("q", auto_delete=0.0)
    engine.bind("q", "e")
    first, _ = attach(engine, "q", credit=1)
    second, _ = attach(engine, "q", credit=1)
    first.detach()
    assert engine.queue("q") is not None
    second.detach()
    assert engine.queue("q") is None


def test_finish_many_finishes_in_order_and_reports_what_it_could_not() -> None:
    engine, _ = make()
    consumer, got = sub(engine, "t", "c", credit=10)
    for body in (b"a", b"b", b"c"):
        pub(engine, "t", body)
    ids = [got.id_of(b"a"), -1, got.id_of(b"c"), got.id_of(b"a"), 10**12]
    assert consumer.finish_many(ids) == [(1, Outcome.NOT_IN_FLIGHT), (3, Outcome.NOT_IN_FLIGHT),
                                         (4, Outcome.NOT_IN_FLIGHT)]
    assert list(consumer.in_flight) == [got.id_of(b"b")]


def test_auto_delete_of_an_empty_queue_keeps_one_that_holds_messages() -> None:
    engine, clock = make()
    deleted: list[tuple[str, bool, list[str]]] = []
    engine.on_queue_deleted.append(lambda queue, bound: deleted.append((queue.name, queue.forgotten_empty, bound)))
    engine.ensure_queue("q", auto_delete=5.0, options={AUTO_DELETE_EMPTY_OPTION: True})
    engine.bind("q", "q")
    consumer, got = attach(engine, "q", credit=1)
    pub(engine, "q", b"one")
    pub(engine, "q", b"two")
    consumer.detach()  # "one" goes back: two messages wait
    advance(engine, clock, 5.0)
    assert engine.queue("q") is not None and "q" in engine.topics
    again, got = attach(engine, "q", credit=10)
    assert got.bodies == [b"one", b"two"]
    pub(engine, "q", b"later", delay=30.0)
    for body in (b"one", b"two"):
        again.finish(got.id_of(body))
    again.detach()
    advance(engine, clock, 5.0)
    assert engine.queue("q") is not None  # one deferred message: kept
    last, got = attach(engine, "q", credit=10)
    advance(engine, clock, 30.0)
    assert got.bodies == [b"later"]
    last.finish(got.id_of(b"later"))
    last.detach()
    advance(engine, clock, 4.999)
    assert engine.queue("q") is not None
    advance(engine, clock, 0.001)
    assert engine.queue("q") is None and "q" in engine.topics  # empty: gone (the topic is the protocols' affair)
    assert deleted == [("q", True, ["q"])]  # observers learn it was forgotten, not deleted by an operator


def test_configure_queue_changes_auto_delete() -> None:
    engine, clock = make()
    queue = engine.ensure_queue("q")
    engine.configure_queue(queue, auto_delete=1.0, options={"manual_ack": True})
    assert queue.options == {"manual_ack": True}
    consumer, _ = attach(engine, "q", credit=1)
    consumer.detach()
    advance(engine, clock, 1.0)
    assert engine.queue("q") is None


# -- TTL ----------------------------------------------------------------------------------------


def test_expired_messages_are_not_delivered() -> None:
    engine, clock = make()
    engine.ensure_queue("Foo")
    engine.bind("Foo", "Foo")
    pub(engine, "Foo", b"short", ttl=1.0)
    pub(engine, "Foo", b"long", ttl=10.0)
    pub(engine, "Foo", b"forever")
    advance(engine, clock, 1.0)
    _consumer, got = attach(engine, "Foo", credit=5)
    assert got.bodies == [b"long", b"forever"]
    assert engine.expired_count == 1
    assert got.messages[0].expires_at == clock.now() + 9.0  # the adapter shows the remaining TTL


def test_ttl_expiry_while_in_flight_drops_it_on_redelivery() -> None:
    engine, clock = make()
    _consumer, got = sub(engine, "t", "c", credit=5, msg_timeout=5.0)
    pub(engine, "t", b"a", ttl=3.0)
    advance(engine, clock, 5.0)
    assert got.log == [(b"a", 1)]
    assert engine.expired_count == 1
    queue = engine.queue("t/c")
    assert queue is not None and queue.depth == 0 and queue.in_flight == {}


# -- ids ------------------------------------------------------------------------------------------


def test_publish_many_keeps_order_and_ids_are_consecutive() -> None:
    engine, _ = make()
    _consumer, got = sub(engine, "t", "c", credit=100)
    before = engine.publish("t", b"before")
    first = engine.publish_many("t", bodies("m", 5))
    after = engine.publish("t", b"after")
    assert got.bodies == [b"before", *bodies("m", 5), b"after"]
    assert [m.id for m in got.messages] == list(range(before, after + 1))
    assert first == before + 1
    topic = engine.topic("t")
    assert topic is not None and topic.message_count == 7



def test_publish_many_gives_each_message_its_headers_and_its_publishers_id() -> None:
    engine, _ = make()
    _consumer, got = sub(engine, "t", "c", credit=100)
    engine.publish_many("t", [b"a", b"b"], each_headers=[{"k": "1"}, {"k": "2"}], each_publisher_id=[b"p1", b"p2"])
    engine.publish_many("t", [b"c", b"d"], headers={"k": "shared"}, each_publisher_id=[b"p3", b"p4"])
    engine.publish_many("t", [b"e"], each_headers=[{"k": "5"}])
    assert [(m.body, m.headers, m.publisher_id) for m in got.messages] == [
        (b"a", {"k": "1"}, b"p1"), (b"b", {"k": "2"}, b"p2"), (b"c", {"k": "shared"}, b"p3"),
        (b"d", {"k": "shared"}, b"p4"), (b"e", {"k": "5"}, None)]
    assert shown_headers(got.messages[0]) == {"k": "1", "msg_id": "p1"}
    assert shown_headers(got.messages[4]) == {"k": "5"}

def test_ids_increase_and_are_never_reused() -> None:
    engine, clock = make()
    seen: list[int] = []
    seen.append(engine.publish("t", b"a"))
    seen.append(engine.publish("t", b"b", drop_if_unbound=True))
    seen.append(engine.publish("u", b"c", drop_if_unbound=True))  # dropped, id spent
    seen.append(engine.publish_many("t", [b"d", b"e"]))
    seen.append(seen[-1] + 1)
    engine.publish_many("t", [])
    seen.append(engine.publish("t", b"f", delay=1.0))
    advance(engine, clock, 2.0)
    seen.append(engine.publish("t", b"g"))
    assert seen == sorted(seen)
    assert len(set(seen)) == len(seen)
    assert all(0 < value < 2**64 for value in seen)  # fits NSQ's 16 hex characters


def test_empty_publish_many_does_not_hand_out_an_id_that_is_used_later() -> None:
    engine, _ = make()
    first = engine.publish_many("t", [])
    second = engine.publish("t", b"a")
    assert second != first


# -- a consumer's accept filter, and NSQ's sample_rate through it ------------------------------------


def test_a_copy_the_consumer_refuses_leaves_the_queue_undelivered_and_uncounted(tmp_path: Path) -> None:
    clock = ManualClock()
    store = Store(tmp_path, clock, mem_queue_size=10_000)
    engine = store.engine
    engine.ensure_queue("q")
    engine.bind("q", "q")
    asked: list[bytes] = []

    def odd_only(message: Message) -> bool:
        asked.append(message.body)
        return int(message.body) % 2 == 1

    consumer, got = attach(engine, "q", credit=10, accept=odd_only)
    pub(engine, "q", *(str(n).encode() for n in range(6)))
    assert asked == [b"0", b"1", b"2", b"3", b"4", b"5"]
    assert got.log == [(b"1", 1), (b"3", 1), (b"5", 1)]
    queue = engine.queue("q")
    assert queue is not None and queue.depth == 0 and queue.in_flight.keys() == consumer.in_flight.keys()
    assert consumer.message_count == 3
    for message in got.messages:
        consumer.finish(message.id)
    other, got_other = attach(engine, "q", credit=10)  # no filter: nothing refused was kept for it
    assert got_other.log == [] and other.message_count == 0
    store.close()
    store = Store(tmp_path, clock, mem_queue_size=10_000)  # nor written as still there
    assert store.queue("q").depth == 0
    store.close()


def test_without_a_filter_every_copy_is_delivered() -> None:
    engine, _ = make()
    consumer, got = sub(engine, "t", "c", credit=100)
    assert not consumer.filtered
    pub(engine, "t", *bodies("m", 50))
    assert got.bodies == bodies("m", 50)


def test_sample_rate_zero_delivers_all_and_99_delivers_all() -> None:
    engine, _ = make()
    assert sampler(0) is None
    _off, got_off = sub(engine, "t", "c0", credit=1000, accept=sampler(0))
    _high, got_high = sub(engine, "t", "c99", credit=1000, accept=sampler(99))
    pub(engine, "t", *bodies("m", 500))
    assert got_off.bodies == bodies("m", 500)
    assert got_high.bodies == bodies("m", 500)


def test_sample_rate_one_keeps_a_small_sample_and_counts_only_deliveries() -> None:
    random.seed(1234)
    engine, _ = make()
    consumer, got = sub(engine, "t", "c", credit=10_000, accept=sampler(1))
    pub(engine, "t", *bodies("m", 2000))
    assert 0 < len(got.log) < 100  # about 2 %
    assert all(attempts == 1 for _, attempts in got.log)
    assert got.bodies == sorted(got.bodies, key=lambda body: int(body[1:]))
    queue = engine.queue("t/c")
    assert queue is not None and queue.depth == 0
    assert len(consumer.in_flight) == len(got.log)
    assert consumer.message_count == len(got.log)


# -- re-entrancy: a deliver callback that calls back into the engine --------------------------------


def test_finish_from_inside_deliver_does_not_recurse_per_message() -> None:
    engine, _ = make()
    engine.ensure_queue("q")
    engine.bind("q", "q")
    engine.publish_many("q", bodies("m", 5000))
    seen: list[bytes] = []
    holder: list[Consumer] = []

    def deliver(message: Message) -> None:
        seen.append(message.body)
        holder[0].finish(message.id)

    holder.append(engine.attach("q", deliver, credit=0))
    holder[0].set_credit(1)
    assert seen == bodies("m", 5000)
    assert holder[0].finish_count == 5000


def test_release_from_inside_deliver_does_not_recurse_per_message() -> None:
    engine, _ = make()
    engine.ensure_queue("q")
    engine.bind("q", "q")
    engine.publish_many("q", bodies("m", 5000))
    seen: list[bytes] = []
    holder: list[Consumer] = []

    def deliver(message: Message) -> None:
        seen.append(message.body)
        holder[0].release()

    holder.append(engine.attach("q", deliver, credit=0, auto_ack=True))
    holder[0].set_credit(1)
    assert seen == bodies("m", 5000)


def test_detach_from_inside_deliver_returns_the_message() -> None:
    engine, _ = make()
    engine.ensure_queue("q")
    engine.bind("q", "q")
    holder: list[Consumer] = []

    def deliver(message: Message) -> None:
        holder[0].detach()

    holder.append(engine.attach("q", deliver, credit=5))
    pub(engine, "q", b"a", b"b")
    queue = engine.queue("q")
    assert queue is not None
    assert [m.body for m in queue.ready] == [b"a", b"b"] and queue.in_flight == {}
    _other, got = attach(engine, "q", credit=5)
    assert got.log == [(b"a", 2), (b"b", 1)]


@pytest.mark.parametrize("mode", [CreditMode.WINDOW, CreditMode.TOKENS])
def test_unknown_queue_attach_raises(mode: CreditMode) -> None:
    engine, _ = make()
    with pytest.raises(KeyError):
        engine.attach("nope", Recorder(), credit=1, mode=mode)


def test_req_from_a_consumer_without_credit_goes_to_a_waiting_consumer() -> None:
    # pynsq's backoff: RDY 0, then REQ. Another consumer of the channel has credit and must get it.
    engine, _ = make()
    engine.ensure_queue("t/c")
    engine.bind("t/c", "t")
    first, got1 = attach(engine, "t/c", credit=1)
    [message_id] = pub(engine, "t", b"a")
    second, got2 = attach(engine, "t/c", credit=1)
    first.set_credit(0)
    assert first.requeue(message_id) is Outcome.OK
    assert got1.log == [(b"a", 1)]
    assert got2.log == [(b"a", 2)]
    queue = engine.queue("t/c")
    assert queue is not None and queue.depth == 0 and list(queue.in_flight) == [message_id]
    assert second.in_flight and not first.in_flight


def test_auto_delete_turned_off_while_pending_keeps_the_queue() -> None:
    engine, clock = make()
    queue = engine.ensure_queue("q", auto_delete=5.0)
    consumer, _ = attach(engine, "q", credit=1)
    consumer.detach()
    engine.configure_queue(queue, auto_delete=None, options={})
    advance(engine, clock, 10.0)
    assert engine.queue("q") is queue


# -- patterns the other protocols build from these calls -------------------------------------------


def test_mqks_disconnect_rejects_to_the_tail_with_retry_plus_one() -> None:
    # MQKS delete_consumer = reject every unacked message (tail, retry+1), then go away. The
    # adapter closes the window first, or requeue_all would hand the dying consumer the next one.
    engine, _ = make()
    engine.ensure_queue("q1")
    engine.bind("q1", "e1")
    consumer, got = attach(engine, "q1", credit=2, auto_ack=False)
    pub(engine, "e1", b"d1", b"d2", b"d3", drop_if_unbound=True)
    assert got.bodies == [b"d1", b"d2"]
    consumer.set_credit(0)
    assert consumer.requeue_all() == 2
    assert got.bodies == [b"d1", b"d2"]
    consumer.detach()
    other, got2 = attach(engine, "q1", credit=10)
    assert got2.log == [(b"d3", 1), (b"d1", 2), (b"d2", 2)]
    assert other.message_count == 3


def test_phpmq_disconnect_returns_messages_ahead_of_newer_ones() -> None:
    engine, _ = make()
    engine.ensure_queue("Foo")
    engine.bind("Foo", "Foo")
    window, _got = attach(engine, "Foo", credit=2)  # 002 Foo 2, no ack timeout
    pub(engine, "Foo", b"1", b"2", b"3")
    window.detach()
    pub(engine, "Foo", b"4")
    _other, got2 = attach(engine, "Foo", credit=10)
    assert got2.bodies == [b"1", b"2", b"3", b"4"]


def test_pzq_nack_resends_at_once() -> None:
    engine, _ = make()
    engine.ensure_queue("pzq")
    engine.bind("pzq", "pzq")
    consumer, got = attach(engine, "pzq", credit=1, msg_timeout=5.0)
    [key] = pub(engine, "pzq", b"job")
    assert consumer.requeue(key) is Outcome.OK  # status other than "1"
    assert got.log == [(b"job", 1), (b"job", 2)]


def test_emqp_ready_tokens_shared_by_competing_workers() -> None:
    engine, _ = make()
    engine.ensure_queue("email")
    engine.bind("email", "email")
    w1, got1 = attach(engine, "email", mode=CreditMode.TOKENS, auto_ack=True)
    w2, got2 = attach(engine, "email", mode=CreditMode.TOKENS, auto_ack=True)
    w1.add_credit()
    w2.add_credit()
    pub(engine, "email", b"j1", b"j2", b"j3")
    assert got1.bodies == [b"j1"] and got2.bodies == [b"j2"]
    w2.add_credit()
    assert got2.bodies == [b"j2", b"j3"]
    queue = engine.queue("email")
    assert queue is not None and queue.depth == 0 and queue.in_flight == {}


def pooled_worker(engine: Engine, queues: list[str], priority: int = 0) -> tuple[CreditPool, Recorder]:
    """An eMQP-style worker: one consumer per queue, all spending one pool, one recorder."""
    pool = CreditPool()
    recorder = Recorder()
    for name in queues:
        engine.ensure_queue(name)
        engine.bind(name, name)
        engine.attach(name, recorder, mode=CreditMode.TOKENS, pool=pool, priority=priority)
    return pool, recorder


def test_a_credit_pool_serves_the_queues_in_the_order_the_worker_joined_them() -> None:
    engine, _ = make()
    pool, got = pooled_worker(engine, ["first", "second"])
    pub(engine, "second", b"s1", b"s2")
    pub(engine, "first", b"f1")
    assert got.bodies == []  # no tokens yet
    pool.add(1)
    assert got.bodies == [b"f1"] and pool.tokens == 0
    pool.add(1)
    assert got.bodies == [b"f1", b"s1"]
    pool.add(5)
    assert got.bodies == [b"f1", b"s1", b"s2"] and pool.tokens == 4
    pub(engine, "second", b"s3")
    pub(engine, "first", b"f2")
    assert got.bodies[3:] == [b"s3", b"f2"] and pool.tokens == 2
    # In flight in both queues, each under the worker's own consumer there.
    for name, count in (("first", 2), ("second", 3)):
        queue = engine.queue(name)
        assert queue is not None and len(queue.in_flight) == count and queue.depth == 0


def test_a_spent_pool_leaves_the_message_for_a_worker_with_tokens() -> None:
    engine, _ = make()
    pool_a, got_a = pooled_worker(engine, ["jobs", "other"])
    pool_b, got_b = pooled_worker(engine, ["jobs"])
    pool_a.add(1)
    pub(engine, "other", b"o1")  # spends a's only token
    pool_b.add(1)
    pub(engine, "jobs", b"j1", b"j2")
    assert got_a.bodies == [b"o1"] and got_b.bodies == [b"j1"]
    pool_a.add(1)
    assert got_a.bodies == [b"o1", b"j2"]
    assert pool_a.tokens == 0 and pool_b.tokens == 0


def test_higher_priority_is_served_first_and_equal_priorities_take_turns() -> None:
    engine, _ = make()
    heavy1, got_h1 = pooled_worker(engine, ["q"], priority=30)
    light, got_l = pooled_worker(engine, ["q"], priority=10)
    heavy2, got_h2 = pooled_worker(engine, ["q"], priority=30)
    for pool in (light, heavy1, heavy2):
        pool.add(2)
    pub(engine, "q", *bodies("m", 6))
    assert got_h1.bodies == [b"m0", b"m2"]
    assert got_h2.bodies == [b"m1", b"m3"]
    assert got_l.bodies == [b"m4", b"m5"]


def test_a_lower_priority_worker_gets_work_while_the_higher_one_has_no_tokens() -> None:
    engine, _ = make()
    heavy, got_h = pooled_worker(engine, ["q"], priority=50)
    light, got_l = pooled_worker(engine, ["q"], priority=1)
    light.add(1)
    pub(engine, "q", b"a")
    heavy.add(1)
    pub(engine, "q", b"b")
    light.add(1)
    heavy.add(1)  # both have a token now: the heavier one takes the next
    pub(engine, "q", b"c")
    assert got_l.bodies == [b"a"] and got_h.bodies == [b"b", b"c"]


def test_detaching_a_pooled_consumer_returns_its_messages_and_leaves_the_pool() -> None:
    engine, _ = make()
    pool, got = pooled_worker(engine, ["q"])
    other_pool, got_other = pooled_worker(engine, ["q"])
    pool.add(2)
    pub(engine, "q", b"x", b"y")
    assert got.bodies == [b"x", b"y"]
    [consumer] = pool.consumers
    consumer.detach()
    assert pool.consumers == []
    other_pool.add(2)
    assert got_other.log == [(b"x", 2), (b"y", 2)]


def test_deliver_callback_publishing_to_its_own_queue_is_delivered_after() -> None:
    engine, _ = make()
    engine.ensure_queue("q")
    engine.bind("q", "q")
    seen: list[bytes] = []

    def deliver(message: Message) -> None:
        seen.append(message.body)
        if message.body == b"first":
            engine.publish("q", b"second")

    engine.attach("q", deliver, credit=5)
    pub(engine, "q", b"first")
    assert seen == [b"first", b"second"]


def test_set_bindings_replaces_and_adds_without_duplicates() -> None:
    engine, _ = make()
    engine.ensure_queue("q")
    engine.set_bindings("q", ["e1", "e2", "e1"])
    queue = engine.queue("q")
    assert queue is not None and queue.topics == ["e1", "e2"]
    engine.set_bindings("q", ["e2", "e3"])
    assert queue.topics == ["e2", "e3"]
    e1 = engine.topic("e1")
    assert e1 is not None and e1.queues == []
    engine.bind("q", "e3")
    e3 = engine.topic("e3")
    assert e3 is not None and e3.queues == [queue]


def test_ephemeral_channel_deleted_from_inside_deliver() -> None:
    engine, _ = make()
    sub_consumer: list[Consumer] = []

    def deliver(message: Message) -> None:
        sub_consumer[0].detach()  # the connection died while writing

    engine.ensure_queue("t/c#ephemeral", ephemeral=True)
    engine.bind("t/c#ephemeral", "t")
    sub_consumer.append(engine.attach("t/c#ephemeral", deliver, credit=5))
    pub(engine, "t", b"a")
    assert engine.queue("t/c#ephemeral") is None  # "a" went with it
    topic = engine.topic("t")
    assert topic is not None and topic.queues == []
    pub(engine, "t", b"b")
    assert [m.body for m in topic.backlog] == [b"b"]


def test_ephemeral_queues_and_topics_are_never_reported_to_storage(tmp_path: Path) -> None:
    clock = ManualClock()
    storage = DiskStorage(tmp_path, clock)
    engine = Engine(clock=clock, storage=storage)
    engine.restore()
    consumer, _ = sub(engine, "t#ephemeral", "c#ephemeral", credit=1)
    pub(engine, "t#ephemeral", b"a")
    assert consumer.queue.log is None and engine.topics["t#ephemeral"].log is None
    consumer.finish(next(iter(consumer.in_flight)))
    consumer.detach()
    assert not storage.has_work()  # nothing was written for them
    sub(engine, "d", "c", credit=1)
    pub(engine, "d", b"x")
    job, written, callbacks = storage.prepare()
    FileWriter().run(job)
    storage.complete(job, written, callbacks)
    journal = [records.decode_meta(payload) for _, _, payload in records.scan((tmp_path / "meta.log").read_bytes())]
    assert {change.get("name") for change in journal} == {None, "d", "d/c"}  # None: the id high-water mark
    assert len([p for p in tmp_path.iterdir() if p.is_dir()]) == 1  # the log of d/c, the one message's copy
    storage.close()


def test_finish_without_refill_waits_for_refill_then_dispatches_once() -> None:
    engine, _ = make()
    consumer, got = sub(engine, "t", "c", credit=2)
    a, b, _c, _d = pub(engine, "t", b"a", b"b", b"c", b"d")
    assert consumer.finish(a, refill=False) is Outcome.OK
    assert consumer.finish(b, refill=False) is Outcome.OK
    assert got.bodies == [b"a", b"b"]  # the freed slots wait
    assert consumer.finish(a, refill=False) is Outcome.NOT_IN_FLIGHT
    consumer.refill()
    assert got.bodies == [b"a", b"b", b"c", b"d"]
    assert consumer.finish_count == 2 and len(consumer.in_flight) == 2


# -- acknowledgements by id from any session, requeue to the tail with a TTL, dead letters ------------


def phpmq_queue(engine: Engine, name: str = "Foo", **options: Any) -> None:
    engine.ensure_queue(name, options=options or None)
    engine.bind(name, name)


def test_finish_any_acknowledges_for_the_holder_and_frees_its_window_slot() -> None:
    engine, _ = make()
    phpmq_queue(engine)
    holder, got = attach(engine, "Foo", credit=1)
    pub(engine, "Foo", b"a", b"b")
    assert got.bodies == [b"a"]
    queue = engine.queue("Foo")
    assert queue is not None
    assert queue.finish_any(got.id_of(b"a")) is Outcome.OK  # from another session: no consumer of its own
    assert got.bodies == [b"a", b"b"], "the holder's slot came back, so the next message flowed"
    assert holder.finish_count == 1 and queue.in_flight.keys() == {got.id_of(b"b")}
    assert queue.finish_any(got.id_of(b"a")) is Outcome.NOT_IN_FLIGHT
    assert queue.finish_any(12345) is Outcome.NOT_IN_FLIGHT


def test_requeue_to_tail_keeps_id_and_attempts_and_sets_a_new_ttl() -> None:
    engine, clock = make()
    phpmq_queue(engine)
    pub(engine, "Foo", b"a", ttl=10)
    pub(engine, "Foo", b"b")
    consumer, got = attach(engine, "Foo", credit=1)
    first = got.messages[0]
    queue = engine.queue("Foo")
    assert queue is not None
    assert queue.requeue_to_tail(first.id, 100.0) is Outcome.OK
    consumer.set_credit(3)
    assert got.log == [(b"a", 1), (b"b", 1), (b"a", 2)], "behind b, one attempt more"
    again = got.messages[2]
    assert again.id == first.id and again.expires_at == clock.now() + 100.0
    assert queue.requeue_to_tail(again.id, None) is Outcome.OK
    assert got.messages[3].expires_at is None and queue.requeue_count == 2
    assert queue.requeue_to_tail(999, 1.0) is Outcome.NOT_IN_FLIGHT


def test_ttl_runs_out_in_the_queue_and_is_counted_per_queue() -> None:
    engine, clock = make()
    phpmq_queue(engine)
    pub(engine, "Foo", b"short", ttl=5)
    pub(engine, "Foo", b"long", ttl=50)
    advance(engine, clock, 6)
    _, got = attach(engine, "Foo", credit=5)
    queue = engine.queue("Foo")
    assert got.bodies == [b"long"]
    assert queue is not None and queue.expired_count == 1 and engine.expired_count == 1


def test_dead_letter_goes_to_the_dead_letter_topic_whose_first_queue_gets_it() -> None:
    engine, _ = make()
    phpmq_queue(engine)
    _, _got = attach(engine, "Foo", credit=5)
    [key] = pub(engine, "Foo", b"poison", headers={"msg_id": "m1"})
    queue = engine.queue("Foo")
    assert queue is not None and queue.dead_letter(key) is Outcome.OK
    assert queue.in_flight == {} and queue.depth == 0 and queue.dead_letter_count == 1
    dead = engine.topic("Foo.dead")
    assert dead is not None and dead.depth == 1, "kept for the first queue bound to it"
    phpmq_queue(engine, "Foo.dead")
    _, letters = attach(engine, "Foo.dead", credit=5)
    [letter] = letters.messages
    assert (letter.id, letter.body, letter.attempts) == (key, b"poison", 1)
    assert letter.headers == {"msg_id": "m1", "dead_letter_queue": "Foo", "dead_letter_reason": "rejected"}
    assert queue.dead_letter(key) is Outcome.NOT_IN_FLIGHT


@pytest.mark.parametrize("how", ["requeue", "timeout", "detach", "requeue_to_tail"])
def test_max_attempts_dead_letters_a_message_that_keeps_coming_back(how: str) -> None:
    engine, clock = make()
    phpmq_queue(engine, max_attempts=2)
    queue = engine.queue("Foo")
    assert queue is not None and queue.max_attempts == 2
    pub(engine, "Foo", b"flaky")
    consumer, got = attach(engine, "Foo", credit=1, msg_timeout=30.0)
    for attempt in (1, 2):
        assert got.log[-1] == (b"flaky", attempt) and len(got.log) == attempt
        message_id = got.messages[-1].id
        if how == "requeue":
            consumer.requeue(message_id)
        elif how == "timeout":
            advance(engine, clock, 31)
        elif how == "requeue_to_tail":
            queue.requeue_to_tail(message_id, None)
        else:
            consumer.detach()
            consumer, again = attach(engine, "Foo", credit=1, msg_timeout=30.0)
            got.messages += again.messages
            got.log += again.log
    assert len(got.log) == 2, "never delivered a third time"
    assert queue.depth == 0 and queue.in_flight == {} and queue.dead_letter_count == 1
    phpmq_queue(engine, "Foo.dead")
    _, letters = attach(engine, "Foo.dead", credit=5)
    assert letters.bodies == [b"flaky"]
    assert letters.messages[0].headers == {"dead_letter_queue": "Foo", "dead_letter_reason": "max attempts"}


def test_dead_letters_go_to_the_queue_name_dot_dead_unless_the_queue_names_their_topic() -> None:
    engine, _ = make()
    engine.ensure_queue("a/b")
    engine.ensure_queue("c", options={DEAD_LETTER_TOPIC_OPTION: "graveyard"})
    keys = {}
    for name in ("a/b", "c"):
        engine.bind(name, name)
        attach(engine, name, credit=1)
        [keys[name]] = pub(engine, name, b"x")
    a_b, c = engine.queue("a/b"), engine.queue("c")
    assert a_b is not None and c is not None
    assert a_b.dead_letter_topic == "a/b.dead" and c.dead_letter_topic == "graveyard"
    assert a_b.dead_letter(keys["a/b"]) is Outcome.OK and c.dead_letter(keys["c"]) is Outcome.OK
    assert {name: topic.depth for name, topic in engine.topics.items()} == {"a/b": 0, "c": 0, "a/b.dead": 1,
                                                                            "graveyard": 1}


def test_an_nsq_channel_dead_letters_to_a_topic_nsq_can_subscribe_to() -> None:
    engine, _ = make()
    _consumer, _got = sub(engine, "orders", "billing", credit=1)
    [key] = pub(engine, "orders", b"x")
    queue = engine.queue("orders/billing")
    assert queue is not None and queue.dead_letter(key, "bad order") is Outcome.OK
    _, letters = sub(engine, "orders.billing.dead", "ops", credit=5)
    assert letters.bodies == [b"x"] and letters.messages[0].headers["dead_letter_reason"] == "bad order"


def test_retry_first_puts_timed_out_and_requeued_messages_back_ahead_of_the_rest() -> None:
    """PZQ's order: a message whose ACK did not come (or came as 0) is the next one sent."""
    engine, clock = make()
    engine.ensure_queue("pzq")
    engine.bind("pzq", "pzq")
    consumer, got = attach(engine, "pzq", credit=2, msg_timeout=5.0, retry_first=True)
    pub(engine, "pzq", b"1", b"2", b"3", b"4")
    assert got.bodies == [b"1", b"2"]
    advance(engine, clock, 6)  # both timed out: back at the front, in order
    assert got.bodies == [b"1", b"2", b"1", b"2"]
    assert consumer.requeue(got.id_of(b"2")) is Outcome.OK  # a NACK: again at once, before 3 and 4
    assert got.log[-1] == (b"2", 3)
    consumer.finish(got.id_of(b"1"))
    consumer.finish(got.id_of(b"2"))
    assert got.bodies[-2:] == [b"3", b"4"]


def test_a_queue_counts_its_deliveries_and_acknowledgements() -> None:
    engine, clock = make()
    queue = engine.ensure_queue("q")
    engine.bind("q", "t")
    consumer, got = attach(engine, "q", credit=10, msg_timeout=5.0)
    pub(engine, "t", b"fin", b"req", b"late", b"any")
    assert (queue.message_count, queue.delivered_count, queue.finished_count) == (4, 4, 0)
    assert consumer.finish(got.id_of(b"fin")) is Outcome.OK
    assert consumer.finish(got.id_of(b"fin")) is Outcome.NOT_IN_FLIGHT  # not counted twice
    assert consumer.requeue(got.id_of(b"req")) is Outcome.OK  # delivered again at once
    assert (queue.delivered_count, queue.finished_count, queue.requeue_count) == (5, 1, 1)
    assert queue.finish_any(got.id_of(b"any")) is Outcome.OK  # by id, from anywhere (PHPMQ)
    assert consumer.finish(got.id_of(b"req")) is Outcome.OK
    advance(engine, clock, 5.0)  # `late` times out and is sent again
    assert (queue.delivered_count, queue.finished_count, queue.timeout_count) == (6, 3, 1)
    consumer.detach()

    _auto, auto_got = attach(engine, "q", credit=10, auto_ack=True)  # acknowledged as it is delivered
    pub(engine, "t", b"a", b"b")
    assert auto_got.bodies == [b"late", b"a", b"b"]
    assert (queue.delivered_count, queue.finished_count) == (9, 6)
