"""`polymq conformance emqp`: passes against a real gateway (pub/sub included), and fails usefully
against wrong brokers: a silent fake, and a gateway told to behave as the original does."""

from __future__ import annotations

from pathlib import Path

import zmq
from click.testing import CliRunner

from polymq.adapters import emqp as emqp_unit
from polymq.conformance.emqp import checks, command
from polymq.gateway.cli import main

from support.gateway import GatewayProcess, running_gateway


def run_suite(*args: str) -> tuple[int, list[str]]:
    result = CliRunner().invoke(command, list(args), catch_exceptions=False)
    return result.exit_code, result.output.splitlines()


def addresses(gateway: GatewayProcess, *, pubsub: bool = True) -> list[str]:
    given = ["--frontend", gateway.addresses["emqp-frontend"], "--backend", gateway.addresses["emqp-backend"],
             "--admin", gateway.addresses["emqp-admin"]]
    if pubsub:
        given += ["--pubsub-in", gateway.addresses["emqp-pubsub-in"],
                  "--pubsub-out", gateway.addresses["emqp-pubsub-out"]]
    return given


def test_every_check_passes_against_the_gateway(tmp_path: Path) -> None:
    with running_gateway("--emqp-heartbeat-interval", "300", data_dir=tmp_path) as gateway:
        code, lines = run_suite(*addresses(gateway), "--heartbeat-interval", "0.3")
    assert lines[-1] == f"{len(checks.checks)} passed, 0 failed", "\n".join(lines)
    assert code == 0
    assert {line.split(" ", 2)[1] for line in lines[:-1]} == {"core", "pubsub", "robustness"}


def test_the_pubsub_checks_run_at_the_gateway_s_default_pub_sub_ports_unless_skipped(tmp_path: Path) -> None:
    settings = {setting.name: setting.default for setting in emqp_unit.PROTOCOL.all_settings}
    defaults = {param.name: param.default for param in command.params}
    assert defaults["pubsub_in"] == f"127.0.0.1:{settings['pubsub_in_port']}"
    assert defaults["pubsub_out"] == f"127.0.0.1:{settings['pubsub_out_port']}"
    listed = CliRunner().invoke(main, ["conformance", "all", "--list", "--only", "pubsub"], catch_exceptions=False)
    assert listed.output.splitlines() == [
        "emqp:", "  pubsub",
        "    pubsub PUBLISH goes out as [topic, message] to the subscribers of a matching prefix"]
    with running_gateway(data_dir=tmp_path) as gateway:
        code, lines = run_suite(*addresses(gateway, pubsub=False), "--skip", "pubsub")
    assert code == 0, "\n".join(lines)
    assert not any(line.startswith("PASS pubsub") for line in lines)
    assert lines[-1] == f"{len(checks.checks) - 1} passed, 0 failed"


def test_a_broker_that_reroutes_and_drops_as_the_original_fails_those_checks(tmp_path: Path) -> None:
    with running_gateway("--emqp-reroute-unknown", "--emqp-max-depth", "10000", data_dir=tmp_path) as gateway:
        code, lines = run_suite(*addresses(gateway, pubsub=False), "--only", "robustness")
    assert code == 1
    failed = {line.split(":", 1)[0] for line in lines if line.startswith("FAIL ")}
    assert failed == {"FAIL robustness requests past 10,000 waiting for a queue are all kept",
                      "FAIL robustness a request for a queue nobody serves waits in it, not in default"}, lines


def test_a_silent_broker_fails_every_check() -> None:
    context = zmq.Context()
    sinks = [context.socket(zmq.ROUTER) for _ in range(3)]
    ports = [sock.bind_to_random_port("tcp://127.0.0.1") for sock in sinks]
    try:
        code, lines = run_suite("--frontend", f"127.0.0.1:{ports[0]}", "--backend", f"127.0.0.1:{ports[1]}",
                                "--admin", f"127.0.0.1:{ports[2]}", "--timeout", "0.3", "--heartbeat-interval", "0.1",
                                "--skip", "pubsub")
    finally:
        for sock in sinks:
            sock.close(linger=0)
        context.term()
    assert code == 1 and lines[-1] == f"0 passed, {len(checks.checks) - 1} failed", "\n".join(lines)
