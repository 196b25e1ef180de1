"""`polymq bench nsq`: measure any nsqd-compatible server the way nsq's own bench tools do.

Four scenarios, each selectable (default: all, in this order):

- `mpub`   MPUB batches (like `bench_writer`), one batch in flight per connection;
- `sub`    consume the backlog `mpub` left (like `bench_reader`), RDY 2500, FIN every message;
- `pub`    PUB, one message per round trip (wait for OK before the next), with consumers
           attached (`--pub-consumers`) so the publish-to-deliver latency is measured too;
- `pubsub` MPUB publishers and consumers at once.

Every body starts with the wall-clock time (int64 ns, big-endian) at which it was sent; the
consumer subtracts it from the time its recv() returned, so latency includes the server's output
buffering (docs/protocols/nsq.md). For `sub` that figure is the age of the backlog, not a delivery delay.

The load runs in spawned worker processes (one per connection by default) on plain blocking
sockets: MPUB/PUB payloads are encoded once and only the timestamps are spliced in (one
`bytes.join` per batch); consumers scan frames with one struct unpack per message and send the
FINs of one recv() as one write.
"""

from __future__ import annotations

import contextlib
import functools
import json
import socket
import struct
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from collections.abc import Callable
from typing import Any

import attrs
import click

from polymq.bench import common, connections
from polymq.clients import nsq, tcp
from polymq.codecs import nsq_client
from polymq.codecs.nsq import (
    FRAME_TYPE_ERROR,
    FRAME_TYPE_MESSAGE,
    FRAME_TYPE_RESPONSE,
    HEARTBEAT,
    MESSAGE_OVERHEAD,
    OK,
)

SCENARIOS = ("mpub", "sub", "pub", "pubsub")

# Defaults of nsq's bench_writer / bench_reader and of the reference runs (docs/protocols/nsq.md):
# 200-byte messages, MPUB batches of 200, RDY 2500 (nsqd's max-rdy-count), 2 connections.
DEFAULT_SIZE = 200
DEFAULT_BATCH = 200
DEFAULT_RDY = 2500
DEFAULT_PUBLISHERS = 2
DEFAULT_CONSUMERS = 2
# The reference runs lasted 5 s (docs/protocols/nsq.md).
DEFAULT_DURATION_S = 5.0
DEFAULT_TOPIC_PREFIX = "polymq_bench"
CHANNEL = "bench"

# nsqd limits (docs/protocols/nsq.md): each message ≤ max-msg-size, one MPUB body ≤ max-body-size.
MAX_MSG_SIZE = 1024 * 1024
MAX_BODY_SIZE = 5 * 1024 * 1024
# The body starts with the send time: int64 ns, big-endian.
STAMP = struct.Struct(">q")
MIN_SIZE = STAMP.size
# Placeholder written where each timestamp goes; splitting an encoded command on it gives the
# pieces that `stamp.join(pieces)` reassembles with the real time (bodies are otherwise b"x").
STAMP_MARKER = b"\xfe\xed\x5a\x11\xc0\xff\xee\x01"
FILLER = b"x"

# Frame scanning: size, type; and for a message frame also nsqd's timestamp, attempts, id and
# the first 8 body bytes (our send time) in one unpack (docs/protocols/nsq.md: 4 + 4 + 8 + 2 + 16 + 8).
FRAME_HEAD = struct.Struct(">ii")
MESSAGE_HEAD = struct.Struct(">iiqH16sq")
FRAME_OK = struct.pack(">ii", 4 + len(OK), FRAME_TYPE_RESPONSE) + OK

# A consumer reads at most this much per recv(): big enough for ~1,200 200-byte messages per
# system call, small enough that the FINs of one read (21 bytes each) stay well inside the
# socket's send buffer, so a blocking FIN write cannot wedge against a server that is itself
# blocked writing messages to us.
CONSUMER_RECV_BYTES = 256 * 1024
PUBLISHER_RECV_BYTES = 64 * 1024
# After the publishers of `pub`/`pubsub` finish, consumers get this long to drain the rest.
DRAIN_TIMEOUT_S = 60.0

# Response frames on a connection that has not sent IDENTIFY with feature_negotiation are
# plain `OK` (docs/protocols/nsq.md: "the Go bench tools send IDENTIFY without it and expect plain OK").
USER_AGENT = "polymq-bench/0.1"


# --- plan (sent to the worker processes) --------------------------------------------------


@attrs.frozen(slots=True)
class ConnSpec(connections.ConnSpec):  # role: "mpub", "pub" or "sub"
    topic: str
    quota: int = 0  # publishers: messages to publish; 0 = until the deadline
    deadline_s: float | None = None  # seconds after the start; None = no deadline


@attrs.frozen(slots=True)
class WorkerPlan(connections.WorkerPlan):
    batch: int
    rdy: int
    identify: dict[str, Any]


# --- worker side --------------------------------------------------------------------------


def _stamped_pieces(encoded: bytes, count: int) -> list[bytes]:
    pieces = encoded.split(STAMP_MARKER)
    if len(pieces) != count + 1:  # the marker also occurs in a topic name or a size: refuse
        raise ValueError("cannot place timestamps in this payload")
    return pieces


def _body(size: int) -> bytes:
    return STAMP_MARKER + FILLER * (size - MIN_SIZE)


class _Conn(connections.Conn):
    """One connection to the server; subclasses do the publishing or the consuming. Writes stay
    blocking: it never waits for writability."""

    def __init__(self, spec: ConnSpec, plan: WorkerPlan, shared: common.SharedState, recv_bytes: int) -> None:
        super().__init__(spec, shared)
        self.spec: ConnSpec = spec
        self.plan = plan
        self.buf = bytearray(recv_bytes)
        self.view = memoryview(self.buf)
        self.end = 0
        self.first_ns = 0
        self.deadline = float("inf")

    def handshake(self) -> list[tuple[bytes, str]]:
        """The commands that open the connection, each answered by a plain OK."""
        return [(nsq_client.identify(self.plan.identify), "IDENTIFY")]

    def open(self) -> None:
        """Connect and shake hands through the client (not hot), then read on the bare socket."""
        conn = nsq.Connection((self.plan.host, self.plan.port), connections.CONNECT_TIMEOUT_S)
        try:
            for command, what in self.handshake():
                conn.send(command)
                try:
                    conn.wait_for_ok(what)
                except tcp.Closed:
                    raise connections.ServerError(f"connection closed after {what}") from None
                except (nsq.ErrorFrame, nsq_client.FrameError, TimeoutError) as error:
                    raise connections.ServerError(str(error)) from None
        except BaseException:
            conn.close()
            raise
        sock, rest = conn.detach()
        self.sock = sock  # type: ignore[assignment]
        self.buf[: len(rest)] = rest
        self.end = len(rest)
        tcp.set_read_timeout(self.sock, connections.IDLE_POLL_S)

    def begin(self, start_mono: float) -> None:
        if self.spec.deadline_s is not None:
            self.deadline = start_mono + self.spec.deadline_s

    def _receive(self) -> int:
        """recv_into the free end of the buffer; returns 0 on the idle timeout."""
        try:
            n = self.sock.recv_into(self.view[self.end :])  # type: ignore[union-attr]
        except BlockingIOError:  # SO_RCVTIMEO expired
            return 0
        if not n:
            raise connections.ServerError("server closed the connection")
        self.end += n
        return n

    def _compact(self, pos: int) -> None:
        if pos:
            rest = self.end - pos
            if rest:
                self.buf[:rest] = self.buf[pos : self.end]
            self.end = rest

    def _error_frame(self, pos: int, nxt: int) -> None:
        text = bytes(self.buf[pos + 8 : nxt]).decode(errors="replace")
        raise connections.ServerError(text)

    def result(self) -> dict[str, Any]:
        return {**super().result(), "first_ns": self.first_ns}


class _Publisher(_Conn):
    """MPUB (batch > 1 or role mpub) or PUB, one command in flight, the next sent on its OK."""

    def __init__(self, spec: ConnSpec, plan: WorkerPlan, shared: common.SharedState) -> None:
        super().__init__(spec, plan, shared, PUBLISHER_RECV_BYTES)
        self.per_command = plan.batch if spec.role == "mpub" else 1
        self._pieces: dict[int, list[bytes]] = {}
        self.rtt = common.new_histogram()
        self.sent_at = 0
        self.in_flight = 0

    def _payload_pieces(self, n: int) -> list[bytes]:
        pieces = self._pieces.get(n)
        if pieces is None:
            body = _body(self.plan.size)
            if self.spec.role == "mpub":
                encoded = nsq_client.mpub(self.spec.topic, [body] * n)
            else:
                encoded = nsq_client.pub(self.spec.topic, body)
            pieces = self._pieces[n] = _stamped_pieces(encoded, n)
        return pieces

    def _send_next(self) -> None:
        n = self.per_command
        if self.spec.quota:
            n = min(n, self.spec.quota - self.count)
        pieces = self._payload_pieces(n)
        self.in_flight = n
        self.sent_at = time.perf_counter_ns()
        self.sock.sendall(STAMP.pack(time.time_ns()).join(pieces))  # type: ignore[union-attr]

    def begin(self, start_mono: float) -> None:
        super().begin(start_mono)
        self._send_next()

    def on_readable(self) -> None:
        if not self._receive():
            return self.on_idle()
        oks = 0
        if self.end == len(FRAME_OK) and self.buf[: self.end] == FRAME_OK:  # the usual case
            oks, self.end = 1, 0
        else:
            buf, end, pos = self.buf, self.end, 0
            while end - pos >= 8:
                size, frame_type = FRAME_HEAD.unpack_from(buf, pos)
                nxt = pos + 4 + size
                if nxt > end:
                    break
                if frame_type == FRAME_TYPE_RESPONSE:
                    data = bytes(buf[pos + 8 : nxt])
                    if data == OK:
                        oks += 1
                    elif data == HEARTBEAT:
                        self.sock.sendall(nsq_client.nop())  # type: ignore[union-attr]
                elif frame_type == FRAME_TYPE_ERROR:
                    self._error_frame(pos, nxt)
                pos = nxt
            self._compact(pos)
        if not oks:
            return
        now = time.perf_counter_ns()
        self.last_ns = time.time_ns()
        if not self.first_ns:
            self.first_ns = self.last_ns
        self.rtt[common.bucket_of((now - self.sent_at) // 1000)] += 1
        self.count += self.in_flight
        self.in_flight = 0
        self.shared.counters[self.slot] = self.count
        if (self.spec.quota and self.count >= self.spec.quota) or time.monotonic() >= self.deadline \
                or self.shared.stop.value:
            self.finish()
        else:
            self._send_next()

    def on_idle(self) -> None:
        if self.shared.stop.value:  # a stalled server: give up on the OK
            self.finish()

    def result(self) -> dict[str, Any]:
        out = super().result()
        out["rtt"] = common.sparse(self.rtt)
        return out


class _Consumer(_Conn):
    """SUB, RDY n, FIN everything; stops at the shared target, the deadline or the stop flag."""

    def __init__(self, spec: ConnSpec, plan: WorkerPlan, shared: common.SharedState) -> None:
        super().__init__(spec, plan, shared, CONSUMER_RECV_BYTES)
        self.latency = common.new_histogram()
        self.redelivered = 0
        self.fin_failed = 0
        self.consumer_slots = plan.consumer_slots

    def handshake(self) -> list[tuple[bytes, str]]:
        return [*super().handshake(), (nsq_client.sub(self.spec.topic, CHANNEL), "SUB")]

    def begin(self, start_mono: float) -> None:
        super().begin(start_mono)
        self.sock.sendall(nsq_client.rdy(self.plan.rdy))  # type: ignore[union-attr]

    def on_readable(self) -> None:
        if not self._receive():
            return self.on_idle()
        now = time.time_ns()
        buf, end, pos = self.buf, self.end, 0
        unpack_message = MESSAGE_HEAD.unpack_from
        ids: list[bytes] = []
        stamps: list[int] = []
        redelivered = 0
        # The hot loop: one unpack per message; the latencies are counted after it.
        while end - pos >= 8:
            if end - pos >= MESSAGE_HEAD.size:
                size, frame_type, _, attempts, msg_id, stamp = unpack_message(buf, pos)
            else:
                size, frame_type = FRAME_HEAD.unpack_from(buf, pos)
                attempts, msg_id, stamp = 0, b"", 0
            nxt = pos + 4 + size
            if nxt > end:
                break
            if frame_type == FRAME_TYPE_MESSAGE and size >= 4 + MESSAGE_OVERHEAD + MIN_SIZE:
                ids.append(msg_id)
                stamps.append(stamp)
                if attempts > 1:
                    redelivered += 1
            elif frame_type == FRAME_TYPE_RESPONSE:
                if bytes(buf[pos + 8 : nxt]) == HEARTBEAT:
                    self.sock.sendall(nsq_client.nop())  # type: ignore[union-attr]
            elif frame_type == FRAME_TYPE_ERROR:
                if bytes(buf[pos + 8 : pos + 8 + len(b"E_FIN_FAILED")]) == b"E_FIN_FAILED":
                    self.fin_failed += 1  # non-fatal (docs/protocols/nsq.md)
                else:
                    self._error_frame(pos, nxt)
            pos = nxt
        self._compact(pos)
        if ids:
            common.record_latencies(self.latency, now, stamps)
            # Same bytes as b"".join(nsq_client.fin(i) for i in ids), in one allocation.
            self.sock.sendall(b"FIN " + b"\nFIN ".join(ids) + b"\n")  # type: ignore[union-attr]
            self.count += len(ids)
            self.redelivered += redelivered
            self.last_ns = now
            if not self.first_ns:
                self.first_ns = now
            self.shared.counters[self.slot] = self.count
        self._check_stop()

    def _check_stop(self) -> None:
        if self.told_to_stop(self.consumer_slots) or time.monotonic() >= self.deadline:
            self.finish()

    def on_idle(self) -> None:
        self._check_stop()

    def result(self) -> dict[str, Any]:
        out = super().result()
        out.update(latency=common.sparse(self.latency), redelivered=self.redelivered, fin_failed=self.fin_failed)
        return out


def _open(spec: ConnSpec, plan: WorkerPlan, shared: common.SharedState) -> _Conn:
    conn = _Consumer(spec, plan, shared) if spec.role == "sub" else _Publisher(spec, plan, shared)
    conn.open()
    return conn


def _begin_and_read(conns: list[connections.Conn], start_mono: float) -> None:
    for conn in conns:
        conn.begin(start_mono)
    connections.read_until_finished(conns)


def _worker_main(plan: WorkerPlan, shared: common.SharedState, index: int) -> list[dict[str, Any]]:
    openers = [functools.partial(_open, spec, plan, shared) for spec in plan.conns]
    return connections.run_worker(shared, index, openers, _begin_and_read)


# --- parent side --------------------------------------------------------------------------


@attrs.frozen(slots=True)
class BenchOptions:
    host: str
    port: int
    http: tuple[str, int] | None
    scenarios: tuple[str, ...]
    duration_s: float | None  # None when --count is given
    count: int | None
    size: int
    batch: int
    rdy: int
    publishers: int
    consumers: int
    pub_consumers: int
    processes: int | None
    topic_prefix: str
    output_buffer_timeout_ms: int | None
    progress: bool
    server_pid: int | None = None
    # Each scenario's topic (and the consumers' channel) made through the HTTP API before it is timed, as a
    # direct client of a cluster makes its stream and consumer first: on a shared engine making one is a
    # replicated write of a tenth of a second or more, a quarter of a short measure.
    make_first: bool = False
    # Called as each measured scenario starts (after a `sub`'s unmeasured fill): a caller sampling something
    # over the measure (`polymq bench jetstream`'s servers' CPU) starts there.
    measure_starts: Callable[[], None] | None = None

    def identify(self, role: str) -> dict[str, Any]:
        data: dict[str, Any] = {"client_id": role, "hostname": socket.gethostname(), "user_agent": USER_AGENT}
        if self.output_buffer_timeout_ms is not None and role == "sub":
            data["output_buffer_timeout"] = self.output_buffer_timeout_ms
        return data


@attrs.define(slots=True)
class ScenarioResult:
    name: str
    topic: str
    publishers: int
    consumers: int
    processes: int
    published: int = 0
    consumed: int = 0
    expected: int = 0  # messages the consumers should have received
    pub_seconds: float = 0.0
    sub_seconds: float = 0.0
    latency: common.LatencySummary | None = None
    rtt: common.LatencySummary | None = None
    redelivered: int = 0
    fin_failed: int = 0
    stalled: bool = False
    # (user, system, run-queue wait) as shares of one core, from --server-pid
    server_cpu: tuple[float, float, float] | None = None

    def server_cpu_text(self) -> str:
        return common.cpu_text(self.server_cpu)

    def pub_rate(self) -> float:
        return self.published / self.pub_seconds if self.pub_seconds > 0 else 0.0

    def sub_rate(self) -> float:
        return self.consumed / self.sub_seconds if self.sub_seconds > 0 else 0.0

    def as_dict(self, size: int) -> dict[str, Any]:
        return {
            "scenario": self.name, "topic": self.topic, "publishers": self.publishers,
            "consumers": self.consumers, "processes": self.processes,
            "published": self.published, "consumed": self.consumed, "expected_consumed": self.expected,
            "pub_seconds": round(self.pub_seconds, 4), "sub_seconds": round(self.sub_seconds, 4),
            "pub_msgs_per_s": round(self.pub_rate(), 1), "sub_msgs_per_s": round(self.sub_rate(), 1),
            "pub_mb_per_s": round(common.mb_per_s(self.published, size, self.pub_seconds), 2),
            "sub_mb_per_s": round(common.mb_per_s(self.consumed, size, self.sub_seconds), 2),
            "deliver_latency_us": self.latency.as_dict() if self.latency else None,
            "pub_rtt_us": self.rtt.as_dict() if self.rtt else None,
            "redelivered": self.redelivered, "fin_failed": self.fin_failed, "stalled": self.stalled,
            **connections.cpu_fields(self.server_cpu),
        }


def _split(total: int, parts: int, unit: int) -> list[int]:
    """`total` messages over `parts` publishers, in whole commands of `unit` where possible."""
    commands, rest = divmod(total, unit)
    shares = [(commands // parts + (1 if i < commands % parts else 0)) * unit for i in range(parts)]
    shares[-1] += rest
    return shares


class _Scenario:
    """Runs one scenario's worker processes and turns their results into a ScenarioResult."""

    def __init__(self, name: str, label: str, opts: BenchOptions, topic: str, *, mpub: int, pub: int, sub: int,
                 pub_count: int | None, sub_target: int | None, sub_deadline: bool) -> None:
        self.name = name
        self.label = label
        self.opts = opts
        self.topic = topic
        deadline = opts.duration_s
        specs: list[ConnSpec] = []
        n_pubs = mpub + pub
        if n_pubs:
            role, unit = ("mpub", opts.batch) if mpub else ("pub", 1)
            quotas = _split(pub_count, n_pubs, unit) if pub_count is not None else [0] * n_pubs
            if pub_count is not None:
                # A quota of 0 means "until the deadline": a count smaller than the publishers' batches
                # leaves some with nothing to publish, and they do not start.
                quotas = [quota for quota in quotas if quota]
                n_pubs = len(quotas)
            specs += [ConnSpec(role, i, topic, q, None if pub_count is not None else deadline)
                      for i, q in enumerate(quotas)]
        specs += [ConnSpec("sub", n_pubs + i, topic, 0, deadline if sub_deadline else None) for i in range(sub)]
        self.specs = specs
        self.pub_slots = tuple(range(n_pubs))
        self.sub_slots = tuple(range(n_pubs, n_pubs + sub))
        self.pub_total = pub_count or 0
        self.sub_target = sub_target
        processes = max(1, min(opts.processes or len(specs), len(specs)))
        self.plans = [
            WorkerPlan(opts.host, opts.port, opts.size, self.sub_slots, tuple(group), batch=opts.batch, rdy=opts.rdy,
                       identify=opts.identify("sub" if any(s.role == "sub" for s in group) else "pub"))
            for group in connections.spread(specs, processes)
        ]
        self.result = ScenarioResult(name, topic, n_pubs, sub, processes)
        self.progress = common.Progress(enabled=None if opts.progress else False)
        self.watch = common.RunWatch(opts.server_pid)
        self._pubs_done_at: float | None = None

    def run(self) -> ScenarioResult:
        target = self.sub_target if self.sub_target is not None else -1
        group = common.WorkerGroup(_worker_main, self.plans, len(self.specs), target=target)
        self._collect(*connections.run_scenario(self.name, group, self._tick, self.progress))
        self.result.server_cpu = self.watch.cpu_share(
            max(self.result.pub_seconds, self.result.sub_seconds, self.watch.elapsed()))
        return self.result

    def _tick(self, shared: common.SharedState) -> None:
        now = time.monotonic()
        published = sum(shared.counters[s] for s in self.pub_slots)
        consumed = sum(shared.counters[s] for s in self.sub_slots)
        # Duration mode with publishers: the consumers' target is what was published.
        if self.sub_slots and shared.target.value < 0 and all(shared.done[s] for s in self.pub_slots):
            shared.target.value = published
            self._pubs_done_at = now
        total = published + consumed
        elapsed, still = self.watch.tick(total)
        # The drain deadline counts only while nothing moves (`still` is 0 on a tick that saw progress).
        if still > connections.STALL_TIMEOUT_S or (still and self._pubs_done_at is not None
                                       and now - self._pubs_done_at > DRAIN_TIMEOUT_S):
            self.result.stalled = True
            shared.stop.value = 1
        if self.opts.duration_s is not None and self.pub_slots:
            fraction = elapsed / self.opts.duration_s
        else:
            want = self.pub_total + max(shared.target.value, 0)
            fraction = total / want if want else elapsed / (self.opts.duration_s or 1)
        parts = []
        if self.pub_slots:
            parts.append(f"pub {published:,} ({published / elapsed if elapsed else 0:,.0f}/s)")
        if self.sub_slots:
            parts.append(f"sub {consumed:,} ({consumed / elapsed if elapsed else 0:,.0f}/s)")
        self.progress.update(self.label, fraction, "  ".join(parts))

    def _collect(self, start_ns: int, conns: list[dict[str, Any]]) -> None:
        r = self.result
        pubs = [c for c in conns if c["role"] != "sub"]
        subs = [c for c in conns if c["role"] == "sub"]
        r.published = sum(c["messages"] for c in pubs)
        r.consumed = sum(c["messages"] for c in subs)
        r.expected = self.sub_target if self.sub_target is not None else (r.published if subs else 0)
        if pubs:
            r.pub_seconds = max(0.0, (max(c["last_ns"] for c in pubs) - start_ns) / 1e9)
            r.rtt = common.summarize(common.merge(c["rtt"] for c in pubs))
        if subs:
            r.sub_seconds = max(0.0, (max(c["last_ns"] for c in subs) - start_ns) / 1e9)
            r.latency = common.summarize(common.merge(c["latency"] for c in subs))
            r.redelivered = sum(c["redelivered"] for c in subs)
            r.fin_failed = sum(c["fin_failed"] for c in subs)


def _http_post(http: tuple[str, int] | None, path: str, **params: str) -> None:
    """Best-effort nsqd HTTP API call (topic clean-up); a missing endpoint is not an error."""
    if http is None:
        return
    url = f"http://{http[0]}:{http[1]}{path}?{urllib.parse.urlencode(params)}"
    with contextlib.suppress(urllib.error.URLError, OSError):
        urllib.request.urlopen(urllib.request.Request(url, data=b"", method="POST"), timeout=10).read()


def run_bench(opts: BenchOptions) -> list[ScenarioResult]:
    run_id = uuid.uuid4().hex[:8]
    results: list[ScenarioResult] = []
    count = opts.count
    backlog: tuple[str, int] | None = None  # (topic, messages) left by mpub for sub

    def topic_for(name: str) -> str:
        return f"{opts.topic_prefix}_{name}_{run_id}"

    def made(topic: str, channel: str | None = None) -> str:
        if opts.make_first:
            _http_post(opts.http, "/topic/create", topic=topic)
            if channel is not None:
                _http_post(opts.http, "/channel/create", topic=topic, channel=channel)
        return topic

    def mpub_phase(name: str, label: str) -> ScenarioResult:
        return _Scenario(name, label, opts, made(topic_for("mpub")), mpub=opts.publishers, pub=0, sub=0,
                         pub_count=count, sub_target=None, sub_deadline=False).run()

    def measure_starts() -> None:
        if opts.measure_starts is not None:
            opts.measure_starts()

    for name in opts.scenarios:
        if name == "mpub":
            measure_starts()
            result = mpub_phase("mpub", "mpub")
            backlog = (result.topic, result.published)
        elif name == "sub":
            if backlog is None:  # sub alone: fill the topic first, unmeasured
                filled = mpub_phase("mpub", "prefill")
                backlog = (filled.topic, filled.published)
            measure_starts()
            result = _Scenario("sub", "sub", opts, made(backlog[0], CHANNEL), mpub=0, pub=0, sub=opts.consumers,
                               pub_count=None, sub_target=backlog[1], sub_deadline=opts.duration_s is not None).run()
            _http_post(opts.http, "/topic/delete", topic=backlog[0])
            backlog = None
        elif name == "pub":
            measure_starts()
            result = _Scenario("pub", "pub", opts, made(topic_for("pub")), mpub=0, pub=opts.publishers,
                               sub=opts.pub_consumers, pub_count=count,
                               sub_target=count if opts.pub_consumers else None, sub_deadline=False).run()
            _http_post(opts.http, "/topic/delete", topic=result.topic)
        else:
            measure_starts()
            result = _Scenario("pubsub", "pubsub", opts, made(topic_for("pubsub"), CHANNEL), mpub=opts.publishers,
                               pub=0, sub=opts.consumers, pub_count=count, sub_target=count, sub_deadline=False).run()
            _http_post(opts.http, "/topic/delete", topic=result.topic)
        results.append(result)
    if backlog is not None:  # mpub ran without sub after it
        _http_post(opts.http, "/topic/delete", topic=backlog[0])
    return results


def render(opts: BenchOptions, results: list[ScenarioResult]) -> str:
    headers = ["scenario", "conns", "published", "pub msgs/s", "pub MB/s", "consumed", "sub msgs/s", "sub MB/s",
               "deliver p50 / p99", "PUB rtt p50 / p99"]
    if opts.server_pid:
        headers.append("server CPU (usr+sys) + run-queue wait")
    rows = []
    notes = []
    for r in results:
        conns = " + ".join(p for p in (f"{r.publishers} pub" if r.publishers else "",
                                        f"{r.consumers} sub" if r.consumers else "") if p)
        consumed = common.format_count(r.consumed) if r.consumers else "-"
        if r.consumers and r.consumed != r.expected:
            consumed += f" of {r.expected:,}"
        latency = common.format_latency(r.latency)
        if r.name == "sub" and r.latency is not None:
            latency += " *"
        rows.append([
            r.name, conns,
            common.format_count(r.published) if r.publishers else "-",
            common.format_count(r.pub_rate()) if r.publishers else "-",
            f"{common.mb_per_s(r.published, opts.size, r.pub_seconds):.1f}" if r.publishers else "-",
            consumed,
            common.format_count(r.sub_rate()) if r.consumers else "-",
            f"{common.mb_per_s(r.consumed, opts.size, r.sub_seconds):.1f}" if r.consumers else "-",
            latency,
            common.format_latency(r.rtt) if r.name == "pub" else "-",
        ])
        if opts.server_pid:
            rows[-1].append(r.server_cpu_text())
        if r.stalled:
            notes.append(connections.stalled_note(r.name))
        if r.redelivered or r.fin_failed:
            notes.append(f"{r.name}: {r.redelivered:,} redeliveries, {r.fin_failed:,} E_FIN_FAILED")
    if any(r.name == "sub" and r.latency for r in results):
        notes.append("* sub latency is the age of the backlog (published before the consumers started)")
    mode = f"{opts.count:,} messages" if opts.count is not None else f"{opts.duration_s:g} s"
    head = (f"polymq bench nsq  {opts.host}:{opts.port}  {opts.size}-byte messages, MPUB batch {opts.batch}, "
            f"RDY {opts.rdy}, {mode} per scenario  (MB = 2^20 bytes, like nsq's bench tools)")
    return "\n".join([head, "", common.render_table(headers, rows), *(["", *notes] if notes else [])])


@click.command()
@click.option("--tcp", "tcp", required=True, callback=connections.address_option, metavar="HOST:PORT",
              help="NSQ V2 TCP address of the server (nsqd: 4150).")
@click.option("--http", "http", default=None, callback=connections.address_option, metavar="HOST:PORT",
              help="nsqd HTTP API address; when given, the bench deletes its topics afterwards.")
@click.option("--scenario", "scenarios", multiple=True, type=click.Choice([*SCENARIOS, "all"]),
              help="Scenario to run (repeatable; default all: mpub, sub, pub, pubsub).")
@click.option("--duration", type=float, default=None,
              help=f"Seconds per scenario (default {DEFAULT_DURATION_S:g}): publishing, or for sub consuming "
                   "what mpub left (with --count, sub consumes all of it).")
@click.option("--count", type=int, default=None, help="Messages per scenario instead of a duration.")
@click.option("--size", type=int, default=DEFAULT_SIZE, show_default=True, help="Message body bytes.")
@click.option("--batch", type=int, default=DEFAULT_BATCH, show_default=True, help="Messages per MPUB.")
@click.option("--rdy", type=int, default=DEFAULT_RDY, show_default=True, help="RDY count of each consumer.")
@click.option("--publishers", type=int, default=DEFAULT_PUBLISHERS, show_default=True,
              help="Publishing connections.")
@click.option("--consumers", type=int, default=DEFAULT_CONSUMERS, show_default=True,
              help="Consuming connections (sub, pubsub).")
@click.option("--pub-consumers", type=int, default=1, show_default=True,
              help="Consumers attached during the pub scenario (0 = publish only, like bench_writer).")
@click.option("--processes", type=int, default=None,
              help="Worker processes to spread the connections over (default: one per connection).")
@click.option("--topic", "topic_prefix", default=DEFAULT_TOPIC_PREFIX, show_default=True,
              help="Topic name prefix (each scenario uses a fresh topic).")
@click.option("--output-buffer-timeout", type=int, default=None, metavar="MS",
              help="IDENTIFY output_buffer_timeout for consumers (default: the server's, 250 ms in nsqd).")
@common.report_options
def command(tcp: tuple[str, int], http: tuple[str, int] | None, scenarios: tuple[str, ...], duration: float | None,
            count: int | None, size: int, batch: int, rdy: int, publishers: int, consumers: int, pub_consumers: int,
            processes: int | None, topic_prefix: str, output_buffer_timeout: int | None, server_pid: int | None,
            as_json: bool, progress: bool) -> None:
    """Benchmark an nsqd-compatible server (polymq or nsqd) like nsq's bench_writer/bench_reader.

    Reports msgs/s and MB/s of publishing and consuming, publish-to-deliver latency (p50/p99,
    from a send timestamp in each body) and, for PUB, the round-trip time.
    """
    if count is not None and duration is not None:
        raise click.UsageError("give --count or --duration, not both")
    if count is not None and count < 1:
        raise click.BadParameter("must be at least 1", param_hint="--count")
    if not MIN_SIZE <= size <= MAX_MSG_SIZE:
        raise click.BadParameter(f"must be {MIN_SIZE}..{MAX_MSG_SIZE} (the body holds an 8-byte timestamp)",
                                 param_hint="--size")
    if batch < 1 or 4 + batch * (4 + size) > MAX_BODY_SIZE:
        raise click.BadParameter(f"batch * (size + 4) must fit nsqd's {MAX_BODY_SIZE}-byte MPUB body",
                                 param_hint="--batch")
    if publishers < 1 or consumers < 1 or pub_consumers < 0:
        raise click.BadParameter("need at least one publisher and one consumer")
    chosen = common.chosen_scenarios(scenarios, SCENARIOS)
    opts = BenchOptions(
        host=tcp[0], port=tcp[1], http=http, scenarios=chosen,
        duration_s=None if count is not None else (duration or DEFAULT_DURATION_S), count=count,
        size=size, batch=batch, rdy=rdy, publishers=publishers, consumers=consumers, pub_consumers=pub_consumers,
        processes=processes, topic_prefix=topic_prefix, output_buffer_timeout_ms=output_buffer_timeout,
        progress=progress and not as_json, server_pid=server_pid,
    )
    results = run_bench(opts)
    if as_json:
        click.echo(json.dumps({
            "server": f"{opts.host}:{opts.port}", "size": size, "batch": batch, "rdy": rdy,
            "duration_s": opts.duration_s, "count": count, "scenarios": [r.as_dict(size) for r in results],
        }, indent=2))
    else:
        click.echo(render(opts, results))
    if any(r.stalled for r in results):
        sys.exit(1)
