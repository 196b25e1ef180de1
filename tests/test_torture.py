"""`polymq torture` (docs/testing.md): the checker on hand-made records, then a 30-second run of the
real command, every protocol at once under SIGKILLs, as a subprocess."""

from __future__ import annotations

import random
import re
import subprocess
import sys

import pytest

from polymq.torture.bodies import BodyId, make_body, parse_body
from polymq.torture.ledger import Ledger
from polymq.torture.topology import FLOWS, PROTOCOLS

# -- bodies and the checker ------------------------------------------------------------------------


def test_a_body_carries_its_id_and_any_changed_byte_is_seen() -> None:
    body = make_body(3, 41, random.Random(1))
    assert parse_body(body) == BodyId(3, 41)
    for index in range(len(body)):
        changed = body[:index] + bytes([body[index] ^ 0x01]) + body[index + 1:]
        assert parse_body(changed) != BodyId(3, 41)
    assert parse_body(body[:-1]) is None
    assert parse_body(b"") is None


def _sent(ledger: Ledger, flow: int, seq: int) -> tuple[bytes, bytes]:
    body_id = BodyId(flow, seq)
    ledger.record_sent([(body_id.key, body_id)])
    return body_id.key, make_body(flow, seq, random.Random(seq))


PZQ_FLOW = next(flow for flow in FLOWS if flow.publisher == "pzq")
PZQ_SINK = PZQ_FLOW.sinks[0]


def test_checker_counts_an_acknowledged_copy_never_delivered_as_lost() -> None:
    ledger = Ledger()
    key, _ = _sent(ledger, PZQ_FLOW.index, 1)
    ledger.record_acked("pzq", [key], 0.001)
    report = ledger.check()
    assert (report.protocols["pzq"].acked, report.protocols["pzq"].lost) == (1, 1)
    assert not report.ok
    assert report.last_line() == ("acked=1 delivered=0 lost=1 duplicated=0 unexpected=0"
                                  " protocols=nsq,mqks,phpmq,pzq,emqp")


def test_checker_allows_an_unacknowledged_publish_to_vanish_or_come() -> None:
    ledger = Ledger()
    _sent(ledger, PZQ_FLOW.index, 1)
    key, body = _sent(ledger, PZQ_FLOW.index, 2)
    assert ledger.record_receipt(PZQ_SINK, body) == key
    ledger.record_finish(PZQ_SINK, key, session=1, generation=1)
    report = ledger.check()
    assert report.ok
    assert (report.protocols["pzq"].acked, report.protocols["pzq"].delivered) == (0, 1)


def test_checker_explains_a_duplicate_only_by_a_hard_end_or_a_kill() -> None:
    ledger = Ledger()
    explained_by_kill, _ = _sent(ledger, PZQ_FLOW.index, 1)
    explained_by_crash, _ = _sent(ledger, PZQ_FLOW.index, 2)
    unexplained, _ = _sent(ledger, PZQ_FLOW.index, 3)
    ledger.record_acked("pzq", [explained_by_kill, explained_by_crash, unexplained], 0.001)
    ledger.record_kill(1)
    ledger.record_restart(1)
    ledger.record_session_end("pzq", 2, disconnected=True)
    for key, first_session, first_generation in ((explained_by_kill, 1, 1), (explained_by_crash, 2, 2),
                                                 (unexplained, 3, 2)):
        ledger.record_finish(PZQ_SINK, key, first_session, first_generation)
        ledger.record_finish(PZQ_SINK, key, 4, 2)
    ledger.record_restart(2)  # the second process ends after both acknowledgements: no excuse
    report = ledger.check()
    assert report.protocols["pzq"].duplicated == 3
    assert report.protocols["pzq"].unexplained_duplicates == 1
    assert not report.ok
    assert any(f"unexplained duplicate: {unexplained.decode()}" in problem for problem in report.problems)
    assert report.protocols["pzq"].lost == 0


def test_checker_explains_a_duplicate_by_another_gateways_end_or_a_server_kill_between_the_two() -> None:
    """Two gateways on a JetStream cluster: the second acknowledgement may come from the other gateway's
    process life, older than the first's; a server SIGKILLed between the two explains it too."""
    ledger = Ledger()
    first_gateway_died, _ = _sent(ledger, PZQ_FLOW.index, 1)
    server_killed_between, _ = _sent(ledger, PZQ_FLOW.index, 2)
    server_killed_before, _ = _sent(ledger, PZQ_FLOW.index, 3)
    ledger.record_acked("pzq", [first_gateway_died, server_killed_between, server_killed_before], 0.001)
    ledger.record_server_kill()  # before any acknowledgement: explains nothing
    ledger.record_finish(PZQ_SINK, first_gateway_died, 1, generation=2)
    ledger.record_kill(2)
    ledger.record_restart(2)
    ledger.record_finish(PZQ_SINK, first_gateway_died, 2, generation=1)  # the other gateway, started first
    ledger.record_finish(PZQ_SINK, server_killed_between, 3, generation=1)
    ledger.record_server_kill()
    ledger.record_finish(PZQ_SINK, server_killed_between, 3, generation=1)
    ledger.record_finish(PZQ_SINK, server_killed_before, 3, generation=1)
    ledger.record_finish(PZQ_SINK, server_killed_before, 3, generation=1)
    report = ledger.check()
    assert (report.protocols["pzq"].duplicated, report.protocols["pzq"].unexplained_duplicates) == (3, 1)
    assert [problem.split(" in ")[0] for problem in report.problems] == [
        f"unexplained duplicate: {server_killed_before.decode()}"]
    assert report.server_kills == 2


def test_checker_explains_a_duplicate_by_a_cut_or_a_pause_between_the_two() -> None:
    """`--partitions`: a server cut off or paused, or a gateway paused past the ack wait, between two
    acknowledgements of a copy explains the second, as a server's SIGKILL does; one before both does not."""
    ledger = Ledger()
    paused_between, _ = _sent(ledger, PZQ_FLOW.index, 1)
    paused_before, _ = _sent(ledger, PZQ_FLOW.index, 2)
    ledger.record_acked("pzq", [paused_between, paused_before], 0.001)
    ledger.record_fault()  # before any acknowledgement: explains nothing
    ledger.record_finish(PZQ_SINK, paused_between, 1, generation=1)
    ledger.record_fault()
    ledger.record_finish(PZQ_SINK, paused_between, 2, generation=2)
    ledger.record_finish(PZQ_SINK, paused_before, 1, generation=1)
    ledger.record_finish(PZQ_SINK, paused_before, 1, generation=1)
    report = ledger.check()
    assert (report.protocols["pzq"].duplicated, report.protocols["pzq"].unexplained_duplicates) == (2, 1)
    assert report.faults == 2 and report.server_kills == 0


def test_a_queue_that_delivers_nothing_past_the_bound_while_copies_wait_is_a_stall() -> None:
    """The watch: a sink with acknowledged copies waiting and no delivery for longer than the bound is said
    once, and fails the run; a sink whose copies all came, or that delivered within the bound, is not."""
    ledger = Ledger()
    waiting, _ = _sent(ledger, PZQ_FLOW.index, 1)
    ledger.record_acked("pzq", [waiting], 0.001)
    assert ledger.watch_stalls(bound_s=3600.0) == []  # within the bound
    [stall] = ledger.watch_stalls(bound_s=0.0)
    assert stall.startswith(f"stalled: {PZQ_SINK} delivered nothing for ") and "1 acknowledged copies" in stall
    assert ledger.watch_stalls(bound_s=0.0) == []  # said once
    ledger.record_finish(PZQ_SINK, waiting, 1, generation=1)
    report = ledger.check()
    assert report.stalls == (stall,) and not report.ok
    calm = Ledger()
    done, _ = _sent(calm, PZQ_FLOW.index, 2)
    calm.record_acked("pzq", [done], 0.001)
    calm.record_finish(PZQ_SINK, done, 1, generation=1)
    assert calm.watch_stalls(bound_s=0.0) == [] and calm.check().ok


def test_checker_explains_a_duplicate_by_a_put_back_its_gateway_did_not_finish() -> None:
    """PHPMQ's 005 on JetStream: the copy at the tail is stored before the delivery it replaces is
    acknowledged; a gateway that ends between the two leaves both, read by whichever sessions."""
    ledger = Ledger()
    put_back_cut, _ = _sent(ledger, PZQ_FLOW.index, 1)
    put_back_finished, _ = _sent(ledger, PZQ_FLOW.index, 2)
    ledger.record_acked("pzq", [put_back_cut, put_back_finished], 0.001)
    ledger.record_requeue(PZQ_SINK, put_back_cut, generation=1)
    ledger.record_kill(1)
    ledger.record_restart(1)
    ledger.record_requeue(PZQ_SINK, put_back_finished, generation=2)
    for key in (put_back_cut, put_back_finished):
        ledger.record_finish(PZQ_SINK, key, 5, generation=2)
        ledger.record_finish(PZQ_SINK, key, 5, generation=2)
    report = ledger.check()
    assert (report.protocols["pzq"].duplicated, report.protocols["pzq"].unexplained_duplicates) == (2, 1)
    assert [problem.split(" in ")[0] for problem in report.problems] == [
        f"unexplained duplicate: {put_back_finished.decode()}"]
    assert report.protocols["pzq"].requeues == 2


def test_checker_counts_a_refused_publish_only_where_refusals_are_allowed() -> None:
    ledger = Ledger()
    key, _ = _sent(ledger, PZQ_FLOW.index, 1)
    ledger.record_refused("pzq", [key], "[b'1', b'0', b'', b'the JetStream cluster cannot be reached']")
    assert not ledger.check().ok  # on the embedded store a refusal is a finding
    ledger = Ledger()
    ledger.refusals_allowed = True
    key, _ = _sent(ledger, PZQ_FLOW.index, 1)
    ledger.record_refused("pzq", [key], "[b'1', b'0', b'', b'the JetStream cluster cannot be reached']")
    report = ledger.check()
    assert report.ok
    assert (report.protocols["pzq"].refused, report.protocols["pzq"].acked, report.protocols["pzq"].lost) == (1, 0, 0)


def test_checker_counts_corrupted_foreign_and_misrouted_bodies_as_unexpected() -> None:
    ledger = Ledger()
    _, body = _sent(ledger, PZQ_FLOW.index, 1)
    never_sent = make_body(PZQ_FLOW.index, 99, random.Random(0))
    assert ledger.record_receipt(PZQ_SINK, b"x" + body[1:]) is None
    assert ledger.record_receipt(PZQ_SINK, never_sent) is None
    nsq_sink = FLOWS[0].sinks[0]
    assert ledger.record_receipt(nsq_sink, body) is None  # a PZQ publish read from an NSQ channel
    report = ledger.check()
    assert (report.protocols["pzq"].unexpected, report.protocols["nsq"].unexpected) == (2, 1)
    assert not report.ok


# -- the real command ------------------------------------------------------------------------------

LAST_LINE = re.compile(r"acked=(\d+) delivered=(\d+) lost=(\d+) duplicated=(\d+) unexpected=(\d+) "
                       r"protocols=nsq,mqks,phpmq,pzq,emqp")
PROTOCOL_LINE = re.compile(r"(\w+): acked=(\d+) delivered=(\d+) lost=(\d+) duplicated=(\d+) unexpected=(\d+) .*"
                           r" unexplained_duplicates=(\d+)$")
SUMMARY_LINE = re.compile(r"torture: duration=\d+s seed=\d+ kills=(\d+) starts=(\d+) drained=yes \S+"
                          r"(?: server_kills=(\d+))?(?: faults=(\d+))?$")
# 30 s of load, a restart per kill and a drain on a loaded 2-core machine: far below this.
RUN_TIMEOUT_S = 600


@pytest.mark.slow
def test_thirty_seconds_of_every_protocol_under_sigkills_lose_nothing() -> None:
    lines = _run_and_check("--duration", "30", "--seed", "1")
    kills, starts, _ = _summary(lines)
    assert kills >= 1 and starts == kills + 1, lines  # every SIGKILL was followed by a restart


@pytest.mark.slow
def test_two_gateways_on_three_nats_servers_under_sigkills_of_both_kinds_lose_nothing() -> None:
    """`--jetstream`: every protocol's clients spread over two gateways sharing their queues through three
    nats-servers; SIGKILLs fall on gateways and servers, and nothing acknowledged is lost."""
    lines = _run_and_check("--duration", "30", "--seed", "2", "--jetstream")
    kills, starts, server_kills = _summary(lines)
    assert starts == kills + 2, lines  # two gateways at first, each SIGKILL followed by a restart
    assert kills >= 1 and server_kills >= 1, lines


@pytest.mark.slow
def test_two_gateways_under_cuts_and_pauses_lose_nothing_and_no_queue_stalls() -> None:
    """`--partitions`: every link through the run's proxies; besides SIGKILLs, a server cut off (held silent,
    reset at the heal), a server paused and a gateway paused: nothing acknowledged is lost, every duplicate
    is explained, and no queue stops delivering for longer than the bound."""
    lines = _run_and_check("--duration", "40", "--seed", "3", "--jetstream", "--partitions")
    faults = next(filter(None, map(SUMMARY_LINE.match, lines))).group(4)  # type: ignore[union-attr]
    assert faults is not None and int(faults) >= 2, lines  # a fault and its end at least


def _summary(lines: list[str]) -> tuple[int, int, int]:
    summary = next(filter(None, map(SUMMARY_LINE.match, lines)), None)
    assert summary is not None, lines
    kills, starts, server_kills, _ = summary.groups()
    return int(kills), int(starts), int(server_kills or 0)


def _run_and_check(*args: str) -> list[str]:
    """Run `polymq torture`, check what every run must show, and return its output's lines."""
    run = subprocess.run([sys.executable, "-m", "polymq", "torture", *args],
                         capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    lines = run.stdout.splitlines()
    explain = f"stdout:\n{run.stdout}\nstderr (end):\n{run.stderr[-4000:]}"
    assert lines and LAST_LINE.fullmatch(lines[-1]), explain
    acked, delivered, lost, _, unexpected = map(int, LAST_LINE.fullmatch(lines[-1]).groups())  # type: ignore[union-attr]
    assert (lost, unexpected) == (0, 0), explain
    assert acked > 0 and delivered > 0, explain
    counts = {match[1]: tuple(map(int, match.groups()[1:])) for match in map(PROTOCOL_LINE.match, lines) if match}
    assert sorted(counts) == sorted(PROTOCOLS), explain
    for protocol, (p_acked, p_delivered, p_lost, _, p_unexpected, unexplained) in counts.items():
        assert p_acked > 0 and p_delivered > 0, f"{protocol}: {explain}"
        assert (p_lost, p_unexpected, unexplained) == (0, 0, 0), f"{protocol}: {explain}"
    assert run.returncode == 0, explain
    return lines
