"""What the flow benches share (`polymq bench pzq`, `emqp`, `phpmq`): each runs producers and consumers
in worker processes (`common.WorkerGroup`), one scenario at a time, and reports the same figures:
messages produced and consumed per second, produce-to-consume latency, the server's CPU, and its
figures beside the original's.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import attrs
import click

from polymq.bench import common

F = TypeVar("F", bound=Callable[..., Any])


@attrs.frozen
class FlowPlan:
    """What a flow bench's worker process is told; each bench adds what its peers need."""

    role: str  # "producer" or "consumer" (eMQP: "client" or "worker")
    address: str | tuple[str, int]
    slot: int  # its counter in SharedState
    messages: int  # a producer's to send
    size: int
    interval_s: float  # a producer's pace: 0 = as fast as the server takes them


WorkerMain = Callable[[Any, common.SharedState, int], dict[str, Any]]


def by_role(producer: WorkerMain, consumer: WorkerMain, plan: FlowPlan, shared: common.SharedState,
            index: int) -> dict[str, Any]:
    """A worker process of a bench whose plans say "producer" or "consumer": the one its plan says.
    A bench's `worker_main` is this with its two (`functools.partial`, which a spawned process can load)."""
    return (producer if plan.role == "producer" else consumer)(plan, shared, index)


class Received:
    """What a consumer process counts: its messages, when the last of them came, their latencies."""

    def __init__(self, shared: common.SharedState, slot: int) -> None:
        self.shared = shared
        self.slot = slot
        self.histogram = common.new_histogram()
        self.count = 0
        self.last_ns = 0

    def add(self, now_ns: int, stamps_ns: list[int]) -> None:
        """The messages of one read, sent at `stamps_ns`, came at `now_ns`."""
        if stamps_ns:
            common.record_latencies(self.histogram, now_ns, stamps_ns)
            self.count += len(stamps_ns)
            self.last_ns = now_ns
            self.shared.counters[self.slot] = self.count

    def result(self) -> dict[str, Any]:
        """The consumer is done: its flag, and what it sends back to the parent."""
        self.shared.done[self.slot] = 1
        return {"received": self.count, "last_ns": self.last_ns, "histogram": common.sparse(self.histogram)}


@attrs.frozen
class FlowOptions:
    """What every flow bench (pzq, emqp, phpmq) is told; each adds its server's addresses and knobs."""

    scenarios: tuple[str, ...]
    producers: int  # eMQP: clients
    consumers: int  # eMQP: workers
    messages: int  # per producer
    latency_messages: int  # per producer, in the latency scenario
    interval_s: float  # between two messages of a producer, in the latency scenario
    size: int
    server_pid: int | None
    progress: bool


@attrs.frozen
class RateVerdict:
    """A figure of some scenarios beside the original's."""

    scenarios: tuple[str, ...]
    side: str  # "produce" or "consume"
    what: str  # the unit and what was done: "msgs/s produced with ACKs"
    original: int
    always: bool = False  # also when that side did nothing (else no line)


def verdicts(result: FlowResult, rates: Sequence[RateVerdict], original_latency_us: int | None = None,
             notes: Sequence[str] = ()) -> list[str]:
    """The lines under the table for a flow scenario: its rates that apply (none for a side that did
    nothing), the bench's `notes`, then its latency in the latency scenario."""
    lines = []
    for rate in rates:
        done = result.produced if rate.side == "produce" else result.consumed
        if (done or rate.always) and result.name in rate.scenarios:
            figure = result.produce_rate() if rate.side == "produce" else result.consume_rate()
            what = rate.what.format(consumers=result.consumers)
            lines.append(rate_verdict(result.name, figure, what, rate.original))
    return [*lines, *notes, *latency_verdicts(result, original_latency_us)]


@attrs.define
class FlowResult:
    """One scenario of producers and consumers: how many, how fast each side, latency, the server's CPU."""

    name: str
    producers: int
    consumers: int
    produced: int
    consumed: int
    produce_seconds: float
    consume_seconds: float
    latency: common.LatencySummary | None
    server_cpu: tuple[float, float, float] | None = None

    def produce_rate(self) -> float:
        return self.produced / self.produce_seconds if self.produce_seconds else 0.0

    def consume_rate(self) -> float:
        return self.consumed / self.consume_seconds if self.consume_seconds else 0.0

    def row(self, with_cpu: bool) -> list[str]:
        count = common.format_count
        cells = [self.name, f"{self.producers} prod + {self.consumers} cons", count(self.produced),
                 count(self.produce_rate()), count(self.consumed), count(self.consume_rate()),
                 common.format_latency(self.latency)]
        return [*cells, common.cpu_text(self.server_cpu)] if with_cpu else cells


FLOW_HEADERS = ("scenario", "conns", "produced", "produce msgs/s", "consumed", "consume msgs/s",
                "latency p50 / p99 / max")
CPU_HEADER = "server CPU (usr+sys) + run-queue wait"


def render_flows(results: Sequence[FlowResult], with_cpu: bool, notes: Sequence[str]) -> str:
    headers = [*FLOW_HEADERS, CPU_HEADER] if with_cpu else list(FLOW_HEADERS)
    return "\n".join([common.render_table(headers, [r.row(with_cpu) for r in results]), "", *notes])


def flow_result(name: str, producers: int, consumers: int, sent: Sequence[dict[str, Any]], sent_key: str,
                received: Sequence[dict[str, Any]], start_ns: int, watch: common.RunWatch) -> FlowResult:
    """A scenario's figures from its workers' results: the producers' `sent_key` and `seconds`, the
    consumers' `received`, `last_ns` and `histogram`."""
    last_ns = max((r["last_ns"] for r in received), default=start_ns)
    return FlowResult(
        name, producers, consumers, sum(r[sent_key] for r in sent), sum(r["received"] for r in received),
        max((r["seconds"] for r in sent), default=0.0), max(0.0, (last_ns - start_ns) / 1e9),
        common.summarize(common.merge(r["histogram"] for r in received)), watch.cpu_share(watch.elapsed()),
    )


def rate_verdict(label: str, rate: float, what: str, original: int) -> str:
    """`label: N what, R x the original's ~O`."""
    return f"{label}: {rate:,.0f} {what}, {rate / original:,.1f}x the original's ~{original:,}"


def latency_verdicts(result: FlowResult, original_us: int | None = None) -> list[str]:
    """`latency: p50 …, p99 …[ (the original: ~O ms)]` for the latency scenario."""
    if result.name != "latency" or result.latency is None:
        return []
    latency = result.latency
    original = "" if original_us is None else f" (the original: ~{original_us / 1000:.0f} ms)"
    return [f"latency: p50 {latency.p50_us / 1000:.2f} ms, p99 {latency.p99_us / 1000:.2f} ms{original}"]


def flow_command(run: Callable[[], list[FlowResult]], against: str, errors: tuple[type[Exception], ...],
                 verdicts: Callable[[FlowResult], list[str]], as_json: bool, server_pid: int | None) -> None:
    """A flow bench's command after its options: run, print the table and the verdicts (or JSON);
    any of `errors` is one line naming the server, `against`."""
    try:
        results = run()
    except (*errors, common.WorkerFailed) as error:
        raise click.ClickException(f"the benchmark failed against {against}: {error}") from None
    if as_json:
        click.echo(json.dumps([attrs.asdict(r) for r in results], default=str, indent=2))
    else:
        click.echo(render_flows(results, server_pid is not None, [line for r in results for line in verdicts(r)]))


# -- options ----------------------------------------------------------------------------------


def count_option(flag: str, default: int, text: str | None = None) -> Callable[[F], F]:
    """A count of at least 1 (`--producers`, `--messages`, …)."""
    return click.option(flag, type=click.IntRange(min=1), default=default, show_default=True, help=text)


def latency_options(messages: int, interval_s: float, item: str, sender: str) -> Callable[[F], F]:
    """--latency-messages and --interval of a flow bench's latency scenario: `item`s per `sender`."""

    def add(function: F) -> F:
        function = click.option("--interval", "interval_s", type=click.FloatRange(min=0.00001), default=interval_s,
                                show_default=True,
                                help=f"Seconds between two {item} of a {sender} in the latency scenario.")(function)
        text = f"{item.capitalize()} per {sender} in the latency scenario."
        return count_option("--latency-messages", messages, text)(function)

    return add


def size_option(default: int, text: str) -> Callable[[F], F]:
    """--size in bytes, room for the send stamp included."""
    return click.option("--size", type=click.IntRange(min=common.STAMP_DIGITS), default=default, show_default=True,
                        help=text)


def flow_options(scenarios: tuple[str, ...], producers: tuple[str, int, str | None],
                 consumers: tuple[str, int, str | None], messages: tuple[int, str],
                 latency: tuple[int, float, str, str], size: tuple[int, str], *,
                 before_messages: Sequence[Callable[[F], F]] = (),
                 before_size: Sequence[Callable[[F], F]] = ()) -> Callable[[F], F]:
    """The options of every flow bench, in this order: --scenario; its producers and consumers
    (flag, default, help); `before_messages`; --messages (default, help); --latency-messages and
    --interval (`latency_options`); `before_size`; --size (default, help); `common.report_options`."""
    decorators = [common.scenario_option(scenarios), count_option(*producers), count_option(*consumers),
                  *before_messages, count_option("--messages", *messages), latency_options(*latency), *before_size,
                  size_option(*size), common.report_options]

    def add(function: F) -> F:
        for decorator in reversed(decorators):
            function = decorator(function)
        return function

    return add
