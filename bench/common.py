"""Helpers shared by the protocol benchmarks (`polymq bench <protocol>`).

Protocol-free: a log-linear latency histogram cheap enough to update once per message in a
worker's hot loop, merging and percentiles, a one-line progress display on stderr, rate and
table formatting, and the multiprocessing plumbing (spawned workers, shared counters, a start
signal) that lets a benchmark drive a server from several processes so that the load generator
is not the bottleneck.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import multiprocessing.context
import multiprocessing.sharedctypes
import os
import queue
import selectors
import signal
import sys
import time
import traceback
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

import attrs
import click

# --- latency histogram --------------------------------------------------------------------
#
# Values are whole microseconds. Below 2**(SUB_BITS + 1) every value has its own bucket; above,
# each power of two is split into 2**SUB_BITS buckets (the HdrHistogram layout), so a reported
# percentile is within 1 / 2**SUB_BITS (< 0.8 %) of the true value. A list of counts indexed by
# bucket costs a bit_length, two shifts and one list store per sample.
SUB_BITS = 7
LINEAR_LIMIT = 1 << (SUB_BITS + 1)  # 256 µs: exact below this
# 2**40 µs is 12 days: anything longer is clamped into the last bucket.
MAX_SHIFT = 40
HIST_BUCKETS = ((MAX_SHIFT + 1) << SUB_BITS) + LINEAR_LIMIT


def new_histogram() -> list[int]:
    return [0] * HIST_BUCKETS


def bucket_of(value_us: int) -> int:
    """Bucket index of a latency in µs (negative values count as 0: clocks of two hosts)."""
    if value_us < LINEAR_LIMIT:
        return value_us if value_us > 0 else 0
    shift = value_us.bit_length() - SUB_BITS - 1
    if shift > MAX_SHIFT:
        return HIST_BUCKETS - 1
    return (shift << SUB_BITS) + (value_us >> shift)


def bucket_value(index: int) -> float:
    """Midpoint (µs) of the values that fall into bucket `index`."""
    if index < LINEAR_LIMIT:
        return float(index)
    shift = (index >> SUB_BITS) - 1
    low = (index - (shift << SUB_BITS)) << shift
    return low + ((1 << shift) - 1) / 2


def sparse(histogram: Sequence[int]) -> dict[int, int]:
    """The non-empty buckets only: what a worker sends back to the parent process."""
    return {i: n for i, n in enumerate(histogram) if n}


def merge(histograms: Iterable[dict[int, int]]) -> dict[int, int]:
    out: dict[int, int] = {}
    for histogram in histograms:
        for index, count in histogram.items():
            out[index] = out.get(index, 0) + count
    return out


def record_latencies(histogram: list[int], now_ns: int, stamps_ns: Iterable[int]) -> int:
    """Count each `now_ns - stamp` (in µs) into `histogram`; returns their sum. The consumers' hot loops
    collect a read's stamps and call this once, so the bucket arithmetic (`bucket_of`) is inlined."""
    total = 0
    for stamp in stamps_ns:
        lat = (now_ns - stamp) // 1000
        total += lat
        if lat < LINEAR_LIMIT:
            histogram[lat if lat > 0 else 0] += 1
        else:
            shift = lat.bit_length() - SUB_BITS - 1
            histogram[(shift << SUB_BITS) + (lat >> shift) if shift <= MAX_SHIFT else HIST_BUCKETS - 1] += 1
    return total


@attrs.frozen(slots=True)
class LatencySummary:
    count: int
    p50_us: float
    p99_us: float
    max_us: float

    def as_dict(self) -> dict[str, float]:
        return {"count": self.count, "p50_us": self.p50_us, "p99_us": self.p99_us, "max_us": self.max_us}


def summarize(histogram: dict[int, int]) -> LatencySummary | None:
    total = sum(histogram.values())
    if not total:
        return None
    indexes = sorted(histogram)
    wanted = {"p50": 0.50 * total, "p99": 0.99 * total}
    found: dict[str, float] = {}
    seen = 0
    for index in indexes:
        seen += histogram[index]
        for name, rank in wanted.items():
            if name not in found and seen >= rank:
                found[name] = bucket_value(index)
    return LatencySummary(total, found["p50"], found["p99"], bucket_value(indexes[-1]))


# --- formatting -------------------------------------------------------------------------


# nsq's bench_writer / bench_reader print MB/s as bytes / 1024 / 1024 per second (that is how
# docs/protocols/nsq.md gets 82.8 MB/s from 434,239 msgs/s of 200 bytes); the same unit here keeps
# figures comparable.
BYTES_PER_MB = 1024 * 1024


def mb_per_s(messages: int, size: int, seconds: float) -> float:
    return messages * size / BYTES_PER_MB / seconds if seconds > 0 else 0.0


def format_count(value: float) -> str:
    return f"{value:,.0f}"


def format_latency(summary: LatencySummary | None) -> str:
    """`p50 / p99` with a unit that suits the magnitude."""
    if summary is None:
        return "-"
    p50, p99 = summary.p50_us, summary.p99_us
    if p99 >= 10_000:
        return f"{p50 / 1000:,.1f} / {p99 / 1000:,.1f} ms"
    return f"{p50:,.0f} / {p99:,.0f} µs"


def render_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Plain text table: first column left-aligned, the others right-aligned."""
    widths = [max(len(str(row[i])) for row in [headers, *rows]) for i in range(len(headers))]

    def line(cells: Sequence[str]) -> str:
        parts = [str(cells[0]).ljust(widths[0])]
        parts += [str(cell).rjust(width) for cell, width in zip(cells[1:], widths[1:], strict=True)]
        return "  ".join(parts).rstrip()

    rule = "  ".join("-" * width for width in widths)
    return "\n".join([line(headers), rule, *(line(row) for row in rows)])


# Every benchmark message starts with the wall-clock ns it was sent at (19 digits until the year
# 2286), so the receiving side measures latency from the body alone.
STAMP_DIGITS = 19


def stamped_body(size: int) -> bytes:
    """A body of `size` bytes (at least the stamp) that starts with the time it is made."""
    return b"%019d" % time.time_ns() + b"x" * max(0, size - STAMP_DIGITS)


class Progress:
    """One self-rewriting status line on stderr; silent unless stderr is a terminal."""

    # Redraw at most this often: a terminal does not need more, and it keeps the parent cheap.
    MIN_INTERVAL_S = 0.2
    BAR_WIDTH = 28

    def __init__(self, enabled: bool | None = None, stream: Any = None) -> None:
        self.stream = stream if stream is not None else sys.stderr
        # Asked for or not, a line rewritten with \r is for a terminal only (a log file gets none).
        self.enabled = enabled is not False and self.stream.isatty()
        self._last_draw = 0.0
        self._width = 0

    def update(self, label: str, fraction: float, detail: str, *, force: bool = False) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if not force and now - self._last_draw < self.MIN_INTERVAL_S:
            return
        self._last_draw = now
        fraction = min(max(fraction, 0.0), 1.0)
        filled = int(fraction * self.BAR_WIDTH)
        text = f"{label:<8} [{'#' * filled}{'.' * (self.BAR_WIDTH - filled)}] {fraction * 100:3.0f}%  {detail}"
        pad = max(0, self._width - len(text))
        self._width = len(text)
        self.stream.write("\r" + text + " " * pad)
        self.stream.flush()

    def done(self) -> None:
        if self.enabled and self._width:
            self.stream.write("\r" + " " * self._width + "\r")
            self.stream.flush()
            self._width = 0


def process_cpu_s(pid: int) -> tuple[float, float, float] | None:
    """(user, system, run-queue wait) seconds of a local process so far, from /proc (Linux only).

    The wait (main thread only: /proc/PID/schedstat) is time the process was runnable but had no
    CPU: on-CPU + wait near 100 % means a CPU-bound server that the machine is starving.
    """
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
        with open(f"/proc/{pid}/schedstat") as schedstat:
            wait_ns = int(schedstat.read().split()[1])
    except (OSError, IndexError, ValueError):
        return None
    # /proc/PID/stat fields 14 and 15 (utime, stime), counted after the ")" that ends field 2.
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick, wait_ns / 1e9


# --- worker processes -------------------------------------------------------------------

# Workers are started with "spawn" so that they share nothing with the parent (no forked
# sockets or locks) and behave the same on every OS.
START_METHOD = "spawn"


class WorkerFailed(Exception):
    """A worker process raised; the message carries its traceback."""


@attrs.define(slots=True)
class SharedState:
    """What the parent and the workers share while a run is in progress.

    counters[slot]: messages done so far by connection `slot` (published with an OK, or
    received); done[slot]: 1 once that connection stopped. `stop` tells every worker to finish
    now; `target` (-1 = not known yet) is the number of received messages at which consumers
    stop; `start_ns` is the wall-clock start all workers measure from.
    """

    counters: Any
    done: Any
    stop: Any
    target: Any
    start_ns: Any
    start: Any  # multiprocessing Event
    results: Any  # multiprocessing Queue of (worker index, payload)

    @classmethod
    def create(cls, ctx: multiprocessing.context.BaseContext, slots: int) -> SharedState:
        # lock=False: every slot has one writer; readers tolerate a value one update old.
        return cls(
            counters=ctx.Array("q", slots, lock=False),
            done=ctx.Array("b", slots, lock=False),
            stop=ctx.Value("b", 0, lock=False),
            target=ctx.Value("q", -1, lock=False),
            start_ns=ctx.Value("q", 0, lock=False),
            start=ctx.Event(),
            results=ctx.Queue(),
        )


READY = "ready"
RESULT = "result"
ERROR = "error"


# prctl(2)'s option asking for a signal when the parent goes (linux/prctl.h).
PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """End this worker with the bench that started it, however the bench ends (SIGTERM and SIGKILL
    included, which skip its exit handlers). An orphan would go on driving the server's ports; a
    ZeroMQ worker reconnecting to a port nobody listens on any more can even end up connected to
    itself there and keep the port from the next server. Linux only: elsewhere the bench's normal
    exit still ends its daemon workers."""
    if not sys.platform.startswith("linux"):
        return
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    parent = multiprocessing.parent_process()
    if parent is not None and os.getppid() != parent.pid:
        os._exit(1)  # the bench went before the request took effect


def worker_entry(main: Callable[[Any, SharedState, int], Any], plan: Any, shared: SharedState, index: int) -> None:
    """Process target: run `main(plan, shared, index)`, which reports READY itself once
    connected; send back its result, one line for a server that is not there or went away, or the
    traceback of anything else it raised (a defect of the bench)."""
    die_with_parent()
    try:
        result = main(plan, shared, index)
    except WorkerFailed as failed:
        shared.results.put((index, ERROR, str(failed)))
    except OSError as error:
        shared.results.put((index, ERROR, f"{_address_of(plan)}{error.strerror or error}: is the server running "
                                          "there (`.venv/bin/polymq serve` starts one), and is it the address?"))
    except BaseException:
        shared.results.put((index, ERROR, traceback.format_exc()))
    else:
        shared.results.put((index, RESULT, result))


def _address_of(plan: Any) -> str:
    """`host:port: ` of the server a worker's plan names, when it names one that way."""
    if hasattr(plan, "host") and hasattr(plan, "port"):
        return f"{plan.host}:{plan.port}: "
    address = getattr(plan, "address", None)
    return f"{address}: " if address else ""


def report_ready(shared: SharedState, index: int) -> None:
    shared.results.put((index, READY, os.getpid()))


def ready_and_wait(shared: SharedState, index: int) -> None:
    """A worker that has connected: say so, and wait until every worker has and the run starts."""
    report_ready(shared, index)
    shared.start.wait()


@attrs.define(slots=True)
class WorkerGroup:
    """Spawn one process per plan, wait until all are connected, start them together, and
    collect their results while a `tick` callback shows progress and may steer `shared`."""

    main: Callable[[Any, SharedState, int], Any]
    plans: list[Any]
    slots: int
    target: int = -1  # initial SharedState.target
    ready_timeout_s: float = 30.0
    poll_interval_s: float = 0.05
    ctx: Any = attrs.field(factory=lambda: multiprocessing.get_context(START_METHOD))

    def run(self, tick: Callable[[SharedState], None]) -> tuple[int, list[Any]]:
        """Return (start_ns, results in plan order)."""
        shared = SharedState.create(self.ctx, self.slots)
        shared.target.value = self.target
        processes = [
            self.ctx.Process(target=worker_entry, args=(self.main, plan, shared, i), daemon=True)
            for i, plan in enumerate(self.plans)
        ]
        for process in processes:
            process.start()
        results: list[Any] = [None] * len(processes)
        try:
            self._wait(shared, processes, READY, self.ready_timeout_s, results, None)
            shared.start_ns.value = time.time_ns()
            shared.start.set()
            self._wait(shared, processes, RESULT, None, results, tick)
            return shared.start_ns.value, results
        finally:
            shared.stop.value = 1
            shared.start.set()
            for process in processes:
                process.join(5)
                if process.is_alive():
                    process.kill()
                    process.join()

    def _wait(self, shared: SharedState, processes: list[Any], kind: str, timeout: float | None,
              results: list[Any], tick: Callable[[SharedState], None] | None) -> None:
        pending = set(range(len(processes)))
        give_up = None if timeout is None else time.monotonic() + timeout
        while pending:
            try:
                index, got, payload = shared.results.get(timeout=self.poll_interval_s)
            except queue.Empty:
                if tick is not None:
                    tick(shared)
                dead = [i for i in pending if processes[i].exitcode is not None]
                if dead:
                    raise WorkerFailed(f"worker {dead[0]} exited with status {processes[dead[0]].exitcode}") from None
                if give_up is not None and time.monotonic() > give_up:
                    raise WorkerFailed(f"workers {sorted(pending)} not {kind} after {timeout:.0f} s") from None
                continue
            if got == ERROR:
                raise WorkerFailed(payload)
            if got == kind:
                pending.discard(index)
                if got == RESULT:
                    results[index] = payload
        if tick is not None:
            tick(shared)


class RunWatch:
    """What a scenario's ticks track in both benches: when the run started, the server's CPU reading
    then, and how long the message counts have stood still."""

    def __init__(self, server_pid: int | None) -> None:
        self.server_pid = server_pid
        self.started = 0.0
        self._cpu_start: tuple[float, float, float] | None = None
        self._last_total = -1
        self._last_change = 0.0

    def start(self) -> None:
        if not self.started:
            self.started = self._last_change = time.monotonic()
            if self.server_pid:
                self._cpu_start = process_cpu_s(self.server_pid)

    def tick(self, total: int) -> tuple[float, float]:
        """(seconds since the start, seconds `total` has not changed)."""
        self.start()
        now = time.monotonic()
        if total != self._last_total:
            self._last_total, self._last_change = total, now
        return now - self.started, now - self._last_change

    def elapsed(self) -> float:
        return time.monotonic() - self.started if self.started else 0.0

    def cpu_share(self, wall_s: float) -> tuple[float, float, float] | None:
        """(user, system, wait) of the server since the start as shares of `wall_s`; None without readings."""
        end = process_cpu_s(self.server_pid) if self.server_pid else None
        start = self._cpu_start
        if not start or not end:
            return None
        wall = max(wall_s, 1e-9)
        return ((end[0] - start[0]) / wall, (end[1] - start[1]) / wall, (end[2] - start[2]) / wall)


def run_selector(conns: Sequence[Any], idle_poll_s: float) -> None:
    """Drive several benchmark connections in one process until each is `finished`.

    A connection has `sock`, `finished`, `sending` (wants its socket writable), `on_writable()`,
    `on_readable()` and `on_idle()` (called every `idle_poll_s` for deadlines and stop signals of
    connections that had nothing to read)."""
    selector = selectors.DefaultSelector()
    for conn in conns:
        selector.register(conn.sock, selectors.EVENT_WRITE if conn.sending else selectors.EVENT_READ, conn)
    live = set(conns)
    next_idle = time.monotonic() + idle_poll_s
    while live:
        for key, events in selector.select(idle_poll_s):
            conn = key.data
            if events & selectors.EVENT_WRITE:
                conn.on_writable()
                if not conn.sending:
                    selector.modify(conn.sock, selectors.EVENT_READ, conn)
            else:
                conn.on_readable()
        now = time.monotonic()
        if now >= next_idle:
            next_idle = now + idle_poll_s
            for conn in live:
                conn.on_idle()
        for conn in [c for c in live if c.finished]:
            selector.unregister(conn.sock)
            live.discard(conn)
    selector.close()


def cpu_text(cpu: tuple[float, float, float] | None) -> str:
    """A server's (user, system, run-queue wait) shares as the benches print them."""
    if cpu is None:
        return "-"
    user, system, wait = cpu
    return f"{(user + system) * 100:.0f}% ({user * 100:.0f}+{system * 100:.0f}) +{wait * 100:.0f}% wait"


# -- the options every protocol's bench has --------------------------------------------------------

F = TypeVar("F", bound=Callable[..., Any])


def scenario_option(scenarios: tuple[str, ...]) -> Callable[[F], F]:
    return click.option("--scenario", "scenarios", multiple=True, type=click.Choice([*scenarios, "all"]),
                        help="Scenario to run (repeatable; default all).")


def chosen_scenarios(asked: tuple[str, ...], scenarios: tuple[str, ...]) -> tuple[str, ...]:
    """The scenarios to run, in the bench's own order: all when none (or "all") is asked."""
    return scenarios if not asked or "all" in asked else tuple(name for name in scenarios if name in asked)


def report_options(function: F) -> F:
    """--server-pid, --json and --progress, in that order."""
    function = click.option("--progress/--no-progress", default=True, show_default=True,
                            help="A progress line on stderr (only when stderr is a terminal).")(function)
    function = click.option("--json", "as_json", is_flag=True,
                            help="Print the results as JSON instead of a table.")(function)
    server_pid = click.option("--server-pid", type=int, default=None,
                              help="PID of a server on this machine: report its CPU use per scenario (Linux /proc).")
    return server_pid(function)

