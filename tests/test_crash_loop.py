"""kill -9 crash loop (docs/durability.md): the checker on hand-made records, then the real loop.

The real loops SIGKILL `polymq serve` at random moments while NSQ clients publish (acknowledged) and
consume (FIN), restart it on the same data dir, drain, and require: no acknowledged publish lost, no
phantom delivery, duplicates only across a kill, growing `attempts` on redelivery.
Set POLYMQ_CRASH_SEED to replay another schedule of kills.
"""

from __future__ import annotations

import os
import sys

import pytest

from support.crash_loop import CrashLoopConfig, CrashLoopResult, Delivery, check, run_crash_loop

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
    """PZQ producers waiting for `1`, consumers answering `1`, kill -9 at random moments, drain."""
    _run_and_report(CrashLoopConfig(rounds=4, seed=SEED + 2), capsys, protocol="pzq")

