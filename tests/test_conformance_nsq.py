"""`polymq conformance nsq`: passes against a real gateway, and fails (usefully) against wrong servers."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import pytest
from click.testing import CliRunner

from polymq.codecs.nsq import FRAME_OK
from polymq.conformance.nsq import checks, command

from support.fake_tcp import fake_server
from support.gateway import GatewayProcess, running_gateway

# How the runner prints a check's description under its result line.
DESCRIPTION = "     checks: "


def run_suite(*args: str) -> tuple[int, list[str]]:
    """The exit code and the report's lines, without the description printed under each check."""
    result = CliRunner().invoke(command, list(args), catch_exceptions=False)
    return result.exit_code, [line for line in result.output.splitlines() if not line.startswith(DESCRIPTION)]


@pytest.mark.slow
def test_suite_passes_against_the_gateway(gateway: GatewayProcess) -> None:
    code, lines = run_suite("--tcp", gateway.nsq_tcp, "--http", gateway.nsq_http)
    failures = [line for line in lines if line.startswith("FAIL")]
    assert failures == []
    assert lines[-1] == f"{len(checks.checks)} passed, 0 failed"
    assert code == 0


def test_only_filters_by_substring(gateway: GatewayProcess) -> None:
    code, lines = run_suite("--tcp", gateway.nsq_tcp, "--http", gateway.nsq_http, "--only", "identify-plain")
    assert lines == ["PASS identify-plain-ok", "1 passed, 0 failed"]
    assert code == 0


def test_suite_fails_against_a_garbage_server() -> None:
    # Neither NSQ frames nor HTTP: every check must fail fast, none may hang.
    with fake_server(lambda _: b"garbage, not a protocol\n") as address:
        code, lines = run_suite("--tcp", address, "--http", address, "--timeout", "0.5")
    assert code == 1
    assert lines[-1] == f"0 passed, {len(checks.checks)} failed"
    assert "FAIL ok-frame-bytes: server sent bytes that are not NSQ frames" in "\n".join(lines)
    assert any(line.startswith("FAIL http-ping: HTTP GET /ping (expected an HTTP response") for line in lines)


def test_suite_fails_against_a_server_that_says_ok_to_everything() -> None:
    # Well-formed frames, wrong behaviour: the failure line names what was sent, expected and got.
    with fake_server(lambda _: FRAME_OK) as address:
        code, lines = run_suite("--tcp", address, "--http", address, "--timeout", "0.5", "--only", "magic-bad")
        assert code == 1
        assert lines == [
            "FAIL magic-bad: magic '  V1': E_BAD_PROTOCOL frame then close "
            "(expected b'\\x00\\x00\\x00\\x12\\x00\\x00\\x00\\x01E_BAD_PROTOCOL' then close, "
            "got b'\\x00\\x00\\x00\\x06\\x00\\x00\\x00\\x00OK', connection still open after 0.5 s)",
            "0 passed, 1 failed",
        ]
        code, lines = run_suite("--tcp", address, "--http", address, "--timeout", "0.5", "--only", "command-invalid")
        assert code == 1
        assert lines[0] == (
            "FAIL command-invalid: 'FOO bar' (expected error frame b'E_INVALID invalid command FOO', "
            "got response frame b'OK')"
        )


def test_unknown_only_pattern_is_a_usage_error() -> None:
    code, lines = run_suite("--only", "no-such-check")
    assert code == 2
    assert any("no check matches" in line for line in lines)


def test_the_suite_leaves_nothing_behind(tmp_path: Path) -> None:
    with running_gateway(data_dir=tmp_path) as gateway:
        code, lines = run_suite("--tcp", gateway.nsq_tcp, "--http", gateway.nsq_http)
        assert code == 0, "\n".join(line for line in lines if line.startswith("FAIL"))
        with urllib.request.urlopen(f"http://{gateway.nsq_http}/stats?format=json", timeout=10) as response:
            assert json.load(response)["topics"] == []
        assert gateway.stop() == 0
    with running_gateway(data_dir=tmp_path) as gateway:
        assert any("restored 0 topics, 0 queues, 0 messages" in line for line in gateway.log_lines)
