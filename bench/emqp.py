"""`polymq bench emqp`: requests per second through a pool of workers, with and without
`reply-requested`, and latency, against any eMQP broker.

Each client and each worker is a process of its own (`common.WorkerGroup`) with a blocking pyzmq
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

import secrets
import time
from typing import Any

import attrs
import click
import zmq

from polymq.bench import common, flows
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
# EventMQ 0.3.13's router on a 2-core machine (docs/protocols/emqp.md).
ORIGINAL_REQUESTS_PER_S = 2_000


@attrs.frozen
class Plan(flows.FlowPlan):  # role: "client" or "worker"
    queue: bytes
    slots: int  # a worker's READYs
    reply: bool  # workers end each job with a REPLY, clients ask for one


def client_main(plan: Plan, shared: common.SharedState, index: int) -> dict[str, Any]:
    # A text identity, as EventMQ's client library sets one: the original router dies on the binary
    # ones ZeroMQ makes up.
    identity = b"bench-client-%d-%s" % (plan.slot, secrets.token_hex(4).encode())
    with zmq_socket.own_socket(zmq.DEALER, plan.address, linger_ms=LINGER_MS, identity=identity) as sock:
        common.ready_and_wait(shared, index)
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
            dispatched += sum(1 for _ in zmq_socket.waiting(sock))  # the "dispatched" REPLYs
            shared.counters[plan.slot] = sent
        seconds = time.monotonic() - started
        shared.done[plan.slot] = 1
        # Open until every request is done: a socket closed at once drops what its linger did not
        # get out, and on a loaded machine the broker may not have read it all by then.
        while not shared.stop.value:
            if sock.poll(POLL_MS):
                dispatched += sum(1 for _ in zmq_socket.waiting(sock))
    return {"sent": sent, "dispatched": dispatched, "seconds": seconds}


def jobs_main(plan: Plan, shared: common.SharedState, index: int, worker: emqp_client.Worker) -> dict[str, Any]:
    """A worker's jobs, each done at once (with a REPLY if asked) and followed by a READY."""
    try:
        worker.inform([(10, plan.queue.decode())])
    except (TimeoutError, emqp_client.Unexpected):
        raise common.WorkerFailed(f"no ACK for the INFORM from tcp://{plan.address} in {NO_ANSWER_S:.0f} s: "
                                  "is an eMQP broker there?") from None
    worker.ready(plan.slots)
    sock = worker.sock
    sock.setsockopt(zmq.SNDTIMEO, -1)  # from here a full queue holds the worker back, as it would a jobmanager
    received = flows.Received(shared, plan.slot)
    common.ready_and_wait(shared, index)
    reply = emqp.REPLY
    ready = emqp.client_message(emqp.READY, b"r")
    send = zmq_socket.send
    while not shared.stop.value:  # the parent stops everyone once every request was done
        if not sock.poll(POLL_MS):
            continue
        now = time.time_ns()
        stamps = []
        for frames in zmq_socket.waiting(sock):
            if frames[2] != emqp.REQUEST:
                continue  # HEARTBEATs
            stamps.append(int(frames[6][:STAMP_DIGITS]))
            if plan.reply:
                send(sock, emqp.client_message(reply, b"d", emqp_client.DEFAULT_RESULT, frames[3]))
            send(sock, ready)
        received.add(now, stamps)
    worker.send(emqp.KBYE, message_id=b"bye")
    return received.result()


def worker_main(plan: Plan, shared: common.SharedState, index: int) -> dict[str, Any]:
    if plan.role == "client":
        return client_main(plan, shared, index)
    identity = b"bench-worker-%d-%s" % (plan.slot, secrets.token_hex(4).encode())
    with zmq.Context() as context, emqp_client.Worker(context, plan.address, identity, NO_ANSWER_S,
                                                      linger_ms=LINGER_MS) as worker:
        return jobs_main(plan, shared, index, worker)


@attrs.frozen
class Options(flows.FlowOptions):  # producers: the clients, consumers: the workers
    frontend: str
    backend: str
    slots: int


def run_scenario(name: str, opts: Options) -> flows.FlowResult:
    latency = name == "latency"
    per_client = opts.latency_messages if latency else opts.messages
    queue = f"bench-{name}-{secrets.token_hex(4)}".encode()
    interval = opts.interval_s if latency else 0.0
    reply = name == "replies"
    plans = [Plan("worker", opts.backend, slot, 0, opts.size, 0.0, queue=queue, slots=opts.slots, reply=reply)
             for slot in range(opts.consumers)]
    plans += [Plan("client", opts.frontend, opts.consumers + number, per_client, opts.size, interval, queue=queue,
                   slots=0, reply=reply) for number in range(opts.producers)]
    total = opts.producers * per_client
    progress = common.Progress(opts.progress)
    watch = common.RunWatch(opts.server_pid)

    def tick(shared: common.SharedState) -> None:
        done = sum(shared.counters[s] for s in range(opts.consumers))
        sent = sum(shared.counters[s] for s in range(opts.consumers, len(plans)))
        _, still = watch.tick(done + sent)
        progress.update(name, done / max(1, total), f"{sent:,} sent, {done:,} done")
        if done >= total or still > STALL_S:
            shared.stop.value = 1

    start_ns, results = common.WorkerGroup(worker_main, plans, len(plans)).run(tick)
    progress.done()
    return flows.flow_result(name, opts.producers, opts.consumers, results[opts.consumers:], "sent",
                              results[: opts.consumers], start_ns, watch)


RATES = (flows.RateVerdict(("requests", "replies"), "consume", "requests/s through {consumers} workers",
                            ORIGINAL_REQUESTS_PER_S),)


def verdicts(r: flows.FlowResult) -> list[str]:
    lost = r.produced - r.consumed
    notes = [f"{r.name}: {lost:,} of {r.produced:,} requests never reached a worker"] if lost > 0 else []
    return flows.verdicts(r, RATES, notes=notes)


SLOTS_OPTION = flows.count_option("--slots", DEFAULT_SLOTS, "READYs each worker keeps out (jobs it may hold at once).")


@click.command()
@click.option("--frontend", default="127.0.0.1:47291", show_default=True, help="The frontend socket HOST:PORT.")
@click.option("--backend", default="127.0.0.1:47290", show_default=True, help="The backend socket HOST:PORT.")
@flows.flow_options(SCENARIOS, ("--clients", DEFAULT_CLIENTS, None), ("--workers", DEFAULT_WORKERS, None),
                     (DEFAULT_MESSAGES, "Requests per client (requests, replies)."),
                     (DEFAULT_LATENCY_MESSAGES, DEFAULT_INTERVAL_S, "requests", "client"),
                     (DEFAULT_SIZE, "Message bytes."), before_messages=[SLOTS_OPTION])
def command(frontend: str, backend: str, scenarios: tuple[str, ...], clients: int, workers: int, slots: int,
            messages: int, latency_messages: int, interval_s: float, size: int, server_pid: int | None,
            as_json: bool, progress: bool) -> None:
    """Measure an eMQP broker: requests through a pool of workers, with and without REPLYs, and latency."""
    opts = Options(common.chosen_scenarios(scenarios, SCENARIOS), clients, workers, messages, latency_messages,
                   interval_s, size, server_pid, progress, frontend=frontend, backend=backend, slots=slots)
    flows.flow_command(lambda: [run_scenario(name, opts) for name in opts.scenarios], f"{frontend} / {backend}",
                        (OSError, zmq.ZMQError), verdicts, as_json, server_pid)
