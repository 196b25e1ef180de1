"""What the protocol conformance suites share: the check registry and printer, and the plumbing
around their checks (contexts, the command's options and run, connections whose failures are
the check's).

A suite registers plain functions with `Registry.check(name)`. Each function receives a
context object made by the suite (addresses, timeout, cleanup) and signals a failure by raising
`CheckFailed`; any other exception is also reported as a failure, never as a crash of the run.
Output is one line per check, `PASS name` or `FAIL name: reason (expected …, got …)`, a
`LEFT OUT name: …` line for each selected check that needs an option the run was not given, then
`N passed, M failed` alone on the last line.

A check's group is the first word of its name (up to a space, else up to a hyphen). A suite marks
the groups the protocol's original server is known to fail (`Registry.original_fails`), so a run
against the original can `--skip` them and `--list` says so.
"""

from __future__ import annotations

import contextlib
import functools
import re
import socket
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any, Generic, TypeVar

import attrs
import click

from polymq.clients import tcp

ContextT = TypeVar("ContextT")
F = TypeVar("F", bound=Callable[..., Any])

# What every suite waits at most for any one expected answer, unless --timeout says otherwise.
DEFAULT_TIMEOUT_S = 5.0
# What a suite waits at most for its server to accept a connection before it runs a check: as long
# as for any one answer.
PROBE_TIMEOUT_S = DEFAULT_TIMEOUT_S

_UNSET: Any = object()


class CheckFailed(Exception):
    """A check saw something other than what the protocol's original server does."""

    def __init__(self, reason: str, expected: Any = _UNSET, got: Any = _UNSET) -> None:
        super().__init__(reason)
        self.reason = reason
        self.expected = expected
        self.got = got

    def line(self) -> str:
        if self.expected is _UNSET and self.got is _UNSET:
            return self.reason
        parts = []
        if self.expected is not _UNSET:
            parts.append(f"expected {_show(self.expected)}")
        if self.got is not _UNSET:
            parts.append(f"got {_show(self.got)}")
        return f"{self.reason} ({', '.join(parts)})"


def _show(value: Any) -> str:
    # Strings are printed bare so that descriptions like "connection closed" read naturally;
    # bytes keep their repr so control characters and exact framing stay visible.
    return value if isinstance(value, str) else repr(value)


def group_of(name: str) -> str:
    """A check's group: the first word of its name (`robustness …`, `http-pub` → `http`)."""
    head = name.split(" ", 1)[0]
    return head if " " in name else head.split("-", 1)[0]


@attrs.frozen(slots=True)
class Check(Generic[ContextT]):
    name: str
    func: Callable[[ContextT], None]

    @property
    def group(self) -> str:
        return group_of(self.name)

    @property
    def about(self) -> str:
        """What the check checks: its function's docstring's first line, else its name."""
        doc = (self.func.__doc__ or "").strip()
        return doc.splitlines()[0] if doc else self.name

    def matches(self, word: str) -> bool:
        """`word` names the check's group, or is part of its name."""
        return word == self.group or word in self.name


@attrs.frozen(slots=True)
class Result:
    name: str
    passed: bool
    detail: str
    seconds: float
    group: str = ""
    about: str = ""

    def line(self) -> str:
        return f"PASS {self.name}" if self.passed else f"FAIL {self.name}: {self.detail}"


@attrs.define(slots=True)
class Summary:
    results: list[Result] = attrs.Factory(list)

    @property
    def passed(self) -> int:
        return sum(1 for r in self.results if r.passed)

    @property
    def failed(self) -> int:
        return sum(1 for r in self.results if not r.passed)

    def line(self) -> str:
        return f"{self.passed} passed, {self.failed} failed"


@attrs.define(slots=True)
class Registry(Generic[ContextT]):
    """Checks in registration order (the order they run and print in)."""

    checks: list[Check[ContextT]] = attrs.Factory(list)
    # group → why the protocol's original server fails it (robustness, newer protocol revisions)
    original_fails: dict[str, str] = attrs.Factory(dict)

    def check(self, name: str) -> Callable[[Callable[[ContextT], None]], Callable[[ContextT], None]]:
        def register(func: Callable[[ContextT], None]) -> Callable[[ContextT], None]:
            if any(c.name == name for c in self.checks):
                raise ValueError(f"duplicate check name {name}")
            self.checks.append(Check(name, func))
            return func

        return register

    def select(self, only: tuple[str, ...] = (), skip: tuple[str, ...] = ()) -> list[Check[ContextT]]:
        """Each of `only` and `skip` is a group name or a plain substring of a check's name (no
        globbing): the checks any `only` matches (all without one), less those any `skip` matches."""
        return [c for c in self.checks
                if (not only or any(c.matches(word) for word in only)) and not any(c.matches(word) for word in skip)]

    def groups(self) -> list[str]:
        return list(dict.fromkeys(c.group for c in self.checks))


def run_one(check: Check[ContextT], make_context: Callable[[str], AbstractContextManager[ContextT]]) -> Result:
    start = time.monotonic()
    try:
        with make_context(check.name) as context:
            check.func(context)
    except CheckFailed as exc:
        return Result(check.name, False, exc.line(), time.monotonic() - start, check.group, check.about)
    except Exception as exc:  # a check must report, never crash the run
        return Result(check.name, False, f"{type(exc).__name__}: {exc}", time.monotonic() - start, check.group,
                      check.about)
    return Result(check.name, True, "", time.monotonic() - start, check.group, check.about)


def run_checks(
    checks: list[Check[ContextT]],
    make_context: Callable[[str], AbstractContextManager[ContextT]],
    echo: Callable[[str], None] = print,
    left_out: list[Check[ContextT]] | None = None,
) -> Summary:
    """Runs `checks`, a line each; then a line for each of `left_out` (selected, but needing an option
    this run was not given); then the summary."""
    summary = Summary()
    for check in checks:
        result = run_one(check, make_context)
        summary.results.append(result)
        echo(result.line())
        if check.about != check.name:
            echo(f"     checks: {check.about}")
    for check in left_out or ():
        echo(f"LEFT OUT {check.name}: needs an option this run was not given (--list marks it)")
    echo(summary.line())
    return summary


def expect_equal(what: str, expected: Any, got: Any) -> None:
    if expected != got:
        raise CheckFailed(what, expected, got)


# -- a check's context ------------------------------------------------------------------------


@attrs.define(slots=True)
class RunState:
    """Shared by the checks of one run."""

    # Set when a cleanup failed: later checks skip cleanup instead of waiting on a broken server
    # again (their own checks still report it).
    cleanup_failed: bool = False


def name_stem(check_name: str, length: int) -> str:
    """The start of a check's name as it may stand in a topic or queue name."""
    return re.sub(r"[^a-z0-9-]", "", check_name)[:length]


def contexts(make: Callable[[str], ContextT], close: Callable[[ContextT], None],
             ignore: tuple[type[BaseException], ...] = ()) -> Callable[[str], AbstractContextManager[ContextT]]:
    """Context managers of a check's context: `make(check name)`, then `close` it whatever happened
    (the errors in `ignore` of a close are the server's, reported by the checks themselves)."""

    @contextmanager
    def context(name: str) -> Iterator[ContextT]:
        target = make(name)
        try:
            yield target
        finally:
            with contextlib.suppress(*ignore):
                close(target)

    return context


class CheckedConnection:
    """Put before a client connection: a failure to connect or to send fails the check."""

    label = "connection"
    shows_sent = True  # a failed send names the start of what it sent (PHPMQ's binary messages: no)

    def __init__(self, address: tuple[str, int], timeout: float, *args: Any, **kwargs: Any) -> None:
        try:
            super().__init__(address, timeout, *args, **kwargs)  # type: ignore[call-arg]
        except OSError as exc:
            raise CheckFailed(f"cannot connect to {address[0]}:{address[1]}", got=str(exc)) from exc

    def send(self, data: bytes) -> None:
        try:
            super().send(data)  # type: ignore[misc]
        except OSError as exc:
            sent = f" {data[:80]!r}" if self.shows_sent else ""
            raise CheckFailed(f"{self.label}: sending{sent}", "the server reading", str(exc)) from exc


# -- the command ------------------------------------------------------------------------------


@attrs.frozen(slots=True)
class Selection:
    """What the command line asks of a run besides the addresses: which checks, list or run,
    where to write JUnit XML."""

    only: tuple[str, ...] = ()
    skip: tuple[str, ...] = ()
    list_only: bool = False
    junit: str | None = None


# Where a suite's command leaves its Selection for `run_command` (the click context's meta).
SELECTION_KEY = "polymq.conformance.selection"
# Set by `polymq conformance all` in the click context's meta: a list each suite appends its
# (name, Summary) to instead of exiting.
COLLECTOR_KEY = "polymq.conformance.collector"
# Set by `polymq conformance all` for its first pass over the suites: each only checks that its
# server answers (before any suite runs a check).
PROBE_ONLY_KEY = "polymq.conformance.probe-only"
# Set by `polymq conformance all` for its second pass: the servers answered the first.
PROBED_KEY = "polymq.conformance.probed"


class NothingAnswers(click.ClickException):
    """No server accepts connections at a suite's address: every check would fail the same way."""


def refuse_if_nothing_answers(flag: str, address: str) -> None:
    """Raises NothingAnswers, naming `address` and the option `flag` that sets it, unless something
    accepts a connection there (a TCP `HOST:PORT`, or a ZeroMQ `ipc://PATH` socket)."""
    try:
        if address.startswith(IPC_PREFIX):
            with socket.socket(socket.AF_UNIX) as probe:
                probe.settimeout(PROBE_TIMEOUT_S)
                probe.connect(address.removeprefix(IPC_PREFIX))
        else:
            socket.create_connection(tcp.split_address(address), timeout=PROBE_TIMEOUT_S).close()
    except OSError as error:
        why = (error.strerror or str(error) or type(error).__name__).lower()
        raise NothingAnswers(f"nothing answers at {address} (set by {flag}): {why}; start the server there, "
                             f"or give its address with {flag}") from None


def selection_options(example: str | None = None) -> Callable[[F], F]:
    """--only, --skip (group names or parts of check names, repeatable), --list and --junit FILE.
    The wrapped command receives none of them: `run_command` finds them in the click context."""

    def add(function: F) -> F:
        @functools.wraps(function)
        def wrapper(*args: Any, only: tuple[str, ...], skip: tuple[str, ...], list_only: bool, junit: str | None,
                    **kwargs: Any) -> Any:
            click.get_current_context().meta[SELECTION_KEY] = Selection(only, skip, list_only, junit)
            return function(*args, **kwargs)

        for option in reversed(_selection_option_list(example)):
            wrapper = option(wrapper)
        return wrapper  # type: ignore[return-value]

    return add


def _selection_option_list(example: str | None = None) -> list[Callable[[F], F]]:
    hint = f" (e.g. {example})" if example else ""
    return [
        click.option("--only", multiple=True, help="run only the checks of this group or whose name contains this"
                     + hint + "; repeatable"),
        click.option("--skip", multiple=True, help="leave out the checks of this group or whose name contains this;"
                     " repeatable"),
        click.option("--list", "list_only", is_flag=True, help="print the checks by group and run nothing"),
        click.option("--junit", default=None, metavar="FILE", help="also write the results as JUnit XML to FILE"),
    ]


def timeout_option(what: str) -> Callable[[F], F]:
    """--timeout SECONDS: how long to wait for `what`."""
    return click.option("--timeout", default=DEFAULT_TIMEOUT_S, show_default=True, type=float,
                        help=f"seconds to wait for any one expected {what}")


# A ZeroMQ endpoint of a local socket file (PZQ's monitor listens on `ipc:///tmp/pzq-monitor`).
IPC_PREFIX = "ipc://"


def address_options(*options: tuple[str, str | None, str]) -> Callable[[F], F]:
    """`--NAME HOST:PORT` options of ZeroMQ endpoints: (flag, default or None, help) each, in order."""

    def add(function: F) -> F:
        for flag, default, text in reversed(options):
            function = click.option(flag, default=default, show_default=default is not None, callback=address_option,
                                    help=text)(function)
        return function

    return add


def run_command(checks: Registry[ContextT], make_context: Callable[[str], AbstractContextManager[ContextT]],
                runs: Callable[[Check[ContextT]], bool] = lambda _: True,
                address: tuple[str, str] | None = None) -> None:
    """Run the checks the command line selects (and `runs` lets run), print their lines and exit
    0 only if every one passed; or print them with --list; or, under `polymq conformance all`,
    hand the summary to it. `address` (its option's flag, its value) is where every check
    connects first: when nothing answers there, one line says so and no check runs (exit 1)."""
    ctx = click.get_current_context()
    selection: Selection = ctx.meta.get(SELECTION_KEY, Selection())
    collector: list[tuple[str, Summary]] | None = ctx.meta.get(COLLECTOR_KEY)
    suite = ctx.info_name or "conformance"
    chosen = checks.select(selection.only, selection.skip)
    selected = [check for check in chosen if runs(check)]
    if selection.list_only:
        if chosen or collector is None:  # `all` lists only the suites that have some
            click.echo(listing(suite, checks, chosen, runs))
        return
    if not selected:
        if collector is not None:  # another suite of `all` may have the checks asked for
            return
        words = selection.only + selection.skip
        raise click.UsageError(f"no check matches {' '.join(map(repr, words))}" if words else "no check to run")
    if address is not None and not ctx.meta.get(PROBED_KEY):
        flag, value = address
        refuse_if_nothing_answers(f"--{suite}-{flag.lstrip('-')}" if collector is not None else flag, value)
    if ctx.meta.get(PROBE_ONLY_KEY):
        return
    if collector is not None:
        click.echo(f"== {suite}")
    left_out = [check for check in chosen if not runs(check)]
    summary = run_checks(selected, make_context, lambda line: click.echo(line), left_out)
    if collector is not None:
        collector.append((suite, summary))
        return
    if selection.junit:
        write_junit(selection.junit, [(suite, summary)])
    raise SystemExit(0 if summary.failed == 0 else 1)


def listing(suite: str, checks: Registry[Any], selected: list[Check[Any]],
            runs: Callable[[Check[Any]], bool] = lambda _: True) -> str:
    """The selected checks by group, the groups the original server is known to fail marked, and
    the checks these options leave out (they need one more, as the suite's help says)."""
    lines = [f"{suite}:"]
    for group in checks.groups():
        members = [check for check in selected if check.group == group]
        if not members:
            continue
        why = checks.original_fails.get(group)
        lines.append(f"  {group}" + (f"  [the original server fails these: {why}]" if why else ""))
        lines.extend(f"    {check.name}" + (f" — {check.about}" if check.about != check.name else "")
                     + ("" if runs(check) else "  [left out: needs another option]") for check in members)
    return "\n".join(lines)


def junit_tree(suites: list[tuple[str, Summary]]) -> ET.ElementTree:
    """One <testsuite> per protocol, one <testcase> per check, a <failure> with expected/got."""
    root = ET.Element("testsuites", name="polymq conformance", tests=str(sum(len(s.results) for _, s in suites)),
                      failures=str(sum(s.failed for _, s in suites)))
    for suite, summary in suites:
        element = ET.SubElement(root, "testsuite", name=suite, tests=str(len(summary.results)),
                                failures=str(summary.failed), errors="0", skipped="0",
                                time=f"{sum(r.seconds for r in summary.results):.3f}")
        for result in summary.results:
            case = ET.SubElement(element, "testcase", classname=f"{suite}.{result.group or group_of(result.name)}",
                                 name=result.name, time=f"{result.seconds:.3f}")
            if result.about and result.about != result.name:
                ET.SubElement(case, "system-out").text = result.about
            if not result.passed:
                failure = ET.SubElement(case, "failure", message=result.detail, type="CheckFailed")
                failure.text = result.detail
    ET.indent(root)
    return ET.ElementTree(root)


def write_junit(path: str, suites: list[tuple[str, Summary]]) -> None:
    junit_tree(suites).write(path, encoding="utf-8", xml_declaration=True)


def parse_address(text: str) -> tuple[str, int]:
    """`HOST:PORT` (IPv6 hosts in brackets) of a server under test."""
    try:
        return tcp.split_address(text)
    except ValueError:
        raise click.BadParameter(f"{text!r} is not HOST:PORT") from None


def address_option(_ctx: click.Context, _param: click.Parameter, value: str | None) -> str | None:
    """A click callback: `HOST:PORT` as given, checked, with an IPv6 host in brackets (a ZeroMQ
    endpoint); or an `ipc://PATH` endpoint as it is."""
    if value is None:
        return None
    if value.startswith(IPC_PREFIX) and len(value) > len(IPC_PREFIX):
        return value
    host, port = parse_address(value)
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


# -- every suite in one run -------------------------------------------------------------------

# The options a suite's command shares with `all` (not prefixed there).
_SHARED_OPTIONS = ("only", "skip", "list_only", "junit")


def combined_command(suites: dict[str, click.Command]) -> click.Command:
    """`all`: every suite in `suites` in turn, each with its default addresses unless
    `--SUITE-OPTION` (its own option, prefixed by its name) says otherwise; the selection options
    shared; one report, one JUnit file with one testsuite per suite, exit 1 if any check failed."""
    passed_on: dict[str, tuple[str, str, bool]] = {}  # parameter → (suite, its own flag, is a flag)
    params: list[click.Parameter] = []
    for suite, command in suites.items():
        for param in command.params:
            if not isinstance(param, click.Option) or param.name in _SHARED_OPTIONS or param.name is None:
                continue
            own = max(param.opts, key=len)
            dest = f"{suite}_{param.name}".replace("-", "_")
            passed_on[dest] = (suite, own, param.is_flag)
            shown = "" if param.is_flag or param.default is None else f" [default: {param.default}]"
            params.append(click.Option([f"--{suite}-{own.lstrip('-')}", dest], is_flag=param.is_flag,
                                       default=False if param.is_flag else None,
                                       help=f"{suite}: {param.help or ''}{shown}"))

    def run(only: tuple[str, ...], skip: tuple[str, ...], list_only: bool, junit: str | None, **given: Any) -> None:
        ctx = click.get_current_context()
        collected: list[tuple[str, Summary]] = []
        ctx.meta[COLLECTOR_KEY] = collected

        def each_suite() -> None:
            for suite, command in suites.items():
                args = [word for w in only for word in ("--only", w)] + [word for w in skip for word in ("--skip", w)]
                args += ["--list"] if list_only else []
                for dest, (owner, own, is_flag) in passed_on.items():
                    value = given.get(dest)
                    if owner == suite and value not in (None, False):
                        args += [own] if is_flag else [own, str(value)]
                with command.make_context(suite, args, parent=ctx) as sub:
                    command.invoke(sub)

        if not list_only:  # every suite's server first: one that answers nothing stops the run before any check
            ctx.meta[PROBE_ONLY_KEY] = True
            each_suite()
            ctx.meta[PROBE_ONLY_KEY], ctx.meta[PROBED_KEY] = False, True
        each_suite()
        if list_only:
            return
        if not collected:
            words = only + skip
            raise click.UsageError(f"no check matches {' '.join(map(repr, words))}" if words else "no check to run")
        total = Summary([result for _, summary in collected for result in summary.results])
        click.echo(f"== all: {total.line()} ({'; '.join(f'{name}: {s.line()}' for name, s in collected)})")
        if junit:
            write_junit(junit, collected)
        raise SystemExit(0 if total.failed == 0 else 1)

    command = click.Command("all", callback=run, params=params, help=(
        "Run every protocol's suite in turn, each against its default addresses unless one of its"
        " options (prefixed by its name) is given. Prints each suite's report and a total; exits"
        " non-zero if any check failed."))
    for option in reversed(_selection_option_list()):
        command = option(command)  # type: ignore[arg-type]
    return command
