"""The queue of a topic's own name (adapters/named_queue.py): made and bound once, and, forgotten
when empty and unused, deleted with its topic unless something else uses the topic."""

from __future__ import annotations

from polymq.adapters.named_queue import forget_their_topics, named_queue
from polymq.core.clock import ManualClock
from polymq.core.engine import Engine


def _forget_now(engine: Engine, name: str) -> None:
    consumer = engine.attach(name, lambda message: None, credit=1)
    consumer.detach()  # the last consumer leaves an empty queue: forgotten at once (0 s)


def test_a_forgotten_named_queue_takes_its_topic_along() -> None:
    engine = Engine(clock=ManualClock())
    queue = named_queue(engine, "jobs", origin="phpmq", forget_empty_after=0.0)
    assert queue.topics == ["jobs"] and named_queue(engine, "jobs", origin="phpmq") is queue
    _forget_now(engine, "jobs")
    assert engine.queue("jobs") is None and "jobs" not in engine.topics


def test_the_topic_stays_while_another_queue_reads_it_or_it_holds_messages() -> None:
    engine = Engine(clock=ManualClock())
    named_queue(engine, "shared", origin="phpmq", forget_empty_after=0.0)
    engine.ensure_queue("shared/nsq-channel")
    engine.bind("shared/nsq-channel", "shared")
    _forget_now(engine, "shared")
    assert engine.queue("shared") is None and "shared" in engine.topics

    named_queue(engine, "held", origin="emqp", forget_empty_after=0.0)
    engine.topics["held"].set_paused(True)
    engine.publish("held", b"waits in the paused topic")
    _forget_now(engine, "held")  # the queue is empty and unused: forgotten, but the topic holds a message
    assert engine.queue("held") is None and engine.topics["held"].depth == 1


def test_an_operator_deleting_the_queue_keeps_the_topic() -> None:
    engine = Engine(clock=ManualClock())
    named_queue(engine, "kept", origin="phpmq", forget_empty_after=0.0)
    assert engine.delete_queue("kept")
    assert "kept" in engine.topics


def test_the_observer_is_installed_once() -> None:
    engine = Engine(clock=ManualClock())
    for _ in range(3):
        forget_their_topics(engine)
    named_queue(engine, "a", origin="phpmq", forget_empty_after=0.0)
    assert len(engine.on_queue_deleted) == 1
