"""A small check registry and printer shared by the protocol conformance suites.

A suite registers plain functions with `Registry.check(name)`. Each function receives a
context object made by the suite (addresses, timeout, cleanup) and signals a failure by raising
`CheckFailed`; any other exception is also reported as a failure, never as a crash of the run.
Output is one line per check, `PASS name` or `FAIL name: reason (expected …, got …)`, then
`N passed, M failed` alone on the last line.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, Generic, TypeVar

import attrs
import click

ContextT = TypeVar("ContextT")

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


def parse_address(text: str) -> tuple[str, int]:
    """`HOST:PORT` (IPv6 hosts in brackets) of a server under test."""
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit():
        raise click.BadParameter(f"{text!r} is not HOST:PORT")
    return host.strip("[]"), int(port)


def address_option(_ctx: click.Context, _param: click.Parameter, value: str | None) -> str | None:
    """A click callback: `HOST:PORT` as given, checked, with an IPv6 host in brackets (a ZeroMQ endpoint)."""
    if value is None:
        return None
    host, port = parse_address(value)
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


# Bytes one socket read asks for in the suites (any value works: they reassemble their frames).
RECV_SIZE = 65536


def recv_before(sock: socket.socket, deadline: float) -> bytes | None:
    """One read from a blocking socket: its bytes (b"" once the server closed), or None when the
    deadline (time.monotonic) passed first. Errors of the connection (a reset) are raised."""
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        return None
    sock.settimeout(remaining)
    try:
        return sock.recv(RECV_SIZE)
    except TimeoutError:
        return None

