"""`polymq bench phpmq`: throughput and publish-to-deliver latency of any PHPMQ server.

Each producer and each consumer is a process of its own (bench_common's workers), with plain
blocking sockets. Producers send 001s (PHPMQ never answers them); consumers hold a window (002)
and acknowledge every delivery (004), all acks of one read in one write. Every content starts with
the wall-clock nanoseconds it was sent at, so consumers measure publish-to-deliver latency.

Scenarios: `throughput` (producers send as fast as they can, consumers drain; end-to-end rate and
latency under load) and `latency` (one message every `--interval` per producer: latency at light
load). The queue of a run is unique and ends empty. See docs/performance.md.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

import attrs
import click

from polymq.bench import common
from polymq.clients import tcp
from polymq.codecs import phpmq

DEFAULT_PORT = 9100  # the original's (its config/phpmq.default.xml)
SCENARIOS = ("throughput", "latency")
DEFAULT_PRODUCERS = 2
DEFAULT_CONSUMERS = 2
DEFAULT_MESSAGES = 50_000  # per producer, throughput
DEFAULT_LATENCY_MESSAGES = 4_000  # per producer
DEFAULT_INTERVAL_S = 0.0005  # light load: one message every 0.5 ms per producer
DEFAULT_WINDOW = 1_000
DEFAULT_SIZE = 64
STAMP_DIGITS = common.STAMP_DIGITS
# Messages a producer writes at once in the throughput scenario (one sendall).
SEND_BATCH = 200
RECV_SIZE = 256 * 1024
POLL_S = 0.05
CONNECT_TIMEOUT_S = 10.0
# A scenario gives up when no message was consumed for this long.
STALL_S = 10.0
# What the original does on a 2-core machine (docs/protocols/phpmq.md), and what polymq aims at.
ORIGINAL_MSGS_PER_S = 84
ORIGINAL_LATENCY_US = 153_000
TARGET_MSGS_PER_S = 20_000
TARGET_P99_US = 2_000


@attrs.frozen
class Plan:
    role: str  # "producer" or "consumer"
    address: tuple[str, int]
    queue: str
    slot: int
    messages: int  # producer: to send
    size: int
    window: int
    interval_s: float  # producer: 0 = as fast as possible


def producer_main(plan: Plan, shared: common.SharedState, index: int) -> dict[str, Any]:
    queue = plan.queue.encode()
    with tcp.connect(plan.address, CONNECT_TIMEOUT_S) as sock:
        sock.settimeout(None)  # a server that stops reading holds the producer back: that is the measure
        common.report_ready(shared, index)
        shared.start.wait()
        sent = 0
        started = time.monotonic()
        if plan.interval_s > 0:
            next_at = started
            while sent < plan.messages and not shared.stop.value:
                next_at += plan.interval_s
                delay = next_at - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
                sock.sendall(phpmq.send(queue, common.stamped_body(plan.size)))
                sent += 1
                shared.counters[plan.slot] = sent
        else:
            while sent < plan.messages and not shared.stop.value:
                count = min(SEND_BATCH, plan.messages - sent)
                sock.sendall(b"".join(phpmq.send(queue, common.stamped_body(plan.size)) for _ in range(count)))
                sent += count
                shared.counters[plan.slot] = sent
        seconds = time.monotonic() - started
        shared.done[plan.slot] = 1
    return {"sent": sent, "seconds": seconds}


def consumer_main(plan: Plan, shared: common.SharedState, index: int) -> dict[str, Any]:
    queue = plan.queue.encode()
    histogram = common.new_histogram()
    bucket_of = common.bucket_of
    codec = phpmq.ClientConnection()
    got = 0
    last_ns = 0
    with tcp.connect(plan.address, CONNECT_TIMEOUT_S) as sock:
        sock.sendall(phpmq.consume(queue, plan.window))
        common.report_ready(shared, index)
        shared.start.wait()
        sock.settimeout(POLL_S)
        while not shared.stop.value:  # the parent stops everyone once all were consumed (`tick`)
            try:
                data = sock.recv(RECV_SIZE)
            except TimeoutError:
                continue
            if not data:
                break
            codec.receive_data(data)
            acks = []
            now = time.time_ns()
            while (event := codec.next_event()) is not phpmq.NEED_DATA:
                if not isinstance(event, phpmq.Delivery):
                    raise RuntimeError(f"not a delivery: {event}")
                histogram[bucket_of((now - int(event.content[:STAMP_DIGITS])) // 1000)] += 1
                acks.append(phpmq.ack(queue, event.message_id))
            if acks:
                sock.sendall(b"".join(acks))
                got += len(acks)
                last_ns = now
                shared.counters[plan.slot] = got
        shared.done[plan.slot] = 1
    return {"received": got, "last_ns": last_ns, "histogram": common.sparse(histogram)}


def worker_main(plan: Plan, shared: common.SharedState, index: int) -> dict[str, Any]:
    return (producer_main if plan.role == "producer" else consumer_main)(plan, shared, index)


@attrs.frozen
class Options:
    address: tuple[str, int]
    scenarios: tuple[str, ...]
    producers: int
    consumers: int
    messages: int
    latency_messages: int
    interval_s: float
    window: int
    size: int
    server_pid: int | None
    progress: bool


def run_scenario(name: str, opts: Options) -> common.FlowResult:
    queue = f"polymq_bench-{name}-{uuid.uuid4().hex[:8]}"
    per_producer = opts.messages if name == "throughput" else opts.latency_messages
    interval = 0.0 if name == "throughput" else opts.interval_s
    total = per_producer * opts.producers
    consumers = [Plan("consumer", opts.address, queue, slot, 0, opts.size, opts.window, 0.0)
                 for slot in range(opts.consumers)]
    producers = [Plan("producer", opts.address, queue, opts.consumers + number, per_producer, opts.size,
                      opts.window, interval) for number in range(opts.producers)]
    progress = common.Progress(opts.progress)
    watch = common.RunWatch(opts.server_pid)
    consumer_slots = range(opts.consumers)

    def tick(shared: common.SharedState) -> None:
        consumed = sum(shared.counters[s] for s in consumer_slots)
        _, still = watch.tick(consumed)
        progress.update(name, consumed / total, f"{consumed:,} of {total:,} consumed")
        if consumed >= total or still > STALL_S:
            shared.stop.value = 1

    group = common.WorkerGroup(worker_main, [*consumers, *producers], opts.consumers + opts.producers,
                               target=total)
    start_ns, results = group.run(tick)
    wall = watch.elapsed()
    progress.done()
    produced = results[opts.consumers:]
    received = results[: opts.consumers]
    consumed = sum(r["received"] for r in received)
    last_ns = max((r["last_ns"] for r in received), default=start_ns)
    histogram = common.merge(r["histogram"] for r in received)
    return common.FlowResult(
        name, opts.producers, opts.consumers, sum(r["sent"] for r in produced), consumed,
        max((r["seconds"] for r in produced), default=0.0), max(0.0, (last_ns - start_ns) / 1e9),
        common.summarize(histogram), watch.cpu_share(wall),
    )


def verdicts(result: common.FlowResult) -> list[str]:
    if result.name == "latency":
        if result.latency is None:
            return []
        met = "met" if result.latency.p99_us < TARGET_P99_US else "NOT met"
        return [f"latency: p50 {result.latency.p50_us / 1000:.2f} ms, p99 {result.latency.p99_us / 1000:.2f} ms "
                f"(the original: ~{ORIGINAL_LATENCY_US / 1000:.0f} ms; target p99 < {TARGET_P99_US / 1000:.0f} ms: "
                f"{met})"]
    met = "met" if result.consume_rate() >= TARGET_MSGS_PER_S else "NOT met"
    return [f"throughput: {result.consume_rate():,.0f} msgs/s end to end (the original: ~{ORIGINAL_MSGS_PER_S}; "
            f"target >= {TARGET_MSGS_PER_S:,}: {met})"]


def render(results: list[common.FlowResult], with_cpu: bool) -> str:
    return common.render_flows(results, with_cpu, [line for r in results for line in verdicts(r)])


@click.command()
@click.option("--addr", default=f"127.0.0.1:{DEFAULT_PORT}", show_default=True, help="PHPMQ server HOST:PORT.")
@common.scenario_option(SCENARIOS)
@click.option("--producers", type=click.IntRange(min=1), default=DEFAULT_PRODUCERS, show_default=True,
              help="Producer connections (one process each).")
@click.option("--consumers", type=click.IntRange(min=1), default=DEFAULT_CONSUMERS, show_default=True,
              help="Consumer connections (one process each).")
@click.option("--messages", type=click.IntRange(min=1), default=DEFAULT_MESSAGES, show_default=True,
              help="Messages per producer in the throughput scenario.")
@click.option("--latency-messages", type=click.IntRange(min=1), default=DEFAULT_LATENCY_MESSAGES, show_default=True,
              help="Messages per producer in the latency scenario.")
@click.option("--interval", "interval_s", type=click.FloatRange(min=0.00001), default=DEFAULT_INTERVAL_S,
              show_default=True, help="Seconds between two messages of a producer in the latency scenario.")
@click.option("--window", type=click.IntRange(min=1), default=DEFAULT_WINDOW, show_default=True,
              help="Each consumer's window (002's count).")
@click.option("--size", type=click.IntRange(min=STAMP_DIGITS), default=DEFAULT_SIZE, show_default=True,
              help="Content bytes.")
@common.report_options
def command(addr: str, scenarios: tuple[str, ...], producers: int, consumers: int, messages: int,
            latency_messages: int, interval_s: float, window: int, size: int, server_pid: int | None, as_json: bool,
            progress: bool) -> None:
    """Measure a PHPMQ server: throughput end to end, and latency at light load."""
    chosen = common.chosen_scenarios(scenarios, SCENARIOS)
    opts = Options(common.parse_address(addr, "127.0.0.1"), chosen, producers, consumers, messages,
                   latency_messages, interval_s, window, size, server_pid, progress)
    try:
        results = [run_scenario(name, opts) for name in opts.scenarios]
    except (OSError, common.WorkerFailed) as error:
        raise click.ClickException(f"the benchmark failed against {addr}: {error}") from None
    if as_json:
        click.echo(json.dumps([attrs.asdict(r) for r in results], default=str, indent=2))
    else:
        click.echo(render(results, server_pid is not None))
