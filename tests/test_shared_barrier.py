"""The shared engine's publish barrier (core/shared.py): an adapter's sync fires once every publish made
before it has the shared engine's answer, answers arriving in any order, with its own publishes' error."""

from __future__ import annotations

from polymq.core.shared import PublishBarrier


def _sync(barrier: PublishBarrier, fired: list[tuple[str, OSError | None]], name: str) -> None:
    barrier.sync(lambda error: fired.append((name, error)))


def test_a_sync_with_nothing_outstanding_fires_at_once() -> None:
    barrier = PublishBarrier()
    fired: list[tuple[str, OSError | None]] = []
    _sync(barrier, fired, "first")
    assert fired == [("first", None)]


def test_syncs_fire_in_order_once_every_earlier_publish_is_answered_whatever_the_answers_order() -> None:
    barrier = PublishBarrier()
    fired: list[tuple[str, OSError | None]] = []
    first = barrier.issue()
    _sync(barrier, fired, "a")
    second, third = barrier.issue(), barrier.issue()
    _sync(barrier, fired, "b")
    third(None)
    second(None)
    assert fired == []  # the first publish has no answer yet: neither sync may fire
    first(None)
    assert fired == [("a", None), ("b", None)]
    assert barrier.syncs == 2 and barrier.publish_count == 3 and barrier.publish_errors == 0


def test_a_failed_publish_fails_only_the_sync_made_after_it_and_before_the_next() -> None:
    barrier = PublishBarrier()
    fired: list[tuple[str, OSError | None]] = []
    refused = barrier.issue()
    _sync(barrier, fired, "refused client")
    stored = barrier.issue()
    _sync(barrier, fired, "other client")
    stored(None)
    refused(ValueError("over max_payload"))
    (name_a, error_a), (name_b, error_b) = fired
    assert (name_a, name_b) == ("refused client", "other client")
    assert isinstance(error_a, OSError) and "over max_payload" in str(error_a)
    assert error_b is None
    assert barrier.publish_errors == 1
