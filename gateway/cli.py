"""The `polymq` command: serve, config, bench, conformance, torture.

The bench and conformance commands are the protocols' own (their units name them), imported only
when one is asked for, as is torture: `polymq serve` loads no benchmark, conformance or torture code.
"""

from __future__ import annotations

import importlib

import click

from polymq import __version__
from polymq.adapters.protocol import load_command
from polymq.adapters.registry import protocols
from polymq.gateway.serve import command as serve
from polymq.gateway.serve import config_command
from polymq.gateway.wait import command as wait

# Benchmarks that belong to no one protocol: listed by the bench package itself.
BENCH_PACKAGE = "polymq.bench"


class LazyGroup(click.Group):
    """A group whose commands are "module:attribute" targets, imported when used."""

    def __init__(self, *args: object, targets: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self._targets = targets  # a callable returning {name: target}, asked only when needed

    def _all(self) -> dict[str, str]:
        return self._targets()  # type: ignore[operator,no-any-return]

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(self._all())

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        target = self._all().get(name)
        return load_command(target) if target is not None else None


def _bench_targets() -> dict[str, str]:
    found = {unit.name: unit.bench for unit in protocols() if unit.bench is not None}
    found.update(importlib.import_module(BENCH_PACKAGE).COMMANDS)
    return found


def _conformance_targets() -> dict[str, str]:
    found = {unit.name: unit.conformance for unit in protocols() if unit.conformance is not None}
    found[ALL] = ALL_TARGET
    return found


# `polymq torture`: every protocol at once under SIGKILLs, imported only when asked for.
TORTURE_TARGET = "polymq.torture.command:command"


# Commands of the group itself loaded only when used (or listed by --help).
LAZY_COMMANDS = {"torture": TORTURE_TARGET}


class MainGroup(click.Group):
    """The `polymq` group: its own commands, and LAZY_COMMANDS imported when asked for."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *LAZY_COMMANDS})

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        target = LAZY_COMMANDS.get(name)
        return load_command(target) if target is not None else super().get_command(ctx, name)


# `polymq conformance all`: every unit's suite in turn (gateway/conformance_all.py names none).
ALL = "all"
ALL_TARGET = "polymq.gateway.conformance_all:command"


@click.group(cls=MainGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, "--version", "-V", prog_name="polymq")
def main() -> None:
    """polymq: one gateway for many message-queue protocols over one queue engine.

    \b
    polymq serve         run the gateway (every protocol, default ports, loopback)
    polymq config        print the effective configuration as TOML
    polymq wait          return once a gateway serves (for scripts that start one)
    polymq bench         measure a server of a protocol (throughput and latency)
    polymq conformance   black-box checks of a server of a protocol, against any address
    polymq torture       every protocol at once under SIGKILLs: nothing acknowledged may be lost
    """


@main.group(cls=LazyGroup, targets=_bench_targets)
def bench() -> None:
    """Measure throughput and latency of any server of a protocol (polymq or the original)."""


@main.group(cls=LazyGroup, targets=_conformance_targets)
def conformance() -> None:
    """Run black-box conformance checks against any server of a protocol.

    Prints one line per check and `N passed, M failed`; exits non-zero if any check failed.
    """


main.add_command(serve, "serve")
main.add_command(config_command, "config")
main.add_command(wait, "wait")
main.help = (main.help or "") + "\n\nProtocols: " + "; ".join(unit.title for unit in protocols()) + "."
