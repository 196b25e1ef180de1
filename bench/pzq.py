"""`polymq bench pzq`: produce with ACKs, consume with ACKs, both at once, and latency, against any PZQ server.

Each producer and consumer is a process of its own (`common.WorkerGroup`) with a blocking pyzmq
socket. Producers keep `--in-flight` messages waiting for their ACK (1 = one per round trip, as
the reference client); consumers acknowledge every delivery. Every body starts with the wall-clock
nanoseconds it was sent at, so consumers measure produce-to-deliver latency.

Scenarios: `produce` (producers alone: stored messages per second), `consume` (a backlog
drained), `both` (producers and consumers at once) and `latency` (one message every `--interval`
per producer). A PZQ server has one queue: run against a server nobody else uses.
"""

from __future__ import annotations

import functools
import time
from typing import Any

import attrs
import click
import zmq

from polymq.bench import common, flows
from polymq.clients import zmq_socket
from polymq.codecs import pzq

SCENARIOS = ("produce", "consume", "both", "latency")
DEFAULT_PRODUCERS = 2
DEFAULT_CONSUMERS = 2
DEFAULT_MESSAGES = 20_000  # per producer
DEFAULT_LATENCY_MESSAGES = 2_000  # per producer
DEFAULT_INTERVAL_S = 0.001  # light load: one message every ms per producer
DEFAULT_IN_FLIGHT = 64  # messages a producer keeps waiting for their ACK
DEFAULT_SIZE = 100  # the original's measurements used 100-byte bodies
STAMP_DIGITS = common.STAMP_DIGITS
POLL_MS = 50
STALL_S = 15.0
# A run that saw no ACK and no delivery at all after this long has no server to talk to.
NO_ANSWER_S = 5.0
# The original on a 2-core machine (docs/protocols/pzq.md).
ORIGINAL_PRODUCE_MSGS_PER_S = 5_000
ORIGINAL_CONSUME_MSGS_PER_S = 1_500


@attrs.frozen
class Plan(flows.FlowPlan):
    in_flight: int  # a producer's messages waiting for their ACK


def producer_main(plan: Plan, shared: common.SharedState, index: int) -> dict[str, Any]:
    with zmq_socket.own_socket(zmq.DEALER, plan.address) as sock:
        common.ready_and_wait(shared, index)
        sent = acked = refused = 0
        started = time.monotonic()
        next_at = started
        while acked + refused < plan.messages and not shared.stop.value:
            while sent < plan.messages and sent - acked - refused < plan.in_flight:
                if plan.interval_s:
                    delay = next_at - time.monotonic()
                    if delay > 0:
                        break
                    next_at += plan.interval_s
                zmq_socket.send(sock, [b"%d" % sent, pzq.DELIMITER, common.stamped_body(plan.size)])
                sent += 1
            if sock.poll(POLL_MS if not plan.interval_s else 1):
                for answer in zmq_socket.waiting(sock):
                    if answer[1] == pzq.ACK_OK:
                        acked += 1
                    else:
                        refused += 1
                shared.counters[plan.slot] = acked
        seconds = time.monotonic() - started
        shared.done[plan.slot] = 1
    return {"sent": sent, "acked": acked, "refused": refused, "seconds": seconds}


def consumer_main(plan: Plan, shared: common.SharedState, index: int) -> dict[str, Any]:
    received = flows.Received(shared, plan.slot)
    with zmq_socket.own_socket(zmq.ROUTER, plan.address) as sock:
        common.ready_and_wait(shared, index)
        while not shared.stop.value:  # the parent stops everyone once all were consumed
            if not sock.poll(POLL_MS):
                continue
            now = time.time_ns()
            stamps = []
            for frames in zmq_socket.waiting(sock):
                stamps.append(int(frames[5][:STAMP_DIGITS]))
                zmq_socket.send(sock, [frames[0], frames[1], pzq.ACK_OK])
            received.add(now, stamps)
    return received.result()


worker_main = functools.partial(flows.by_role, producer_main, consumer_main)


@attrs.frozen
class Options(flows.FlowOptions):
    receive: str
    send: str
    in_flight: int


def _run(name: str, opts: Options, producers: int, consumers: int, per_producer: int, interval: float,
         expect_consumed: int) -> tuple[list[Any], list[Any], int, common.RunWatch]:
    plans = [Plan("consumer", opts.send, slot, 0, opts.size, 0.0, in_flight=0) for slot in range(consumers)]
    plans += [Plan("producer", opts.receive, consumers + number, per_producer, opts.size, interval,
                   in_flight=1 if interval else opts.in_flight) for number in range(producers)]
    progress = common.Progress(opts.progress)
    watch = common.RunWatch(opts.server_pid)
    produce_total = producers * per_producer

    def tick(shared: common.SharedState) -> None:
        consumed = sum(shared.counters[s] for s in range(consumers))
        produced = sum(shared.counters[s] for s in range(consumers, consumers + producers))
        elapsed, still = watch.tick(consumed + produced)
        total = expect_consumed if consumers else produce_total
        done = consumed if consumers else produced
        progress.update(name, done / max(1, total), f"{produced:,} produced, {consumed:,} consumed")
        # A delivery may reach its consumer before its ACK reaches the producer: the run ends when
        # both sides have seen everything.
        finished = done >= total and produced >= produce_total
        # ZeroMQ connects to nothing without an error: no answer at all is the sign of no server.
        if finished or still > STALL_S or (consumed + produced == 0 and elapsed > NO_ANSWER_S):
            shared.stop.value = 1

    start_ns, results = common.WorkerGroup(worker_main, plans, len(plans)).run(tick)
    progress.done()
    return results[:consumers], results[consumers:], start_ns, watch


def run_scenario(name: str, opts: Options, backlog: int) -> flows.FlowResult:
    """One scenario; `backlog`: the messages earlier scenarios left in the queue (consume drains them)."""
    latency = name == "latency"
    per_producer = opts.latency_messages if latency else opts.messages
    producers = 0 if name == "consume" else opts.producers
    consumers = 0 if name == "produce" else opts.consumers
    if name == "consume" and not backlog:
        _, filled, _, _ = _run("fill", opts, opts.producers, 0, opts.messages, 0.0, 0)  # not measured
        backlog = sum(r["acked"] for r in filled)
    expected = backlog + producers * per_producer
    received, produced, start_ns, watch = _run(name, opts, producers, consumers, per_producer,
                                               opts.interval_s if latency else 0.0, expected)
    if not any(r["acked"] + r["refused"] for r in produced) and not any(r["received"] for r in received):
        raise common.WorkerFailed(f"no answer from {opts.receive} / {opts.send} in {NO_ANSWER_S:.0f} s: "
                                  "is a PZQ server there?")
    return flows.flow_result(name, producers, consumers, produced, "acked", received, start_ns, watch)


def run_bench(opts: Options) -> list[flows.FlowResult]:
    results = []
    backlog = 0
    for name in opts.scenarios:
        result = run_scenario(name, opts, backlog)
        backlog = max(0, backlog + result.produced - result.consumed)
        results.append(result)
    return results


RATES = (
    flows.RateVerdict(("produce", "both"), "produce", "msgs/s produced with ACKs", ORIGINAL_PRODUCE_MSGS_PER_S),
    flows.RateVerdict(("consume", "both"), "consume", "msgs/s consumed with ACKs", ORIGINAL_CONSUME_MSGS_PER_S),
)


def verdicts(r: flows.FlowResult) -> list[str]:
    return flows.verdicts(r, RATES)


IN_FLIGHT_OPTION = flows.count_option("--in-flight", DEFAULT_IN_FLIGHT,
                                       "Messages a producer keeps waiting for their ACK (1: one per round trip).")


@click.command()
@click.option("--receive", default="127.0.0.1:11131", show_default=True, help="The receive socket HOST:PORT.")
@click.option("--send", default="127.0.0.1:11132", show_default=True, help="The send socket HOST:PORT.")
@flows.flow_options(SCENARIOS, ("--producers", DEFAULT_PRODUCERS, None), ("--consumers", DEFAULT_CONSUMERS, None),
                     (DEFAULT_MESSAGES, "Messages per producer (produce, consume's backlog, both)."),
                     (DEFAULT_LATENCY_MESSAGES, DEFAULT_INTERVAL_S, "messages", "producer"),
                     (DEFAULT_SIZE, "Body bytes."), before_size=[IN_FLIGHT_OPTION])
def command(receive: str, send: str, scenarios: tuple[str, ...], producers: int, consumers: int, messages: int,
            latency_messages: int, interval_s: float, in_flight: int, size: int, server_pid: int | None,
            as_json: bool, progress: bool) -> None:
    """Measure a PZQ server: produce and consume with ACKs, both at once, and latency at light load."""
    opts = Options(common.chosen_scenarios(scenarios, SCENARIOS), producers, consumers, messages, latency_messages,
                   interval_s, size, server_pid, progress, receive=receive, send=send, in_flight=in_flight)
    flows.flow_command(lambda: run_bench(opts), f"{receive} / {send}", (OSError, zmq.ZMQError), verdicts, as_json,
                        server_pid)
