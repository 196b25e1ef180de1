"""One run: the gateway on a store the run owns, every protocol's clients at once, SIGKILLs at
random moments with a restart on the same store, then a drain and the check of the records.

With `jetstream`, the run starts three nats-servers and two gateways sharing their queues through
them; each client keeps to one gateway, and the SIGKILLs fall on gateways and servers alike. With
`partitions` too, every link (server to server, gateway to server) goes through a proxy the run owns
(`clients.link_proxy`), and the faults include a server cut off from everything (held silent, reset at the
heal), a server paused (SIGSTOP, SIGCONT) and a gateway paused. Throughout, a queue that delivers nothing
for `STALL_BOUND_S` while acknowledged copies wait for it is a finding."""

from __future__ import annotations

import os
import random
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import attrs

from polymq.clients.nats_servers import NatsCluster, NatsServerError
from polymq.torture import emqp, mqks, nsq, phpmq, pzq
from polymq.torture.gateway import GatewayDidNotStart
from polymq.torture.ledger import Ledger, Report
from polymq.torture.topology import PROTOCOLS, SINKS, Sink
from polymq.torture.worker import Gateways, Run, Settings, percentile

CLIENTS: dict[str, tuple[Callable[[Run, int], threading.Thread], Callable[[Run, Sink, int], threading.Thread]]] = {
    "nsq": (nsq.publisher, nsq.consumer),
    "mqks": (mqks.publisher, mqks.consumer),
    "phpmq": (phpmq.publisher, phpmq.consumer),
    "pzq": (pzq.publisher, pzq.consumer),
    "emqp": (emqp.publisher, emqp.consumer),
}

# The gateway's options in a run: PZQ's queue is the run's; deliveries held by a live consumer never
# time out within a run (a crashed one's come back with the next process life or the final one).
PZQ_ACK_TIMEOUT_MS = 600_000
GATEWAY_ARGS = (
    "--pzq-queue", "torture_pzq",
    "--pzq-ack-timeout", str(PZQ_ACK_TIMEOUT_MS),
    "--emqp-heartbeat-timeout", str(emqp.HEARTBEAT_TIMEOUT_MS),
)
JOIN_S = 30.0  # a client thread ends within its socket timeout and a poll

# With `jetstream`: servers and gateways in a run (the smallest cluster that survives losing one
# server, and two nodes so that every queue has consumers on both).
JETSTREAM_SERVERS = 3
JETSTREAM_GATEWAYS = 2
# JetStream's ack wait in a run: what a SIGKILLed gateway held goes to the other one after it, so the
# drain waits seconds, not the minute of the default.
JETSTREAM_ACK_WAIT_S = 10.0
# With `partitions`: how long a server stays cut off, and a server or gateway paused (s).
CUT_S = (8.0, 20.0)
PAUSE_S = (5.0, 15.0)
# A queue delivering nothing this long while acknowledged copies wait is stalled: the longest fault (20 s),
# a silent link noticed (6 s), its lost pull requests let go (7 s), and the ack wait (10 s) of what a paused
# or cut-off node held, with room for an election.
STALL_BOUND_S = 60.0
STALL_CHECK_S = 1.0


@attrs.define(slots=True)
class Options:
    duration_s: float = 30.0
    seed: int = 0
    data_dir: Path | None = None  # None: a temporary folder, removed afterwards
    kill_min_s: float = 2.0  # a process life lasts uniform(kill_min_s, kill_max_s) before its SIGKILL
    kill_max_s: float = 6.0
    kills: bool = True
    chaos: bool = True
    drain_timeout_s: float = 180.0
    idle_timeout_s: float = 60.0  # the drain gives up after this long without any delivery
    settle_s: float = 1.0  # everything acknowledged delivered: this quiet long for the stragglers
    gateway_args: tuple[str, ...] = ()
    settings: Settings = attrs.Factory(Settings)
    jetstream: bool = False  # three nats-servers and two gateways on them, both kinds SIGKILLed
    partitions: bool = False  # with jetstream: every link through a proxy; cuts and pauses among the faults


@attrs.frozen(slots=True)
class Rates:
    """What each protocol got while the clients ran (the measured window, without the drain)."""

    seconds: float
    acked: dict[str, int]
    delivered: dict[str, int]
    ack_p50_ms: dict[str, float]
    ack_p99_ms: dict[str, float]

    def lines(self) -> list[str]:
        return [
            f"rate {protocol}: acked_per_s={self.acked[protocol] / self.seconds:.0f}"
            f" delivered_per_s={self.delivered[protocol] / self.seconds:.0f}"
            f" ack_p50_ms={self.ack_p50_ms[protocol]:.1f} ack_p99_ms={self.ack_p99_ms[protocol]:.1f}"
            for protocol in PROTOCOLS
        ]


@attrs.frozen(slots=True)
class Result:
    report: Report
    rates: Rates
    starts: int
    elapsed_s: float
    drained: bool


def run_torture(options: Options, progress: Callable[[str], None] = lambda _: None) -> Result:
    started = time.monotonic()
    own_dir = None
    data_dir = options.data_dir
    if data_dir is None:
        own_dir = data_dir = Path(tempfile.mkdtemp(prefix="polymq-torture-"))
    ledger = Ledger()
    ledger.refusals_allowed = options.jetstream
    ledger.late_acks_allowed = options.partitions
    # The eMQP workers are jobmanagers of `emqp_slots` processes: the gateway is told so.
    worker_processes = ("--emqp-worker-processes", str(options.settings.emqp_slots))
    args = (*GATEWAY_ARGS, *worker_processes, *options.gateway_args)
    cluster: NatsCluster | None = None
    data_dirs = [data_dir]
    if options.jetstream:
        cluster = NatsCluster(data_dir / "nats", JETSTREAM_SERVERS, proxied=options.partitions)
        data_dirs = [data_dir / f"gateway-{slot + 1}" for slot in range(JETSTREAM_GATEWAYS)]
        args = (*args, "--jetstream", ",".join(cluster.urls), "--jetstream-ack-wait", f"{JETSTREAM_ACK_WAIT_S:g}")
    gateways = Gateways(data_dirs, args, ledger)
    run = Run(options.settings, gateways, ledger, options.seed)
    rng = random.Random(options.seed)
    publishers: list[threading.Thread] = []
    consumers: list[threading.Thread] = []
    drained = False
    measure_start = time.monotonic()
    rates: Rates | None = None
    try:
        if cluster is not None:
            cluster.start()
            cluster.wait_ready()
        gateways.start()
        bound = [sink for sink in SINKS.values() if sink.bound_over_mqks]
        current = gateways.current(0, JOIN_S)
        if bound and current is not None:
            mqks.bind_over_mqks(current[1], bound)
        run.consuming.set()
        for sink in SINKS.values():
            consumers += [CLIENTS[sink.protocol][1](run, sink, index) for index in range(options.settings.consumers)]
        # Every sink exists before the first publish (an MQKS publish to an event without a queue
        # is dropped, and a channel made later would miss what came before it).
        _wait_for(lambda: _sinks_ready(ledger, len(SINKS) * options.settings.consumers), 60.0)
        if options.chaos:
            run.chaos.set()
        with ledger.lock:
            ledger.measuring = True
        measure_start = time.monotonic()
        watch = threading.Thread(target=_watch_stalls, args=(ledger, run, progress), name="stall-watch",
                                 daemon=True)
        watch.start()
        run.publishing.set()
        for protocol in PROTOCOLS:
            publishers += [CLIENTS[protocol][0](run, index) for index in range(options.settings.publishers)]
        end = measure_start + options.duration_s
        while (now := time.monotonic()) < end:
            life = rng.uniform(options.kill_min_s, options.kill_max_s)
            if not options.kills or now + life >= end:
                time.sleep(end - now)
                break
            time.sleep(life)
            if options.partitions and cluster is not None and rng.random() < 0.6:
                _fault_one(rng, gateways, cluster, ledger, life, progress)
            else:
                _kill_one(rng, gateways, cluster, ledger, life, progress)
        run.publishing.clear()
        measured = time.monotonic() - measure_start
        with ledger.lock:
            ledger.measuring = False
        _join(publishers, ledger)
        rates = _rates(ledger, measured)
        run.chaos.clear()
        # A last restart (SIGKILL, or a clean stop with --no-kills): what crashed consumers held comes
        # back with the last process life (PZQ's and eMQP's peers are not seen to go).
        if options.kills:
            for slot in range(gateways.slots):
                generation = gateways.kill(slot)
                progress(f"SIGKILL: process life {generation}, then the drain")
        else:
            gateways.stop()
        if cluster is not None:
            cluster.wait_ready()
        gateways.start()
        drained = _drain(ledger, options)
        run.consuming.clear()
        _join(consumers, ledger)
        gateways.stop()
    except GatewayDidNotStart:
        pass  # recorded: the run ends here, its report says so
    except (TimeoutError, NatsServerError) as error:
        ledger.record_error(str(error))
    finally:
        run.publishing.clear()
        run.consuming.clear()
        gateways.stop()
        for thread in publishers + consumers:
            thread.join(JOIN_S)  # at once after a run that went its way
        if cluster is not None:
            cluster.stop()
            cluster.close_proxies()
        if own_dir is not None:
            shutil.rmtree(own_dir, ignore_errors=True)
    if rates is None:
        rates = _rates(ledger, time.monotonic() - measure_start)
    return Result(ledger.check(), rates, gateways.starts, time.monotonic() - started, drained)


def _kill_one(rng: random.Random, gateways: Gateways, cluster: NatsCluster | None, ledger: Ledger, life: float,
              progress: Callable[[str], None]) -> None:
    """SIGKILL a gateway or, with a cluster, one of its servers (as likely), and start it again at once
    on its own store."""
    if cluster is not None and rng.random() < 0.5:
        server = rng.choice(cluster.servers)
        server.kill()
        ledger.record_server_kill()
        progress(f"SIGKILL: nats-server {server.name} after {life:.1f} s")
        server.start()
        return
    slot = rng.randrange(gateways.slots)
    generation = gateways.kill(slot)
    progress(f"SIGKILL: process life {generation} after {life:.1f} s")
    gateways.start(slot)


def _fault_one(rng: random.Random, gateways: Gateways, cluster: NatsCluster, ledger: Ledger, life: float,
               progress: Callable[[str], None]) -> None:
    """A fault quieter than a kill, then its end: a server cut off from the others and from every gateway,
    a server paused, or a gateway paused."""
    kind = rng.choice(("cut", "server-pause", "gateway-pause"))
    if kind == "gateway-pause":
        slot = rng.randrange(gateways.slots)
        current = gateways.current(slot, JOIN_S)
        if current is None:
            return
        generation, process = current
        duration = rng.uniform(*PAUSE_S)
        progress(f"SIGSTOP: process life {generation} for {duration:.1f} s after {life:.1f} s")
        ledger.record_fault()
        os.kill(process.process.pid, signal.SIGSTOP)
        try:
            time.sleep(duration)
        finally:
            os.kill(process.process.pid, signal.SIGCONT)
        ledger.record_fault()
        return
    server = rng.choice(cluster.servers)
    if kind == "cut":
        duration = rng.uniform(*CUT_S)
        progress(f"cut off: nats-server {server.name} for {duration:.1f} s after {life:.1f} s")
        ledger.record_fault()
        cluster.cut_off(server)
        try:
            time.sleep(duration)
        finally:
            cluster.heal(server)
        ledger.record_fault()
        return
    duration = rng.uniform(*PAUSE_S)
    pid = server.pid
    if pid is None:
        return
    progress(f"SIGSTOP: nats-server {server.name} for {duration:.1f} s after {life:.1f} s")
    ledger.record_fault()
    os.kill(pid, signal.SIGSTOP)
    try:
        time.sleep(duration)
    finally:
        os.kill(pid, signal.SIGCONT)
    ledger.record_fault()


def _watch_stalls(ledger: Ledger, run: Run, progress: Callable[[str], None]) -> None:
    """While the run publishes: a queue delivering nothing past STALL_BOUND_S is said at once."""
    run.publishing.wait()
    while run.publishing.is_set():
        for stall in ledger.watch_stalls(STALL_BOUND_S):
            progress(stall)
        time.sleep(STALL_CHECK_S)


def _sinks_ready(ledger: Ledger, sessions: int) -> bool:
    """Each consumer thread has had a session running long enough to have made its queue."""
    with ledger.lock:
        return len(ledger.subscribed) >= sessions


def _wait_for(condition: Callable[[], bool], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError("the consumers did not subscribe in time")
        time.sleep(0.05)


def _drain(ledger: Ledger, options: Options) -> bool:
    """Wait until every acknowledged copy was delivered and nothing more came for a while; False
    when the drain gave up (nothing came for `idle_timeout_s`, or `drain_timeout_s` passed)."""
    start = last_change = time.monotonic()
    last_count = -1
    while True:
        now = time.monotonic()
        count, missing = ledger.progress()
        if count != last_count:
            last_count, last_change = count, now
        quiet = now - last_change
        if missing == 0 and quiet >= options.settle_s:
            return True
        if quiet >= options.idle_timeout_s or now - start >= options.drain_timeout_s:
            return False
        time.sleep(0.05)


def _join(threads: list[threading.Thread], ledger: Ledger) -> None:
    for thread in threads:
        thread.join(JOIN_S)
        if thread.is_alive():
            ledger.record_error(f"{thread.name} did not end")


def _rates(ledger: Ledger, seconds: float) -> Rates:
    with ledger.lock:
        latencies = {protocol: sorted(ledger.ack_latencies[protocol]) for protocol in PROTOCOLS}
        return Rates(
            seconds=max(seconds, 1e-9),
            acked={protocol: ledger.acked_in_window[protocol] for protocol in PROTOCOLS},
            delivered={protocol: ledger.delivered_in_window[protocol] for protocol in PROTOCOLS},
            ack_p50_ms={protocol: percentile(latencies[protocol], 0.50) * 1000 for protocol in PROTOCOLS},
            ack_p99_ms={protocol: percentile(latencies[protocol], 0.99) * 1000 for protocol in PROTOCOLS},
        )
