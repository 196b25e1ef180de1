"""A hypothesis state machine over the queue engine, driven by a ManualClock.

Random sequences of publish / bind / attach / set_credit / release / finish / requeue / touch /
detach / pause / delete / advance-clock, with the engine's invariants checked after every step
and at every delivery:

- no message copy is lost or duplicated: each copy a queue received is ready, deferred or in
  flight exactly once until it is finished, auto-acked, expired (TTL) or its queue is deleted;
  a topic with no bound queue (or a paused topic) keeps a backlog, which the first bound queue
  receives; `drop_if_unbound` publishes to such a topic vanish;
- a window-mode consumer never holds more than its credit at a delivery; tokens never go negative;
- queue.in_flight is exactly the disjoint union of its consumers' in_flight;
- attempts == the number of deliveries of that copy;
- nothing stalls: a queue that is not paused has no ready message while a consumer has credit;
- time: every in-flight deadline and every deferred due time is still in the future after the
  due timers ran, no live timer is overdue, and live timers stay few (one per consumer, two per queue);
- storage: the real embedded store's logs count exactly the copies the engine holds, and a restart
  from a copy of its files at any step brings back every held copy with its attempts and due time.
"""

from __future__ import annotations

import random
import shutil
import tempfile
from collections import Counter, defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from polymq.core.clock import ManualClock
from polymq.core.disk_io import FileWriter
from polymq.core.disk_storage import DiskStorage, FsyncPolicy
from polymq.core.engine import Consumer, CreditMode, Engine, Message, Outcome, Queue


class CommittingStorage:
    """The real embedded store, committing synchronously in the test's thread when asked (a wrapper:
    the store may be a compiled class, which interpreted classes cannot inherit from)."""

    def __init__(self, directory: Path, clock: ManualClock) -> None:
        self.store = DiskStorage(directory, clock, policy=FsyncPolicy("never"))
        self.writer = FileWriter()

    def commit(self) -> None:
        job, written, callbacks = self.store.prepare()
        self.writer.run(job)
        assert job.error is None
        self.store.complete(job, written, callbacks)


def held_copies(queue: Queue) -> list[Message]:
    return [*queue.ready, *(m for _, _, m in queue.deferred), *queue.in_flight.values()]


TOPICS = ("t", "u", "v")
# queue name → topics it is bound to when it exists. "t/a" always exists; the others come and go.
QUEUES = {"t/a": ("t",), "t/b": ("t",), "u/x": ("u",), "q": ("t", "u")}
ADVANCES = st.sampled_from([0.001, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0])
PUBLISH_TOPICS = st.sampled_from(["t", "t", "t", "t", "u", "v"])
MODES = st.sampled_from([CreditMode.WINDOW, CreditMode.WINDOW, CreditMode.TOKENS])
AUTO_ACK = st.sampled_from([False, False, True])
MSG_TIMEOUTS = st.sampled_from([None, 3.0, 3.0, 10.0])
MAX_MSG_TIMEOUTS = st.sampled_from([None, 12.0, 60.0])
CONSUMER_OPTIONS = st.fixed_dictionaries({
    "credit": st.integers(1, 4), "mode": MODES, "auto_ack": AUTO_ACK, "msg_timeout": MSG_TIMEOUTS,
    "max_msg_timeout": MAX_MSG_TIMEOUTS,
})


def has_in_flight(machine: EngineMachine) -> bool:
    return any(c.in_flight for c in machine.consumers)


class EngineMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.clock = ManualClock()
        self.dir = Path(tempfile.mkdtemp(prefix="polymq-stateful-"))
        self.storage = CommittingStorage(self.dir, self.clock)
        self.engine = Engine(clock=self.clock, storage=self.storage.store)
        self.engine.restore()
        # The model.
        self.alive: dict[str, set[int]] = {}  # queue → ids of copies not done yet
        self.backlog: dict[str, list[int]] = defaultdict(list)
        self.expires: dict[int, float] = {}  # id → when its TTL runs out
        self.deliveries: Counter[tuple[str, int]] = Counter()
        self.consumers: list[Consumer] = []
        self.closed: list[Consumer] = []
        self.expired = 0
        self.dropped = 0
        self.create_queue("t/a")

    # -- helpers -------------------------------------------------------------------------------

    def create_queue(self, name: str) -> None:
        engine = self.engine
        assert engine.queue(name) is None
        engine.ensure_queue(name)
        self.alive[name] = set()
        for topic_name in QUEUES[name]:
            topic = engine.topic(topic_name)
            if topic is not None and not topic.queues and not topic.paused:
                # The first bound queue receives the topic's backlog (model first: the engine
                # delivers during `bind`).
                self.alive[name].update(self.backlog.pop(topic_name, []))
            engine.bind(name, topic_name)

    def deliver_for(self, queue_name: str) -> Callable[[Message], None]:
        holder: list[Consumer] = []

        def deliver(message: Message) -> None:
            consumer = holder[0]
            key = (queue_name, message.id)
            assert message.id in self.alive[queue_name], "delivered a copy that is not alive"
            self.deliveries[key] += 1
            assert message.attempts == self.deliveries[key]
            assert message.expires_at is None or message.expires_at > self.clock.now()
            if consumer.mode is CreditMode.TOKENS:
                assert consumer.credit >= 0
            elif consumer.auto_ack:
                assert consumer.outstanding <= consumer.credit
            else:
                assert len(consumer.in_flight) <= consumer.credit
            if consumer.auto_ack:
                assert message.owner is None
                self.alive[queue_name].discard(message.id)
            else:
                assert message.owner is consumer and consumer.in_flight.get(message.id) is message

        deliver.holder = holder  # type: ignore[attr-defined]
        return deliver

    def pick(self, index: int) -> Consumer:
        return self.consumers[index % len(self.consumers)]

    def publish_to(self, topic_name: str, ids: list[int], dropped: bool) -> None:
        if dropped:
            self.dropped += len(ids)
            return
        topic = self.engine.topic(topic_name)
        if topic is None or topic.paused or not topic.queues:
            self.backlog[topic_name].extend(ids)
        else:
            for queue in topic.queues:
                self.alive[queue.name].update(ids)

    def will_drop(self, topic_name: str) -> bool:
        topic = self.engine.topic(topic_name)
        return topic is None or not topic.queues

    # -- rules ---------------------------------------------------------------------------------

    @initialize(consumers=st.lists(CONSUMER_OPTIONS, min_size=1, max_size=3))
    def start_consumers(self, consumers: list[dict[str, Any]]) -> None:
        for options in consumers:
            self.attach(name="t/a", **options)

    @rule(topic=PUBLISH_TOPICS, delay=st.sampled_from([0.0, 0.0, 0.0, 1.0, 3.0]),
          ttl=st.sampled_from([None, None, None, 2.0, 7.0]), drop=st.sampled_from([False, False, True]))
    def publish(self, topic: str, delay: float, ttl: float | None, drop: bool) -> None:
        # The model learns of the copies first: the engine delivers them during the call.
        expected = self.engine.ids.last + 1
        if ttl is not None:
            self.expires[expected] = self.clock.now() + ttl
        self.publish_to(topic, [expected], drop and self.will_drop(topic))
        message_id = self.engine.publish(topic, b"m", delay=delay, ttl=ttl, drop_if_unbound=drop)
        assert message_id == expected

    @rule(topic=PUBLISH_TOPICS, count=st.integers(1, 4))
    def publish_many(self, topic: str, count: int) -> None:
        expected = self.engine.ids.last + 1
        self.publish_to(topic, list(range(expected, expected + count)), False)
        assert self.engine.publish_many(topic, [b"x"] * count) == expected

    @rule(name=st.sampled_from(sorted(set(QUEUES) - {"t/a"})))
    def add_or_delete_queue(self, name: str) -> None:
        queue = self.engine.queue(name)
        if queue is None:
            self.create_queue(name)
            return
        gone = [c for c in self.consumers if c.queue is queue]
        assert self.engine.delete_queue(name)
        for consumer in gone:
            assert consumer.closed
            self.consumers.remove(consumer)
            self.closed.append(consumer)
        del self.alive[name]

    @rule(name=st.sampled_from(sorted(QUEUES)), credit=st.integers(0, 4), mode=MODES, auto_ack=AUTO_ACK,
          msg_timeout=MSG_TIMEOUTS, max_msg_timeout=MAX_MSG_TIMEOUTS)
    def attach(self, name: str, credit: int, mode: CreditMode, auto_ack: bool, msg_timeout: float | None,
               max_msg_timeout: float | None) -> None:
        if self.engine.queue(name) is None or len(self.consumers) >= 6:
            return
        deliver = self.deliver_for(name)
        consumer = self.engine.attach(name, deliver, credit=0, mode=mode, auto_ack=auto_ack,
                                      msg_timeout=msg_timeout, max_msg_timeout=max_msg_timeout)
        deliver.holder.append(consumer)  # type: ignore[attr-defined]
        self.consumers.append(consumer)
        consumer.set_credit(credit)

    @precondition(lambda self: self.consumers)
    @rule(index=st.integers(0, 100), credit=st.integers(0, 5), add=st.booleans())
    def credit(self, index: int, credit: int, add: bool) -> None:
        consumer = self.pick(index)
        if add:
            consumer.add_credit(max(credit, 1))  # eMQP READY, or a wider RDY window
        else:
            consumer.set_credit(credit)  # NSQ RDY, PHPMQ 002

    @precondition(lambda self: any(c.outstanding > 0 for c in self.consumers))
    @rule(index=st.integers(0, 100), count=st.integers(1, 3))
    def release(self, index: int, count: int) -> None:
        candidates = [c for c in self.consumers if c.outstanding > 0]
        consumer = candidates[index % len(candidates)]
        consumer.release(min(count, consumer.outstanding))

    def pick_in_flight(self, index: int, which: int) -> tuple[Consumer, int] | None:
        holders = [c for c in self.consumers if c.in_flight]
        if not holders:
            return None
        consumer = holders[index % len(holders)]
        ids = list(consumer.in_flight)
        return consumer, ids[which % len(ids)]

    @precondition(has_in_flight)
    @rule(index=st.integers(0, 100), which=st.integers(0, 100))
    def finish(self, index: int, which: int) -> None:
        picked = self.pick_in_flight(index, which)
        if picked is None:
            return
        consumer, message_id = picked
        assert consumer.finish(message_id) is Outcome.OK
        self.alive[consumer.queue.name].discard(message_id)
        assert consumer.finish(message_id) is Outcome.NOT_IN_FLIGHT

    @precondition(has_in_flight)
    @rule(index=st.integers(0, 100), which=st.integers(0, 100), delay=st.sampled_from([0.0, 0.0, 0.5, 2.0]))
    def requeue(self, index: int, which: int, delay: float) -> None:
        picked = self.pick_in_flight(index, which)
        if picked is None:
            return
        consumer, message_id = picked
        assert consumer.requeue(message_id, delay) is Outcome.OK

    @precondition(has_in_flight)
    @rule(index=st.integers(0, 100), which=st.integers(0, 100))
    def touch(self, index: int, which: int) -> None:
        picked = self.pick_in_flight(index, which)
        if picked is None:
            return
        consumer, message_id = picked
        message = consumer.in_flight[message_id]
        assert consumer.touch(message_id) is Outcome.OK
        if consumer.msg_timeout is not None:
            expected = self.clock.now() + consumer.msg_timeout
            if consumer.max_msg_timeout is not None:
                expected = min(expected, message.delivered_at + consumer.max_msg_timeout)
            assert message.deadline == expected

    @precondition(has_in_flight)
    @rule(index=st.integers(0, 100), which=st.integers(0, 100))
    def ack_by_another_consumer(self, index: int, which: int) -> None:
        picked = self.pick_in_flight(index, which)
        if picked is None:
            return
        owner, message_id = picked
        # Every other consumer of that queue, attached or gone, is refused (the other queues hold
        # copies of their own under the same id).
        for other in self.consumers + self.closed:
            if other is not owner and other.queue is owner.queue:
                assert other.finish(message_id) is Outcome.NOT_OWNED
                assert other.requeue(message_id) is Outcome.NOT_OWNED
                assert other.touch(message_id) is Outcome.NOT_OWNED

    @precondition(has_in_flight)
    @rule(index=st.integers(0, 100), which=st.integers(0, 100), how=st.sampled_from(["finish", "tail", "dead"]))
    def by_id_from_any_session(self, index: int, which: int, how: str) -> None:
        """PHPMQ's acks, requeues (005) and dead letters (006): by queue and id, whoever holds it."""
        picked = self.pick_in_flight(index, which)
        if picked is None:
            return
        consumer, message_id = picked
        queue = consumer.queue
        if how == "finish":
            assert queue.finish_any(message_id) is Outcome.OK
            self.alive[queue.name].discard(message_id)
        elif how == "tail":
            self.expires.pop(message_id, None)  # its new TTL: none (copies elsewhere keep theirs)
            assert queue.requeue_to_tail(message_id, None) is Outcome.OK
        else:
            assert queue.dead_letter(message_id) is Outcome.OK
            self.alive[queue.name].discard(message_id)
        if how != "tail":  # a requeued copy may go straight back out (it is the tail, maybe also the head)
            assert message_id not in consumer.in_flight
            assert queue.finish_any(message_id) is Outcome.NOT_IN_FLIGHT

    @precondition(lambda self: self.consumers)
    @rule(index=st.integers(0, 100))
    def detach(self, index: int) -> None:
        consumer = self.pick(index)
        self.consumers.remove(consumer)
        self.closed.append(consumer)
        consumer.detach()
        assert consumer.closed and consumer.in_flight == {}

    @rule(name=st.sampled_from([*sorted(QUEUES), *TOPICS]), paused=st.booleans())
    def pause(self, name: str, paused: bool) -> None:
        if name in QUEUES:
            queue = self.engine.queue(name)
            if queue is not None:
                queue.set_paused(paused)
            return
        topic = self.engine.topic(name)
        if topic is None:
            return
        if not paused and topic.queues and self.backlog.get(name):
            ids = self.backlog.pop(name)
            for queue in topic.queues:
                self.alive[queue.name].update(ids)
        topic.set_paused(paused)

    @rule(seconds=ADVANCES)
    def advance(self, seconds: float) -> None:
        self.clock.advance(seconds)
        self.engine.run_timers()

    # -- invariants ----------------------------------------------------------------------------

    @invariant()
    def copies_are_conserved(self) -> None:
        engine = self.engine
        now = self.clock.now()
        assert set(engine.queues) == set(self.alive)
        for name, queue in engine.queues.items():
            ready = [m.id for m in queue.ready]
            deferred = [m.id for _, _, m in queue.deferred]
            in_flight = list(queue.in_flight)
            held = Counter(ready + deferred + in_flight)
            duplicated = [i for i, n in held.items() if n > 1]
            assert not duplicated, f"{name}: copies held twice: {duplicated}"
            model = self.alive[name]
            extra = set(held) - model
            assert not extra, f"{name}: copies the model does not know: {extra}"
            missing = model - set(held)
            # Only expired copies may vanish (dropped when dispatch reached them).
            for message_id in missing:
                assert self.expires.get(message_id, now + 1) <= now, f"{name}: copy {message_id} lost"
            self.expired += len(missing)
            model -= missing
            for message in queue.ready:
                assert message.owner is None
            for message in [*queue.ready, *(m for _, _, m in queue.deferred), *queue.in_flight.values()]:
                assert message.attempts == self.deliveries[(name, message.id)]
            for due, _, message in queue.deferred:
                assert due > now, f"{name}: deferred copy {message.id} not released at {due} (now {now})"
        assert engine.expired_count == self.expired
        assert engine.dropped_count == self.dropped
        for name in TOPICS:
            topic = engine.topic(name)
            backlog = [] if topic is None else [m.id for m in topic.backlog]
            assert backlog == self.backlog.get(name, [])

    @invariant()
    def in_flight_is_the_union_of_the_consumers(self) -> None:
        now = self.clock.now()
        for queue in self.engine.queues.values():
            union: dict[int, Message] = {}
            for consumer in queue.consumers:
                assert not consumer.closed
                for message_id, message in consumer.in_flight.items():
                    assert message_id not in union
                    assert message.owner is consumer
                    if consumer.msg_timeout is None:
                        assert message.deadline is None
                    else:
                        assert message.deadline is not None and message.deadline > now, "missed timeout"
                    union[message_id] = message
            assert union.keys() == queue.in_flight.keys()
            assert all(union[i] is queue.in_flight[i] for i in union)
            assert set(map(id, queue.consumers)) == {id(c) for c in self.consumers if c.queue is queue}
        for consumer in self.closed:
            assert consumer.closed and consumer.in_flight == {} and not consumer.in_ring

    @invariant()
    def nothing_stalls(self) -> None:
        for queue in self.engine.queues.values():
            ring = list(queue.ring)
            assert len({id(c) for c in ring}) == len(ring)
            for consumer in queue.consumers:
                assert consumer.in_ring == any(c is consumer for c in ring)
                assert consumer.in_ring == (consumer.available() > 0), "ring out of step with credit"
            if queue.ready and not queue.paused:
                assert not ring, f"{queue.name}: ready messages while consumers have credit"

    @invariant()
    def timers_stay_few_and_none_is_overdue(self) -> None:
        engine = self.engine
        next_due = engine.timers.next_due()
        assert next_due is None or next_due > self.clock.now()
        # At most one timeout timer per consumer, one deferred and one auto-delete timer per queue.
        assert len(engine.timers) <= len(self.consumers) + 2 * len(engine.queues)

    @invariant()
    def storage_matches_the_engine(self) -> None:
        """Every durable owner's log counts exactly the copies the engine holds (nothing spills here)."""
        self.storage.commit()
        engine = self.engine
        for name, queue in engine.queues.items():
            assert queue.log is not None and queue.spilled == 0
            assert sum(queue.log.live.values()) == len(held_copies(queue)), f"log of {name} out of step"  # type: ignore[attr-defined]
        for name, topic in engine.topics.items():
            assert topic.log is not None
            assert sum(topic.log.live.values()) == len(topic.backlog), f"log of topic {name} out of step"  # type: ignore[attr-defined]

    @rule()
    def a_restart_brings_back_what_is_held(self) -> None:
        """Restore a copy of the data dir (as after a kill at this instant) and compare with the engine."""
        self.storage.commit()
        copy = Path(tempfile.mkdtemp(prefix="polymq-restored-"))
        try:
            shutil.copytree(self.dir, copy, dirs_exist_ok=True)
            storage = DiskStorage(copy, self.clock)
            restored = Engine(clock=self.clock, storage=storage)
            restored.restore()
            engine = self.engine
            assert set(restored.queues) == set(engine.queues)
            for name, queue in engine.queues.items():
                again = restored.queues[name]
                # In-flight copies come back ready, with the attempts their deliveries gave them.
                assert {m.id: m.attempts for m in held_copies(again)} == {m.id: m.attempts for m in held_copies(queue)}
                assert {m.id for _, _, m in again.deferred} == {m.id for _, _, m in queue.deferred}
                assert (again.topics, again.paused) == (queue.topics, queue.paused)
            for name, topic in engine.topics.items():
                if topic.backlog or topic.paused:
                    again_topic = restored.topics[name]
                    assert [m.id for m in again_topic.backlog] == [m.id for m in topic.backlog]
                    assert again_topic.paused == topic.paused
            storage.close()
        finally:
            shutil.rmtree(copy, ignore_errors=True)

    def teardown(self) -> None:
        self.storage.store.close()
        shutil.rmtree(self.dir, ignore_errors=True)


EngineMachine.TestCase.settings = settings(
    max_examples=100,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestEngineMachine = EngineMachine.TestCase


# -- long random walks over the same machine ----------------------------------------------------------
# Hypothesis keeps most of its runs short; these walks take thousands of steps with the same rules
# and invariants, so deep states (many consumers, timeouts piling up, deferred chains) are reached.


def random_walk(seed: int, steps: int) -> EngineMachine:
    rng = random.Random(seed)
    machine = EngineMachine()

    def consumer_options() -> dict[str, Any]:
        return {
            "credit": rng.randint(0, 4),
            "mode": rng.choice([CreditMode.WINDOW, CreditMode.WINDOW, CreditMode.TOKENS]),
            "auto_ack": rng.random() < 0.3,
            "msg_timeout": rng.choice([None, 3.0, 3.0, 10.0]),
            "max_msg_timeout": rng.choice([None, 12.0, 60.0]),
        }

    for _ in range(rng.randint(1, 3)):
        machine.attach(name="t/a", **consumer_options())
    actions: list[tuple[int, Callable[[], None]]] = [
        (8, lambda: machine.publish(topic=rng.choice(["t", "t", "t", "u", "v"]),
                                    delay=rng.choice([0.0, 0.0, 0.0, 1.0, 3.0]),
                                    ttl=rng.choice([None, None, None, 2.0, 7.0]), drop=rng.random() < 0.2)),
        (3, lambda: machine.publish_many(topic=rng.choice(["t", "t", "u", "v"]), count=rng.randint(1, 4))),
        (1, lambda: machine.add_or_delete_queue(name=rng.choice(["t/b", "u/x", "q"]))),
        (3, lambda: machine.attach(name=rng.choice(sorted(QUEUES)), **consumer_options())),
        (4, lambda: machine.consumers and machine.credit(index=rng.randint(0, 100), credit=rng.randint(0, 5),
                                                        add=rng.random() < 0.4)),
        (3, lambda: any(c.outstanding > 0 for c in machine.consumers)
            and machine.release(index=rng.randint(0, 100), count=rng.randint(1, 3))),
        (6, lambda: machine.finish(index=rng.randint(0, 100), which=rng.randint(0, 100))),
        (4, lambda: machine.requeue(index=rng.randint(0, 100), which=rng.randint(0, 100),
                                    delay=rng.choice([0.0, 0.0, 0.5, 2.0]))),
        (2, lambda: machine.touch(index=rng.randint(0, 100), which=rng.randint(0, 100))),
        (1, lambda: machine.ack_by_another_consumer(index=rng.randint(0, 100), which=rng.randint(0, 100))),
        (2, lambda: machine.consumers and machine.detach(index=rng.randint(0, 100))),
        (1, lambda: machine.pause(name=rng.choice([*sorted(QUEUES), *TOPICS]), paused=rng.random() < 0.4)),
        (5, lambda: machine.advance(seconds=rng.choice([0.001, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0]))),
    ]
    weights = [weight for weight, _ in actions]
    for _ in range(steps):
        _, action = rng.choices(actions, weights)[0]
        action()
        machine.copies_are_conserved()
        machine.in_flight_is_the_union_of_the_consumers()
        machine.nothing_stalls()
        machine.storage_matches_the_engine()
        machine.timers_stay_few_and_none_is_overdue()
        if rng.random() < 0.02:
            machine.a_restart_brings_back_what_is_held()
    machine.teardown()
    return machine


@pytest.mark.parametrize("seed", range(6))
def test_long_random_walk(seed: int) -> None:
    machine = random_walk(seed, 1500)
    deliveries = sum(machine.deliveries.values())
    assert deliveries > 100  # the walk did exercise delivery
