"""`polymq wait`: ready once the gateway serves; the gateway's own start-up failure line, at once,
when the gateway it waits for will not serve (its run file says so)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from polymq.gateway import run_file
from polymq.gateway.wait import START_GRACE_S, why_not

from support.gateway import running_gateway

# Every listener but the ones a test names off or on a free port.
OTHER_PORTS = ("--nsq-http-port", "0", "--mqks-port", "0", "--phpmq-port", "0", "--phpmq-console-port", "0",
               "--no-pzq", "--no-emqp")
# Far more than any answer here takes: reaching it fails the test by its message, not its time.
WAIT_TIMEOUT_S = "120"


@pytest.fixture(autouse=True)
def own_run_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The run files of this test's gateways, apart from any other gateway's."""
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    return tmp_path / "polymq"


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _wait(admin_port: int) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "polymq", "wait", "--address", f"127.0.0.1:{admin_port}",
                           "--timeout", WAIT_TIMEOUT_S], capture_output=True, text=True,
                          timeout=float(WAIT_TIMEOUT_S) + 30, env=dict(os.environ))


def test_wait_says_why_a_gateway_started_in_the_background_did_not_start(tmp_path: Path) -> None:
    """The README's steps: `serve --in-memory > log & …`, then `wait`, with the NSQ port taken."""
    admin_port = _free_port()
    with socket.socket() as taken, (tmp_path / "polymq-try.log").open("w") as log:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        nsq_port = taken.getsockname()[1]
        gateway = subprocess.Popen([sys.executable, "-m", "polymq", "serve", "--in-memory", "--nsq-tcp-port",
                                    str(nsq_port), "--admin-port", str(admin_port), *OTHER_PORTS],
                                   stdout=log, stderr=subprocess.STDOUT)
        try:
            result = _wait(admin_port)
        finally:
            gateway.wait(timeout=30)
    assert result.returncode == 1
    assert result.stderr.splitlines() == [
        f"polymq: the gateway (pid {gateway.pid}) did not start: cannot listen for nsq-tcp on 127.0.0.1:{nsq_port}: "
        f"address already in use; stop the process using it, or choose another port with --nsq-tcp-port "
        "(-1 turns nsq-tcp off)"]
    assert result.stdout == ""


def test_a_gateway_gone_while_starting_ends_the_wait_after_the_grace_of_an_older_record(own_run_dir: Path) -> None:
    admin_port = _free_port()
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    assert run_file.run_dir(create=True) == own_run_dir
    run_file.RunFile(own_run_dir / run_file.file_name("127.0.0.1", admin_port), pid=gone.pid).starting()
    result = _wait(admin_port)
    assert result.returncode == 1
    assert result.stderr.splitlines() == [
        f"polymq: the gateway (pid {gone.pid}) exited before it served; its log says why"]


def test_a_gateway_that_serves_leaves_no_run_file_and_wait_says_ready(own_run_dir: Path) -> None:
    admin_port = _free_port()
    with running_gateway("--in-memory", "--admin-port", str(admin_port)):
        assert not list(own_run_dir.iterdir())
        result = _wait(admin_port)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [f"polymq: the gateway at 127.0.0.1:{admin_port} is ready"]


def test_a_protocols_port_given_for_the_gateways_http_says_so_in_one_line() -> None:
    """An NSQ port answers an HTTP request with its own error: the wait ends at once naming the address."""
    with running_gateway("--in-memory") as gateway:
        nsq_port = int(gateway.nsq_tcp.rpartition(":")[2])
        result = _wait(nsq_port)
    assert result.returncode == 1
    assert result.stderr.splitlines() == [
        f"polymq: 127.0.0.1:{nsq_port} answers, but not over HTTP: give the gateway's own HTTP listener "
        "(its --admin-port), not a protocol's port"]


def test_a_new_gateway_replaces_the_failure_of_an_earlier_one(own_run_dir: Path) -> None:
    admin_port = _free_port()
    run_file.run_dir(create=True)
    run_file.RunFile(own_run_dir / run_file.file_name("127.0.0.1", admin_port), pid=1).failed("an earlier failure")
    with running_gateway("--in-memory", "--admin-port", str(admin_port)):
        assert run_file.read("127.0.0.1", admin_port) is None
        assert _wait(admin_port).returncode == 0


def test_a_gateway_bound_to_every_address_is_found_by_its_loopback_address(own_run_dir: Path) -> None:
    run_file.run_dir(create=True)
    run_file.RunFile(own_run_dir / run_file.file_name("0.0.0.0", 4181)).failed("a failure")
    record = run_file.read("127.0.0.1", 4181)
    assert record is not None and record.error == "a failure" and record.pid == os.getpid()


# -- which record ends the wait, by when it was written -----------------------------------------

STARTED_AT = 1000.0  # when `wait` started


def _record(state: str, written_at: float, pid: int = 1, error: str = "") -> run_file.Record:
    return run_file.Record(pid, state, error, written_at)


def test_a_failure_written_after_wait_started_ends_it_at_once() -> None:
    record = _record(run_file.FAILED, STARTED_AT + 0.5, error="cannot listen")
    assert why_not(record, STARTED_AT, STARTED_AT + 0.6) == "the gateway (pid 1) did not start: cannot listen"


def test_an_older_failure_waits_for_the_grace_of_a_gateway_started_just_before() -> None:
    record = _record(run_file.FAILED, STARTED_AT - 0.5, error="cannot listen")
    assert why_not(record, STARTED_AT, STARTED_AT + START_GRACE_S - 0.1) is None
    assert why_not(record, STARTED_AT, STARTED_AT + START_GRACE_S) == "the gateway (pid 1) did not start: cannot listen"


def test_a_starting_gateway_whose_process_runs_is_waited_for() -> None:
    assert why_not(_record(run_file.STARTING, STARTED_AT + 0.5, pid=os.getpid()), STARTED_AT, STARTED_AT + 60) is None
    assert why_not(None, STARTED_AT, STARTED_AT + 60) is None
