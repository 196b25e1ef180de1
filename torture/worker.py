"""What every client thread of a run shares: the gateway of the moment, the records, the random
moments of chaos, and the loop that reconnects a client to whichever gateway process is up.
"""

from __future__ import annotations

import itertools
import random
import signal
import statistics
import threading
import traceback
from collections.abc import Callable
from pathlib import Path

import attrs
import zmq

from polymq.clients import tcp
from polymq.torture.bodies import BodyId, make_body
from polymq.torture.gateway import GatewayDidNotStart, GatewayProcess, start_gateway
from polymq.torture.ledger import Ledger
from polymq.torture.topology import FLOWS, Flow, flows_of

# Any one socket operation; a live gateway this slow on a loaded 2-core machine is still treated
# as alive (the session ends and reconnects, and what it held counts as in flight).
IO_TIMEOUT_S = 10.0
# A start of the gateway on a store full of a run's records, on a loaded 2-core machine: far below.
START_TIMEOUT_S = 60.0
# How often a waiting client looks whether its gateway is still the current one.
POLL_S = 0.1


@attrs.define(slots=True)
class Settings:
    publishers: int = 1  # publisher threads per protocol
    consumers: int = 2  # consumer threads per sink
    window: int = 8  # publishes awaiting their confirmation per publisher
    max_batch: int = 20  # bodies per batched publish (NSQ MPUB, PHPMQ's batch before its barrier)
    max_backlog: int = 2000  # a flow's publishers pause while it has this many copies undelivered
    requeue_p: float = 0.03  # per delivery: send it back (NSQ REQ, MQKS reject, PHPMQ 005, PZQ ACK 0)
    crash_p: float = 0.003  # per delivery: the consumer goes away holding it unacknowledged
    disconnect_p: float = 0.003  # per delivery or publish: the client closes its connection
    emqp_slots: int = 1  # READYs an eMQP worker sends when it joins (torture/emqp.py says why 1)
    flood: str | None = None  # the protocol whose publishers flood (no pause, no window, big batches)
    flood_window: int = 64
    flood_batch: int = 100
    # The flood's own pause: far above max_backlog, so its queue stays deep all along, yet bounded, so
    # that the drain after it takes seconds rather than hours.
    flood_backlog: int = 50_000


class Gateways:
    """The gateway processes of the moment, one per slot, each on its own store: started, SIGKILLed and
    started again. A process life is a *generation*, numbered across the slots; each client thread
    keeps to one slot (given round-robin), so with two slots a queue's consumers sit on both nodes."""

    def __init__(self, data_dirs: list[Path], args: tuple[str, ...], ledger: Ledger) -> None:
        self.data_dirs = data_dirs
        self.args = args
        self.ledger = ledger
        self.generation = 0  # the newest process life, of any slot
        self.starts = 0
        self._gateways: list[GatewayProcess | None] = [None] * len(data_dirs)
        self._generations = [0] * len(data_dirs)
        self._assigned = itertools.count()
        self._changed = threading.Condition()

    @property
    def slots(self) -> int:
        return len(self._gateways)

    def assign(self) -> int:
        """The slot of a new client thread."""
        with self._changed:
            return next(self._assigned) % self.slots

    def start(self, slot: int | None = None) -> None:
        """Start the slot's gateway (every slot's when None)."""
        for index in range(self.slots) if slot is None else (slot,):
            try:
                gateway = start_gateway(self.data_dirs[index], self.args, ready_timeout=START_TIMEOUT_S)
            except GatewayDidNotStart as error:
                self.ledger.record_error(str(error))
                raise
            with self._changed:
                self.generation += 1
                self.starts += 1
                self._gateways[index] = gateway
                self._generations[index] = self.generation
                self._changed.notify_all()

    def kill(self, slot: int = 0) -> int:
        """SIGKILL the slot's process (by its PID); a process that had died on its own is a finding.
        Returns the generation it ended."""
        with self._changed:
            gateway, generation = self._gateways[slot], self._generations[slot]
            self._gateways[slot] = None
            self._changed.notify_all()
        if gateway is None:
            return generation
        code = gateway.process.poll()
        if code is not None:
            log = "\n".join(gateway.log_lines[-60:])
            self.ledger.record_error(f"the gateway exited on its own (code {code}):\n{log}")
        gateway.stop(signal.SIGKILL)
        self.ledger.record_kill(generation)
        self.ledger.record_restart(generation)
        return generation

    def stop(self) -> None:
        """Stop every slot's process (SIGTERM)."""
        for slot in range(self.slots):
            with self._changed:
                gateway, generation = self._gateways[slot], self._generations[slot]
                self._gateways[slot] = None
                self._changed.notify_all()
            if gateway is None:
                continue
            self.ledger.record_restart(generation)
            code = gateway.process.poll()
            if code is not None:
                self.ledger.record_error(f"the gateway exited on its own (code {code})")
            gateway.stop()

    def current(self, slot: int, timeout: float) -> tuple[int, GatewayProcess] | None:
        with self._changed:
            if self._gateways[slot] is None:
                self._changed.wait(timeout)
            gateway = self._gateways[slot]
            return None if gateway is None else (self._generations[slot], gateway)

    def alive(self, generation: int) -> bool:
        gateways, generations = self._gateways, self._generations
        return any(gateways[slot] is not None and generations[slot] == generation for slot in range(self.slots))

    def wait_for_change(self, generation: int, timeout: float) -> None:
        with self._changed:
            if self.alive(generation):
                self._changed.wait(timeout)


class Run:
    """The shared state of one run, handed to every client thread."""

    def __init__(self, settings: Settings, gateways: Gateways, ledger: Ledger, seed: int) -> None:
        self.settings = settings
        self.gateways = gateways
        self.ledger = ledger
        self.rng = random.Random(seed)
        self.publishing = threading.Event()  # set while publishers publish
        self.consuming = threading.Event()  # set while consumers consume
        self.chaos = threading.Event()  # set while clients disconnect, crash and requeue at random
        self._sequences = {flow.index: itertools.count() for flow in FLOWS}
        self._lock = threading.Lock()

    def worker_rng(self) -> random.Random:
        with self._lock:
            return random.Random(self.rng.getrandbits(64))

    def bodies(self, flow: Flow, count: int, rng: random.Random) -> list[tuple[bytes, bytes]]:
        """`count` new (key, body) pairs of `flow`, recorded as sent (before the write: a kill may
        come in the middle of it)."""
        with self._lock:
            seqs = [next(self._sequences[flow.index]) for _ in range(count)]
        made = [(BodyId(flow.index, seq), make_body(flow.index, seq, rng)) for seq in seqs]
        self.ledger.record_sent([(body_id.key, body_id) for body_id, _ in made])
        return [(body_id.key, body) for body_id, body in made]

    def flooding(self, protocol: str) -> bool:
        return self.settings.flood == protocol

    def throttled(self, flow: Flow) -> bool:
        limit = self.settings.flood_backlog if self.flooding(flow.publisher) else self.settings.max_backlog
        return self.ledger.backlog(flow.index) > limit

    def flows(self, protocol: str) -> tuple[Flow, ...]:
        """The flows a publisher of `protocol` writes to: a flood goes to its protocol's own topic only."""
        flows = flows_of(protocol)
        return flows[:1] if self.flooding(protocol) else flows

    def window(self, protocol: str) -> int:
        return self.settings.flood_window if self.flooding(protocol) else self.settings.window

    def batch(self, protocol: str, rng: random.Random) -> int:
        return self.settings.flood_batch if self.flooding(protocol) else rng.randint(1, self.settings.max_batch)

    def roll(self, rng: random.Random, probability: float) -> bool:
        return self.chaos.is_set() and rng.random() < probability


# The end of a connection as the clients see it: a reset, EOF, a timeout, a ZeroMQ error.
CONNECTION_ERRORS = (OSError, tcp.Closed, TimeoutError, zmq.ZMQError)


class Refused(Exception):
    """The gateway answered a subscription with the protocol's error where the cluster under it may not
    answer in time (a server cut off or paused: `Ledger.refusals_allowed`): the session ends and is made
    again, as after a disconnect."""


def client_thread(run: Run, name: str, session: Callable[[GatewayProcess, int], None],
                  running: threading.Event) -> threading.Thread:
    """A thread that runs `session` against the current gateway while `running` is set, again after
    every disconnect and on every new gateway process."""

    slot = run.gateways.assign()

    def loop() -> None:
        try:
            while running.is_set():
                current = run.gateways.current(slot, POLL_S)
                if current is None:
                    continue
                generation, gateway = current
                try:
                    session(gateway, generation)
                except (*CONNECTION_ERRORS, Refused):
                    # The gateway went away (or stalled), or refused for now: wait for the next one, or reconnect.
                    run.gateways.wait_for_change(generation, POLL_S)
        except BaseException:  # a harness bug must show in the report, not vanish with the thread
            run.ledger.record_error(f"{name}: {traceback.format_exc()}")

    thread = threading.Thread(target=loop, name=name, daemon=True)
    thread.start()
    return thread


def percentile(values: list[float], fraction: float) -> float:
    if not values:
        return 0.0
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[min(98, max(0, round(fraction * 100) - 1))]



ACK, REQUEUE, CRASH, DISCONNECT = "ack", "requeue", "crash", "disconnect"


class ConsumerSession:
    """One connection of one consumer of `sink`: decides what happens to each delivery and records it."""

    def __init__(self, run: Run, sink: str, protocol: str, generation: int, rng: random.Random,
                 requeue: bool = True) -> None:
        self.run = run
        self.sink = sink
        self.protocol = protocol
        self.generation = generation
        self.rng = rng
        self.can_requeue = requeue
        self.id = run.ledger.new_session()
        self.crashed = self.disconnected = False
        self.broken = True  # until it ends on its own terms

    def first(self) -> bool:
        """This thread's first session (it has not said it made its queue yet)."""
        return threading.current_thread().name not in self.run.ledger.subscribed

    def subscribed(self) -> None:
        self.run.ledger.record_subscribed(threading.current_thread().name)

    def keep_going(self) -> bool:
        return self.run.consuming.is_set() and self.run.gateways.alive(self.generation)

    def received(self, body: bytes) -> str:
        """What to do with a delivery: ACK, REQUEUE, CRASH (close, acknowledging nothing more) or
        DISCONNECT (acknowledge it, then close). Recorded before the acknowledgement is sent: a kill
        between the two makes a redelivery legal."""
        run = self.run
        key = run.ledger.record_receipt(self.sink, body)
        if key is None:
            return ACK  # unexpected: counted, and taken out of the way
        if run.roll(self.rng, run.settings.crash_p):
            self.crashed = True
            return CRASH
        if self.can_requeue and run.roll(self.rng, run.settings.requeue_p):
            run.ledger.record_requeue(self.sink, key, self.generation)
            return REQUEUE
        run.ledger.record_finish(self.sink, key, self.id, self.generation)
        if run.roll(self.rng, run.settings.disconnect_p):
            self.disconnected = True
            return DISCONNECT
        return ACK

    def ended_cleanly(self) -> None:
        """The session stopped reading on its own: cleanly, unless its gateway went away meanwhile
        (what it acknowledged last may not have been read)."""
        self.broken = not self.run.gateways.alive(self.generation)

    def end(self) -> None:
        self.run.ledger.record_session_end(self.protocol, self.id, crashed=self.crashed,
                                           disconnected=self.disconnected,
                                           broken=self.broken and not (self.crashed or self.disconnected))


def publisher_keeps_going(run: Run, generation: int) -> bool:
    return run.publishing.is_set() and run.gateways.alive(generation)
