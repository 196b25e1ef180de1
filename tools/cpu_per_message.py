"""The gateway's CPU per message under nsq's own bench tools: `polymq serve --in-memory` (or other
flags) driven by `bench_writer --batch-size=1` (PUB), `--batch-size=200` (MPUB) and `bench_reader
--rdy=2500` (consume), its user and system CPU seconds read from /proc before and after each run.

    .venv/bin/python tools/cpu_per_message.py                     # this checkout, --in-memory
    .venv/bin/python tools/cpu_per_message.py --pythonpath DIR    # the polymq package in DIR/polymq

Prints, for each run, µs of gateway CPU per message (user + system) and the messages per second.
CPU per message moves far less than throughput on a machine shared with other work, so two builds
are compared by alternating runs of each (docs/performance.md, "The compiled hot modules").
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

import click

from polymq.bench.common import process_cpu_s
from polymq.bench.versus_nsqd import (
    DEFAULT_NSQ_BIN,
    FILL_RUN_S,
    MESSAGE_SIZE,
    MPUB_BATCH,
    READER_RDY,
    BenchError,
    stop_server,
    wait_accepting,
)
from polymq.clients.ports import free_ports

# Messages queued before the consume run, so the reader does not run dry in a few seconds.
BACKLOG = 1_500_000
# What nsq's tools print at the end: "duration: 3.0s - 12.3mb/s - 64000.0ops/s - 15.6us/op", the duration
# in Go's notation (a run under a second in ms).
_RESULT = re.compile(r"duration: ([0-9.]+)(ms|s) - [0-9.]+mb/s - ([0-9.]+)ops/s")
_SECONDS_PER = {"ms": 1e-3, "s": 1.0}


def _cpu(pid: int) -> tuple[float, float]:
    """User and system CPU seconds of a process."""
    found = process_cpu_s(pid)
    if found is None:
        raise click.ClickException(f"no CPU figures for process {pid} in /proc")
    return found[0], found[1]


def _tool(nsq_bin: Path, name: str, tcp: int, runfor: float, *args: str) -> tuple[float, float]:
    """Run one of nsq's bench tools: (messages, messages per second)."""
    done = subprocess.run([str(nsq_bin / name), f"--nsqd-tcp-address=127.0.0.1:{tcp}", f"--runfor={runfor}s",
                           f"--size={MESSAGE_SIZE}", *args], capture_output=True, text=True, timeout=runfor + 120,
                          check=False)
    found = _RESULT.findall(done.stdout + done.stderr)
    if done.returncode != 0 or not found:
        raise click.ClickException(f"{name} failed (status {done.returncode}): {done.stderr.strip()[-300:]}")
    duration, unit, rate = found[-1]
    return float(duration) * _SECONDS_PER[unit] * float(rate), float(rate)


def _depth(http: int, topic: str) -> int:
    with urllib.request.urlopen(f"http://127.0.0.1:{http}/stats?format=json&topic={topic}", timeout=10) as reply:
        stats = json.load(reply)
    return sum(entry.get("depth", 0) + sum(channel.get("depth", 0) for channel in entry.get("channels") or [])
               for entry in stats.get("topics") or [] if entry.get("topic_name") == topic)


def _measured(pid: int, run: tuple[float, float], before: tuple[float, float]) -> str:
    """The CPU the gateway used since `before`, per message of `run`."""
    messages, rate = run
    user, system = (after - start for after, start in zip(_cpu(pid), before, strict=True))
    return (f"{1e6 * (user + system) / messages:.2f} us/msg (user {1e6 * user / messages:.2f}, "
            f"sys {1e6 * system / messages:.2f}) at {rate / 1000:.1f}k msgs/s")


@click.command()
@click.option("--nsq-bin", type=click.Path(path_type=Path), default=DEFAULT_NSQ_BIN,
              show_default=True, help="Folder with nsq 1.3.0's bench_writer and bench_reader.")
@click.option("--pythonpath", type=click.Path(path_type=Path), default=None,
              help="Serve the polymq package found in this folder (DIR/polymq), e.g. an earlier checkout.")
@click.option("--runfor", type=float, default=3.0, show_default=True, help="Seconds per measured run.")
@click.option("--backlog", type=click.IntRange(min=1), default=BACKLOG, show_default=True,
              help="Messages queued before the consume run.")
@click.option("--only", "only", multiple=True, type=click.Choice(["PUB", "MPUB", "consume"]),
              help="Measure only these (repeatable); all three by default.")
@click.argument("serve_args", nargs=-1)
def main(nsq_bin: Path, pythonpath: Path | None, runfor: float, backlog: int, only: tuple[str, ...],
         serve_args: tuple[str, ...]) -> None:
    """Gateway CPU µs per message for PUB, MPUB and consume (SERVE_ARGS: flags of `polymq serve`,
    --in-memory when none are given)."""
    wanted = set(only or ("PUB", "MPUB", "consume"))
    tcp, http = free_ports(2)
    env = dict(os.environ)
    if pythonpath is not None:
        env["PYTHONPATH"] = str(pythonpath)
    with tempfile.TemporaryDirectory(prefix="polymq-cpu-") as data:
        serve_args = serve_args or ("--in-memory",)
        storage = () if "--in-memory" in serve_args else ("--data-dir", data)
        argv = [sys.executable, "-m", "polymq", "serve", *storage, "--nsq-tcp-port", str(tcp),
                "--nsq-http-port", str(http), "--mqks-port", "-1", "--phpmq-port", "-1", "--phpmq-console-port",
                "-1", "--no-pzq", "--no-emqp", "--admin-port", "-1", *serve_args]
        # Started from the data dir: `python -m` puts the working directory first on sys.path.
        server = subprocess.Popen(argv, cwd=data, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            try:
                wait_accepting(tcp, server)
            except BenchError as error:
                raise click.ClickException(f"the gateway did not start: {error}") from None
            for label, topic, batch in (("PUB", "cpu_pub", 1), ("MPUB", "cpu_sub", MPUB_BATCH)):
                if label in wanted:
                    before = _cpu(server.pid)
                    run = _tool(nsq_bin, "bench_writer", tcp, runfor, f"--batch-size={batch}", f"--topic={topic}")
                    click.echo(f"{label}: {_measured(server.pid, run, before)}")
            if "consume" in wanted:
                while _depth(http, "cpu_sub") < backlog:
                    _tool(nsq_bin, "bench_writer", tcp, FILL_RUN_S, f"--batch-size={MPUB_BATCH}", "--topic=cpu_sub")
                before = _cpu(server.pid)
                run = _tool(nsq_bin, "bench_reader", tcp, runfor, "--topic=cpu_sub", "--channel=ch",
                            f"--rdy={READER_RDY}")
                click.echo(f"consume: {_measured(server.pid, run, before)}")
        finally:
            stop_server(server)


if __name__ == "__main__":
    main()
