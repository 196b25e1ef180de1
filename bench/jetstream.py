"""`polymq bench jetstream`: polymq on a three-server JetStream cluster, beside direct clients of the same cluster.

One run starts its own cluster of three `nats-server` processes (R3 streams, on loopback, from the
venv), then measures in turn:

- **direct clients**, the ceiling a client sees, each on a stream that keeps a message until its consumer has
  it done, as a topic's does: nats-py's async publish of every message (acks awaited 256 at a time, and 32 in
  flight, each sent as the oldest is answered) and a pull consumer's fetch of 256 with an ack per message;
  atomic batches of 200 with 2 and 8 in flight, and of 16 with 2 (the gateway's own batch publisher,
  `jetstream/batches.py`, on its NATS client), what a batching client gets; and fast-ingest batches
  (`bench/fast_ingest.py`: one and eight at once with the largest flow, one whose window is 32 messages as
  the batches of 16 have), the server's other way of taking many messages, which gives up all-or-nothing;
- **polymq on JetStream**: a gateway started with `--jetstream` on that cluster, measured with the NSQ
  bench (MPUB batches of 200 over 2 and over 8 connections, PUB one per round trip over 8 and over 32,
  consume), the MQKS bench (manual acks) and the PHPMQ bench (2 producers, 2 consumers acking each
  delivery); each NSQ topic and channel made before its measure, as the direct clients make their stream
  and consumer;
- **polymq embedded**: the same benches against a gateway on its embedded store (`--fsync=always`).

With each rate, the servers' CPU per message (the three nats-servers' user and system time over the measure; a
consume's measure starts once its backlog is published)
and the gateway's CPU with its run-queue wait (time it was runnable and had no core: on 2 cores, what the
benchmark's clients and the servers took from it). Each gateway runs alone, on free loopback ports, with a data
dir in the system's temporary folder.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
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
import trio

from polymq.bench import common, fast_ingest
from polymq.bench import mqks as mqks_bench
from polymq.bench import nsq as nsq_bench
from polymq.bench import phpmq as phpmq_bench
from polymq.bench.common import process_cpu_s
from polymq.bench.versus_nsqd import START_TIMEOUT_S, BenchError, stop_server, wait_accepting
from polymq.clients.nats_servers import NatsCluster, NatsServerError
from polymq.clients.ports import free_ports
from polymq.core.clock import SystemClock
from polymq.jetstream import api
from polymq.jetstream.batches import Batches
from polymq.jetstream.nats_connection import NatsConnection, NatsOptions

MESSAGE_SIZE = 200  # nsq's bench_writer's default
DIRECT_WINDOW = 256  # publish acks awaited at once by the direct client
FETCH_BATCH = 256
STREAM_READY_S = 20.0  # how long a new stream may take to elect its leader


BATCH_SIZE = 200  # the direct batching client's batches (the NSQ bench's MPUB batch)
# Batches the direct client keeps in flight, and the NSQ bench's MPUB connections through a gateway (each waits
# for its answer, so as many MPUBs in flight): 8 is also the most a gateway keeps per topic.
BATCHES_IN_FLIGHT = (2, 8)
PUB_CONNECTIONS = (8, 32)
# Small atomic batches with as many messages unanswered as the NSQ bench's 32 PUB connections: what a gateway
# gathering their single publishes could get at best, beside the fast-ingest batch with the same window.
SMALL_BATCH = PUB_CONNECTIONS[-1] // 2
# Fast-ingest batches measured (how many at once, the most messages a flow ack covers): one batch and eight at
# the server's largest flow, and one whose two unanswered flow acks are the NSQ bench's 32 PUB connections.
FAST_INGEST = ((1, fast_ingest.FLOW_MAX), (8, fast_ingest.FLOW_MAX),
               (1, PUB_CONNECTIONS[-1] // fast_ingest.OUTSTANDING))


@attrs.define
class Row:
    label: str
    rates: dict[str, float] = attrs.Factory(dict)  # msgs/s by measure
    servers_us: dict[str, float] = attrs.Factory(dict)  # the nats-servers' CPU µs per message, by measure
    gateway_cpu: dict[str, list[float]] = attrs.Factory(dict)  # the gateway's (user, system, wait) shares
    error: str | None = None


class ServersCpu:
    """The cluster's servers' CPU (user + system) over a measure."""

    def __init__(self, pids: list[int]) -> None:
        self.pids = pids
        self._start = self._now()

    def restart(self) -> None:
        """Count from now."""
        self._start = self._now()

    def _now(self) -> float:
        readings = [process_cpu_s(pid) for pid in self.pids]
        return sum(reading[0] + reading[1] for reading in readings if reading is not None)

    def per_message_us(self, messages: int) -> float:
        return (self._now() - self._start) / max(messages, 1) * 1e6


async def _direct(urls: list[str], messages: int, pids: list[int], row: Row) -> None:
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
                # As a topic's stream: a message stays until its consumers have it done, which each ack costs.
                await js.add_stream(name="BENCH_DIRECT", subjects=["bench.direct"], num_replicas=min(3, len(urls)),
                                    retention="interest")
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
        # The consumer first: the stream keeps only what a consumer is to read.
        await js.add_consumer("BENCH_DIRECT", durable_name="bench", ack_policy="explicit")
        servers = ServersCpu(pids)
        started = time.perf_counter()
        pending: list[asyncio.Future[object]] = []
        for _ in range(messages):
            pending.append(await js.publish_async("bench.direct", body))
            if len(pending) >= DIRECT_WINDOW:
                await asyncio.gather(*pending)
                pending.clear()
        await asyncio.gather(*pending)
        publish_s = time.perf_counter() - started
        row.rates["publish"], row.servers_us["publish"] = messages / publish_s, servers.per_message_us(messages)
        # As many in flight as the NSQ bench's PUB connections, each sent as the oldest is answered: what a
        # client gets from the cluster at the concurrency those connections give a gateway.
        in_flight = PUB_CONNECTIONS[-1]
        servers = ServersCpu(pids)
        started = time.perf_counter()
        window: collections.deque[asyncio.Future[object]] = collections.deque()
        for _ in range(messages):
            window.append(await js.publish_async("bench.direct", body))
            if len(window) >= in_flight:
                await window.popleft()
        await asyncio.gather(*window)
        label = f"publish, {in_flight} in flight"
        row.rates[label] = messages / (time.perf_counter() - started)
        row.servers_us[label] = servers.per_message_us(messages)
        subscription = await js.pull_subscribe("bench.direct", durable="bench")
        servers = ServersCpu(pids)
        started = time.perf_counter()
        received = 0
        while received < messages:
            for message in await subscription.fetch(FETCH_BATCH, timeout=10):
                await message.ack()
                received += 1
        consume_s = time.perf_counter() - started
        row.rates["fetch + ack"], row.servers_us["fetch + ack"] = messages / consume_s, servers.per_message_us(messages)
        await js.delete_stream("BENCH_DIRECT")
    finally:
        await client.close()


async def _direct_batches(urls: list[str], messages: int, pids: list[int], row: Row) -> None:
    """Atomic batches of BATCH_SIZE, each of BATCHES_IN_FLIGHT at once, and of SMALL_BATCH two at once, then
    fast-ingest batches (FAST_INGEST), on the gateway's NATS client, to a stream
    made as a topic's is, with a consumer keeping what it holds (as a topic's first queue does)."""
    async with trio.open_nursery() as nursery:
        connection = await NatsConnection.connect(NatsOptions(urls, name="polymq-bench"), nursery)
        try:
            await api.ensure_stream(connection, "bench-batches", api.StreamSettings(replicas=min(3, len(urls))))
            await api.ensure_consumer(connection, "bench-batches", "keeper", api.consumer_config(
                "keeper", topic="bench-batches", ack_wait_s=60.0, start_seq=0))
            for in_flight in BATCHES_IN_FLIGHT:
                await _batches(connection, BATCH_SIZE, in_flight, messages, pids, row)
            await _batches(connection, SMALL_BATCH, 2, messages, pids, row)
            await fast_ingest.allow(connection, "bench-batches")
            for flows, flow in FAST_INGEST:
                await _fast_ingest(connection, flows, flow, messages, pids, row)
            await api.delete_stream(connection, "bench-batches")
        finally:
            await connection.close()
            nursery.cancel_scope.cancel()


async def _batches(connection: NatsConnection, size: int, in_flight: int, messages: int, pids: list[int],
                   row: Row) -> None:
    await api.api(connection, f"STREAM.PURGE.{api.topic_stream('bench-batches')}")
    batches = Batches(connection, SystemClock(), lambda: None, in_flight=in_flight)
    body = b"x" * MESSAGE_SIZE
    done = trio.Event()
    left = [-(-messages // size)]
    failures: list[Exception] = []

    def answered(_: int, error: Exception | None) -> None:
        if error is not None:
            failures.append(error)
        left[0] -= 1
        if left[0] == 0:
            done.set()

    servers = ServersCpu(pids)
    started = time.perf_counter()
    deadline = SystemClock().now() + STREAM_READY_S
    for first in range(0, messages, size):
        count = min(size, messages - first)
        batches.publish("bench-batches", [(body, {})] * count, deadline, answered)
        await trio.lowlevel.checkpoint()  # the connection writes as the batches go
    await done.wait()
    elapsed = time.perf_counter() - started
    if failures:
        raise failures[0]
    label = f"atomic batches of {size}, {in_flight} in flight"
    row.rates[label], row.servers_us[label] = messages / elapsed, servers.per_message_us(messages)


async def _fast_ingest(connection: NatsConnection, flows: int, flow: int, messages: int, pids: list[int],
                       row: Row) -> None:
    """`flows` fast-ingest batches at once, of messages / flows each, a flow ack covering at most `flow`."""
    await api.api(connection, f"STREAM.PURGE.{api.topic_stream('bench-batches')}")
    body = b"x" * MESSAGE_SIZE
    servers = ServersCpu(pids)
    started = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for share in range(flows):
            count = messages // flows + (share < messages % flows)
            nursery.start_soon(functools.partial(fast_ingest.publish, connection, "bench-batches", body, count,
                                                 flow=flow))
    elapsed = time.perf_counter() - started
    label = f"fast ingest, {flows} {'batch' if flows == 1 else 'batches'} at once, flow {flow}"
    row.rates[label], row.servers_us[label] = messages / elapsed, servers.per_message_us(messages)


@contextlib.contextmanager
def _gateway(extra: list[str]) -> Iterator[tuple[int, int, int, int, int]]:
    tcp, http, mqks, php = free_ports(4)
    data = Path(tempfile.mkdtemp(prefix="polymq-bench-js-"))
    log = data / "gateway.log"
    argv = [sys.executable, "-m", "polymq", "serve", "--data-dir", str(data / "data"), "--nsq-tcp-port", str(tcp),
            "--nsq-http-port", str(http), "--mqks-port", str(mqks), "--phpmq-port", str(php),
            "--phpmq-console-port", "-1", "--no-pzq", "--no-emqp", "--admin-port", "-1", *extra]
    with log.open("wb") as output:
        process = subprocess.Popen(argv, stdout=output, stderr=subprocess.STDOUT)
    try:
        try:
            wait_accepting(tcp, process)
            wait_accepting(mqks, process)
            wait_accepting(php, process)
            _wait_ready(log, process)  # it listens before its engine is open (on JetStream: streams made)
        except BenchError as error:  # the gateway's own last line says why it did not start
            lines = log.read_text(errors="replace").strip().splitlines()
            raise BenchError(f"{error}: {lines[-1] if lines else 'it printed nothing'}") from None
        yield tcp, http, mqks, php, process.pid
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


def _through_gateway(extra: list[str], messages: int, pids: list[int], row: Row) -> None:
    with _gateway(extra) as (tcp, http, mqks, php, gateway_pid):
        for scenario, publishers, label in (*(("mpub", count, f"NSQ MPUB x{count}") for count in BATCHES_IN_FLIGHT),
                                            *(("pub", count, f"NSQ PUB x{count}") for count in PUB_CONNECTIONS),
                                            ("sub", 2, "NSQ consume")):
            servers = ServersCpu(pids)
            opts = nsq_bench.BenchOptions(
                host="127.0.0.1", port=tcp, http=("127.0.0.1", http), scenarios=(scenario,), duration_s=None,
                count=messages, size=MESSAGE_SIZE, batch=nsq_bench.DEFAULT_BATCH, rdy=nsq_bench.DEFAULT_RDY,
                publishers=publishers, consumers=2, pub_consumers=0, processes=min(publishers, 2),
                topic_prefix=f"bench_js_{scenario}{publishers}", output_buffer_timeout_ms=None, progress=False,
                server_pid=gateway_pid, make_first=True, measure_starts=servers.restart)  # after a consume's fill
            [result] = nsq_bench.run_bench(opts)
            measured = result.sub_rate() if scenario == "sub" else result.pub_rate()
            _measured(row, label, measured, servers, result.published or result.consumed, result.server_cpu)
        mqks_opts = mqks_bench.BenchOptions(
            host="127.0.0.1", port=mqks, scenarios=("manual",), clients=mqks_bench.DEFAULT_CLIENTS,
            messages=messages, latency_clients=0, latency_messages=0, interval_s=mqks_bench.DEFAULT_INTERVAL_S,
            size=mqks_bench.DEFAULT_SIZE, processes=None, prefix="bench_js", progress=False, server_pid=gateway_pid)
        servers = ServersCpu(pids)
        [manual] = mqks_bench.run_bench(mqks_opts)
        row.rates["MQKS publish"] = manual.pub_rate()
        _measured(row, "MQKS end to end", manual.e2e_rate(), servers, messages * mqks_bench.DEFAULT_CLIENTS,
                  manual.server_cpu)
        php_opts = phpmq_bench.Options(
            ("throughput",), phpmq_bench.DEFAULT_PRODUCERS, phpmq_bench.DEFAULT_CONSUMERS,
            messages // phpmq_bench.DEFAULT_PRODUCERS, 0, 0.0, MESSAGE_SIZE, gateway_pid, False,
            address=("127.0.0.1", php), window=phpmq_bench.DEFAULT_WINDOW)
        servers = ServersCpu(pids)
        flow = phpmq_bench.run_scenario("throughput", php_opts)
        _measured(row, "PHPMQ end to end", flow.consume_rate(), servers, flow.consumed, flow.server_cpu)


def _measured(row: Row, label: str, rate: float, servers: ServersCpu, messages: int,
              gateway: tuple[float, float, float] | None) -> None:
    row.rates[label] = rate
    if servers.pids:
        row.servers_us[label] = servers.per_message_us(messages)
    if gateway is not None:
        row.gateway_cpu[label] = [round(share, 3) for share in gateway]


def render(rows: list[Row], messages: int, sync_always: bool) -> str:
    lines = [f"{messages:,} messages of {MESSAGE_SIZE} bytes per measure; three nats-servers, R3, "
             f"sync_interval {'always' if sync_always else 'default'}", "",
             "| client | measure | msgs/s | servers' CPU per message | gateway CPU (+ run-queue wait) |",
             "|---|---|---|---|---|"]
    for row in rows:
        if row.error:
            lines.append(f"| {row.label} | {row.error} | | | |")
        for name, rate in row.rates.items():
            servers = f"{row.servers_us[name]:.0f} µs" if name in row.servers_us else ""
            gateway = common.cpu_text(tuple(row.gateway_cpu[name])) if name in row.gateway_cpu else ""  # type: ignore[arg-type]
            lines.append(f"| {row.label} | {name} | {rate:,.0f} | {servers} | {gateway} |")
    rates = {(row.label, name): rate for row in rows for name, rate in row.rates.items()}
    shared = "polymq on JetStream"
    ratios = [*((f"NSQ MPUB x{count}", "direct, batching", f"atomic batches of {BATCH_SIZE}, {count} in flight")
                for count in BATCHES_IN_FLIGHT),
              *((f"NSQ PUB x{PUB_CONNECTIONS[-1]}", "nats-py, direct", theirs)
                for theirs in ("publish", f"publish, {PUB_CONNECTIONS[-1]} in flight")),
              ("NSQ consume", "nats-py, direct", "fetch + ack")]
    found = [f"{ours} {rates[(shared, ours)] / rates[(label, theirs)]:.2f}x {theirs}"
             for ours, label, theirs in ratios if (shared, ours) in rates and rates.get((label, theirs))]
    if found:
        lines += ["", "polymq on JetStream against the direct clients: " + "; ".join(found)]
    return "\n".join(lines)


@click.command()
@click.option("--messages", type=click.IntRange(min=100), default=20_000, show_default=True,
              help="Messages per measure.")
@click.option("--sync-always", is_flag=True, help="Run the servers with `sync_interval: always` (an fsync before "
              "every publish acknowledgement).")
@click.option("--json", "as_json", is_flag=True, help="Print the results as JSON instead of a table.")
def command(messages: int, sync_always: bool, as_json: bool) -> None:
    """Direct clients of a three-server JetStream cluster, polymq on that cluster, and polymq embedded."""
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="polymq-bench-nats-") as folder:
        cluster = NatsCluster(Path(folder), 3, sync_always=sync_always)
        try:
            cluster.start()
            cluster.wait_ready()
        except NatsServerError as error:
            cluster.stop()
            raise click.ClickException(str(error)) from error
        pids = [server.pid for server in cluster.servers if server.pid is not None]
        urls = cluster.urls
        try:
            for label, run in (
                    ("nats-py, direct", lambda row: asyncio.run(_direct(urls, messages, pids, row))),
                    ("direct, batching", lambda row: trio.run(_direct_batches, urls, messages, pids, row)),
                    ("polymq on JetStream", lambda row: _through_gateway(["--jetstream", ",".join(urls)], messages,
                                                                         pids, row)),
                    ("polymq embedded (--fsync=always)", lambda row: _through_gateway([], messages, [], row))):
                click.echo(f"measuring {label} ...", err=True)
                row = Row(label)
                try:
                    run(row)
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
