"""`polymq conformance phpmq`: passes against a real gateway, and fails (usefully) against wrong servers:
a silent fake, and gateways configured away from the original's behaviour one defect at a time."""

from __future__ import annotations

from pathlib import Path

from click.testing import CliRunner

from polymq.conformance.phpmq import checks, command

from support.fake_tcp import fake_server
from support.gateway import GatewayProcess, running_gateway


def run_suite(*args: str) -> tuple[int, list[str]]:
    result = CliRunner().invoke(command, list(args), catch_exceptions=False)
    return result.exit_code, result.output.splitlines()


def address_of(gateway: GatewayProcess) -> str:
    host, port = gateway.host_port("phpmq")
    return f"{host}:{port}"


def failed(lines: list[str]) -> set[str]:
    return {line[len("FAIL "):].split(":", 1)[0] for line in lines if line.startswith("FAIL ")}


def test_every_check_passes_against_the_gateway(module_gateway: GatewayProcess) -> None:
    code, lines = run_suite("--addr", address_of(module_gateway), "--quiet", "0.3")
    assert lines[-1] == f"{len(checks.checks)} passed, 0 failed", "\n".join(lines)
    assert code == 0
    assert {line.split(" ", 2)[1] for line in lines[:-1]} == {"core", "current-generation", "robustness"}


def test_only_selects_a_group(module_gateway: GatewayProcess) -> None:
    code, lines = run_suite("--addr", address_of(module_gateway), "--only", "robustness")
    assert code == 0 and lines[-1] == "5 passed, 0 failed"


def test_a_silent_server_fails_every_check() -> None:
    with fake_server(lambda _chunk: b"") as address:
        code, lines = run_suite("--addr", address, "--timeout", "0.5", "--quiet", "0.1")
    assert code == 1 and lines[-1] == f"0 passed, {len(checks.checks)} failed"
    assert "FAIL core send then consume delivers a 3-packet 003 with a 32-hex id: 003: deliveries " \
           "(expected 1, got 0)" in lines


def test_a_server_writing_the_current_generation_to_everyone_fails_the_pinned_core_check(tmp_path: Path) -> None:
    with running_gateway("--phpmq-generation", "current", data_dir=tmp_path) as gateway:
        code, lines = run_suite("--addr", address_of(gateway), "--only", "core", "--quiet", "0.3")
    assert code == 1
    assert failed(lines) == {"core send then consume delivers a 3-packet 003 with a 32-hex id"}
    assert any("003 header (expected b'H0100303', got b'H0100304')" in line for line in lines)


def test_a_server_that_times_out_deliveries_fails_the_window_check(tmp_path: Path) -> None:
    with running_gateway("--phpmq-ack-timeout", "100", data_dir=tmp_path) as gateway:
        code, lines = run_suite("--addr", address_of(gateway), "--only", "window", "--quiet", "0.5")
    assert code == 1
    assert failed(lines) == {"core a window of N holds N unacknowledged and each ack lets one more flow"}
