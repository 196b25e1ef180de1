"""`polymq bench durable-pub`: the durable PUB beside what the disk allows, in one run.

For each number of connections N (1, 2 and 8 by default): the disk's bound first (`disk_bound.measure`,
N threads each writing a 200-byte record and fdatasyncing it, on the folder the servers store in),
then polymq in its default mode (`--fsync=always`: a PUB is answered once its record is fdatasynced)
and nsqd 1.3.0 in its durable mode (`--mem-queue-size=0 --sync-every=1`: every message written and
fsynced), each driven by nsq's `bench_writer --batch-size=1` with GOMAXPROCS=N, which opens N
connections, one message per round trip on each. docs/performance.md has the figures.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import click

from polymq.bench import common
from polymq.bench.disk_bound import measure
from polymq.bench.versus_nsqd import (
    DEFAULT_NSQ_BIN,
    NSQD_DURABLE,
    POLYMQ_DEFAULT,
    PUB_TOPIC,
    SERVERS,
    BenchError,
    bench_tool,
    default_polymq,
    running_server,
)

DEFAULT_CONNECTIONS = (1, 2, 8)


@click.command()
@click.option("--nsq-bin", type=click.Path(file_okay=False, path_type=Path), default=DEFAULT_NSQ_BIN,
              show_default=True, help="Folder with nsqd and bench_writer (nsq 1.3.0).")
@click.option("--runfor", type=click.FloatRange(min=0.5), default=3.0, show_default=True,
              help="Seconds per measured run (the disk's, and bench_writer --runfor).")
@click.option("--connections", "connections", multiple=True, type=click.IntRange(min=1),
              help="Connections (and disk threads) to measure with (repeatable; default 1, 2 and 8).")
def command(nsq_bin: Path, runfor: float, connections: tuple[int, ...]) -> None:
    """The disk's write+fdatasync rate beside polymq's and nsqd's durable PUB, for 1, 2 and 8 connections."""
    missing = [name for name in ("nsqd", "bench_writer") if not os.access(nsq_bin / name, os.X_OK)]
    if missing:
        raise click.UsageError(f"{nsq_bin} has no {', '.join(missing)}: put nsq 1.3.0's nsqd and bench_writer "
                               "there, or name their folder with --nsq-bin (docs/performance.md)")
    servers = {server.label: server for server in SERVERS}
    polymq, nsqd = servers[POLYMQ_DEFAULT], servers[NSQD_DURABLE]
    rows = []
    failed = False
    for count in connections or DEFAULT_CONNECTIONS:
        click.echo(f"measuring {count} connection(s) ...", err=True)
        disk, p50, p99 = measure(tempfile.gettempdir(), count, runfor)
        row = [str(count), f"{common.format_count(disk)} (p50 {p50:.0f} us, p99 {p99:.0f} us)"]
        rates = []
        for server in (polymq, nsqd):
            try:
                with running_server(server, nsq_bin, default_polymq()) as (tcp, _):
                    rate = bench_tool(nsq_bin, "bench_writer", tcp, "--batch-size=1", f"--topic={PUB_TOPIC}",
                                 runfor=runfor, env={"GOMAXPROCS": str(count)})
            except (BenchError, OSError) as error:
                failed = True
                row.append(f"failed: {error}")
                rates.append(None)
                continue
            rates.append(rate)
            row.append(f"{common.format_count(rate)} ({rate / disk:.2f}x the disk)")
        polymq_rate, nsqd_rate = rates
        row.append(f"{polymq_rate / nsqd_rate:.2f}x" if polymq_rate and nsqd_rate else "-")
        rows.append(row)
    headers = ["connections", "disk: write+fdatasync/s (that many threads)", "polymq --fsync=always PUB",
               "nsqd --mem-queue-size=0 --sync-every=1 PUB", "polymq / nsqd"]
    click.echo(common.render_table(headers, rows))
    click.echo(f"msgs/s; the disk and both servers in {tempfile.gettempdir()}; each server fresh for each row")
    if failed:
        sys.exit(1)
