"""`polymq bench phpmq`: throughput and publish-to-deliver latency of any PHPMQ server.

Each producer and each consumer is a process of its own (`common.WorkerGroup`), with plain
blocking sockets. Producers send 001s (PHPMQ never answers them); consumers hold a window (002)
and acknowledge every delivery (004), all acks of one read in one write. Every content starts with
the wall-clock nanoseconds it was sent at, so consumers measure publish-to-deliver latency.

Scenarios: `throughput` (producers send as fast as they can, consumers drain; end-to-end rate and
latency under load) and `latency` (one message every `--interval` per producer: latency at light
load). The queue of a run is unique and ends empty. See docs/performance.md.
"""

from __future__ import annotations

import functools
import time
import uuid
from typing import Any

import attrs
import click

from polymq.bench import common, flows
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
# What the original does on a 2-core machine (docs/protocols/phpmq.md).
ORIGINAL_MSGS_PER_S = 84
ORIGINAL_LATENCY_US = 153_000


@attrs.frozen
class Plan(flows.FlowPlan):
    queue: str
    window: int  # a consumer's


def producer_main(plan: Plan, shared: common.SharedState, index: int) -> dict[str, Any]:
    queue = plan.queue.encode()
    with tcp.connect(plan.address, CONNECT_TIMEOUT_S) as sock:
        sock.settimeout(None)  # a server that stops reading holds the producer back: that is the measure
        common.ready_and_wait(shared, index)
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
    codec = phpmq.ClientConnection()
    received = flows.Received(shared, plan.slot)
    with tcp.connect(plan.address, CONNECT_TIMEOUT_S) as sock:
        sock.sendall(phpmq.consume(queue, plan.window))
        common.ready_and_wait(shared, index)
        sock.settimeout(POLL_S)
        while not shared.stop.value:  # the parent stops everyone once all were consumed (`tick`)
            try:
                data = sock.recv(RECV_SIZE)
            except TimeoutError:
                continue
            if not data:
                break
            codec.receive_data(data)
            now = time.time_ns()
            stamps, acks = [], []
            while (event := codec.next_event()) is not phpmq.NEED_DATA:
                if not isinstance(event, phpmq.Delivery):
                    raise RuntimeError(f"not a delivery: {event}")
                stamps.append(int(event.content[:STAMP_DIGITS]))
                acks.append(phpmq.ack(queue, event.message_id))
            if acks:
                sock.sendall(b"".join(acks))
            received.add(now, stamps)
    return received.result()


worker_main = functools.partial(flows.by_role, producer_main, consumer_main)


@attrs.frozen
class Options(flows.FlowOptions):
    address: tuple[str, int]
    window: int


def run_scenario(name: str, opts: Options) -> flows.FlowResult:
    queue = f"polymq_bench-{name}-{uuid.uuid4().hex[:8]}"
    per_producer = opts.messages if name == "throughput" else opts.latency_messages
    interval = 0.0 if name == "throughput" else opts.interval_s
    total = per_producer * opts.producers
    consumers = [Plan("consumer", opts.address, slot, 0, opts.size, 0.0, queue=queue, window=opts.window)
                 for slot in range(opts.consumers)]
    producers = [Plan("producer", opts.address, opts.consumers + number, per_producer, opts.size, interval,
                      queue=queue, window=opts.window) for number in range(opts.producers)]
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
    progress.done()
    return flows.flow_result(name, opts.producers, opts.consumers, results[opts.consumers:], "sent",
                              results[: opts.consumers], start_ns, watch)


RATES = (flows.RateVerdict(("throughput",), "consume", "msgs/s end to end", ORIGINAL_MSGS_PER_S, always=True),)


def verdicts(r: flows.FlowResult) -> list[str]:
    return flows.verdicts(r, RATES, ORIGINAL_LATENCY_US)


WINDOW_OPTION = flows.count_option("--window", DEFAULT_WINDOW, "Each consumer's window (002's count).")


@click.command()
@click.option("--addr", default=f"127.0.0.1:{DEFAULT_PORT}", show_default=True, help="PHPMQ server HOST:PORT.")
@flows.flow_options(SCENARIOS, ("--producers", DEFAULT_PRODUCERS, "Producer connections (one process each)."),
                     ("--consumers", DEFAULT_CONSUMERS, "Consumer connections (one process each)."),
                     (DEFAULT_MESSAGES, "Messages per producer in the throughput scenario."),
                     (DEFAULT_LATENCY_MESSAGES, DEFAULT_INTERVAL_S, "messages", "producer"),
                     (DEFAULT_SIZE, "Content bytes."), before_size=[WINDOW_OPTION])
def command(addr: str, scenarios: tuple[str, ...], producers: int, consumers: int, messages: int,
            latency_messages: int, interval_s: float, window: int, size: int, server_pid: int | None, as_json: bool,
            progress: bool) -> None:
    """Measure a PHPMQ server: throughput end to end, and latency at light load."""
    opts = Options(common.chosen_scenarios(scenarios, SCENARIOS), producers, consumers, messages, latency_messages,
                   interval_s, size, server_pid, progress, address=tcp.split_address(addr, "127.0.0.1"),
                   window=window)
    flows.flow_command(lambda: [run_scenario(name, opts) for name in opts.scenarios], addr, (OSError,), verdicts,
                        as_json, server_pid)
