"""`polymq conformance pzq`: passes against a real gateway (restart check included), and fails
usefully against wrong servers: a silent fake, and a gateway with a longer ACK timeout than the
suite is told."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq
from click.testing import CliRunner

from polymq.clients.ports import restartable_ports
from polymq.conformance.pzq import checks, command

from support import restart_gateway
from support.gateway import running_gateway

# How the runner prints a check's description under its result line.
DESCRIPTION = "     checks: "


def run_suite(*args: str) -> tuple[int, list[str]]:
    """The exit code and the report's lines, without the description printed under each check."""
    result = CliRunner().invoke(command, list(args), catch_exceptions=False)
    return result.exit_code, [line for line in result.output.splitlines() if not line.startswith(DESCRIPTION)]


@pytest.fixture
def restartable(tmp_path: Path) -> Iterator[tuple[list[int], str]]:
    """A gateway on fixed PZQ ports, and a command that restarts it (tests/support/restart_gateway.py)."""
    ports = restartable_ports(3)
    args = [sys.executable, "-m", "polymq", "serve", "--data-dir", str(tmp_path / "data"), "--nsq-tcp-port", "-1",
            "--nsq-http-port", "-1", "--mqks-port", "-1", "--phpmq-port", "-1", "--phpmq-console-port", "-1",
            "--pzq-receive-port", str(ports[0]), "--pzq-send-port", str(ports[1]),
            "--pzq-monitor-port", str(ports[2]), "--pzq-ack-timeout", "500", "--no-emqp",
            "--admin-port", "-1"]
    state = tmp_path / "gateway.json"
    log = state.with_suffix(".log")
    process = subprocess.Popen(args, stdout=log.open("a"), stderr=subprocess.STDOUT, start_new_session=True)
    state.write_text(json.dumps({"pid": process.pid, "args": args}))
    deadline = time.monotonic() + 20
    while not log.read_text().rstrip().endswith("ready"):
        assert time.monotonic() < deadline and process.poll() is None, log.read_text()
        time.sleep(0.02)
    try:
        yield ports, f"{sys.executable} {restart_gateway.__file__} {state}"
    finally:
        pid = json.loads(state.read_text())["pid"]
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
        process.wait(10)  # the first one (the restarted ones are the restart script's, reaped by init)


def addresses(ports: list[int]) -> list[str]:
    return ["--receive", f"127.0.0.1:{ports[0]}", "--send", f"127.0.0.1:{ports[1]}",
            "--monitor", f"127.0.0.1:{ports[2]}"]


def test_every_check_passes_against_the_gateway_restart_included(restartable: tuple[list[int], str]) -> None:
    ports, restart = restartable
    code, lines = run_suite(*addresses(ports), "--ack-timeout", "0.5", "--restart-command", restart)
    assert lines[-1] == f"{len(checks.checks)} passed, 0 failed", "\n".join(lines)
    assert code == 0
    assert {line.split(" ", 2)[1] for line in lines[:-1]} == {"core", "restart", "robustness"}


def test_without_a_restart_command_the_restart_check_is_left_out(tmp_path: Path) -> None:
    with running_gateway("--pzq-ack-timeout", "500", data_dir=tmp_path) as gateway:
        code, lines = run_suite("--receive", gateway.addresses["pzq-receive"], "--send", gateway.addresses["pzq-send"],
                                "--monitor", gateway.addresses["pzq-monitor"], "--only", "core", "--ack-timeout", "0.5")
    assert code == 0 and lines[-1] == "9 passed, 0 failed", "\n".join(lines)


def test_the_monitor_may_be_an_ipc_endpoint(tmp_path: Path) -> None:
    """PZQ's own monitor listens on `ipc:///tmp/pzq-monitor` by default: the gateway's TCP monitor is
    reached here through a ZeroMQ proxy bound on a socket file."""
    endpoint = f"ipc://{tmp_path}/monitor"
    with running_gateway("--pzq-ack-timeout", "500", data_dir=tmp_path / "data") as gateway:
        context = zmq.Context()
        front, back = context.socket(zmq.ROUTER), context.socket(zmq.DEALER)
        front.bind(endpoint)
        back.connect(f"tcp://{gateway.addresses['pzq-monitor']}")

        def relay() -> None:
            with contextlib.suppress(zmq.ContextTerminated):
                zmq.proxy(front, back)
            front.close(linger=0)
            back.close(linger=0)

        relaying = threading.Thread(target=relay, daemon=True)
        relaying.start()
        try:
            code, lines = run_suite("--receive", gateway.addresses["pzq-receive"], "--send",
                                    gateway.addresses["pzq-send"], "--monitor", endpoint, "--only", "core",
                                    "--ack-timeout", "0.5")
        finally:
            context.term()  # ends the proxy, which closes its sockets
            relaying.join()
    assert code == 0 and lines[-1] == "9 passed, 0 failed", "\n".join(lines)


def test_a_silent_server_fails_every_check() -> None:
    context = zmq.Context()
    sinks = [context.socket(kind) for kind in (zmq.ROUTER, zmq.DEALER, zmq.ROUTER)]
    ports = [sock.bind_to_random_port("tcp://127.0.0.1") for sock in sinks]
    try:
        code, lines = run_suite(*addresses(ports), "--timeout", "0.3", "--ack-timeout", "0.1")
    finally:
        for sock in sinks:
            sock.close(linger=0)
        context.term()
    assert code == 1 and lines[-1] == f"0 passed, {len(checks.checks) - 1} failed", "\n".join(lines)


def test_a_server_slower_to_resend_than_the_suite_expects_fails_the_no_ack_check(tmp_path: Path) -> None:
    with running_gateway("--pzq-ack-timeout", "8000", data_dir=tmp_path) as gateway:
        code, lines = run_suite("--receive", gateway.addresses["pzq-receive"], "--send", gateway.addresses["pzq-send"],
                                "--monitor", gateway.addresses["pzq-monitor"], "--only", "no-ack",
                                "--ack-timeout", "0.2", "--timeout", "0.3")
    assert code == 1
    assert lines[0].startswith("FAIL core no-ack") and "sent again: nothing came" in lines[0]
