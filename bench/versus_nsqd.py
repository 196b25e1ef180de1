"""`polymq bench versus-nsqd`: nsqd and polymq side by side, measured by nsq's own bench tools.

Runs each server in turn on free loopback ports with a fresh data dir (nsqd 1.3.0 with its
defaults, with `--mem-queue-size=1000000`, and in its durable mode `--mem-queue-size=0
--sync-every=1`; polymq `--in-memory`, `--fsync=never` and its
default `--fsync=always`), and drives every one with the same three runs of nsq's Go tools:

- PUB: `bench_writer --batch-size=1`, one message per round trip on each connection;
- MPUB: `bench_writer --batch-size=200`;
- consume: `bench_reader --rdy=2500` on a backlog of at least `--backlog` messages, filled first
  (and reported as "drained" if the reader emptied it, when the figure is a lower bound).

Both tools open one connection per Go processor (GOMAXPROCS: 2 on a 2-core machine). The table
gives messages per second and each polymq mode's ratio to the nsqd mode it is compared with:
`--fsync=never` and the default with nsqd's defaults (neither fsyncs per publish: the default
polymq does), `--in-memory` with nsqd `--mem-queue-size=1000000`; and polymq's default with nsqd's
durable mode on a line of its own. See docs/performance.md.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path

import attrs
import click

from polymq.bench import common
from polymq.clients.ports import free_ports

# Where nsq's build script puts the binaries by default.
DEFAULT_NSQ_BIN = Path.home() / "ref" / "nsq" / "bin"
# nsq's bench tools' defaults: 200-byte messages, MPUB batches of 200, RDY 2500.
MESSAGE_SIZE = 200
MPUB_BATCH = 200
READER_RDY = 2500
# A server must accept connections within this long after it was started.
START_TIMEOUT_S = 30.0
# How long a server may take to stop cleanly on SIGTERM (a durable one flushes its store).
STOP_TIMEOUT_S = 30.0
# Messages in the backlog before the consume run, so the reader does not run dry.
DEFAULT_BACKLOG = 2_000_000
# A fill run of bench_writer (seconds), repeated until the backlog is deep enough.
FILL_RUN_S = 1.0
# Bounds the fill runs: a server this slow would never reach the backlog anyway.
MAX_FILL_RUNS = 60

PUB_TOPIC = "bench_pub"
SUB_TOPIC = "bench_sub"
CHANNEL = "ch"
_OPS = re.compile(r"([0-9.]+)ops/s")


@attrs.frozen
class Server:
    label: str
    kind: str  # "nsqd" or "polymq"
    args: tuple[str, ...]
    compare_with: str | None  # the label of the nsqd mode its ratio is taken against


NSQD_DURABLE = "nsqd 1.3.0, --mem-queue-size=0 --sync-every=1"
POLYMQ_DEFAULT = "polymq (default: --fsync=always)"
SERVERS = (
    Server("nsqd 1.3.0, defaults", "nsqd", (), None),
    Server("nsqd 1.3.0, --mem-queue-size=1000000", "nsqd", ("--mem-queue-size=1000000",), None),
    # nsqd's own durable mode: every message to disk and fsynced (what polymq's default promises).
    Server(NSQD_DURABLE, "nsqd", ("--mem-queue-size=0", "--sync-every=1"), None),
    Server("polymq --in-memory", "polymq", ("--in-memory",), "nsqd 1.3.0, --mem-queue-size=1000000"),
    Server("polymq --fsync=never", "polymq", ("--fsync=never",), "nsqd 1.3.0, defaults"),
    Server(POLYMQ_DEFAULT, "polymq", (), "nsqd 1.3.0, defaults"),
)
COLUMNS = ("PUB", "MPUB", "consume")


@attrs.define
class Result:
    server: Server
    rates: dict[str, float] = attrs.Factory(dict)
    drained: bool = False
    error: str | None = None


class BenchError(Exception):
    pass


def wait_accepting(port: int, process: subprocess.Popen[bytes]) -> None:
    """Until something accepts connections on 127.0.0.1:`port`; BenchError if `process` exits first
    or nothing does within START_TIMEOUT_S."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise BenchError(f"the server exited at start with status {process.returncode}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return
        time.sleep(0.05)
    raise BenchError(f"nothing accepts connections on 127.0.0.1:{port} after {START_TIMEOUT_S:.0f} s")


@contextlib.contextmanager
def running_server(server: Server, nsq_bin: Path, polymq_cmd: Sequence[str]) -> Iterator[tuple[int, int]]:
    tcp, http = free_ports(2)
    data = Path(tempfile.mkdtemp(prefix="polymq-versus-"))
    if server.kind == "nsqd":
        argv = [str(nsq_bin / "nsqd"), f"--data-path={data}", f"--tcp-address=127.0.0.1:{tcp}",
                f"--http-address=127.0.0.1:{http}", *server.args]
    else:
        storage = () if "--in-memory" in server.args else ("--data-dir", str(data / "data"))
        argv = [*polymq_cmd, "serve", *storage, "--nsq-tcp-port", str(tcp),
                "--nsq-http-port", str(http), "--mqks-port", "-1", "--phpmq-port", "-1",
                "--phpmq-console-port", "-1", "--no-pzq", "--no-emqp", "--admin-port", "-1", *server.args]
    process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_accepting(tcp, process)
        yield tcp, http
    finally:
        stop_server(process)
        shutil.rmtree(data, ignore_errors=True)


def stop_server(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM, then SIGKILL if it has not exited within STOP_TIMEOUT_S (its PID only)."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def bench_tool(nsq_bin: Path, name: str, tcp: int, *args: str, runfor: float,
               env: dict[str, str] | None = None) -> float:
    """Run one of nsq's bench tools (with `env` added to ours: GOMAXPROCS sets its connections); its ops/s."""
    argv = [str(nsq_bin / name), f"--nsqd-tcp-address=127.0.0.1:{tcp}", f"--runfor={runfor}s",
            f"--size={MESSAGE_SIZE}", *args]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=runfor + 120, check=False,
                          env={**os.environ, **(env or {})})
    found = _OPS.findall(done.stdout + done.stderr)
    if done.returncode != 0 or not found:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        raise BenchError(f"{name} failed (status {done.returncode}): {tail[0]}")
    return float(found[-1])


def _depth(http: int, topic: str) -> int:
    """Messages waiting in `topic` and its channels (nsqd's /stats, which polymq serves alike)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{http}/stats?format=json&topic={topic}", timeout=10) as reply:
        stats = json.load(reply)
    total = 0
    for entry in stats.get("topics", []):
        if entry.get("topic_name") == topic:
            total += entry.get("depth", 0) + sum(channel.get("depth", 0) for channel in entry.get("channels", []))
    return total


def measure(server: Server, nsq_bin: Path, polymq_cmd: Sequence[str], runfor: float, backlog: int) -> Result:
    result = Result(server)
    try:
        with running_server(server, nsq_bin, polymq_cmd) as (tcp, http):
            result.rates["PUB"] = bench_tool(nsq_bin, "bench_writer", tcp, "--batch-size=1", f"--topic={PUB_TOPIC}",
                                        runfor=runfor)
            result.rates["MPUB"] = bench_tool(nsq_bin, "bench_writer", tcp, f"--batch-size={MPUB_BATCH}",
                                         f"--topic={SUB_TOPIC}", runfor=runfor)
            for _ in range(MAX_FILL_RUNS):
                if _depth(http, SUB_TOPIC) >= backlog:
                    break
                bench_tool(nsq_bin, "bench_writer", tcp, f"--batch-size={MPUB_BATCH}", f"--topic={SUB_TOPIC}",
                      runfor=FILL_RUN_S)
            result.rates["consume"] = bench_tool(nsq_bin, "bench_reader", tcp, f"--topic={SUB_TOPIC}",
                                            f"--channel={CHANNEL}", f"--rdy={READER_RDY}", runfor=runfor)
            result.drained = _depth(http, SUB_TOPIC) == 0
    except (BenchError, OSError, subprocess.SubprocessError) as error:
        result.error = str(error)
    return result


def render(results: Sequence[Result]) -> str:
    by_label = {result.server.label: result for result in results}
    rows = []
    for result in results:
        row = [result.server.label]
        reference = by_label.get(result.server.compare_with or "")
        for column in COLUMNS:
            rate = result.rates.get(column)
            if rate is None:
                row.append("failed" if result.error else "-")
                continue
            cell = common.format_count(rate)
            if column == "consume" and result.drained:
                cell = f">= {cell} (drained)"
            base = reference.rates.get(column) if reference is not None else None
            if base:
                cell += f" ({rate / base:.2f}x)"
            row.append(cell)
        rows.append(row)
    headers = ["server and flags", "PUB, one per round trip", f"MPUB, batches of {MPUB_BATCH}",
               f"consume the backlog, RDY {READER_RDY}"]
    lines = [common.render_table(headers, rows)]
    lines.append("msgs/s; (Nx) = ratio to nsqd --mem-queue-size=1000000 for --in-memory, to nsqd's defaults "
                 "for the other polymq modes")
    durable, default = by_label.get(NSQD_DURABLE), by_label.get(POLYMQ_DEFAULT)
    if durable is not None and default is not None:
        ratios = [f"{column} {default.rates[column] / durable.rates[column]:.1f}x" for column in COLUMNS
                  if default.rates.get(column) and durable.rates.get(column)]
        if ratios:
            lines.append(f"polymq's default against nsqd's durable mode ({NSQD_DURABLE}): {', '.join(ratios)}")
    lines += [f"{result.server.label}: {result.error}" for result in results if result.error]
    return "\n".join(lines)


def default_polymq() -> list[str]:
    return [sys.executable, "-m", "polymq"]


@click.command()
@click.option("--nsq-bin", type=click.Path(file_okay=False, path_type=Path), default=DEFAULT_NSQ_BIN,
              show_default=True, help="Folder with nsqd, bench_writer and bench_reader (nsq 1.3.0).")
@click.option("--runfor", type=click.FloatRange(min=0.5), default=3.0, show_default=True,
              help="Seconds per measured run (bench_writer and bench_reader --runfor).")
@click.option("--backlog", type=click.IntRange(min=0), default=DEFAULT_BACKLOG, show_default=True,
              help="Messages in the backlog before the consume run.")
@click.option("--only", "only", multiple=True, type=click.Choice([s.label for s in SERVERS]),
              help="Run only these servers (repeatable); all six by default.")
def command(nsq_bin: Path, runfor: float, backlog: int, only: tuple[str, ...]) -> None:
    """nsqd 1.3.0 and polymq one after the other, each measured with nsq's bench_writer and bench_reader.

    Prints the ratio table of docs/performance.md. Each server runs alone on free loopback ports
    with a fresh data dir in the system's temporary folder, removed afterwards.
    """
    missing = [name for name in ("nsqd", "bench_writer", "bench_reader") if not os.access(nsq_bin / name, os.X_OK)]
    if missing:
        raise click.UsageError(f"{nsq_bin} has no {', '.join(missing)}: put nsq 1.3.0's nsqd, bench_writer and "
                               "bench_reader there, or name their folder with --nsq-bin (docs/performance.md)")
    results = []
    for server in SERVERS:
        if only and server.label not in only:
            continue
        click.echo(f"measuring {server.label} ...", err=True)
        results.append(measure(server, nsq_bin, default_polymq(), runfor, backlog))
    click.echo(render(results))
    if any(result.error for result in results):
        sys.exit(1)
