"""`polymq bench jetstream`: polymq on a three-server JetStream cluster, beside nats-py on the same cluster.

One run starts its own cluster of three `nats-server` processes (R3 streams, on loopback, from the
venv), then measures in turn:

- **nats-py, direct**: the ceiling a NATS client sees, an async publish of every message (acks awaited
  in a window) and a pull consumer's fetch of 256 with an ack per message;
- **polymq on JetStream**: a gateway started with `--jetstream` on that cluster, measured with the NSQ
  bench (MPUB batches, PUB one per round trip, consume with RDY) and the MQKS bench (manual acks);
- **polymq embedded**: the same benches against a gateway on its embedded store (`--fsync=always`).

Each gateway runs alone, on free loopback ports, with a data dir in the system's temporary folder.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import attrs
import click

from polymq.bench import mqks as mqks_bench
from polymq.bench import nsq as nsq_bench
from polymq.bench.versus_nsqd import START_TIMEOUT_S, BenchError, stop_server, wait_accepting
from polymq.clients.nats_servers import NatsCluster, NatsServerError
from polymq.clients.ports import free_ports

MESSAGE_SIZE = 200  # nsq's bench_writer's default
DIRECT_WINDOW = 256  # publish acks awaited at once by the direct client
FETCH_BATCH = 256
STREAM_READY_S = 20.0  # how long a new stream may take to elect its leader


@attrs.define
class Row:
    label: str
    rates: dict[str, float] = attrs.Factory(dict)  # msgs/s by measure
    error: str | None = None


async def _direct(urls: list[str], messages: int) -> dict[str, float]:
    import nats  # the bench's own dependency (the test extra): the ceiling a NATS client sees

    client = await nats.connect(servers=urls)
    try:
        js = client.jetstream()
        with contextlib.suppress(Exception):
            await js.delete_stream("BENCH_DIRECT")
        body = b"x" * MESSAGE_SIZE
        deadline = time.monotonic() + STREAM_READY_S
        while True:  # a cluster just started may have no peers to place it on yet
            try:
                await js.add_stream(name="BENCH_DIRECT", subjects=["bench.direct"], num_replicas=min(3, len(urls)))
                break
            except Exception:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.1)
        while True:  # a stream just made answers once its leader is elected
            try:
                await js.publish("bench.direct", body)
                break
            except Exception:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.1)
        await js.purge_stream("BENCH_DIRECT")
        started = time.perf_counter()
        pending: list[asyncio.Future[object]] = []
        for _ in range(messages):
            pending.append(await js.publish_async("bench.direct", body))
            if len(pending) >= DIRECT_WINDOW:
                await asyncio.gather(*pending)
                pending.clear()
        await asyncio.gather(*pending)
        publish_s = time.perf_counter() - started
        subscription = await js.pull_subscribe("bench.direct", durable="bench")
        started = time.perf_counter()
        received = 0
        while received < messages:
            for message in await subscription.fetch(FETCH_BATCH, timeout=10):
                await message.ack()
                received += 1
        consume_s = time.perf_counter() - started
        await js.delete_stream("BENCH_DIRECT")
        return {"publish": messages / publish_s, "consume": messages / consume_s}
    finally:
        await client.close()


@contextlib.contextmanager
def _gateway(extra: list[str]) -> Iterator[tuple[int, int, int]]:
    tcp, http, mqks = free_ports(3)
    data = Path(tempfile.mkdtemp(prefix="polymq-bench-js-"))
    log = data / "gateway.log"
    argv = [sys.executable, "-m", "polymq", "serve", "--data-dir", str(data / "data"), "--nsq-tcp-port", str(tcp),
            "--nsq-http-port", str(http), "--mqks-port", str(mqks), "--phpmq-port", "-1", "--phpmq-console-port", "-1",
            "--no-pzq", "--no-emqp", "--admin-port", "-1", *extra]
    with log.open("wb") as output:
        process = subprocess.Popen(argv, stdout=output, stderr=subprocess.STDOUT)
    try:
        try:
            wait_accepting(tcp, process)
            wait_accepting(mqks, process)
            _wait_ready(log, process)  # it listens before its engine is open (on JetStream: streams made)
        except BenchError as error:  # the gateway's own last line says why it did not start
            lines = log.read_text(errors="replace").strip().splitlines()
            raise BenchError(f"{error}: {lines[-1] if lines else 'it printed nothing'}") from None
        yield tcp, http, mqks
    finally:
        stop_server(process)
        shutil.rmtree(data, ignore_errors=True)


def _wait_ready(log: Path, process: subprocess.Popen[bytes]) -> None:
    """Until the gateway logs `ready`; BenchError if it exits first or does not within START_TIMEOUT_S."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while not any(line.endswith(" ready") for line in log.read_text(errors="replace").splitlines()):
        if process.poll() is not None:
            raise BenchError(f"the gateway exited at start with status {process.returncode}")
        if time.monotonic() > deadline:
            raise BenchError(f"the gateway was not ready after {START_TIMEOUT_S:.0f} s")
        time.sleep(0.05)


def _through_gateway(extra: list[str], messages: int) -> dict[str, float]:
    rates: dict[str, float] = {}
    with _gateway(extra) as (tcp, http, mqks):
        for scenario, publishers in (("mpub", 2), ("pub", 8), ("sub", 2)):
            opts = nsq_bench.BenchOptions(
                host="127.0.0.1", port=tcp, http=("127.0.0.1", http), scenarios=(scenario,), duration_s=None,
                count=messages, size=MESSAGE_SIZE, batch=nsq_bench.DEFAULT_BATCH, rdy=nsq_bench.DEFAULT_RDY,
                publishers=publishers, consumers=2, pub_consumers=0, processes=None,
                topic_prefix=f"bench_js_{scenario}", output_buffer_timeout_ms=None, progress=False)
            [result] = nsq_bench.run_bench(opts)
            if scenario == "sub":
                rates["NSQ consume"] = result.sub_rate()
            else:
                rates[f"NSQ {scenario.upper()}"] = result.pub_rate()
        mqks_opts = mqks_bench.BenchOptions(
            host="127.0.0.1", port=mqks, scenarios=("manual",), clients=mqks_bench.DEFAULT_CLIENTS,
            messages=messages, latency_clients=0, latency_messages=0, interval_s=mqks_bench.DEFAULT_INTERVAL_S,
            size=mqks_bench.DEFAULT_SIZE, processes=None, prefix="bench_js", progress=False)
        [manual] = mqks_bench.run_bench(mqks_opts)
        rates["MQKS publish"] = manual.pub_rate()
        rates["MQKS end to end"] = manual.e2e_rate()
    return rates


def render(rows: list[Row], messages: int, sync_always: bool) -> str:
    measures = list(dict.fromkeys(name for row in rows for name in row.rates))
    lines = [f"{messages:,} messages of {MESSAGE_SIZE} bytes per measure; three nats-servers, R3, "
             f"sync_interval {'always' if sync_always else 'default'}", "",
             "| | " + " | ".join(measures) + " |", "|---|" + "---|" * len(measures)]
    for row in rows:
        cells = [f"{row.rates[name]:,.0f}" if name in row.rates else "" for name in measures]
        lines.append(f"| {row.label} | " + " | ".join(cells) + " |" + (f" {row.error}" if row.error else ""))
    direct = next((row for row in rows if row.label.startswith("nats-py")), None)
    shared = next((row for row in rows if "JetStream" in row.label), None)
    if direct is not None and shared is not None and direct.rates:
        lines.append("")
        publish = max((rate for name, rate in shared.rates.items() if name in ("NSQ MPUB", "NSQ PUB")), default=0.0)
        lines.append(f"polymq on JetStream / nats-py: publish {publish / direct.rates['publish']:.2f}x (its best NSQ "
                     f"publish), consume {shared.rates.get('NSQ consume', 0.0) / direct.rates['consume']:.2f}x")
    return "\n".join(lines)


@click.command()
@click.option("--messages", type=click.IntRange(min=100), default=20_000, show_default=True,
              help="Messages per measure.")
@click.option("--sync-always", is_flag=True, help="Run the servers with `sync_interval: always` (an fsync before "
              "every publish acknowledgement).")
@click.option("--json", "as_json", is_flag=True, help="Print the results as JSON instead of a table.")
def command(messages: int, sync_always: bool, as_json: bool) -> None:
    """nats-py straight to a three-server JetStream cluster, polymq on that cluster, and polymq embedded."""
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="polymq-bench-nats-") as folder:
        cluster = NatsCluster(Path(folder), 3, sync_always=sync_always)
        try:
            cluster.start()
            cluster.wait_ready()
        except NatsServerError as error:
            cluster.stop()
            raise click.ClickException(str(error)) from error
        try:
            for label, run in (
                    ("nats-py, direct", lambda: asyncio.run(_direct(cluster.urls, messages))),
                    ("polymq on JetStream", lambda: _through_gateway(["--jetstream", ",".join(cluster.urls)],
                                                                     messages)),
                    ("polymq embedded (--fsync=always)", lambda: _through_gateway([], messages))):
                click.echo(f"measuring {label} ...", err=True)
                row = Row(label)
                try:
                    row.rates = run()
                except Exception as error:  # a failed measure is a row saying why, the others still run
                    row.error = f"{type(error).__name__}: {error}"
                    click.echo(f"{label} failed: {row.error}", err=True)
                rows.append(row)
        finally:
            cluster.stop()
    if as_json:
        click.echo(json.dumps([attrs.asdict(row) for row in rows], indent=2))
    else:
        click.echo(render(rows, messages, sync_always))
    if any(row.error for row in rows):
        sys.exit(1)
