"""kill -9 crash loop (docs/durability.md): the checker on hand-made records, then the real loop.

The real loops SIGKILL `polymq serve` at random moments while clients publish (acknowledged) and
consume, over NSQ, PZQ and eMQP, restart it on the same data dir, drain, and require: no acknowledged
publish lost, no phantom delivery, duplicates only across a kill, growing `attempts` on redelivery,
and no attempt handed out twice (counted where the wire shows none: PZQ, eMQP).
Set POLYMQ_CRASH_SEED to replay another schedule of kills.
"""

from __future__ import annotations

import os
import sys

import pytest

from support.crash_loop import CrashLoopConfig, CrashLoopResult, Delivery, PZQCrashLoop, check, run_crash_loop
from support.emqp_crash_loop import EMQPCrashLoop

SEED = int(os.environ.get("POLYMQ_CRASH_SEED", "1"))

# -- the checker -------------------------------------------------------------------------------------

A, B, C = b"m000000001", b"m000000002", b"m000000003"


def test_checker_passes_clean_records() -> None:
    report = check({A: 0, B: 0, C: 1}, {A, B}, [Delivery(A, 1, 0), Delivery(B, 1, 1), Delivery(C, 1, 1)], {0})
    assert report.ok, report.problems()
    assert (report.sent, report.acknowledged, report.delivered, report.duplicated) == (3, 2, 3, 0)
    assert report.unacked_delivered == 1  # C: sent, the kill came before its OK, delivered anyway
    assert report.problems() == ""


def test_checker_allows_an_unacked_publish_to_vanish() -> None:
    report = check({A: 0, B: 0}, {A}, [Delivery(A, 1, 1)], {0})
    assert report.ok and report.lost == 0


def test_checker_reports_a_lost_acknowledged_publish() -> None:
    report = check({A: 0, B: 0}, {A, B}, [Delivery(A, 1, 0)], {0})
    assert not report.ok
    assert report.lost == 1
    assert "lost" in report.problems() and repr(B) in report.problems()


def test_checker_reports_a_phantom_delivery() -> None:
    report = check({A: 0}, {A}, [Delivery(A, 1, 0), Delivery(C, 1, 0)], set())
    assert not report.ok
    assert report.phantom == 1
    assert "phantom" in report.problems()


def test_checker_reports_a_delivery_before_its_send() -> None:
    # Sent in epoch 2 but seen in epoch 1: the gateway cannot have had it then.
    report = check({A: 2}, {A}, [Delivery(A, 1, 1), Delivery(A, 2, 2)], {0, 1})
    assert report.phantom == 1


def test_checker_reports_a_duplicate_within_one_process_life() -> None:
    report = check({A: 0}, {A}, [Delivery(A, 1, 1), Delivery(A, 2, 1)], {0})
    assert not report.ok
    assert (report.duplicated, report.illegal_duplicates) == (1, 1)


def test_checker_allows_a_duplicate_across_a_kill() -> None:
    # Delivered in epoch 0, killed before the FIN counted, delivered again (attempt 2) in epoch 1.
    report = check({A: 0}, {A}, [Delivery(A, 1, 0), Delivery(A, 2, 1)], {0})
    assert report.ok, report.problems()
    assert (report.duplicated, report.illegal_duplicates, report.attempts_not_grown) == (1, 0, 0)


def test_checker_allows_redeliveries_across_several_kills() -> None:
    deliveries = [Delivery(A, 1, 0), Delivery(A, 2, 1), Delivery(A, 3, 3)]
    assert check({A: 0}, {A}, deliveries, {0, 1, 2}).ok


def test_checker_reports_a_duplicate_across_a_restart_without_kill() -> None:
    # Epoch 0 ended cleanly (not in kills): its FINs were processed, no redelivery may follow.
    report = check({A: 0}, {A}, [Delivery(A, 1, 0), Delivery(A, 2, 1)], set())
    assert report.illegal_duplicates == 1


def test_checker_reports_a_redelivery_whose_attempts_did_not_grow() -> None:
    report = check({A: 0}, {A}, [Delivery(A, 1, 0), Delivery(A, 1, 1)], {0})
    assert not report.ok
    assert (report.illegal_duplicates, report.attempts_not_grown) == (0, 1)
    assert "attempts_not_grown" in report.problems()


def test_checker_reports_an_attempt_handed_out_twice_across_a_kill() -> None:
    # Attempt 1 went out, the kill came before its record was written: it came back as attempt 1 again.
    report = check({A: 0}, {A}, [Delivery(A, 1, 0), Delivery(A, 1, 1)], {0})
    assert not report.ok
    assert report.repeated_attempts == 1
    assert "repeated_attempts" in report.problems() and repr(A) in report.problems()


def test_checker_allows_a_key_on_every_delivery_of_its_message() -> None:
    # PZQ keys name the message, as the original's: each delivery of it has the same one.
    deliveries = [Delivery(A, 1, 0, b"a", key=b"a"), Delivery(A, 2, 1, b"a", key=b"a")]
    report = check({A: 0}, {A}, deliveries, {0})
    assert report.ok, report.problems()
    assert (report.shared_keys, report.repeated_attempts) == (0, 0)


def test_checker_reports_a_key_given_to_two_messages() -> None:
    report = check({A: 0, B: 0}, {A, B}, [Delivery(A, 1, 0, key=b"k"), Delivery(B, 1, 0, key=b"k")], set())
    assert (report.shared_keys, report.repeated_attempts) == (1, 0)
    assert not report.ok
    assert "shared_keys" in report.problems() and repr(b"k") in report.problems()


def test_pzq_attempts_are_counted_from_what_the_gateway_restored() -> None:
    """The same key on every delivery: the n-th delivery of a life is attempt `restored + n`."""
    loop = PZQCrashLoop(CrashLoopConfig())
    loop.ledger.deliveries += [Delivery(A, 0, 0, b"a", key=b"a"), Delivery(A, 0, 1, b"a", key=b"a"),
                               Delivery(B, 0, 1, b"b", key=b"b")]
    loop.restored = {0: {}, 1: {A: 0, B: 0}}  # A's first attempt had no record when the kill came
    assert [(d.body, d.attempts) for d in loop.checked_deliveries()] == [(A, 1), (A, 1), (B, 1)]
    report = check({A: 0, B: 0}, {A, B}, loop.checked_deliveries(), {0})
    assert report.repeated_attempts == 1 and report.examples[-1] == ("repeated_attempts", (A,))


def test_checker_reports_a_message_held_after_a_restart_and_never_delivered_again() -> None:
    # Delivered in epoch 0; the gateway showed it again at the start of epoch 1: it must come then.
    report = check({A: 0}, set(), [Delivery(A, 1, 0)], {0}, held={A: 1})
    assert not report.ok and report.lost == 1
    assert check({A: 0}, set(), [Delivery(A, 1, 0), Delivery(A, 2, 1)], {0}, held={A: 1}).ok


def test_emqp_attempts_are_counted_from_what_the_gateway_restored() -> None:
    """A worker sees no attempt count: the n-th delivery of a life is attempt `restored + n`."""
    loop = EMQPCrashLoop(CrashLoopConfig())
    loop.ledger.deliveries += [Delivery(A, 0, 0), Delivery(B, 0, 0), Delivery(A, 0, 1), Delivery(B, 0, 1)]
    loop.restored = {0: {}, 1: {A: 1, B: 0}}  # B's first attempt had no record when the kill came
    assert [(d.body, d.attempts) for d in loop.checked_deliveries()] == [(A, 1), (B, 1), (A, 2), (B, 1)]
    report = check({A: 0, B: 0}, {A, B}, loop.checked_deliveries(), {0})
    assert report.repeated_attempts == 1 and report.examples[-1] == ("repeated_attempts", (B,))


# -- the real loop ----------------------------------------------------------------------------------


def _run_and_report(config: CrashLoopConfig, capsys: pytest.CaptureFixture[str],
                    protocol: str = "nsq") -> CrashLoopResult:
    result = run_crash_loop(config, protocol)
    # On the real terminal, so CI output shows the counts whether the test passes or not.
    with capsys.disabled():
        print(f"\n{result.line()}", file=sys.stderr)
    assert not result.harness_errors, "\n".join(result.harness_errors)
    assert result.report.acknowledged > 0 and result.report.delivered > 0, result.line()
    if not result.report.ok:  # pytest.fail: the report itself, not an introspection of the whole result
        pytest.fail(f"{result.line()}\n{result.report.problems()}", pytrace=False)
    return result


@pytest.mark.slow
def test_crash_loop_kill9_loses_no_acknowledged_publish(capsys: pytest.CaptureFixture[str]) -> None:
    _run_and_report(CrashLoopConfig(rounds=6, seed=SEED), capsys)


@pytest.mark.slow
def test_crash_loop_kill9_with_messages_on_disk_only(capsys: pytest.CaptureFixture[str]) -> None:
    # A memory queue of 10: nearly every message lives only in the on-disk store when the kill comes.
    _run_and_report(CrashLoopConfig(rounds=3, seed=SEED + 1, gateway_args=("--mem-queue-size", "10")), capsys)


@pytest.mark.slow
def test_crash_loop_kill9_loses_no_acknowledged_pzq_message(capsys: pytest.CaptureFixture[str]) -> None:
    """PZQ producers waiting for `1`, consumers answering `1`, kill -9 just after a consumer got a
    message (at random moments), drain: no attempt of a message is handed out twice (the attempts
    counted from what the gateway restored), no key names two messages."""
    report = _run_and_report(CrashLoopConfig(rounds=4, seed=SEED + 2), capsys, protocol="pzq").report
    assert (report.lost, report.shared_keys, report.repeated_attempts) == (0, 0, 0)


@pytest.mark.slow
def test_crash_loop_kill9_emqp_loses_no_request_and_counts_every_attempt(capsys: pytest.CaptureFixture[str]) -> None:
    """eMQP clients' REQUESTs, jobmanager-style workers, kill -9 just after a worker got a job, drain:
    nothing dispatched or restored is lost, no attempt of a job is handed out twice."""
    report = _run_and_report(CrashLoopConfig(rounds=4, seed=SEED + 3), capsys, protocol="emqp").report
    assert (report.lost, report.repeated_attempts) == (0, 0)

