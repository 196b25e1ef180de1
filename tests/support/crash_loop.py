"""Kill -9 crash loop for `polymq serve` (docs/durability.md), and the checker of its records.

The loop starts the gateway on a data dir, publishes over NSQ (PUB and MPUB, each acknowledged by `OK`)
while consumers FIN what they get, SIGKILLs the process at a random moment, restarts it on the same data
dir and repeats; a last epoch publishes nothing and drains. `check` then proves, from the records alone:

* every acknowledged publish was delivered at least once (`lost == 0`);
* nothing was delivered that was not sent before (`phantom == 0`);
* a body is delivered twice only across a kill (`illegal_duplicates == 0`): a FIN carries no reply,
  so a message delivered before a kill may come back after it, never twice within one process life;
* a redelivery carries a larger `attempts` than the delivery before it (`attempts_not_grown == 0`);
* no attempt of a message is handed out twice (`repeated_attempts == 0`), across kills too: a
  delivery leaves only after the record of its attempt is written. Where the wire shows no attempt
  count (PZQ, eMQP) the loop counts it: the attempts the gateway restored the message with (its
  stream snapshot, read before any client connects) plus one per delivery in that process life;
* a message key (PZQ's, the same on every delivery of a message) names one message only
  (`shared_keys == 0`);
* what the gateway held when it came back from a kill (the loop reads its state, where the protocol
  acknowledges nothing) is delivered in that process life or a later one (counted in `lost`).

Run as a script: `python tests/support/crash_loop.py --rounds 20 --seed 7` prints the report line and
exits 1 when a check fails; `--protocol pzq` and `--protocol emqp` run it over those protocols.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import random
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
from collections import Counter, deque
from collections.abc import Callable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from pathlib import Path

# As a script, `support` is not on the path yet (pytest adds `tests` through `pythonpath`).
if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import attrs

from polymq.clients.stream import StreamClient, StreamClientError
from polymq.codecs import nsq_client as client
from polymq.codecs import stream_rows

from support.gateway import GatewayProcess, running_gateway
from support.nsq_wire import HEARTBEAT, Closed, split_address

# 60 s, the nsqd default: no message times out (and comes back) within one process life.
MSG_TIMEOUT_MS = 60_000
EXAMPLES = 5  # bodies quoted per kind of problem in a report

# --------------------------------------------------------------------------------------------------
# Records and the checker (pure: no sockets, no processes).


@attrs.frozen(slots=True)
class Delivery:
    """One message frame a consumer received (and then FINed), in the process life `epoch`."""

    body: bytes
    attempts: int
    epoch: int
    msg_id: bytes = b""
    consumer: int = 0
    key: bytes = b""  # the protocol's name of the message (PZQ's key, the same on every delivery); b"": none


@attrs.frozen(slots=True)
class CrashReport:
    rounds: int  # kills
    sent: int  # distinct bodies written to a socket
    acknowledged: int  # ... and answered with OK
    unacked_delivered: int  # sent, never acknowledged (the kill came first), delivered anyway: allowed
    delivered: int  # distinct bodies delivered
    deliveries: int  # message frames received
    duplicated: int  # bodies delivered more than once
    lost: int
    phantom: int
    illegal_duplicates: int
    attempts_not_grown: int
    repeated_attempts: int = 0  # bodies one of whose attempts was received twice
    shared_keys: int = 0  # keys received with two different messages
    examples: tuple[tuple[str, tuple[bytes, ...]], ...] = ()

    @property
    def ok(self) -> bool:
        return not (self.lost or self.phantom or self.illegal_duplicates or self.attempts_not_grown
                    or self.repeated_attempts or self.shared_keys)

    def line(self) -> str:
        return (
            f"crash-loop: rounds={self.rounds} sent={self.sent} acknowledged={self.acknowledged}"
            f" delivered={self.delivered} deliveries={self.deliveries} duplicated={self.duplicated}"
            f" unacked_delivered={self.unacked_delivered} lost={self.lost} phantom={self.phantom}"
            f" illegal_duplicates={self.illegal_duplicates} attempts_not_grown={self.attempts_not_grown}"
            f" repeated_attempts={self.repeated_attempts} shared_keys={self.shared_keys}"
        )

    def problems(self) -> str:
        """The failed checks with a few example bodies each (empty when all passed)."""
        lines = [f"{kind}: {', '.join(repr(body[:24]) for body in bodies)}" for kind, bodies in self.examples]
        return "\n".join(lines)


def check(
    sent: Mapping[bytes, int],
    acked: AbstractSet[bytes],
    deliveries: Sequence[Delivery],
    kills: AbstractSet[int],
    *,
    rounds: int | None = None,
    held: Mapping[bytes, int] | None = None,
) -> CrashReport:
    """Check the records of a crash loop.

    `sent` maps each body to the epoch it was first written to a socket in, `acked` holds the bodies
    answered with OK, `deliveries` is in arrival order, `kills` holds the epochs ended by SIGKILL.
    `held` maps a body to the last epoch at whose start the gateway's state showed it (restored,
    not finished): it must be delivered in that epoch or a later one.
    """
    by_body: dict[bytes, list[Delivery]] = {}
    for delivery in deliveries:
        by_body.setdefault(delivery.body, []).append(delivery)

    held = held or {}
    lost = sorted({
        *(body for body in acked if body not in by_body),
        *(body for body, epoch in held.items() if all(d.epoch < epoch for d in by_body.get(body, ()))),
    })
    # Delivered in an epoch before the one it was sent in is as impossible as never sent.
    phantom = sorted(
        body for body, got in by_body.items() if body not in sent or min(d.epoch for d in got) < sent[body]
    )
    duplicated = sorted(body for body, got in by_body.items() if len(got) > 1)
    illegal: list[bytes] = []
    not_grown: list[bytes] = []
    for body in duplicated:
        ordered = sorted(by_body[body], key=lambda d: d.epoch)  # stable: arrival order within an epoch
        highest = ordered[0].attempts
        for before, after in itertools.pairwise(ordered):
            if not any(epoch in kills for epoch in range(before.epoch, after.epoch)):
                illegal.append(body)
            if after.attempts <= highest:
                not_grown.append(body)
            highest = max(highest, after.attempts)

    # An attempt is handed out once: a second delivery with the same attempts went out before the
    # record of the first was written, and a kill made the gateway forget it.
    attempts_seen = Counter((delivery.body, delivery.attempts) for delivery in deliveries)
    repeated_attempts = sorted({body for (body, _), count in attempts_seen.items() if count > 1})
    bodies_of_key: dict[bytes, set[bytes]] = {}
    for delivery in deliveries:
        if delivery.key:
            bodies_of_key.setdefault(delivery.key, set()).add(delivery.body)
    shared_keys = sorted(key for key, bodies in bodies_of_key.items() if len(bodies) > 1)

    unacked_delivered = sum(1 for body in by_body if body in sent and body not in acked)
    examples = tuple(
        (kind, tuple(bodies[:EXAMPLES]))
        for kind, bodies in (
            ("lost", lost),
            ("phantom", phantom),
            ("illegal_duplicates", sorted(set(illegal))),
            ("attempts_not_grown", sorted(set(not_grown))),
            ("repeated_attempts", repeated_attempts),
            ("shared_keys", shared_keys),
        )
        if bodies
    )
    return CrashReport(
        rounds=len(kills) if rounds is None else rounds,
        sent=len(sent),
        acknowledged=len(acked),
        unacked_delivered=unacked_delivered,
        delivered=len(by_body),
        deliveries=len(deliveries),
        duplicated=len(duplicated),
        lost=len(lost),
        phantom=len(phantom),
        illegal_duplicates=len(illegal),
        attempts_not_grown=len(not_grown),
        repeated_attempts=len(repeated_attempts),
        shared_keys=len(shared_keys),
        examples=examples,
    )


# --------------------------------------------------------------------------------------------------
# The shared records of a run, written by the client threads.


@attrs.define(slots=True)
class Ledger:
    sent: dict[bytes, int] = attrs.Factory(dict)
    acked: set[bytes] = attrs.Factory(set)
    deliveries: list[Delivery] = attrs.Factory(list)
    kills: set[int] = attrs.Factory(set)
    errors: list[str] = attrs.Factory(list)  # trouble of the harness itself: bad frames, crashed threads
    # Acknowledged, not delivered yet: the drain watches its size.
    missing: set[bytes] = attrs.Factory(set)
    delivered: set[bytes] = attrs.Factory(set)
    # Body → the last epoch at whose start the gateway's state showed it (`check`'s `held`).
    held: dict[bytes, int] = attrs.Factory(dict)
    sent_in_epoch: int = 0
    delivered_in_epoch: int = 0
    lock: threading.Lock = attrs.Factory(threading.Lock)
    # Set by every delivery: the kill can wait for the next one (`CrashLoopConfig.kill_on_delivery`).
    a_delivery: threading.Event = attrs.Factory(threading.Event)

    def new_epoch(self) -> None:
        with self.lock:
            self.sent_in_epoch = self.delivered_in_epoch = 0

    def record_sent(self, bodies: list[bytes], epoch: int) -> None:
        with self.lock:
            for body in bodies:
                self.sent.setdefault(body, epoch)
            self.sent_in_epoch += len(bodies)

    def record_acked(self, bodies: list[bytes]) -> None:
        with self.lock:
            self.acked.update(bodies)
            self.missing.update(body for body in bodies if body not in self.delivered)

    def record_held(self, bodies: list[bytes], epoch: int) -> None:
        """The gateway holds these at the start of `epoch`: they must be delivered from then on."""
        with self.lock:
            for body in bodies:
                self.held[body] = epoch
            self.missing.update(bodies)

    def record_delivery(self, delivery: Delivery) -> None:
        with self.lock:
            self.deliveries.append(delivery)
            self.delivered.add(delivery.body)
            self.missing.discard(delivery.body)
            self.delivered_in_epoch += 1
        self.a_delivery.set()

    def record_error(self, text: str) -> None:
        with self.lock:
            self.errors.append(text)

    def backlog(self) -> int:
        with self.lock:
            return self.sent_in_epoch - self.delivered_in_epoch

    def progress(self) -> tuple[int, int]:
        """(message frames received so far, acknowledged bodies not delivered yet)."""
        with self.lock:
            return len(self.deliveries), len(self.missing)


# --------------------------------------------------------------------------------------------------
# A minimal NSQ connection that never loses a partial frame on a read timeout.


class _Wire:
    def __init__(self, address: str, timeout: float) -> None:
        self.sock = socket.create_connection(split_address(address), timeout=timeout)
        self.reader = client.FrameReader()
        self.frames: deque[client.Frame] = deque()
        self.send(client.magic())

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def next_frame(self, timeout: float) -> client.Frame | None:
        """The next frame, answering heartbeats; None when nothing came within `timeout`."""
        deadline = time.monotonic() + timeout
        while True:
            while not self.frames:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                self.sock.settimeout(remaining)
                try:
                    data = self.sock.recv(65536)
                except TimeoutError:
                    return None
                if not data:
                    raise Closed("server closed the connection")
                self.reader.receive_data(data)
                self.frames.extend(self.reader.frames())
            frame = self.frames.popleft()
            if frame.is_response and frame.data == HEARTBEAT:
                self.send(client.nop())
                continue
            return frame

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()


# --------------------------------------------------------------------------------------------------
# The loop.


@attrs.define(slots=True)
class CrashLoopConfig:
    rounds: int = 5  # process lives ended by SIGKILL, before the drain
    seed: int = 0
    gateway_args: tuple[str, ...] = ()
    data_dir: Path | None = None  # None: a temporary folder, removed afterwards
    publishers: int = 2
    consumers: int = 2
    min_run_s: float = 0.2  # a process life lasts uniform(min_run_s, max_run_s) before the kill
    max_run_s: float = 1.5
    max_batch: int = 50  # MPUB size is uniform(1, max_batch)
    window: int = 8  # publish commands awaiting their OK per connection
    max_backlog: int = 5000  # publishers pause while an epoch's sent - delivered exceeds this
    rdy: int = 50
    io_timeout_s: float = 5.0  # any single socket operation; a gateway this slow is treated as gone
    drain_timeout_s: float = 30.0
    idle_timeout_s: float = 5.0  # the drain gives up after this long without any delivery
    settle_s: float = 0.5  # all acknowledged delivered: wait this quiet long for the unacked stragglers
    topic: str = "crash"
    channel: str = "c"
    # After the random moment, the kill waits for the next message a consumer receives: the
    # gateway dies just after a delivery left it, while its record may still be on its way to disk.
    kill_on_delivery: bool = False


@attrs.frozen(slots=True)
class CrashLoopResult:
    config: CrashLoopConfig
    report: CrashReport
    harness_errors: tuple[str, ...]
    elapsed_s: float

    def line(self) -> str:
        extra = f" gateway_args={' '.join(self.config.gateway_args)!r}" if self.config.gateway_args else ""
        return (
            f"{self.report.line()} harness_errors={len(self.harness_errors)}"
            f" seed={self.config.seed}{extra} elapsed={self.elapsed_s:.1f}s"
        )


class CrashLoop:
    def __init__(self, config: CrashLoopConfig) -> None:
        self.config = config
        self.ledger = Ledger()
        self.rng = random.Random(config.seed)
        self._counter = itertools.count()
        self._counter_lock = threading.Lock()

    # -- client threads ----------------------------------------------------------------------

    def publish_address(self, gateway: GatewayProcess) -> str:
        return gateway.nsq_tcp

    def consume_address(self, gateway: GatewayProcess) -> str:
        return gateway.nsq_tcp

    def _thread(self, name: str, target: Callable[..., None], *args: object) -> threading.Thread:
        def guarded() -> None:
            try:
                target(*args)
            except BaseException:  # a harness bug must show up in the result, not vanish with the thread
                self.ledger.record_error(f"{name}: {traceback.format_exc()}")

        thread = threading.Thread(target=guarded, name=name, daemon=True)
        thread.start()
        return thread

    def _bodies(self, rng: random.Random, count: int) -> list[bytes]:
        with self._counter_lock:
            numbers = [next(self._counter) for _ in range(count)]
        # Unique tokens, padded to varied sizes.
        return [b"m%09d." % n + b"x" * rng.randrange(64) for n in numbers]

    def _publisher(self, address: str, epoch: int, rng: random.Random, stop: threading.Event) -> None:
        config, ledger = self.config, self.ledger
        try:
            wire = _Wire(address, config.io_timeout_s)
        except OSError:
            return  # killed before we connected
        pending: deque[list[bytes]] = deque()  # OK frames come back in command order

        def read_ack() -> None:
            frame = wire.next_frame(config.io_timeout_s)
            if frame is None:
                raise TimeoutError("no reply to a publish")
            bodies = pending.popleft()
            if frame.is_response and frame.data == b"OK":
                ledger.record_acked(bodies)
            else:
                ledger.record_error(f"publisher epoch {epoch}: unexpected reply {frame}")

        try:
            while not stop.is_set():
                throttled = ledger.backlog() > config.max_backlog
                if pending and (len(pending) >= config.window or throttled):
                    read_ack()
                elif throttled:
                    stop.wait(0.005)
                else:
                    bodies = self._bodies(rng, rng.randint(1, config.max_batch))
                    ledger.record_sent(bodies, epoch)  # before the send: a kill may come mid-write
                    pending.append(bodies)
                    if len(bodies) == 1 and rng.random() < 0.5:
                        wire.send(client.pub(config.topic, bodies[0]))
                    else:
                        wire.send(client.mpub(config.topic, bodies))
            while pending:  # OKs the dead process sent before the kill may still be buffered
                read_ack()
        except (Closed, OSError):
            pass  # the gateway died: what is still pending stays unacknowledged
        finally:
            wire.close()

    def _consumer(self, address: str, epoch: int, index: int, subscribed: threading.Event,
                  stop: threading.Event) -> None:
        config, ledger = self.config, self.ledger
        wire: _Wire | None = None
        try:
            wire = _Wire(address, config.io_timeout_s)
            wire.send(client.identify({"feature_negotiation": True, "msg_timeout": MSG_TIMEOUT_MS}))
            reply = wire.next_frame(config.io_timeout_s)
            assert reply is not None and reply.is_response, f"IDENTIFY reply {reply}"
            wire.send(client.sub(config.topic, config.channel))
            reply = wire.next_frame(config.io_timeout_s)
            assert reply is not None and (reply.frame_type, reply.data) == (0, b"OK"), f"SUB reply {reply}"
            wire.send(client.rdy(config.rdy))
        except (Closed, OSError, AssertionError) as exc:
            ledger.record_error(f"consumer {index} epoch {epoch}: could not subscribe: {exc!r}")
            if wire is not None:
                wire.close()
            return
        finally:
            subscribed.set()
        try:
            while not stop.is_set():
                frame = wire.next_frame(0.2)  # short: notice `stop` soon
                if frame is None:
                    continue
                if frame.is_message:
                    message = client.decode_message(frame.data)
                    # Recorded before the FIN: a kill between the two makes a redelivery legal.
                    ledger.record_delivery(Delivery(message.body, message.attempts, epoch, message.msg_id, index))
                    wire.send(client.fin(message.msg_id))
                else:
                    ledger.record_error(f"consumer {index} epoch {epoch}: unexpected frame {frame}")
        except TimeoutError:
            # A dead process resets its sockets, it does not stall them; leaving a live gateway would
            # requeue our in-flight messages within the epoch and fake an illegal duplicate.
            ledger.record_error(f"consumer {index} epoch {epoch}: a FIN could not be sent in time")
        except (Closed, OSError):
            pass  # the gateway died
        finally:
            wire.close()

    def _start_consumers(self, gateway: GatewayProcess, epoch: int, stop: threading.Event) -> list[threading.Thread]:
        threads = []
        events = []
        for index in range(self.config.consumers):
            subscribed = threading.Event()
            events.append(subscribed)
            threads.append(self._thread(f"consumer-{epoch}-{index}", self._consumer, self.consume_address(gateway),
                                        epoch, index, subscribed, stop))
        # Subscribed before anything is published, so the channel exists from the first message on.
        for subscribed in events:
            subscribed.wait(self.config.io_timeout_s * 3)
        return threads

    def _join(self, threads: list[threading.Thread]) -> None:
        for thread in threads:
            thread.join(self.config.io_timeout_s * 4)
            if thread.is_alive():
                self.ledger.record_error(f"{thread.name} did not end")

    # -- epochs ------------------------------------------------------------------------------

    def epoch_started(self, gateway: GatewayProcess, epoch: int) -> None:
        """The gateway is up, no client is connected yet (a protocol loop may read its state here)."""

    def checked_deliveries(self) -> list[Delivery]:
        """The deliveries `check` gets (a protocol loop may complete what its clients could not see)."""
        return list(self.ledger.deliveries)

    def _check_alive(self, gateway: GatewayProcess, epoch: int) -> None:
        # Only our SIGKILL may end a process life: a gateway that died on its own is a finding.
        code = gateway.process.poll()
        if code is not None:
            log = "\n".join(gateway.log_lines[-20:])
            self.ledger.record_error(f"epoch {epoch}: the gateway exited on its own (code {code}):\n{log}")

    def _kill_epoch(self, data_dir: Path, epoch: int) -> None:
        run_s = self.rng.uniform(self.config.min_run_s, self.config.max_run_s)
        self.ledger.new_epoch()
        with running_gateway(*self.config.gateway_args, data_dir=data_dir) as gateway:
            stop = threading.Event()
            threads: list[threading.Thread] = []
            try:
                self.epoch_started(gateway, epoch)
                threads += self._start_consumers(gateway, epoch, stop)
                for index in range(self.config.publishers):
                    rng = random.Random(self.rng.getrandbits(64))
                    threads.append(self._thread(f"publisher-{epoch}-{index}", self._publisher,
                                                self.publish_address(gateway), epoch, rng, stop))
                time.sleep(run_s)  # the random moment of the kill
                if self.config.kill_on_delivery:
                    self.ledger.a_delivery.clear()
                    self.ledger.a_delivery.wait(self.config.io_timeout_s)  # none within: killed anyway
                self._check_alive(gateway, epoch)
                gateway.stop(signal.SIGKILL)  # our own child, by its PID
                self.ledger.kills.add(epoch)
            finally:
                stop.set()
                self._join(threads)

    def _drain_epoch(self, data_dir: Path, epoch: int) -> None:
        config = self.config
        self.ledger.new_epoch()
        with running_gateway(*config.gateway_args, data_dir=data_dir) as gateway:
            stop = threading.Event()
            threads: list[threading.Thread] = []
            try:
                self.epoch_started(gateway, epoch)
                threads += self._start_consumers(gateway, epoch, stop)
                start = last_change = time.monotonic()
                last_count = -1
                while True:
                    now = time.monotonic()
                    count, missing = self.ledger.progress()
                    if count != last_count:
                        last_count, last_change = count, now
                    quiet = now - last_change
                    if missing == 0 and quiet >= config.settle_s:
                        break
                    if quiet >= config.idle_timeout_s or now - start >= config.drain_timeout_s:
                        break
                    time.sleep(0.05)
                self._check_alive(gateway, epoch)
            finally:
                stop.set()
                self._join(threads)

    def run(self) -> CrashLoopResult:
        started = time.monotonic()
        own_dir = None
        data_dir = self.config.data_dir
        if data_dir is None:
            own_dir = data_dir = Path(tempfile.mkdtemp(prefix="polymq-crash-"))
        try:
            for epoch in range(self.config.rounds):
                self._kill_epoch(data_dir, epoch)
            self._drain_epoch(data_dir, self.config.rounds)
        finally:
            if own_dir is not None:
                shutil.rmtree(own_dir, ignore_errors=True)
        ledger = self.ledger
        deliveries = self.checked_deliveries()
        with ledger.lock:
            report = check(ledger.sent, ledger.acked, deliveries, ledger.kills, rounds=self.config.rounds,
                           held=ledger.held)
            errors = tuple(ledger.errors)
        return CrashLoopResult(self.config, report, errors, time.monotonic() - started)


# The queue PZQ producers and consumers use (the gateway's default `--pzq-queue`).
PZQ_QUEUE = "pzq"


class CountedAttemptsLoop(CrashLoop):
    """A loop over a protocol whose wire shows no attempt count (PZQ, eMQP): the engine counts one
    attempt per delivery, and the stream snapshot of `queue`, read as each process life starts,
    gives the count each message came back with; so the n-th delivery of a message in a process
    life is its attempt `restored + n`. A message that left before the record of its attempt was
    written comes back after a kill with the count it had before: that attempt is then handed out
    twice (`repeated_attempts`)."""

    queue: str

    def __init__(self, config: CrashLoopConfig) -> None:
        super().__init__(config)
        self.restored: dict[int, dict[bytes, int]] = {}  # epoch → body → attempts the gateway came back with

    def epoch_started(self, gateway: GatewayProcess, epoch: int) -> None:
        held = queue_attempts(gateway.http, self.queue, self.config.io_timeout_s)
        self.restored[epoch] = held
        self.ledger.record_held(list(held), epoch)

    def checked_deliveries(self) -> list[Delivery]:
        """Each delivery with its attempt: the count its message was restored with, plus one per
        delivery of it in that process life."""
        derived: list[Delivery] = []
        counts: dict[bytes, int] = {}
        epoch = -1
        with self.ledger.lock:
            deliveries = list(self.ledger.deliveries)
        for delivery in deliveries:  # in epoch order: each process life's clients ended before the next began
            if delivery.epoch != epoch:
                epoch = delivery.epoch
                counts = dict(self.restored.get(epoch, {}))
            attempt = counts.get(delivery.body, 0) + 1
            counts[delivery.body] = attempt
            derived.append(attrs.evolve(delivery, attempts=attempt))
        return derived


def queue_attempts(http_address: str, queue: str, timeout: float) -> dict[bytes, int]:
    """Every message `queue` holds (body → attempts), from a snapshot; {} when there is no such queue."""
    with StreamClient(http_address, timeout=timeout) as client:
        try:
            taken = client.snapshot(queue)
        except StreamClientError as error:
            if error.status == 404:
                return {}
            raise
        snapshot, count = taken["snapshot"], taken["rows"]
        rows: list[stream_rows.ReadRow] = []
        while len(rows) < count:
            batch = list(stream_rows.decode_read_rows(client.snapshot_rows(snapshot, len(rows), count)))
            if not batch:
                break
            rows += batch
        client.snapshot_close(snapshot)
    assert len(rows) == count, f"the snapshot of {queue} said {count} rows, {len(rows)} came"
    return {row.body: row.attempts for row in rows}


class PZQCrashLoop(CountedAttemptsLoop):
    """The same loop over PZQ: DEALER producers waiting for `1`, ROUTER consumers answering `1`.

    ZeroMQ reports no dead peer: a client thread ends when the loop's `stop` is set after the kill,
    taking whatever answers were already buffered. The gateway's ACK timeout is long
    (`PZQ_ACK_TIMEOUT_MS`), so within one process life nothing is sent twice. A PZQ key is the same on
    every delivery of a message: the attempts are counted (`CountedAttemptsLoop`).
    """

    queue = PZQ_QUEUE

    def publish_address(self, gateway: GatewayProcess) -> str:
        return gateway.addresses["pzq-receive"]

    def consume_address(self, gateway: GatewayProcess) -> str:
        return gateway.addresses["pzq-send"]

    def _publisher(self, address: str, epoch: int, rng: random.Random, stop: threading.Event) -> None:
        import zmq

        config, ledger = self.config, self.ledger
        context = zmq.Context()
        sock = context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(f"tcp://{address}")
        pending: dict[bytes, bytes] = {}  # producer id -> body
        try:
            while not stop.is_set() or pending:
                throttled = ledger.backlog() > config.max_backlog
                if not stop.is_set() and not throttled and len(pending) < config.window:
                    [body] = self._bodies(rng, 1)
                    producer_id = body.split(b".", 1)[0]
                    ledger.record_sent([body], epoch)  # before the send: a kill may come mid-write
                    pending[producer_id] = body
                    sock.send_multipart([producer_id, b"", body])
                    continue
                if not sock.poll(50):
                    if stop.is_set():
                        break  # the process is gone: what is pending stays unacknowledged
                    continue
                answer = sock.recv_multipart()
                body = pending.pop(answer[0], None)
                if body is None or answer[1:3] != [b"1", b""]:
                    ledger.record_error(f"publisher epoch {epoch}: unexpected answer {answer!r}")
                    continue
                ledger.record_acked([body])
        finally:
            sock.close(linger=0)
            context.term()

    def _consumer(self, address: str, epoch: int, index: int, subscribed: threading.Event,
                  stop: threading.Event) -> None:
        import zmq

        ledger = self.ledger
        context = zmq.Context()
        sock = context.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(f"tcp://{address}")
        subscribed.set()
        try:
            while not stop.is_set():
                if not sock.poll(200):
                    continue
                frames = sock.recv_multipart()
                key = frames[1]  # the message's, on every delivery of it; its attempt is counted
                # Recorded before the answer: a kill between the two makes a redelivery legal.
                ledger.record_delivery(Delivery(frames[5], 0, epoch, key, index, key))
                sock.send_multipart([frames[0], frames[1], b"1"])
        finally:
            sock.close(linger=0)
            context.term()


# The PZQ loop's ACK timeout: nothing comes twice within one process life.
PZQ_ACK_TIMEOUT_MS = 60_000
# Deliveries each PZQ consumer may hold: small, so that most leave from the bursts of ACKs (their
# messages' ADD records written long before, their attempt records not yet) as well as from the
# producers' bursts.
PZQ_WINDOW = 2


def run_crash_loop(config: CrashLoopConfig, protocol: str = "nsq") -> CrashLoopResult:
    if protocol == "pzq":
        config = attrs.evolve(config, kill_on_delivery=True, gateway_args=(
            *config.gateway_args, "--pzq-ack-timeout", str(PZQ_ACK_TIMEOUT_MS), "--pzq-window", str(PZQ_WINDOW)))
        return PZQCrashLoop(config).run()
    if protocol == "emqp":
        from support.emqp_crash_loop import EMQPCrashLoop, emqp_config  # it builds on this module

        return EMQPCrashLoop(emqp_config(config)).run()
    return CrashLoop(config).run()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="kill -9 crash loop against `polymq serve`")
    parser.add_argument("--rounds", type=int, default=5, help="SIGKILLs before the final drain")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--fsync", default=None, help="passed to the gateway (always|never|interval:MS)")
    parser.add_argument("--mem-queue-size", type=int, default=None, help="passed to the gateway")
    parser.add_argument("--data-dir", type=Path, default=None, help="default: a temporary folder")
    parser.add_argument("--publishers", type=int, default=2)
    parser.add_argument("--consumers", type=int, default=2)
    parser.add_argument("--min-run", type=float, default=0.2, help="shortest process life before a kill (s)")
    parser.add_argument("--max-run", type=float, default=1.5, help="longest process life before a kill (s)")
    parser.add_argument("--drain-timeout", type=float, default=30.0)
    parser.add_argument("--protocol", choices=("nsq", "pzq", "emqp"), default="nsq",
                        help="nsq: PUB/MPUB and FIN; pzq: DEALER producers and ROUTER consumers; "
                             "emqp: REQUESTs on the frontend, jobmanager-style workers on the backend")
    args = parser.parse_args(argv)
    gateway_args: list[str] = []
    if args.fsync is not None:
        gateway_args += ["--fsync", args.fsync]
    if args.mem_queue_size is not None:
        gateway_args += ["--mem-queue-size", str(args.mem_queue_size)]
    config = CrashLoopConfig(
        rounds=args.rounds,
        seed=args.seed,
        gateway_args=tuple(gateway_args),
        data_dir=args.data_dir,
        publishers=args.publishers,
        consumers=args.consumers,
        min_run_s=args.min_run,
        max_run_s=args.max_run,
        drain_timeout_s=args.drain_timeout,
    )
    result = run_crash_loop(config, args.protocol)
    print(result.line())
    if result.harness_errors:
        print("harness errors:\n" + "\n".join(result.harness_errors), file=sys.stderr)
    if not result.report.ok:
        print(result.report.problems(), file=sys.stderr)
    return 0 if result.report.ok and not result.harness_errors else 1


if __name__ == "__main__":
    sys.exit(main())
