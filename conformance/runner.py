"""What the protocol conformance suites share: the check registry and printer, and the plumbing
around their checks (contexts, the command's options and run, connections whose failures are
the check's).

A suite registers plain functions with `Registry.check(name)`. Each function receives a
context object made by the suite (addresses, timeout, cleanup) and signals a failure by raising
`CheckFailed`; any other exception is also reported as a failure, never as a crash of the run.
Output is one line per check, `PASS name` or `FAIL name: reason (expected …, got …)`, then
`N passed, M failed` alone on the last line.
"""

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any, Generic, NoReturn, TypeVar

import attrs
import click

from polymq.clients import tcp

ContextT = TypeVar("ContextT")
F = TypeVar("F", bound=Callable[..., Any])

# What every suite waits at most for any one expected answer, unless --timeout says otherwise.
DEFAULT_TIMEOUT_S = 5.0

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


@attrs.frozen(slots=True)
class Check(Generic[ContextT]):
    name: str
    func: Callable[[ContextT], None]


@attrs.frozen(slots=True)
class Result:
    name: str
    passed: bool
    detail: str
    seconds: float

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

    def check(self, name: str) -> Callable[[Callable[[ContextT], None]], Callable[[ContextT], None]]:
        def register(func: Callable[[ContextT], None]) -> Callable[[ContextT], None]:
            if any(c.name == name for c in self.checks):
                raise ValueError(f"duplicate check name {name}")
            self.checks.append(Check(name, func))
            return func

        return register

    def select(self, only: str | None) -> list[Check[ContextT]]:
        """`only` is a plain substring of the check name (no globbing)."""
        if not only:
            return list(self.checks)
        return [c for c in self.checks if only in c.name]


def run_one(check: Check[ContextT], make_context: Callable[[str], AbstractContextManager[ContextT]]) -> Result:
    start = time.monotonic()
    try:
        with make_context(check.name) as context:
            check.func(context)
    except CheckFailed as exc:
        return Result(check.name, False, exc.line(), time.monotonic() - start)
    except Exception as exc:  # a check must report, never crash the run
        return Result(check.name, False, f"{type(exc).__name__}: {exc}", time.monotonic() - start)
    return Result(check.name, True, "", time.monotonic() - start)


def run_checks(
    checks: list[Check[ContextT]],
    make_context: Callable[[str], AbstractContextManager[ContextT]],
    echo: Callable[[str], None] = print,
) -> Summary:
    summary = Summary()
    for check in checks:
        result = run_one(check, make_context)
        summary.results.append(result)
        echo(result.line())
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


def only_option(example: str | None = None) -> Callable[[F], F]:
    """--only SUBSTRING."""
    return click.option("--only", default=None, help="run only checks whose name contains this substring"
                        + (f" (e.g. {example})" if example else ""))


def timeout_option(what: str) -> Callable[[F], F]:
    """--timeout SECONDS: how long to wait for `what`."""
    return click.option("--timeout", default=DEFAULT_TIMEOUT_S, show_default=True, type=float,
                        help=f"seconds to wait for any one expected {what}")


def address_options(*options: tuple[str, str | None, str]) -> Callable[[F], F]:
    """`--NAME HOST:PORT` options of ZeroMQ endpoints: (flag, default or None, help) each, in order."""

    def add(function: F) -> F:
        for flag, default, text in reversed(options):
            function = click.option(flag, default=default, show_default=default is not None, callback=address_option,
                                    help=text)(function)
        return function

    return add


def run_command(checks: Registry[ContextT], only: str | None,
                make_context: Callable[[str], AbstractContextManager[ContextT]],
                runs: Callable[[Check[ContextT]], bool] = lambda _: True) -> NoReturn:
    """Run the checks `--only` selects (and `runs` lets run), print their lines, exit 0 only if
    every one passed."""
    selected = [check for check in checks.select(only) if runs(check)]
    if not selected:
        raise click.UsageError(f"no check name contains {only!r}" if only else "no check to run")
    summary = run_checks(selected, make_context, lambda line: click.echo(line))
    raise SystemExit(0 if summary.failed == 0 else 1)


def parse_address(text: str) -> tuple[str, int]:
    """`HOST:PORT` (IPv6 hosts in brackets) of a server under test."""
    try:
        return tcp.split_address(text)
    except ValueError:
        raise click.BadParameter(f"{text!r} is not HOST:PORT") from None


def address_option(_ctx: click.Context, _param: click.Parameter, value: str | None) -> str | None:
    """A click callback: `HOST:PORT` as given, checked, with an IPv6 host in brackets (a ZeroMQ endpoint)."""
    if value is None:
        return None
    host, port = parse_address(value)
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
