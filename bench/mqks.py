"""`polymq bench mqks`: end-to-end throughput and light-load latency of any MQKS server.

Modelled on the original's `tests/benchmark` (docs/protocols/mqks.md): queue *i* is bound to event *i*,
each publisher publishes its messages round-robin over all the events, and consumer *i* reads
queue *i* until every published message arrived. Four scenarios (default: all, in this order):

- `auto`     N publishers x M messages as fast as the server takes them, N auto-ack consumers
             (the reference run `benchmark 4 20000 0`: 80,000 messages end-to-end);
- `manual`   the same with `--manual-ack` consumers that ack every message;
- `latency`  paced publishing, one message every `--interval` per publisher, and the
             publish-to-deliver latency (avg, p50, p99, max) at a load the server can keep up with;
- `client`   the project's own trio client (`polymq.clients.mqks.MQKSClient`) in this
             process: one connection publishing `--client-messages` with `publish_nowait`, one
             auto-ack consumer (`consume(on_msg=...)`) counting deliveries and their latency.

Every body starts with the wall-clock send time (19 decimal digits of ns); a consumer subtracts
it from the time its recv() returned. A publisher ends with a ping and waits for the pong, so
its time covers the server having read every publish.

The load runs in spawned worker processes (one per connection by default) on plain blocking
sockets. Publishers format a chunk of lines per send; consumers split a read into lines and find
the timestamp of a delivery at a fixed offset (ids have a fixed length), falling back to the full
parser (`polymq.codecs.mqks_client`) for anything else; manual-ack consumers send the acks of one
read in one write. The `client` scenario is the exception: one trio run in the bench process,
where the client's own parsing and scheduling are what it measures.
"""

from __future__ import annotations

import contextlib
import functools
import json
import sys
import time
import uuid
from typing import Any

import attrs
import click

from polymq.bench import common, connections
from polymq.clients import tcp
from polymq.codecs import mqks_client as codec
from polymq.codecs.mqks import ID_LENGTH, MANUAL_ACK_FLAG, WHEN_UNUSED_FLAG

SCENARIOS = ("auto", "manual", "latency", "client")

# The original's reference runs (docs/protocols/mqks.md): `benchmark 4 20000 0` (4 clients x 20,000
# messages, no pause) and `benchmark 2 10000 0.0001` (2 paced clients) on a 2-core VM.
DEFAULT_CLIENTS = 4
DEFAULT_MESSAGES = 20_000
DEFAULT_LATENCY_CLIENTS = 2
DEFAULT_LATENCY_MESSAGES = 5_000
DEFAULT_CLIENT_MESSAGES = 20_000
# "Light load": one message every 0.5 ms per publisher (between 0.1 and 1 ms, well under saturation).
DEFAULT_INTERVAL_S = 0.0005
# Upstream bodies are `str(time.time())`, ~18 bytes; ours hold a 19-digit ns stamp plus filler.
DEFAULT_SIZE = 32
MAX_SIZE = 1024 * 1024  # polymq's MQKS line limit (codecs/mqks.py MAX_LINE_LENGTH) bounds the line
DEFAULT_PREFIX = "polymq_bench"
DEFAULT_PORT = 25000  # the original's one-worker port (docs/protocols/mqks.md)

# What the original did on a 2-core VM (docs/protocols/mqks.md).
ORIGINAL_E2E_MSGS_PER_S = 5_800
ORIGINAL_AVG_LATENCY_US = 3_000

# The send time at the start of each body: wall-clock ns, 19 digits until the year 2286.
STAMP_DIGITS = common.STAMP_DIGITS
MIN_SIZE = STAMP_DIGITS
FILLER = b"x"
# Throughput publishers send this many lines per sendall (one timestamp per chunk).
CHUNK_MESSAGES = 200
# A request id is the original's 24 characters: a per-connection prefix and a counter.
COUNTER_DIGITS = 10
PREFIX_LENGTH = ID_LENGTH - COUNTER_DIGITS
CONSUMER_RECV_BYTES = 256 * 1024
PUBLISHER_RECV_BYTES = 64 * 1024
# How long the client scenario waits for its queue to be deleted at the end.
CLEANUP_TIMEOUT_S = 5.0
PING_DATA = b"polymq.bench"


# --- plan (sent to the worker processes) --------------------------------------------------


@attrs.frozen(slots=True)
class ConnSpec(connections.ConnSpec):  # role: "pub" or "sub"
    id_prefix: str  # PREFIX_LENGTH characters, unique in the run
    events: tuple[str, ...]  # pub: published round-robin, from events[slot % len]; sub: its one event
    queue: str = ""  # sub
    quota: int = 0  # pub: messages to publish
    interval_s: float = 0.0  # pub: seconds between messages; 0 = as fast as possible
    manual_ack: bool = False  # sub


# --- worker side --------------------------------------------------------------------------


def _fail_on_error(line: bytes) -> None:
    try:
        response = codec.parse_response(line)
    except codec.ResponseError:
        raise connections.ServerError(f"unparsable response {line[:200]!r}") from None
    if not response.ok:
        raise connections.ServerError(f"server answered {line[:200].decode(errors='replace')}")


class _Conn(connections.Conn):
    def __init__(self, spec: ConnSpec, plan: connections.WorkerPlan, shared: common.SharedState) -> None:
        super().__init__(spec, shared)
        self.spec: ConnSpec = spec
        self.plan = plan
        self.sock = tcp.connect((plan.host, plan.port), connections.CONNECT_TIMEOUT_S)
        tcp.set_read_timeout(self.sock, connections.IDLE_POLL_S)
        self.rest = b""

    def _lines(self, max_bytes: int) -> list[bytes] | None:
        """The complete lines of one recv(); None on the idle timeout."""
        try:
            data = self.sock.recv(max_bytes)  # type: ignore[union-attr]
        except BlockingIOError:  # SO_RCVTIMEO expired
            return None
        if not data:
            raise connections.ServerError("server closed the connection")
        lines = (self.rest + data).split(b"\n") if self.rest else data.split(b"\n")
        self.rest = lines.pop()
        return lines


class _Publisher(_Conn):
    """Publishes its quota (in chunks, or paced one by one), then pings and waits for the pong."""

    def __init__(self, spec: ConnSpec, plan: connections.WorkerPlan, shared: common.SharedState) -> None:
        super().__init__(spec, plan, shared)
        self.prefix = spec.id_prefix.encode()
        self.heads = [f" publish {event} ".encode() for event in spec.events]
        self.first_event = spec.slot  # start the round-robin at a different event per publisher
        self.filler = FILLER * (plan.size - STAMP_DIGITS) + b"\n"
        self.ping_id = (spec.id_prefix + "9" * COUNTER_DIGITS).encode()
        self.sending = True
        self.late = 0  # paced sends that left more than one interval behind schedule

    def _lines_for(self, first: int, n: int, stamp_ns: int) -> bytes:
        tail = b"%019d%s" % (stamp_ns, self.filler)
        heads, events, prefix, start = self.heads, len(self.heads), self.prefix, self.first_event
        return b"".join([b"%s%010d%s%s" % (prefix, k, heads[(start + k) % events], tail)
                         for k in range(first, first + n)])

    def on_writable(self) -> None:
        """Throughput mode: one chunk."""
        n = min(CHUNK_MESSAGES, self.spec.quota - self.count)
        self.sock.sendall(self._lines_for(self.count, n, time.time_ns()))
        self.count += n
        self.shared.counters[self.slot] = self.count
        if self.count >= self.spec.quota or self.shared.stop.value:
            self._send_ping()

    def run_paced(self, start_mono: float) -> None:
        """Latency mode: message k leaves at start + k * interval (an absolute schedule: no drift)."""
        interval, quota, shared = self.spec.interval_s, self.spec.quota, self.shared
        sendall, clock, lines_for = self.sock.sendall, time.perf_counter, self._lines_for
        start = clock() + (start_mono - time.monotonic())
        for k in range(quota):
            due = start + k * interval
            delay = due - clock()
            if delay > 0:
                time.sleep(delay)
            elif -delay > interval:
                self.late += 1
            sendall(lines_for(k, 1, time.time_ns()))
            self.count = k + 1
            shared.counters[self.slot] = self.count
            if shared.stop.value:
                break
        self._send_ping()

    def on_idle(self) -> None:
        if self.shared.stop.value and not self.sending:
            self.finish()

    def _send_ping(self) -> None:
        self.sending = False
        self.sock.sendall(self.ping_id + b" ping " + PING_DATA + b"\n")

    def on_readable(self) -> None:
        """Wait for the pong; any `error` before it fails the run."""
        lines = self._lines(PUBLISHER_RECV_BYTES)
        if lines is None:
            if self.shared.stop.value:
                self.finish()
            return
        for line in lines:
            if line.startswith(self.ping_id + b" ok "):
                self.last_ns = time.time_ns()
                self.finish()
                return
            _fail_on_error(line)

    def result(self) -> dict[str, Any]:
        out = super().result()
        out["late"] = self.late
        return out


class _Consumer(_Conn):
    """consume --confirm; then count deliveries, measure their latency, ack them if manual."""

    def __init__(self, spec: ConnSpec, plan: connections.WorkerPlan, shared: common.SharedState) -> None:
        super().__init__(spec, plan, shared)
        self.id = (spec.id_prefix + "0" * COUNTER_DIGITS).encode()
        event = spec.events[0].encode()
        # A plain delivery: `{id} ok {msg_id:24} event={event} {stamp}…`; the stamp's offset is fixed.
        self.props = b" event=" + event + b" "
        self.props_at = len(self.id) + len(b" ok ") + ID_LENGTH
        self.stamp_at = self.props_at + len(self.props)
        self.msg_id_at = len(self.id) + len(b" ok ")
        self.ack_head = b" ack " + self.id + b" "
        self.latency = common.new_histogram()
        self.latency_sum_us = 0
        self.redelivered = 0
        flags = [WHEN_UNUSED_FLAG] + ([MANUAL_ACK_FLAG] if spec.manual_ack else [])
        data = " ".join([spec.queue, *spec.events, *flags])
        self.sock.sendall(codec.request(self.id.decode(), "consume", data, confirm=True))
        self._wait_confirm()

    def _wait_confirm(self) -> None:
        confirm = self.id + b" ok "
        while True:
            lines = self._lines(PUBLISHER_RECV_BYTES)
            for line in lines or ():
                if line == confirm:
                    return
                _fail_on_error(line)  # an `--update` is fine; an error is not

    def on_readable(self) -> None:
        lines = self._lines(CONSUMER_RECV_BYTES)
        if lines is None:
            self._check_stop()
            return
        now = time.time_ns()
        props, props_at, stamp_at, stamp_end = self.props, self.props_at, self.stamp_at, self.stamp_at + STAMP_DIGITS
        props_end = props_at + len(props)
        manual = self.spec.manual_ack
        msg_id_at, msg_id_end = self.msg_id_at, self.msg_id_at + ID_LENGTH
        acks: list[bytes] = []
        stamps: list[int] = []
        # The hot loop: one slice compare and one int() per delivery; the latencies are counted after it.
        for line in lines:
            if line[props_at:props_end] == props and len(line) >= stamp_end:
                stamp = int(line[stamp_at:stamp_end])
            else:
                stamp = self._other(line)
                if stamp is None:
                    continue
            stamps.append(stamp)
            if manual:
                acks.append(line[msg_id_at:msg_id_end])
        if acks:
            # The ack's own request id: the message id with its first character changed (unique too).
            head = self.ack_head
            self.sock.sendall(b"".join([b"A" + msg_id[1:] + head + msg_id + b"\n" for msg_id in acks]))
        if stamps:
            self.count += len(stamps)
            self.latency_sum_us += common.record_latencies(self.latency, now, stamps)
            self.last_ns = now
            self.shared.counters[self.slot] = self.count
        self._check_stop()

    def _other(self, line: bytes) -> int | None:
        """Not a plain delivery of ours: a redelivery (retry=n), a confirm, an update, or an error."""
        _fail_on_error(line)
        response = codec.parse_response(line)
        if not response.data or codec.is_update(response.data) or response.request_id != self.id.decode():
            return None
        delivery = codec.parse_delivery(response.data)
        if delivery.retry:
            self.redelivered += 1
        return int(delivery.body[:STAMP_DIGITS])

    def on_idle(self) -> None:
        self._check_stop()

    def _check_stop(self) -> None:
        if self.told_to_stop(self.plan.consumer_slots):
            self.finish()

    def result(self) -> dict[str, Any]:
        out = super().result()
        out.update(latency=common.sparse(self.latency), latency_sum_us=self.latency_sum_us,
                   redelivered=self.redelivered)
        return out


def _open(spec: ConnSpec, plan: connections.WorkerPlan, shared: common.SharedState) -> _Conn:
    return _Consumer(spec, plan, shared) if spec.role == "sub" else _Publisher(spec, plan, shared)


def _drive(conns: list[connections.Conn], start_mono: float) -> None:
    if len(conns) == 1 and isinstance(conns[0], _Publisher):  # a lone publisher sends before it reads
        publisher = conns[0]
        if publisher.spec.interval_s > 0:
            publisher.run_paced(start_mono)
        else:
            while publisher.sending:
                publisher.on_writable()
    connections.read_until_finished(conns)


def _worker_main(plan: connections.WorkerPlan, shared: common.SharedState, index: int) -> list[dict[str, Any]]:
    # Consumers first, each confirmed: a publish to a queue nobody consumed yet is dropped.
    specs = sorted(plan.conns, key=lambda spec: spec.role != "sub")
    return connections.run_worker(shared, index, [functools.partial(_open, spec, plan, shared) for spec in specs],
                                  _drive)


# --- parent side --------------------------------------------------------------------------


@attrs.frozen(slots=True)
class BenchOptions:
    host: str
    port: int
    scenarios: tuple[str, ...]
    clients: int
    messages: int
    latency_clients: int
    latency_messages: int
    interval_s: float
    size: int
    processes: int | None
    prefix: str
    progress: bool
    server_pid: int | None = None
    client_messages: int = DEFAULT_CLIENT_MESSAGES


@attrs.define(slots=True)
class ScenarioResult:
    name: str
    publishers: int
    consumers: int
    processes: int
    interval_s: float = 0.0
    published: int = 0
    consumed: int = 0
    expected: int = 0
    pub_seconds: float = 0.0
    e2e_seconds: float = 0.0
    latency: common.LatencySummary | None = None
    avg_latency_us: float = 0.0
    redelivered: int = 0
    late: int = 0
    stalled: bool = False
    server_cpu: tuple[float, float, float] | None = None  # (user, system, run-queue wait) shares of a core

    def pub_rate(self) -> float:
        return self.published / self.pub_seconds if self.pub_seconds > 0 else 0.0

    def e2e_rate(self) -> float:
        return self.consumed / self.e2e_seconds if self.e2e_seconds > 0 else 0.0

    def server_cpu_text(self) -> str:
        return common.cpu_text(self.server_cpu)

    def as_dict(self) -> dict[str, Any]:
        latency = self.latency.as_dict() if self.latency else None
        if latency is not None:
            latency["avg_us"] = round(self.avg_latency_us, 1)
        return {
            "scenario": self.name, "publishers": self.publishers, "consumers": self.consumers,
            "processes": self.processes, "interval_s": self.interval_s or None,
            "published": self.published, "consumed": self.consumed, "expected_consumed": self.expected,
            "pub_seconds": round(self.pub_seconds, 4), "e2e_seconds": round(self.e2e_seconds, 4),
            "pub_msgs_per_s": round(self.pub_rate(), 1), "e2e_msgs_per_s": round(self.e2e_rate(), 1),
            "latency_us": latency, "redelivered": self.redelivered, "late_sends": self.late,
            "stalled": self.stalled,
            **connections.cpu_fields(self.server_cpu),
        }


class _Scenario:
    """One scenario: n publishers, n consumers (queue i bound to event i), worker processes."""

    def __init__(self, name: str, opts: BenchOptions, run_id: str) -> None:
        self.name = name
        self.opts = opts
        paced = name == "latency"
        n = opts.latency_clients if paced else opts.clients
        quota = opts.latency_messages if paced else opts.messages
        base = f"{opts.prefix}.{run_id}.{name}"
        events = tuple(f"{base}.e{i}" for i in range(n))
        ids = [f"{run_id}{name[0]}{i:0{PREFIX_LENGTH - len(run_id) - 1}d}" for i in range(2 * n)]
        specs = [ConnSpec("pub", i, ids[i], events, quota=quota, interval_s=opts.interval_s if paced else 0.0)
                 for i in range(n)]
        specs += [ConnSpec("sub", n + i, ids[n + i], (events[i],), queue=f"{base}.q{i}", manual_ack=name == "manual")
                  for i in range(n)]
        self.pub_slots = tuple(range(n))
        self.sub_slots = tuple(range(n, 2 * n))
        self.total = n * quota
        # Paced publishers sleep between sends: each gets a process of its own so that no
        # other connection's work delays its schedule or a consumer's read.
        processes = len(specs) if paced else max(1, min(opts.processes or len(specs), len(specs)))
        # Publisher i and consumer i share a process, like an upstream client.
        self.plans = [connections.WorkerPlan(opts.host, opts.port, opts.size, self.sub_slots, tuple(group))
                      for group in connections.spread(specs, processes)]
        self.result = ScenarioResult(name, n, n, processes, opts.interval_s if paced else 0.0)
        self.progress = common.Progress(enabled=None if opts.progress else False)
        self.watch = common.RunWatch(opts.server_pid)

    def run(self) -> ScenarioResult:
        group = common.WorkerGroup(_worker_main, self.plans, len(self.pub_slots) + len(self.sub_slots),
                                   target=self.total)
        self._collect(*connections.run_scenario(self.name, group, self._tick, self.progress))
        self.result.server_cpu = self.watch.cpu_share(max(self.result.pub_seconds, self.result.e2e_seconds))
        return self.result

    def _tick(self, shared: common.SharedState) -> None:
        published = sum(shared.counters[s] for s in self.pub_slots)
        consumed = sum(shared.counters[s] for s in self.sub_slots)
        total = published + consumed
        elapsed, still = self.watch.tick(total)
        if still > connections.STALL_TIMEOUT_S:
            self.result.stalled = True
            shared.stop.value = 1
        self.progress.update(self.name, total / (2 * self.total),
                             f"pub {published:,} ({published / elapsed if elapsed else 0:,.0f}/s)  "
                             f"sub {consumed:,} ({consumed / elapsed if elapsed else 0:,.0f}/s)")

    def _collect(self, start_ns: int, conns: list[dict[str, Any]]) -> None:
        r = self.result
        pubs = [c for c in conns if c["role"] == "pub"]
        subs = [c for c in conns if c["role"] == "sub"]
        r.published = sum(c["messages"] for c in pubs)
        r.consumed = sum(c["messages"] for c in subs)
        r.expected = self.total
        r.late = sum(c["late"] for c in pubs)
        r.pub_seconds = max(0.0, (max(c["last_ns"] for c in pubs) - start_ns) / 1e9) if pubs else 0.0
        r.e2e_seconds = max(0.0, (max(c["last_ns"] for c in subs) - start_ns) / 1e9) if subs else 0.0
        r.latency = common.summarize(common.merge(c["latency"] for c in subs))
        r.avg_latency_us = sum(c["latency_sum_us"] for c in subs) / r.consumed if r.consumed else 0.0
        r.redelivered = sum(c["redelivered"] for c in subs)


class _ClientScenario:
    """`client`: the project's trio MQKSClient, one trio run in this process with two connections.

    The consumer (auto-ack, confirmed before anything is published) counts deliveries in its
    on_msg and measures their latency; the publisher queues its messages with publish_nowait, a
    chunk per scheduler turn, then pings (its time ends with the pong, like a worker publisher's).
    The queue is deleted at the end, whatever happened.
    """

    def __init__(self, opts: BenchOptions, run_id: str) -> None:
        self.opts = opts
        base = f"{opts.prefix}.{run_id}.client"
        self.event = f"{base}.e0"
        self.queue = f"{base}.q0"
        self.total = opts.client_messages
        self.tail = FILLER * (opts.size - STAMP_DIGITS)
        self.result = ScenarioResult("client", 1, 1, 1, expected=self.total)
        self.progress = common.Progress(enabled=None if opts.progress else False)
        self.latency = common.new_histogram()
        self.latency_sum_us = 0
        self.last_ns = 0
        self._all_consumed: Any = None  # a trio.Event, made inside the trio run

    def run(self) -> ScenarioResult:
        # Imported here: the other scenarios' worker processes (spawned, they import this module)
        # have no use for trio.
        import trio

        from polymq.clients.mqks import MQKSError

        watch = common.RunWatch(self.opts.server_pid)
        watch.start()
        try:
            start_ns, pub_end_ns = trio.run(self._main)
        except (OSError, MQKSError) as exc:
            raise click.ClickException(f"scenario client: {exc}") from None
        finally:
            self.progress.done()
        r = self.result
        r.pub_seconds = max(0.0, (pub_end_ns - start_ns) / 1e9) if pub_end_ns else 0.0
        r.e2e_seconds = max(0.0, (self.last_ns - start_ns) / 1e9) if self.last_ns else 0.0
        r.latency = common.summarize(common.sparse(self.latency))
        r.avg_latency_us = self.latency_sum_us / r.consumed if r.consumed else 0.0
        r.server_cpu = watch.cpu_share(max(r.pub_seconds, r.e2e_seconds))
        return r

    def _on_msg(self, message: Any) -> None:
        now = time.time_ns()
        lat = (now - int(message.body[:STAMP_DIGITS])) // 1000
        self.latency[common.bucket_of(lat)] += 1
        self.latency_sum_us += lat
        self.last_ns = now
        r = self.result
        r.consumed += 1
        if message.retry:
            r.redelivered += 1
        if r.consumed >= self.total:
            self._all_consumed.set()

    def _show(self, start_mono: float) -> None:
        r, elapsed = self.result, time.monotonic() - start_mono
        self.progress.update("client", (r.published + r.consumed) / (2 * self.total),
                             f"pub {r.published:,} ({r.published / elapsed if elapsed else 0:,.0f}/s)  "
                             f"sub {r.consumed:,} ({r.consumed / elapsed if elapsed else 0:,.0f}/s)")

    async def _main(self) -> tuple[int, int]:
        """(start, pong) in wall-clock ns; pong 0 if the publisher's ping went unanswered."""
        import trio

        from polymq.clients.mqks import MQKSClient, MQKSError

        self._all_consumed = trio.Event()
        r, event, tail, publish_chunk = self.result, self.event, self.tail, CHUNK_MESSAGES
        async with (MQKSClient(self.opts.host, self.opts.port) as sub,
                    MQKSClient(self.opts.host, self.opts.port) as pub):
            try:
                await sub.consume(self.queue, [self.event], on_msg=self._on_msg, confirm=True)
                start_mono, start_ns = time.monotonic(), time.time_ns()
                publish = pub.publish_nowait
                for first in range(0, self.total, publish_chunk):
                    for _ in range(min(publish_chunk, self.total - first)):
                        publish(event, b"%019d%s" % (time.time_ns(), tail))
                    r.published = min(first + publish_chunk, self.total)
                    self._show(start_mono)
                    await trio.sleep(0)  # let the writer send and the consumer read
                pub_end_ns = 0
                with trio.move_on_after(connections.STALL_TIMEOUT_S):
                    await pub.ping(PING_DATA)
                    pub_end_ns = time.time_ns()
                last_count, last_change = -1, time.monotonic()
                while not self._all_consumed.is_set() and pub_end_ns:
                    with trio.move_on_after(connections.IDLE_POLL_S):
                        await self._all_consumed.wait()
                    self._show(start_mono)
                    if r.consumed != last_count:
                        last_count, last_change = r.consumed, time.monotonic()
                    elif time.monotonic() - last_change > connections.STALL_TIMEOUT_S:
                        break
                r.stalled = not self._all_consumed.is_set()
            finally:
                with (trio.move_on_after(CLEANUP_TIMEOUT_S, shield=True),
                      contextlib.suppress(OSError, MQKSError)):
                    await sub.delete_queue(self.queue, confirm=True)
        return start_ns, pub_end_ns


def run_bench(opts: BenchOptions) -> list[ScenarioResult]:
    run_id = uuid.uuid4().hex[:8]
    return [(_ClientScenario(opts, run_id) if name == "client" else _Scenario(name, opts, run_id)).run()
            for name in opts.scenarios]


def _ms(us: float) -> str:
    return f"{us / 1000:,.2f} ms"


def verdicts(r: ScenarioResult) -> list[str]:
    """The scenario beside the original's figures."""
    if r.name == "latency":
        if r.latency is None:
            return []
        return [f"latency: avg {_ms(r.avg_latency_us)} vs the original's ~{_ms(ORIGINAL_AVG_LATENCY_US)}; "
                f"p99 {_ms(r.latency.p99_us)}"]
    if r.name == "client":
        # A figure of the Python client, not of the server.
        return [f"client: the project's trio MQKSClient, 1 publisher (publish_nowait) + 1 auto-ack consumer in one "
                f"process: {r.e2e_rate():,.0f} msgs/s end-to-end (the original's reference run: "
                f"~{ORIGINAL_E2E_MSGS_PER_S:,} with 4 of its clients)"]
    speedup = r.e2e_rate() / ORIGINAL_E2E_MSGS_PER_S
    # The original's figure is of auto-ack consumers (upstream's benchmark has no manual-ack mode).
    of_what = "" if r.name == "auto" else " auto-ack"
    return [f"{r.name}: {r.e2e_rate():,.0f} msgs/s end-to-end = {speedup:.1f}x the original's{of_what} "
            f"~{ORIGINAL_E2E_MSGS_PER_S:,}"]


def render(opts: BenchOptions, results: list[ScenarioResult]) -> str:
    headers = ["scenario", "conns", "published", "pub msgs/s", "consumed", "e2e msgs/s",
               "latency avg", "p50", "p99", "max"]
    if opts.server_pid:
        headers.append("server CPU (usr+sys) + run-queue wait")
    rows = []
    notes: list[str] = []
    for r in results:
        consumed = common.format_count(r.consumed)
        if r.consumed != r.expected:
            consumed += f" of {r.expected:,}"
        lat = r.latency
        rows.append([
            r.name, f"{r.publishers} pub + {r.consumers} sub",
            common.format_count(r.published), common.format_count(r.pub_rate()),
            consumed, common.format_count(r.e2e_rate()),
            _ms(r.avg_latency_us) if lat else "-", _ms(lat.p50_us) if lat else "-",
            _ms(lat.p99_us) if lat else "-", _ms(lat.max_us) if lat else "-",
        ])
        if opts.server_pid:
            rows[-1].append(r.server_cpu_text())
        notes += verdicts(r)
        if r.name != "latency" and lat is not None:
            notes.append(f"{r.name}: latency includes the publishers' backlog (publishing as fast as possible)")
        if r.stalled:
            notes.append(connections.stalled_note(r.name))
        if r.redelivered:
            notes.append(f"{r.name}: {r.redelivered:,} redeliveries")
        if r.late:
            notes.append(f"{r.name}: {r.late:,} sends left more than one interval behind schedule")
    head = (f"polymq bench mqks  {opts.host}:{opts.port}  {opts.size}-byte messages; "
            f"throughput: {opts.clients} publishers x {opts.messages:,}, {opts.clients} consumers; "
            f"latency: {opts.latency_clients} x {opts.latency_messages:,}, "
            f"one every {opts.interval_s * 1000:g} ms each")
    if "client" in opts.scenarios:
        head += f"; client: 1 x {opts.client_messages:,} through MQKSClient"
    return "\n".join([head, "", common.render_table(headers, rows), "", *notes])


@click.command()
@click.option("--addr", "addr", default=f"127.0.0.1:{DEFAULT_PORT}", show_default=True,
              callback=connections.address_option, metavar="HOST:PORT",
              help="MQKS address of the server (the original's worker 0: 25000).")
@click.option("--scenario", "scenarios", multiple=True, type=click.Choice([*SCENARIOS, "all"]),
              help="Scenario to run (repeatable; default all: auto, manual, latency, client).")
@click.option("--clients", type=int, default=DEFAULT_CLIENTS, show_default=True,
              help="Throughput: publishers, and as many queues and consumers.")
@click.option("--messages", type=int, default=DEFAULT_MESSAGES, show_default=True,
              help="Throughput: messages per publisher.")
@click.option("--latency-clients", type=int, default=DEFAULT_LATENCY_CLIENTS, show_default=True,
              help="Latency: paced publishers, and as many queues and consumers.")
@click.option("--latency-messages", type=int, default=DEFAULT_LATENCY_MESSAGES, show_default=True,
              help="Latency: messages per publisher.")
@click.option("--interval", "interval_s", type=float, default=DEFAULT_INTERVAL_S, show_default=True,
              help="Latency: seconds between two messages of one publisher.")
@click.option("--client-messages", type=int, default=DEFAULT_CLIENT_MESSAGES, show_default=True,
              help="Client: messages the project's MQKSClient publishes (one publisher, one consumer).")
@click.option("--size", type=int, default=DEFAULT_SIZE, show_default=True, help="Message body bytes.")
@click.option("--processes", type=int, default=None,
              help="Throughput: worker processes to spread the connections over (default: one per connection).")
@click.option("--prefix", default=DEFAULT_PREFIX, show_default=True, help="Queue and event name prefix.")
@common.report_options
def command(addr: tuple[str, int], scenarios: tuple[str, ...], clients: int, messages: int, latency_clients: int,
            latency_messages: int, interval_s: float, client_messages: int, size: int, processes: int | None,
            prefix: str, server_pid: int | None, as_json: bool, progress: bool) -> None:
    """Benchmark an MQKS server (polymq or the original) like the original's tests/benchmark.

    Reports end-to-end msgs/s with auto-ack and manual-ack consumers, and publish-to-deliver
    latency (avg, p50, p99, max) under paced publishing, against the original's figures; and the
    same end-to-end figures for the project's own Python client (MQKSClient).
    """
    if min(clients, messages, latency_clients, latency_messages, client_messages) < 1:
        raise click.BadParameter("clients and messages must be at least 1")
    if not MIN_SIZE <= size <= MAX_SIZE - 200:
        raise click.BadParameter(f"must be {MIN_SIZE}..{MAX_SIZE - 200} (the body holds a {STAMP_DIGITS}-digit "
                                 "timestamp)", param_hint="--size")
    if interval_s <= 0:
        raise click.BadParameter("must be positive", param_hint="--interval")
    if any(ch.isspace() for ch in prefix) or not prefix:
        raise click.BadParameter("must be non-empty without spaces", param_hint="--prefix")
    chosen = common.chosen_scenarios(scenarios, SCENARIOS)
    opts = BenchOptions(host=addr[0], port=addr[1], scenarios=chosen, clients=clients, messages=messages,
                        latency_clients=latency_clients, latency_messages=latency_messages, interval_s=interval_s,
                        size=size, processes=processes, prefix=prefix, progress=progress and not as_json,
                        server_pid=server_pid, client_messages=client_messages)
    results = run_bench(opts)
    if as_json:
        click.echo(json.dumps({
            "server": f"{opts.host}:{opts.port}", "size": size,
            "reference": {"original_e2e_msgs_per_s": ORIGINAL_E2E_MSGS_PER_S,
                          "original_avg_latency_us": ORIGINAL_AVG_LATENCY_US},
            "scenarios": [r.as_dict() for r in results],
        }, indent=2))
    else:
        click.echo(render(opts, results))
    if any(r.stalled or r.consumed != r.expected or r.consumed != r.published for r in results):
        sys.exit(1)
