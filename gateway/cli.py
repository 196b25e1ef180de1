"""The `polymq` command: serve, config, bench, conformance."""

from __future__ import annotations

import click

from polymq import __version__
from polymq.conformance.emqp import command as conformance_emqp
from polymq.conformance.mqks import command as conformance_mqks
from polymq.conformance.nsq import command as conformance_nsq
from polymq.conformance.phpmq import command as conformance_phpmq
from polymq.conformance.pzq import command as conformance_pzq
from polymq.gateway.bench_emqp import command as bench_emqp
from polymq.gateway.bench_mqks import command as bench_mqks
from polymq.gateway.bench_nsq import command as bench_nsq
from polymq.gateway.bench_phpmq import command as bench_phpmq
from polymq.gateway.bench_pzq import command as bench_pzq
from polymq.gateway.bench_spark import command as bench_spark
from polymq.gateway.bench_versus import command as bench_versus
from polymq.gateway.serve import command as serve
from polymq.gateway.serve import config_command


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="polymq")
def main() -> None:
    """polymq: one gateway for NSQ V2 (TCP and HTTP), MQKS, PHPMQ, PZQ and eMQP over one queue engine.

    \b
    polymq serve         run the gateway (every built protocol, default ports, loopback)
    polymq config        print the effective configuration as TOML
    polymq bench         measure a server of a protocol (throughput and latency)
    polymq conformance   black-box checks of a server of a protocol, against any address
    """


@main.group()
def bench() -> None:
    """Measure throughput and latency of any server of a protocol (polymq or the original)."""


@main.group()
def conformance() -> None:
    """Run black-box conformance checks against any server of a protocol.

    Prints one line per check and `N passed, M failed`; exits non-zero if any check failed.
    """


main.add_command(serve, "serve")
main.add_command(config_command, "config")
bench.add_command(bench_emqp, "emqp")
bench.add_command(bench_mqks, "mqks")
bench.add_command(bench_nsq, "nsq")
bench.add_command(bench_phpmq, "phpmq")
bench.add_command(bench_pzq, "pzq")
bench.add_command(bench_spark, "spark")
bench.add_command(bench_versus, "versus-nsqd")
conformance.add_command(conformance_nsq, "nsq")
conformance.add_command(conformance_mqks, "mqks")
conformance.add_command(conformance_phpmq, "phpmq")
conformance.add_command(conformance_pzq, "pzq")
conformance.add_command(conformance_emqp, "emqp")
