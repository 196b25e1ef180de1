"""The publishes of a client whose protocol acknowledges none (PHPMQ) reach the shared engine in its
order across topics (core/shared.py): topics are stored apart, so a publish to another topic waits
until the client's pending ones are stored. Other clients' publishes are not held.

The link here holds every publish until the test answers it, which is how the order of JetStream's
answers is chosen; `test_jetstream_backend.py` checks the same on a real cluster."""

from __future__ import annotations

from typing import Any

from polymq.core.clock import ManualClock
from polymq.core.message import Message
from polymq.core.shared import MAX_HELD_BYTES, SharedEngine, Stored
from polymq.core.trace import Client


class HeldLink:
    """A `Link` whose publishes wait for the test: `sent` in the order the engine sent them."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, list[bytes], Stored]] = []

    def publish(self, topic: Any, messages: list[Message], stored: Stored, drop_if_unbound: bool) -> None:
        self.sent.append((topic.name, [message.body for message in messages], stored))

    def answer(self, body: bytes, error: Exception | None = None) -> None:
        for _, bodies, stored in self.sent:
            if body in bodies:
                stored(error)
                return
        raise AssertionError(f"{body!r} was not sent")

    def topic_made(self, topic: Any, done: Stored) -> None:
        done(None)  # its place in the cluster at once: the tests hold publishes only

    def order(self) -> list[bytes]:
        return [body for _, bodies, _ in self.sent for body in bodies]

    def __getattr__(self, name: str) -> Any:
        return lambda *args, **kwargs: None  # the rest of the Link: nothing to do here


def _engine() -> tuple[SharedEngine, HeldLink]:
    link = HeldLink()
    return SharedEngine(link, node=1, clock=ManualClock()), link  # type: ignore[arg-type]


def _synced(engine: SharedEngine) -> list[OSError | None]:
    fired: list[OSError | None] = []
    engine.storage.sync(fired.append)
    return fired


def test_a_publish_to_another_topic_waits_until_the_clients_earlier_ones_are_stored() -> None:
    engine, link = _engine()
    php = Client("phpmq", "127.0.0.1:5000", publishes_in_order=True)
    engine.publish_many("batch", [b"one", b"two"], client=php)
    engine.publish("batch", b"three", client=php)  # the same topic: sent at once
    engine.publish("marker", b"marker", client=php)
    engine.publish("batch", b"four", client=php)  # after the marker: waits behind it
    assert link.order() == [b"one", b"two", b"three"]
    link.answer(b"three")
    assert link.order() == [b"one", b"two", b"three"]
    link.answer(b"one")
    assert link.order() == [b"one", b"two", b"three", b"marker"]
    link.answer(b"marker")
    assert link.order() == [b"one", b"two", b"three", b"marker", b"four"]
    link.answer(b"four")
    assert engine._orders == {}  # nothing kept for a client with nothing pending


def test_other_clients_and_publishes_without_a_client_are_not_held() -> None:
    engine, link = _engine()
    first = Client("phpmq", "127.0.0.1:1", publishes_in_order=True)
    second = Client("phpmq", "127.0.0.1:2", publishes_in_order=True)
    engine.publish("a", b"first on a", client=first)
    engine.publish("b", b"first on b", client=first)
    engine.publish("b", b"second on b", client=second)
    engine.publish("c", b"nobody's on c")
    assert link.order() == [b"first on a", b"second on b", b"nobody's on c"]
    link.answer(b"first on a")
    assert link.order()[-1] == b"first on b"


def test_a_failed_publish_fails_what_the_client_published_after_it_to_other_topics() -> None:
    engine, link = _engine()
    php = Client("phpmq", "127.0.0.1:5000", publishes_in_order=True)
    engine.publish("batch", b"lost", client=php)
    engine.publish("marker", b"marker", client=php)
    engine.publish("batch", b"after", client=php)
    fired = _synced(engine)
    link.answer(b"lost", TimeoutError("no quorum"))
    assert link.order() == [b"lost"]  # neither the marker nor what followed it was sent
    [error] = fired
    assert isinstance(error, OSError) and "no quorum" in str(error)
    assert engine.barrier.publish_errors == 3
    engine.publish("marker", b"next marker", client=php)
    assert link.order() == [b"lost", b"next marker"]  # the client's next publish goes on


def test_publishes_answered_while_they_are_sent_release_the_next_topic_at_once() -> None:
    engine, link = _engine()
    answered_at_once = Client("phpmq", "127.0.0.1:7", publishes_in_order=True)

    def publish_answered(topic: Any, messages: list[Message], stored: Stored, drop_if_unbound: bool) -> None:
        link.sent.append((topic.name, [message.body for message in messages], stored))
        stored(None)

    link.publish = publish_answered  # type: ignore[method-assign]
    for index in range(5):
        engine.publish(f"topic-{index % 2}", b"%d" % index, client=answered_at_once)
    assert link.order() == [b"0", b"1", b"2", b"3", b"4"]
    assert _synced(engine) == [None]
    assert engine._orders == {}


def test_a_client_whose_publishes_are_acknowledged_goes_round_robin_over_topics_unheld() -> None:
    engine, link = _engine()
    mqks = Client("mqks", "127.0.0.1:8")
    for index in range(6):
        engine.publish(f"event-{index % 3}", b"%d" % index, client=mqks)
    assert link.order() == [b"%d" % index for index in range(6)]  # none answered yet, all sent
    assert engine._orders == {}


def test_a_client_holding_more_than_the_limit_is_refused_until_its_earlier_publishes_are_stored() -> None:
    engine, link = _engine()
    php = Client("phpmq", "127.0.0.1:5000", publishes_in_order=True)
    engine.publish("a", b"first", client=php)
    engine.publish("b", b"x" * (MAX_HELD_BYTES + 1), client=php)  # held behind the first
    refusal = engine.publish_refusal("b", client=php)
    assert refusal is not None and str(MAX_HELD_BYTES) in refusal
    assert engine.publish_refusal("b", client=Client("phpmq", "127.0.0.1:5001", publishes_in_order=True)) is None
    link.answer(b"first")
    assert engine.publish_refusal("b", client=php) is None  # sent now: nothing held
