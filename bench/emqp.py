"""`polymq bench emqp`: requests per second through a pool of workers, with and without
`reply-requested`, and latency, against any eMQP broker.

Each client and each worker is a process of its own (bench_common's workers) with a blocking pyzmq
DEALER, as EventMQ's peers connect. A worker INFORMs one queue (new for each run), says READY once
per slot (`--slots`), and for each REQUEST it gets says READY again (after a REPLY naming the
request in the `replies` scenario, as a jobmanager does with `reply-requested`): the job itself
takes no time. Every message starts with the wall-clock nanoseconds it was sent at, so workers
measure request-to-worker latency.

Scenarios: `requests` (clients send as fast as the broker takes them; jobs done per second),
`replies` (the same, each job ended by its REPLY), `latency` (one request every `--interval` per
client).
"""

from __future__ import annotations

import json
import secrets
import time
from typing import Any

import attrs
import click
import zmq

from polymq.bench import common
from polymq.clients import emqp as emqp_client
from polymq.clients import zmq_socket
from polymq.codecs import emqp

SCENARIOS = ("requests", "replies", "latency")
# One client and two workers: on a 2-core machine every load process takes CPU from the broker it
# measures (2 + 4 processes cost the broker a fifth of its throughput in run-queue waits).
DEFAULT_CLIENTS = 1
DEFAULT_WORKERS = 2
DEFAULT_SLOTS = 50  # READYs each worker keeps out (EventMQ's jobmanager: one per worker process)
DEFAULT_MESSAGES = 40_000  # per client
DEFAULT_LATENCY_MESSAGES = 2_000  # per client
DEFAULT_INTERVAL_S = 0.001  # light load: one request every ms per client
DEFAULT_SIZE = 100
STAMP_DIGITS = common.STAMP_DIGITS
POLL_MS = 50
STALL_S = 15.0
# A worker that gets no ACK for its INFORM in this long has no broker to talk to.
NO_ANSWER_S = 5.0
# What a peer's socket still holds at its close gets this long to go out (the worker's KBYE).
LINGER_MS = 1000
# Requests a client sends before it lets the broker catch up (reads what came back to it).
CLIENT_BATCH = 256
# EventMQ 0.3.13's router on a 2-core machine (docs/protocols/emqp.md), and what polymq aims at.
ORIGINAL_REQUESTS_PER_S = 2_000
TARGET_REQUESTS_PER_S = 20_000
TARGET_P99_US = 2_000


@attrs.frozen
class Plan:
    role: str  # "client" or "worker"
    address: str  # HOST:PORT
    slot: int
    queue: bytes
    messages: int
    size: int
    interval_s: float
    slots: int
    reply: bool


def client_main(plan: Plan, shared: common.SharedState, index: int) -> dict[str, Any]:
    context = zmq.Context()
    # A text identity, as EventMQ's client library sets one: the original router dies on the binary
    # ones ZeroMQ makes up.
    sock = zmq_socket.open_socket(context, zmq.DEALER, plan.address, linger_ms=LINGER_MS,
                                  identity=b"bench-client-%d-%s" % (plan.slot, secrets.token_hex(4).encode()))
    common.report_ready(shared, index)
    shared.start.wait()
    headers = emqp.REPLY_REQUESTED.encode() if plan.reply else b""
    sent = dispatched = 0
    send = zmq_socket.send
    started = time.monotonic()
    next_at = started
    while sent < plan.messages and not shared.stop.value:
        if plan.interval_s:
            delay = next_at - time.monotonic()
            if delay > 0:
                time.sleep(min(delay, 0.0005))
                continue
            next_at += plan.interval_s
        for _ in range(1 if plan.interval_s else min(CLIENT_BATCH, plan.messages - sent)):
            send(sock, emqp.client_message(emqp.REQUEST, b"%d-%d" % (plan.slot, sent), plan.queue, headers,
                                           common.stamped_body(plan.size)))
            sent += 1
        while sock.poll(0):  # the "dispatched" REPLYs
            zmq_socket.receive(sock)
            dispatched += 1
        shared.counters[plan.slot] = sent
    seconds = time.monotonic() - started
    shared.done[plan.slot] = 1
    sock.close()
    context.term()
    return {"sent": sent, "dispatched": dispatched, "seconds": seconds}


def worker_main(plan: Plan, shared: common.SharedState, index: int) -> dict[str, Any]:
    if plan.role == "client":
        return client_main(plan, shared, index)
    context = zmq.Context()
    identity = b"bench-worker-%d-%s" % (plan.slot, secrets.token_hex(4).encode())
    worker = emqp_client.Worker(context, plan.address, identity, NO_ANSWER_S, linger_ms=LINGER_MS)
    try:
        worker.inform([(10, plan.queue.decode())])
    except (TimeoutError, emqp_client.Unexpected) as error:
        raise common.WorkerFailed(f"no ACK for the INFORM from tcp://{plan.address} in {NO_ANSWER_S:.0f} s: "
                                  "is an eMQP broker there?") from error
    worker.ready(plan.slots)
    sock = worker.sock
    sock.setsockopt(zmq.SNDTIMEO, -1)  # from here a full queue holds the worker back, as it would a jobmanager
    histogram = common.new_histogram()
    bucket_of = common.bucket_of
    common.report_ready(shared, index)
    shared.start.wait()
    got = 0
    last_ns = 0
    reply = emqp.REPLY
    ready = emqp.client_message(emqp.READY, b"r")
    send, receive, noblock = zmq_socket.send, zmq_socket.receive, zmq_socket.NOBLOCK
    while not shared.stop.value:  # the parent stops everyone once every request was done
        if not sock.poll(POLL_MS):
            continue
        now = time.time_ns()
        while True:
            try:
                frames = receive(sock, noblock)
            except zmq.Again:
                break
            if frames[2] != emqp.REQUEST:
                continue  # HEARTBEATs
            histogram[bucket_of((now - int(frames[6][:STAMP_DIGITS])) // 1000)] += 1
            if plan.reply:
                send(sock, emqp.client_message(reply, b"d", b'{"value": true}', frames[3]))
            send(sock, ready)
            got += 1
        last_ns = now
        shared.counters[plan.slot] = got
    shared.done[plan.slot] = 1
    worker.send(emqp.KBYE, message_id=b"bye")
    worker.close()
    context.term()
    return {"received": got, "last_ns": last_ns, "histogram": common.sparse(histogram)}


@attrs.frozen
class Options:
    frontend: str
    backend: str
    scenarios: tuple[str, ...]
    clients: int
    workers: int
    slots: int
    messages: int
    latency_messages: int
    interval_s: float
    size: int
    server_pid: int | None
    progress: bool


def run_scenario(name: str, opts: Options) -> common.FlowResult:
    latency = name == "latency"
    per_client = opts.latency_messages if latency else opts.messages
    queue = f"bench-{name}-{secrets.token_hex(4)}".encode()
    interval = opts.interval_s if latency else 0.0
    plans = [Plan("worker", opts.backend, slot, queue, 0, opts.size, 0.0, opts.slots, name == "replies")
             for slot in range(opts.workers)]
    plans += [Plan("client", opts.frontend, opts.workers + number, queue, per_client, opts.size, interval,
                   0, name == "replies") for number in range(opts.clients)]
    total = opts.clients * per_client
    progress = common.Progress(opts.progress)
    watch = common.RunWatch(opts.server_pid)

    def tick(shared: common.SharedState) -> None:
        done = sum(shared.counters[s] for s in range(opts.workers))
        sent = sum(shared.counters[s] for s in range(opts.workers, len(plans)))
        _, still = watch.tick(done + sent)
        progress.update(name, done / max(1, total), f"{sent:,} sent, {done:,} done")
        if done >= total or still > STALL_S:
            shared.stop.value = 1

    start_ns, results = common.WorkerGroup(worker_main, plans, len(plans)).run(tick)
    progress.done()
    wall = watch.elapsed()
    done_by, sent_by = results[:opts.workers], results[opts.workers:]
    last_ns = max((r["last_ns"] for r in done_by), default=start_ns)
    histogram = common.merge(r["histogram"] for r in done_by)
    return common.FlowResult(
        name, opts.clients, opts.workers, sum(r["sent"] for r in sent_by), sum(r["received"] for r in done_by),
        max((r["seconds"] for r in sent_by), default=0.0), max(0.0, (last_ns - start_ns) / 1e9),
        common.summarize(histogram), watch.cpu_share(wall),
    )


def verdicts(r: common.FlowResult) -> list[str]:
    lines = []
    if r.name in ("requests", "replies") and r.consumed:
        met = "met" if r.consume_rate() >= TARGET_REQUESTS_PER_S else "NOT met"
        lines.append(f"{r.name}: {r.consume_rate():,.0f} requests/s through {r.consumers} workers (the original: "
                     f"~{ORIGINAL_REQUESTS_PER_S:,}; target >= {TARGET_REQUESTS_PER_S:,}: {met})")
    if r.consumed < r.produced:
        lines.append(f"{r.name}: {r.produced - r.consumed:,} of {r.produced:,} requests never reached a worker")
    if r.name == "latency" and r.latency is not None:
        met = "met" if r.latency.p99_us < TARGET_P99_US else "NOT met"
        lines.append(f"latency: p50 {r.latency.p50_us / 1000:.2f} ms, p99 {r.latency.p99_us / 1000:.2f} ms "
                     f"(target p99 < {TARGET_P99_US / 1000:.0f} ms: {met})")
    return lines


@click.command()
@click.option("--frontend", default="127.0.0.1:47291", show_default=True, help="The frontend socket HOST:PORT.")
@click.option("--backend", default="127.0.0.1:47290", show_default=True, help="The backend socket HOST:PORT.")
@common.scenario_option(SCENARIOS)
@click.option("--clients", type=click.IntRange(min=1), default=DEFAULT_CLIENTS, show_default=True)
@click.option("--workers", type=click.IntRange(min=1), default=DEFAULT_WORKERS, show_default=True)
@click.option("--slots", type=click.IntRange(min=1), default=DEFAULT_SLOTS, show_default=True,
              help="READYs each worker keeps out (jobs it may hold at once).")
@click.option("--messages", type=click.IntRange(min=1), default=DEFAULT_MESSAGES, show_default=True,
              help="Requests per client (requests, replies).")
@click.option("--latency-messages", type=click.IntRange(min=1), default=DEFAULT_LATENCY_MESSAGES, show_default=True,
              help="Requests per client in the latency scenario.")
@click.option("--interval", "interval_s", type=click.FloatRange(min=0.00001), default=DEFAULT_INTERVAL_S,
              show_default=True, help="Seconds between two requests of a client in the latency scenario.")
@click.option("--size", type=click.IntRange(min=STAMP_DIGITS), default=DEFAULT_SIZE, show_default=True,
              help="Message bytes.")
@common.report_options
def command(frontend: str, backend: str, scenarios: tuple[str, ...], clients: int, workers: int, slots: int,
            messages: int, latency_messages: int, interval_s: float, size: int, server_pid: int | None,
            as_json: bool, progress: bool) -> None:
    """Measure an eMQP broker: requests through a pool of workers, with and without REPLYs, and latency."""
    chosen = common.chosen_scenarios(scenarios, SCENARIOS)
    opts = Options(frontend, backend, chosen, clients, workers, slots, messages, latency_messages, interval_s,
                   size, server_pid, progress)
    try:
        results = [run_scenario(name, opts) for name in opts.scenarios]
    except (OSError, zmq.ZMQError, common.WorkerFailed) as error:
        raise click.ClickException(f"the benchmark failed against {frontend} / {backend}: {error}") from None
    if as_json:
        click.echo(json.dumps([attrs.asdict(r) for r in results], default=str, indent=2))
    else:
        notes = [line for r in results for line in verdicts(r)]
        click.echo(common.render_flows(results, server_pid is not None, notes))
