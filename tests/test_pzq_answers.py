"""The rule of PZQ's `0` answers (adapters/pzq/answers.py), on a clock of plain numbers: a `0` is
honoured once per delivery, and a superseded delivery's `0` is ignored for one ACK timeout."""

from __future__ import annotations

from polymq.adapters.pzq.answers import SWEEP_AT_LEAST, NackRule

TIMEOUT = 5.0
M = 7


def test_a_0_is_honoured_once_per_delivery() -> None:
    rule = NackRule(grace=TIMEOUT)
    rule.delivered(M, 1, 0.0, {M})
    assert rule.nack(M, 1.0) is True
    assert rule.nack(M, 1.1) is False, "a second 0 of the same delivery"
    rule.delivered(M, 2, 1.2, {M})
    assert rule.nack(M, 1.3) is True, "the next delivery's 0"


def test_a_superseded_delivery_s_0_is_ignored_and_the_holder_s_then_honoured() -> None:
    rule = NackRule(grace=TIMEOUT)
    rule.delivered(M, 1, 0.0, {M})
    rule.delivered(M, 2, 5.0, {M})  # the first one timed out unanswered
    assert rule.nack(M, 6.0) is False, "taken as the first delivery's late answer"
    assert rule.nack(M, 6.1) is True, "the second delivery's"


def test_each_superseded_delivery_answers_once() -> None:
    rule = NackRule(grace=TIMEOUT)
    rule.delivered(M, 1, 0.0, {M})
    rule.delivered(M, 2, 5.0, {M})
    rule.delivered(M, 3, 9.0, {M})  # the first may answer until 10.0, the second until 14.0
    assert [rule.nack(M, 9.5) for _ in range(4)] == [False, False, True, False]


def test_a_superseded_delivery_may_answer_for_one_ack_timeout() -> None:
    rule = NackRule(grace=TIMEOUT)
    rule.delivered(M, 1, 0.0, {M})
    rule.delivered(M, 2, 5.0, {M})
    assert rule.nack(M, 10.5) is True, "the first delivery's consumer had until 10.0"


def test_a_late_0_of_a_timed_out_delivery_leaves_the_next_delivery_its_own() -> None:
    rule = NackRule(grace=TIMEOUT)
    rule.delivered(M, 1, 0.0, set())
    assert rule.nack(M, 5.5) is True  # it answered before it went again: the service sees it out of flight
    rule.delivered(M, 2, 5.6, {M})
    assert rule.nack(M, 6.0) is True


def test_answers_for_messages_of_no_delivery_are_not_honoured() -> None:
    rule = NackRule(grace=TIMEOUT)
    assert rule.nack(M, 0.0) is False
    rule.delivered(M, 1, 0.0, {M})
    rule.forget(M)
    assert rule.nack(M, 0.1) is False and len(rule) == 0


def test_records_of_messages_gone_elsewhere_are_swept() -> None:
    rule = NackRule(grace=TIMEOUT)
    held = {0}
    for message_id in range(SWEEP_AT_LEAST):
        rule.delivered(message_id, 1, 0.0, held)
    assert len(rule) == SWEEP_AT_LEAST
    # Later than two ACK timeouts: only the one still held and the new one stay.
    rule.delivered(SWEEP_AT_LEAST, 1, 2 * TIMEOUT + 1, held)
    assert len(rule) == 2
    # A superseded delivery that may still answer keeps its record too.
    rule.delivered(0, 2, 2 * TIMEOUT + 1, held)
    assert rule.nack(0, 2 * TIMEOUT + 2) is False
