"""`polymq conformance emqp`: black-box checks of any eMQP (EventMQ) broker: its frontend, backend
and admin sockets, and, when given, its pub/sub device.

Written from how EventMQ 0.3.13's router behaves on the wire (docs/protocols/emqp.md). Groups, by
the first word of a check's name:

- `core …`: what the original does; a conformant broker passes them all.
- `pubsub …`: the pub/sub device, at `--pubsub-in` and `--pubsub-out` (by default where EventMQ's
  `emq-pubsub` and polymq listen; `--skip pubsub` for a broker without one).
- `robustness …`: what the original gets wrong (it crashes on binary identities and on a worker's
  DISCONNECT, stops for any client's DISCONNECT, leaves a bad INFORM unanswered, loses the jobs of
  a worker that goes, drops requests past 10,000 waiting, and reroutes unknown queues).

Every check uses queues of its own (named after the run), and its workers say KBYE when it ends.
Only `polymq.clients`, `polymq.codecs` and the shared runner are imported (docs/architecture.md).
"""

from __future__ import annotations

import contextlib
import json
import secrets
import time
from collections.abc import Callable
from contextlib import AbstractContextManager

import click
import zmq

from polymq.clients import emqp as emqp_client
from polymq.clients import zmq_socket
from polymq.codecs import emqp
from polymq.conformance import runner
from polymq.conformance.runner import CheckFailed, Registry, expect_equal

DEFAULT_FRONTEND = "127.0.0.1:47291"
DEFAULT_BACKEND = "127.0.0.1:47290"
DEFAULT_ADMIN = "127.0.0.1:47293"
# EventMQ's emq-pubsub's default addresses, and the gateway's (--emqp-pubsub-in-port, -out-port).
DEFAULT_PUBSUB_IN = "127.0.0.1:47298"
DEFAULT_PUBSUB_OUT = "127.0.0.1:47299"
HEARTBEAT_INTERVAL_S = 3.0  # the original's HEARTBEAT_INTERVAL
HEARTBEAT_TIMEOUT_S = 5.0  # the original's HEARTBEAT_TIMEOUT
# The original drops requests past this many waiting for one queue (its HWM).
HIGH_WATER_MARK = 10_000
# How long a check watches for something that must not come (and the drain for one more job).
QUIET_S = 0.5
# The jobs the draining worker takes at once.
DRAIN_SLOTS = 100


class Checked:
    """Waits that fail the check instead of raising: listed after an eMQP client class, whose
    `next_message` they use."""

    timeout: float

    def next_message(self, timeout: float | None = None, *, heartbeats: bool = False) -> list[bytes] | None:
        raise NotImplementedError

    def expect_message(self, what: str, timeout: float | None = None, *, heartbeats: bool = False) -> list[bytes]:
        """The next message (HEARTBEATs skipped unless asked for)."""
        frames = self.next_message(timeout, heartbeats=heartbeats)
        if frames is None:
            raise CheckFailed(f"{what}: nothing came",
                              got=f"nothing within {self.timeout if timeout is None else timeout} s")
        return frames

    def expect_quiet(self, what: str, seconds: float = QUIET_S) -> None:
        """Nothing but HEARTBEATs for `seconds`."""
        frames = self.next_message(seconds)
        if frames is not None:
            raise CheckFailed(what, "nothing", frames)


class Peer(emqp_client.Client, Checked):
    """A DEALER with its own identity, as EventMQ's peers connect."""


class Worker(emqp_client.Worker, Checked):
    def expect_job(self, what: str, timeout: float | None = None) -> list[bytes]:
        try:
            return self.job(timeout)
        except TimeoutError as error:
            raise CheckFailed(f"{what}: nothing came", got=str(error)) from None
        except emqp_client.Unexpected as error:
            raise CheckFailed(f"{what}: a REQUEST", error.expected, error.got) from None


class Target:
    def __init__(self, frontend: str, backend: str, admin: str | None, pubsub: tuple[str, str],
                 timeout: float, heartbeat_interval: float, run_id: str, check_number: int) -> None:
        self.frontend, self.backend, self.admin_address, self.pubsub = frontend, backend, admin, pubsub
        self.timeout, self.heartbeat_interval = timeout, heartbeat_interval
        self.prefix = f"conformance-{run_id}-{check_number}"
        self.context = zmq.Context()
        self.peers: list[Peer | Worker] = []
        self.workers: list[Worker] = []
        self.queues: set[str] = set()

    def queue(self, name: str) -> str:
        """A queue of this check's own, drained when the check ends."""
        queue = f"{self.prefix}-{name}"
        self.queues.add(queue)
        return queue

    def peer(self, address: str, identity: bytes | None = None) -> Peer:
        peer = Peer(self.context, address, identity, self.timeout)
        self.peers.append(peer)
        return peer

    def new_worker(self, identity: bytes | None = None) -> Worker:
        """A worker connected to the backend that has said nothing yet."""
        worker = Worker(self.context, self.backend, identity, self.timeout)
        self.peers.append(worker)
        return worker

    def worker(self, queues: list[tuple[int, str]], identity: bytes | None = None) -> Worker:
        worker = self.new_worker(identity)
        try:
            worker.inform(queues)
        except TimeoutError as error:
            raise CheckFailed("the INFORM's ACK: nothing came", got=str(error)) from None
        except emqp_client.Unexpected as error:
            raise CheckFailed("ACK", error.expected, error.got) from None
        self.workers.append(worker)
        return worker

    def client(self, identity: bytes | None = None) -> Peer:
        return self.peer(self.frontend, identity)

    def admin(self, command: bytes) -> object:
        if self.admin_address is None:
            raise CheckFailed("needs --admin")
        peer = self.peer(self.admin_address)
        peer.send(command, message_id=b"admin:" + emqp_client.new_msgid())
        frames = peer.expect_message(f"the answer to {command.decode()}")
        if frames[2:3] != [emqp.REPLY] or len(frames) < 5:
            raise CheckFailed(f"{command.decode()}: a REPLY", "['', 'eMQP/1.0', 'REPLY', msgid, json]", frames)
        try:
            return json.loads(frames[4])
        except ValueError as error:
            raise CheckFailed(f"{command.decode()}: JSON", "JSON", frames[4][:200]) from error

    def slots_of(self, worker: Worker) -> int | None:
        shown = self.admin(emqp.ROUTER_SHOW_WORKERS)
        workers = shown.get("connected_workers", {}) if isinstance(shown, dict) else {}
        entry = workers.get(worker.identity.decode("utf-8", "backslashreplace"))
        return entry.get("available_slots") if isinstance(entry, dict) else None

    def serving(self, queues: list[tuple[int, str]], identity: bytes | None = None, *, slots: int = 1) -> Worker:
        """A worker of `queues` whose `slots` READYs the broker has counted."""
        worker = self.worker(queues, identity)
        worker.ready(slots)
        self.wait_slots(worker, slots)
        return worker

    def wait_slots(self, worker: Worker, slots: int) -> None:
        """Until the broker counts the worker's READYs (a READY and a REQUEST on two sockets may
        otherwise cross). Without --admin, a moment."""
        if self.admin_address is None:
            time.sleep(0.3)
            return
        deadline = time.monotonic() + self.timeout
        while (got := self.slots_of(worker)) != slots:
            if time.monotonic() > deadline:
                raise CheckFailed("the worker's free slots", slots, got)
            time.sleep(0.02)

    def close(self) -> None:
        for worker in self.workers:
            with contextlib.suppress(zmq.ZMQError):
                worker.send(emqp.KBYE)
        time.sleep(0.05 if self.workers else 0)  # the KBYEs leave before the sockets close
        for peer in self.peers:
            peer.close()
        try:
            if self.queues:
                # Best effort: a server that does not answer the drain has failed the check already,
                # whose own reason must stay the one reported.
                with contextlib.suppress(TimeoutError, emqp_client.Unexpected):
                    self.drain()
        finally:
            self.context.term()

    def drain(self) -> None:
        """eMQP has no delete: a worker of this check's queues finishes every job left in them
        (unanswered requests, jobs its workers took without a REPLY) until none comes for a
        while, then says KBYE, so the broker holds nothing of the check."""
        worker = Worker(self.context, self.backend, None, self.timeout)
        try:
            worker.inform([(10, name) for name in sorted(self.queues)])
            worker.ready(DRAIN_SLOTS)
            while (frames := worker.next_message(QUIET_S)) is not None:
                if frames[2:3] == [emqp.REQUEST] and len(frames) == 7:
                    worker.reply(frames)
                    worker.ready()
            worker.send(emqp.KBYE)
            time.sleep(0.05)  # the KBYE leaves before the socket closes
        finally:
            worker.close()


checks: Registry[Target] = Registry(original_fails={
    "robustness": "EventMQ 0.3.13 crashes, stops or loses jobs on these (module docstring)"})


def job_payload(tag: str) -> bytes:
    return json.dumps(["run", {"path": "conformance", "callable": "job", "args": [tag], "kwargs": {},
                               "class_args": [], "class_kwargs": {}}]).encode()


# -- core -----------------------------------------------------------------------------------------


@checks.check("core INFORM is answered ACK naming the INFORM's msgid")
def _inform(t: Target) -> None:
    worker = t.new_worker()
    sent = worker.send(emqp.INFORM, json.dumps([[10, t.queue("q")]]).encode(), emqp.WORKER)
    ack = worker.expect_message("ACK")
    t.workers.append(worker)
    expect_equal("ACK frames", [b"", b"eMQP/1.0", b"ACK", sent], [*ack[:3], *ack[4:]])
    expect_equal("ACK has its own msgid", True, bool(ack[3]) and ack[3] != sent)


@checks.check("core a request for a free worker is forwarded with the client's msgid and answered dispatched")
def _forward(t: Target) -> None:
    name = t.queue("jobs")
    worker = t.serving([(10, name)])
    client = t.client()
    payload = job_payload("a")
    msgid = client.send(emqp.REQUEST, name.encode(), b"reply-requested,timeout:30", payload)
    job = worker.expect_job("the forwarded REQUEST")
    expect_equal("forwarded frames",
                 [b"", b"eMQP/1.0", b"REQUEST", msgid, name.encode(), b"reply-requested,timeout:30", payload], job)
    reply = client.expect_message("the dispatched REPLY")
    expect_equal("dispatched REPLY", [b"", b"eMQP/1.0", b"REPLY", msgid], [*reply[:3], *reply[4:]])


@checks.check("core a request without a free slot waits for the next READY, oldest first, with no REPLY")
def _buffered(t: Target) -> None:
    name = t.queue("later")
    worker = t.worker([(10, name)])
    client = t.client()
    sent = [client.send(emqp.REQUEST, name.encode(), b"", job_payload(str(index))) for index in range(3)]
    worker.expect_quiet("a request without a free slot")
    worker.ready(3)
    expect_equal("in the order sent", sent, [worker.expect_job("a waiting request")[3] for _ in sent])
    client.expect_quiet("a REPLY for a request that waited")


@checks.check("core the highest weight is served first and equal weights take turns")
def _weights(t: Target) -> None:
    name = t.queue("weights")
    heavy, light = t.serving([(10, name)], slots=2), t.serving([(5, name)], slots=2)
    client = t.client()
    sent = [client.send(emqp.REQUEST, name.encode(), b"", job_payload(str(index))) for index in range(3)]
    expect_equal("the heavier worker's", sent[:2], [heavy.expect_job("the first two")[3] for _ in range(2)])
    expect_equal("then the lighter one's", sent[2], light.expect_job("the third")[3])
    even = t.queue("even")
    first, second = t.serving([(7, even)], slots=2), t.serving([(7, even)], slots=2)
    sent = [client.send(emqp.REQUEST, even.encode(), b"", job_payload(str(index))) for index in range(4)]
    got_first = [first.expect_job("turns")[3] for _ in range(2)]
    got_second = [second.expect_job("turns")[3] for _ in range(2)]
    # Which of the two starts depends on whose READY the socket read first (ZeroMQ fair-queues
    # its peers): taking turns means one gets the 1st and 3rd request, the other the 2nd and 4th.
    turns = {(sent[0], sent[2]), (sent[1], sent[3])}
    expect_equal("equal weights in turn", turns, {tuple(got_first), tuple(got_second)})


@checks.check("core a READY serves the worker's queues in the order it listed them")
def _ready_order(t: Target) -> None:
    urgent, bulk = t.queue("urgent"), t.queue("bulk")
    worker = t.worker([(1, urgent), (50, bulk)])
    client = t.client()
    client.send(emqp.REQUEST, bulk.encode(), b"", job_payload("bulk"))
    client.send(emqp.REQUEST, urgent.encode(), b"", job_payload("urgent"))
    worker.expect_quiet("without a READY")
    worker.ready()
    expect_equal("the first listed queue's", urgent.encode(), worker.expect_job("the first")[4])
    worker.ready()
    expect_equal("then the other's", bulk.encode(), worker.expect_job("the second")[4])


@checks.check("core a worker's REPLY and READY keep it serving")
def _reply(t: Target) -> None:
    name = t.queue("replies")
    worker = t.worker([(10, name)])
    worker.ready()
    client = t.client()
    client.send(emqp.REQUEST, name.encode(), b"reply-requested", job_payload("1"))
    job = worker.expect_job("the first")
    worker.send(emqp.REPLY, b'{"value": true}', job[3])
    worker.ready()
    msgid = client.send(emqp.REQUEST, name.encode(), b"", job_payload("2"))
    expect_equal("the next request", msgid, worker.expect_job("the second")[3])


@checks.check("core the broker sends its workers HEARTBEATs")
def _heartbeats(t: Target) -> None:
    worker = t.worker([(10, t.queue("hb"))])
    frames = worker.expect_message("a HEARTBEAT", t.heartbeat_interval + t.timeout, heartbeats=True)
    expect_equal("HEARTBEAT", [b"", b"eMQP/1.0", b"HEARTBEAT"], frames[:3])
    try:
        stamp = float(frames[4])
    except (IndexError, ValueError):
        raise CheckFailed("HEARTBEAT carries a unix time", "a number", frames[4:]) from None
    expect_equal("a unix time about now", True, abs(stamp - time.time()) < 60)


@checks.check("core KBYE takes the worker out: a request waits for another")
def _kbye(t: Target) -> None:
    name = t.queue("kbye")
    leaving = t.serving([(10, name)], slots=2)
    leaving.send(emqp.KBYE)
    t.workers.remove(leaving)
    time.sleep(0.1)
    client = t.client()
    msgid = client.send(emqp.REQUEST, name.encode(), b"", job_payload("k"))
    leaving.expect_quiet("a request for a worker that said KBYE")
    staying = t.worker([(10, name)])
    staying.ready()
    expect_equal("the request", msgid, staying.expect_job("the waiting request")[3])


@checks.check("core the admin socket answers STATUS, ROUTER_SHOW_WORKERS and ROUTER_SHOW_SCHEDULERS")
def _admin(t: Target) -> None:
    name = t.queue("admin")
    worker = t.serving([(30, name)], slots=2)
    status = t.admin(emqp.STATUS)
    keys = {"inflight_messages_by_queue", "latency_messages_by_queue", "max_latency_messages_by_queue",
            "waiting_messages_by_queue", "processed_messages_by_queue", "processed_messages_by_worker"}
    expect_equal("STATUS keys", keys, keys & set(status) if isinstance(status, dict) else status)
    shown = t.admin(emqp.ROUTER_SHOW_WORKERS)
    me = worker.identity.decode()
    try:
        entry = shown["connected_workers"][me]  # type: ignore[index]
        queue = shown["connected_queues"][name]  # type: ignore[index]
    except (KeyError, TypeError):
        raise CheckFailed("ROUTER_SHOW_WORKERS names the worker and its queue", me, shown) from None
    expect_equal("its queues", [[30, name]], entry.get("queues"))
    expect_equal("its free slots", 2, entry.get("available_slots"))
    expect_equal("the queue's workers", [[30, me]], queue)
    schedulers = t.admin(emqp.ROUTER_SHOW_SCHEDULERS)
    expect_equal("ROUTER_SHOW_SCHEDULERS", True, isinstance(schedulers, dict) and "connected_schedulers" in schedulers)


@checks.check("core STATUS counts a request as processed only when it was handed to a worker as it arrived")
def _status_counts(t: Target) -> None:
    # The original counts a request in processed_messages_by_queue and _by_worker when it dispatches it
    # on arrival; one that waited in its queue for a READY is not counted.
    if t.admin_address is None:
        raise CheckFailed("this check reads STATUS: give --admin", "an admin address", None)
    name = t.queue("counted")
    waiting = t.worker([(10, name)])  # no free slot: the request waits in its queue
    t.client().send(emqp.REQUEST, name.encode(), b"", job_payload("waits"))
    waiting.expect_quiet("a request for a worker without a free slot")
    waiting.ready()
    waiting.expect_job("the request that waited")
    status = t.admin(emqp.STATUS)
    counts = status.get("processed_messages_by_queue") if isinstance(status, dict) else status
    expect_equal("processed_messages_by_queue after a request that waited", None,
                 counts.get(name) if isinstance(counts, dict) else counts)
    ready = t.serving([(10, name)], slots=1)
    t.client().send(emqp.REQUEST, name.encode(), b"", job_payload("at once"))
    ready.expect_job("the request handed over as it arrived")
    status = t.admin(emqp.STATUS)
    counts = status.get("processed_messages_by_queue") if isinstance(status, dict) else status
    expect_equal("processed_messages_by_queue after a request handed over at once", 1,
                 counts.get(name) if isinstance(counts, dict) else counts)
    workers = status.get("processed_messages_by_worker") if isinstance(status, dict) else None
    expect_equal("processed_messages_by_worker", 1,
                 workers.get(ready.identity.decode()) if isinstance(workers, dict) else workers)


@checks.check("core a scheduler's INFORM on the frontend is answered ACK")
def _scheduler(t: Target) -> None:
    scheduler = t.client()
    sent = scheduler.send(emqp.INFORM, b"", emqp.SCHEDULER)
    ack = scheduler.expect_message("ACK")
    expect_equal("ACK", [b"", b"eMQP/1.0", b"ACK", sent], [*ack[:3], ack[-1]])
    scheduler.send(emqp.KBYE)


# -- pub/sub --------------------------------------------------------------------------------------


@checks.check("pubsub PUBLISH goes out as [topic, message] to the subscribers of a matching prefix")
def _pubsub(t: Target) -> None:
    topic = t.queue("news").encode()
    subscriber = t.context.socket(zmq.SUB)
    other = t.context.socket(zmq.SUB)
    for sock, prefix in ((subscriber, topic[:-2]), (other, topic + b"-not")):
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SUBSCRIBE, prefix)
        sock.connect(zmq_socket.endpoint(t.pubsub[1]))
    publisher = t.peer(t.pubsub[0])
    try:
        deadline = time.monotonic() + t.timeout
        while not subscriber.poll(20):  # a subscription reaches the PUB a moment after connecting
            if time.monotonic() > deadline:
                raise CheckFailed("a PUBLISH reaches a subscriber", got=f"nothing within {t.timeout} s")
            publisher.send(emqp.PUBLISH, topic, b"warm-up")
        while subscriber.poll(50):
            subscriber.recv_multipart()
        publisher.send(emqp.PUBLISH, topic, b'["update", "1"]')
        if not subscriber.poll(int(t.timeout * 1000)):
            raise CheckFailed("the PUBLISH", got="nothing")
        expect_equal("published frames", [topic, b'["update", "1"]'], subscriber.recv_multipart())
        expect_equal("nothing for another prefix", 0, other.poll(int(QUIET_S * 1000)))
    finally:
        subscriber.close(linger=0)
        other.close(linger=0)


# -- robustness -----------------------------------------------------------------------------------


@checks.check("robustness binary identities, msgids and frames work")
def _binary(t: Target) -> None:
    name = t.queue("binary")
    worker = t.serving([(10, name)], identity=b"\x00\xff\xfe" + secrets.token_bytes(4))
    client = t.client(identity=b"\x80\x81" + secrets.token_bytes(4))
    client.send(emqp.REQUEST, name.encode(), b"\xfeh", b"\x00\x01\xff", message_id=b"\xff\x00id")
    expect_equal("the forwarded frames", [b"\xff\x00id", name.encode(), b"\xfeh", b"\x00\x01\xff"],
                 worker.expect_job("a binary request")[3:])


@checks.check("robustness a worker's or a client's DISCONNECT stops nothing")
def _disconnects(t: Target) -> None:
    name = t.queue("disconnect")
    worker = t.worker([(10, name)])
    worker.send(emqp.DISCONNECT)
    client = t.client()
    client.send(emqp.DISCONNECT)
    time.sleep(0.2)
    fresh = t.worker([(10, name)])  # answered: the broker still runs
    fresh.ready()
    msgid = client.send(emqp.REQUEST, name.encode(), b"", job_payload("d"))
    expect_equal("a request still goes out", msgid, fresh.expect_job("the request")[3])


@checks.check("robustness an INFORM that cannot be read is answered")
def _bad_inform(t: Target) -> None:
    peer = t.peer(t.backend)
    peer.send(emqp.INFORM, b"[[10, 'single quotes']]", emqp.WORKER)
    answer = peer.expect_message("an answer")
    expect_equal("an ACK or a DISCONNECT", True, answer[2:3] in ([emqp.ACK], [emqp.DISCONNECT]))


@checks.check("robustness a job whose worker goes is handed to another worker")
def _handed_on(t: Target) -> None:
    name = t.queue("handover")
    first = t.serving([(10, name)])
    client = t.client()
    msgid = client.send(emqp.REQUEST, name.encode(), b"", job_payload("h"))
    expect_equal("the first worker's job", msgid, first.expect_job("the job")[3])
    second = t.worker([(10, name)])
    second.ready()
    first.send(emqp.KBYE)
    t.workers.remove(first)
    expect_equal("the same job", msgid, second.expect_job("the job again")[3])


@checks.check("robustness requests past 10,000 waiting for a queue are all kept")
def _no_high_water_mark(t: Target) -> None:
    name = t.queue("many").encode()
    # The worker INFORMs first, so the requests wait in its queue (one nobody serves is another check).
    worker = t.worker([(10, name.decode())])
    client = t.client()
    total = HIGH_WATER_MARK + 50
    for index in range(total):
        client.send(emqp.REQUEST, name, b"", b"%d" % index, message_id=b"%d" % index)
    # A barrier: the broker answers this INFORM only after every request before it waits.
    client.send(emqp.INFORM, b"", emqp.SCHEDULER)
    client.expect_message("the ACK after the requests")
    client.send(emqp.KBYE)
    worker.ready(total)
    got = [worker.expect_job("a waiting request")[3] for _ in range(total)]
    expect_equal("every request, in order", [b"%d" % index for index in range(total)], got)


@checks.check("robustness a request for a queue nobody serves waits in it, not in default")
def _no_reroute(t: Target) -> None:
    default = t.serving([(10, "default")])
    name = t.queue("unserved")
    client = t.client()
    msgid = client.send(emqp.REQUEST, name.encode(), b"", job_payload("u"))
    default.expect_quiet("a request for another queue")
    worker = t.worker([(10, name)])
    worker.ready()
    expect_equal("the request, in its own queue", [msgid, name.encode()], worker.expect_job("the request")[3:5])


# ---------------------------------------------------------------------------------------------


def make_context_factory(frontend: str, backend: str, admin: str | None, pubsub: tuple[str, str],
                         timeout: float, heartbeat_interval: float) -> Callable[[str], AbstractContextManager[Target]]:
    run_id = secrets.token_hex(4)
    numbers = iter(range(1, 1_000_000))
    return runner.contexts(lambda _: Target(frontend, backend, admin, pubsub, timeout, heartbeat_interval, run_id,
                                            next(numbers)), Target.close, (zmq.ZMQError,))


@click.command()
@runner.address_options(("--frontend", DEFAULT_FRONTEND, "The frontend socket (clients, schedulers), HOST:PORT."),
                 ("--backend", DEFAULT_BACKEND, "The backend socket (jobmanagers), HOST:PORT."),
                 ("--admin", DEFAULT_ADMIN, "The admin socket (emq-cli), HOST:PORT."),
                 ("--pubsub-in", DEFAULT_PUBSUB_IN, "The pub/sub device's input (PUBLISH), HOST:PORT."),
                 ("--pubsub-out", DEFAULT_PUBSUB_OUT, "The pub/sub device's PUB socket, HOST:PORT."))
@runner.selection_options("core")
@runner.timeout_option("answer")
@click.option("--heartbeat-interval", default=HEARTBEAT_INTERVAL_S, show_default=True, type=float,
              help="the broker's heartbeat interval in seconds (the heartbeat check waits for one)")
def command(frontend: str, backend: str, admin: str, pubsub_in: str, pubsub_out: str,
            timeout: float, heartbeat_interval: float) -> None:
    """Check that an eMQP broker behaves like EventMQ 0.3.13's router.

    Groups: `core` (the original's behaviour), `pubsub` (the pub/sub device; --skip it for a broker
    without one) and `robustness` (what the original gets wrong). Prints `PASS name` or
    `FAIL name: reason` per check, then `N passed, M failed`; exits 0 only if every check passed.
    """
    contexts = make_context_factory(frontend, backend, admin, (pubsub_in, pubsub_out), timeout, heartbeat_interval)
    runner.run_command(checks, contexts, address=("--frontend", frontend))
