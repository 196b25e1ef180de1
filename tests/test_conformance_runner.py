"""The suites' shared command line: --list, --only/--skip by group or name, --junit, the exit
code, and `polymq conformance all` over every unit's suite."""

from __future__ import annotations

import importlib
import socket
import subprocess
import sys
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from polymq.adapters.registry import protocols
from polymq.conformance import runner
from polymq.conformance.runner import CheckFailed, Registry
from polymq.gateway.cli import main

checks: Registry[None] = Registry(original_fails={"robustness": "the original crashes"})


@checks.check("core one passes")
def _passes(_: None) -> None:
    """A check that passes."""


@checks.check("core two fails")
def _fails(_: None) -> None:
    raise CheckFailed("the answer", "b'OK'", "b'E_INVALID'")


@checks.check("robustness three passes")
def _robust(_: None) -> None:
    pass


@contextmanager
def _context(_name: str) -> Iterator[None]:
    yield None


@click.command()
@runner.selection_options("core")
def toy() -> None:
    runner.run_command(checks, _context)


def invoke(*args: str) -> tuple[int, list[str]]:
    result = CliRunner().invoke(toy, list(args), catch_exceptions=False)
    return result.exit_code, result.output.splitlines()


def test_report_names_what_each_check_checks_and_fails_with_expected_and_got() -> None:
    code, lines = invoke()
    assert code == 1
    assert "PASS core one passes" in lines
    assert "     checks: A check that passes." in lines
    assert "FAIL core two fails: the answer (expected b'OK', got b'E_INVALID')" in lines
    assert lines[-1] == "2 passed, 1 failed"


def test_only_and_skip_take_groups_and_parts_of_names_and_repeat() -> None:
    assert invoke("--only", "robustness") == (0, ["PASS robustness three passes", "1 passed, 0 failed"])
    code, lines = invoke("--skip", "robustness", "--skip", "two")
    assert (code, lines[-1]) == (0, "1 passed, 0 failed")
    code, lines = invoke("--only", "one", "--only", "three")
    assert (code, [line for line in lines if line.startswith(("PASS", "FAIL"))]) == (
        0, ["PASS core one passes", "PASS robustness three passes"])


@click.command()
@runner.selection_options("core")
def toy_without_an_option() -> None:
    runner.run_command(checks, _context, lambda check: not check.name.startswith("robustness"))


def test_a_check_left_out_for_want_of_an_option_is_said_before_the_summary() -> None:
    result = CliRunner().invoke(toy_without_an_option, [], catch_exceptions=False)
    lines = result.output.splitlines()
    assert lines[-2:] == ["LEFT OUT robustness three passes: needs an option this run was not given (--list marks it)",
                          "1 passed, 1 failed"]


def test_nothing_selected_is_a_usage_error() -> None:
    code, lines = invoke("--only", "no-such-check")
    assert code == 2 and "no check matches 'no-such-check'" in "\n".join(lines)


def test_list_prints_groups_and_marks_what_the_original_fails_without_running() -> None:
    code, lines = invoke("--list")
    assert code == 0
    assert lines == ["toy:", "  core", "    core one passes — A check that passes.", "    core two fails",
                     "  robustness  [the original server fails these: the original crashes]",
                     "    robustness three passes"]


def test_junit_has_one_testcase_per_check_and_the_failure_with_expected_and_got(tmp_path: Path) -> None:
    report = tmp_path / "report.xml"
    code, _ = invoke("--junit", str(report))
    assert code == 1
    suite = ET.parse(report).getroot().find("testsuite")
    assert suite is not None and suite.get("name") == "toy"
    assert (suite.get("tests"), suite.get("failures")) == ("3", "1")
    cases = {case.get("name"): case for case in suite.iter("testcase")}
    assert set(cases) == {"core one passes", "core two fails", "robustness three passes"}
    failure = cases["core two fails"].find("failure")
    assert failure is not None and failure.get("message") == "the answer (expected b'OK', got b'E_INVALID')"
    assert cases["core one passes"].find("failure") is None


def test_all_lists_every_units_suite() -> None:
    result = CliRunner().invoke(main, ["conformance", "all", "--list", "--only", "core"], catch_exceptions=False)
    assert result.exit_code == 0
    suites = [line for line in result.output.splitlines() if line and not line.startswith(" ")]
    assert suites == ["phpmq:", "pzq:", "emqp:"]  # NSQ's and MQKS's groups are others
    assert "  robustness" not in result.output
    assert "core oldest first" in result.output


def test_list_shows_the_checks_an_option_is_missing_for() -> None:
    result = CliRunner().invoke(main, ["conformance", "pzq", "--list", "--only", "restart"], catch_exceptions=False)
    assert result.exit_code == 0
    assert "[left out: needs another option]" in result.output


@contextmanager
def _silent_servers(count: int) -> Iterator[list[str]]:
    """Addresses that accept connections and never answer."""
    with ExitStack() as stack:
        addresses = []
        for _ in range(count):
            sock = stack.enter_context(socket.socket())
            sock.bind(("127.0.0.1", 0))
            sock.listen()
            addresses.append(f"127.0.0.1:{sock.getsockname()[1]}")
        yield addresses


def _closed_address() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{sock.getsockname()[1]}"


def test_all_writes_one_testsuite_per_suite_and_fails_when_a_server_is_wrong(tmp_path: Path) -> None:
    # Servers that never answer: every selected check fails, and each suite reports.
    report = tmp_path / "all.xml"
    with _silent_servers(3) as (tcp, http, mqks):
        result = CliRunner().invoke(main, [
            "conformance", "all", "--only", "ping", "--only", "magic-bad", "--junit", str(report),
            "--nsq-tcp", tcp, "--nsq-http", http, "--nsq-timeout", "0.3", "--mqks-addr", mqks,
            "--mqks-timeout", "0.3"], catch_exceptions=False)
    assert result.exit_code == 1, result.output
    names = [suite.get("name") for suite in ET.parse(report).getroot().iter("testsuite")]
    assert names == ["nsq", "mqks"]
    assert "FAIL magic-bad" in result.output and "FAIL ping" in result.output


def _conformance(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "polymq", "conformance", *args], capture_output=True, text=True,
                          timeout=60)


# Each suite's address every check connects to first, by the option that sets it.
FIRST_ADDRESS = {"nsq": "--tcp", "mqks": "--addr", "phpmq": "--addr", "pzq": "--receive", "emqp": "--frontend"}


@pytest.mark.parametrize(("suite", "flag"), FIRST_ADDRESS.items())
def test_a_suite_pointed_at_nothing_says_so_in_one_line_and_runs_no_check(suite: str, flag: str) -> None:
    address = _closed_address()
    result = _conformance(suite, flag, address)
    assert result.returncode == 1
    assert result.stdout == ""
    assert result.stderr.splitlines() == [f"Error: nothing answers at {address} (set by {flag}): connection refused; "
                                          f"start the server there, or give its address with {flag}"]


def test_all_pointed_at_nothing_says_so_in_one_line_before_any_suite_runs() -> None:
    nothing = _closed_address()
    with _silent_servers(2) as (tcp, http):  # NSQ answers: its checks would run first, and do not
        result = _conformance("all", "--nsq-tcp", tcp, "--nsq-http", http, "--mqks-addr", nothing)
    assert result.returncode == 1
    assert result.stdout == ""
    assert result.stderr.splitlines() == [f"Error: nothing answers at {nothing} (set by --mqks-addr): connection "
                                          "refused; start the server there, or give its address with --mqks-addr"]


def test_list_needs_no_server() -> None:
    result = _conformance("nsq", "--tcp", _closed_address(), "--list")
    assert result.returncode == 0 and result.stdout.startswith("nsq:\n")


# A check's name is its description when it says what is checked in words (`core oldest first`);
# a short hyphenated name (`rdy-range`) needs a docstring.
DESCRIPTIVE_NAME_WORDS = 3


def test_every_check_of_every_suite_says_what_it_checks() -> None:
    suites = {unit.name: unit.conformance for unit in protocols() if unit.conformance is not None}
    assert set(suites) >= {"nsq", "mqks", "phpmq", "pzq", "emqp"}
    undescribed = []
    for name, target in suites.items():
        module = importlib.import_module(target.partition(":")[0])
        registry = module.checks
        assert isinstance(registry, Registry) and registry.checks, name
        for check in registry.checks:
            described = check.about != check.name or len(check.name.split()) >= DESCRIPTIVE_NAME_WORDS
            if not described or "\n" in check.about or len(check.about) < 20:
                undescribed.append(f"{name}: {check.name}")
    assert undescribed == []


def test_list_prints_each_check_s_description() -> None:
    result = CliRunner().invoke(main, ["conformance", "nsq", "--list", "--only", "rdy-range"], catch_exceptions=False)
    assert result.exit_code == 0
    assert "rdy-range — RDY up to max_rdy_count is accepted" in result.output
