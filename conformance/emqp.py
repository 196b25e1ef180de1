"""`polymq conformance emqp`: black-box checks of any eMQP (EventMQ) broker: its frontend, backend
and admin sockets, and, when given, its pub/sub device.

Written from how EventMQ 0.3.13's router behaves on the wire (docs/protocols/emqp.md). Groups, by
the first word of a check's name:

- `core …`: what the original does; a conformant broker passes them all.
- `pubsub …`: only with `--pubsub-in` and `--pubsub-out`: the pub/sub device.
- `robustness …`: what the original gets wrong (it crashes on binary identities and on a worker's
  DISCONNECT, stops for any client's DISCONNECT, leaves a bad INFORM unanswered, loses the jobs of
  a worker that goes, drops requests past 10,000 waiting, and reroutes unknown queues).

Every check uses queues of its own (named after the run), and its workers say KBYE when it ends.
Only `polymq.codecs` and the shared runner are imported (docs/architecture.md).
"""

from __future__ import annotations

import contextlib
import json
import secrets
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager

import click
import zmq

from polymq.codecs import emqp
from polymq.conformance.runner import CheckFailed, Registry, address_option, run_checks

DEFAULT_FRONTEND = "127.0.0.1:47291"
DEFAULT_BACKEND = "127.0.0.1:47290"
DEFAULT_ADMIN = "127.0.0.1:47293"
DEFAULT_TIMEOUT_S = 5.0
HEARTBEAT_INTERVAL_S = 3.0  # the original's HEARTBEAT_INTERVAL
HEARTBEAT_TIMEOUT_S = 5.0  # the original's HEARTBEAT_TIMEOUT
# The original drops requests past this many waiting for one queue (its HWM).
HIGH_WATER_MARK = 10_000
# How long a check watches for something that must not come.
QUIET_S = 0.5


class Peer:
    """A DEALER with its own identity, as EventMQ's peers connect."""

    def __init__(self, target: Target, address: str, identity: bytes | None = None) -> None:
        self.target = target
        self.identity = identity if identity is not None else str(uuid.uuid4()).encode()
        self.sock = target.context.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.IDENTITY, self.identity)
        self.sock.setsockopt(zmq.SNDTIMEO, int(target.timeout * 1000))
        self.sock.connect(f"tcp://{address}")
        target.peers.append(self)

    def send(self, command: bytes, *body: bytes, msgid: bytes | None = None) -> bytes:
        msgid = msgid if msgid is not None else str(uuid.uuid4()).encode()
        self.sock.send_multipart(emqp.client_message(command, msgid, *body))
        return msgid

    def receive(self, what: str, timeout: float | None = None, *, heartbeats: bool = False) -> list[bytes]:
        """The next message (HEARTBEATs skipped unless asked for)."""
        wait = self.target.timeout if timeout is None else timeout
        deadline = time.monotonic() + wait
        while (left := deadline - time.monotonic()) > 0 and self.sock.poll(int(left * 1000)):
            frames = self.sock.recv_multipart()
            if heartbeats or frames[2:3] != [emqp.HEARTBEAT]:
                return frames
        raise CheckFailed(f"{what}: nothing came", got=f"nothing within {wait} s")

    def quiet(self, what: str, seconds: float = QUIET_S) -> None:
        """Nothing but HEARTBEATs for `seconds`."""
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0 and self.sock.poll(int(left * 1000)):
            frames = self.sock.recv_multipart()
            if frames[2:3] != [emqp.HEARTBEAT]:
                raise CheckFailed(what, "nothing", frames)


class Worker(Peer):
    def inform(self, queues: list[tuple[int, str]]) -> None:
        sent = self.send(emqp.INFORM, json.dumps([[weight, name] for weight, name in queues]).encode(), emqp.WORKER)
        ack = self.receive("the INFORM's ACK")
        expect("ACK", [b"", emqp.VERSION, emqp.ACK, sent], [*ack[:3], ack[-1]])
        self.target.workers.append(self)

    def ready(self, count: int = 1) -> None:
        for _ in range(count):
            self.send(emqp.READY)

    def job(self, what: str, timeout: float | None = None) -> list[bytes]:
        frames = self.receive(what, timeout)
        if frames[2:3] != [emqp.REQUEST] or len(frames) != 7:
            raise CheckFailed(f"{what}: a REQUEST", "['', 'eMQP/1.0', 'REQUEST', msgid, queue, headers, message]",
                              frames)
        return frames


class Target:
    def __init__(self, frontend: str, backend: str, admin: str | None, pubsub: tuple[str, str] | None,
                 timeout: float, heartbeat_interval: float, run_id: str, check_number: int) -> None:
        self.frontend, self.backend, self.admin_address, self.pubsub = frontend, backend, admin, pubsub
        self.timeout, self.heartbeat_interval = timeout, heartbeat_interval
        self.prefix = f"conformance-{run_id}-{check_number}"
        self.context = zmq.Context()
        self.peers: list[Peer] = []
        self.workers: list[Worker] = []

    def queue(self, name: str) -> str:
        return f"{self.prefix}-{name}"

    def worker(self, queues: list[tuple[int, str]], identity: bytes | None = None) -> Worker:
        worker = Worker(self, self.backend, identity)
        worker.inform(queues)
        return worker

    def client(self, identity: bytes | None = None) -> Peer:
        return Peer(self, self.frontend, identity)

    def admin(self, command: bytes) -> object:
        if self.admin_address is None:
            raise CheckFailed("needs --admin")
        peer = Peer(self, self.admin_address)
        peer.send(command, msgid=b"admin:" + str(uuid.uuid4()).encode())
        frames = peer.receive(f"the answer to {command.decode()}")
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
            peer.sock.close(linger=0)
        self.context.term()


checks: Registry[Target] = Registry()


def expect(what: str, expected: object, got: object) -> None:
    if expected != got:
        raise CheckFailed(what, expected, got)


def job_payload(tag: str) -> bytes:
    return json.dumps(["run", {"path": "conformance", "callable": "job", "args": [tag], "kwargs": {},
                               "class_args": [], "class_kwargs": {}}]).encode()


# -- core -----------------------------------------------------------------------------------------


@checks.check("core INFORM is answered ACK naming the INFORM's msgid")
def _inform(t: Target) -> None:
    worker = Worker(t, t.backend)
    sent = worker.send(emqp.INFORM, json.dumps([[10, t.queue("q")]]).encode(), emqp.WORKER)
    ack = worker.receive("ACK")
    t.workers.append(worker)
    expect("ACK frames", [b"", b"eMQP/1.0", b"ACK", sent], [*ack[:3], *ack[4:]])
    expect("ACK has its own msgid", True, bool(ack[3]) and ack[3] != sent)


@checks.check("core a request for a free worker is forwarded with the client's msgid and answered dispatched")
def _forward(t: Target) -> None:
    name = t.queue("jobs")
    worker = t.worker([(10, name)])
    worker.ready()
    t.wait_slots(worker, 1)
    client = t.client()
    payload = job_payload("a")
    msgid = client.send(emqp.REQUEST, name.encode(), b"reply-requested,timeout:30", payload)
    job = worker.job("the forwarded REQUEST")
    expect("forwarded frames", [b"", b"eMQP/1.0", b"REQUEST", msgid, name.encode(), b"reply-requested,timeout:30",
                                payload], job)
    reply = client.receive("the dispatched REPLY")
    expect("dispatched REPLY", [b"", b"eMQP/1.0", b"REPLY", msgid], [*reply[:3], *reply[4:]])


@checks.check("core a request without a free slot waits for the next READY, oldest first, with no REPLY")
def _buffered(t: Target) -> None:
    name = t.queue("later")
    worker = t.worker([(10, name)])
    client = t.client()
    sent = [client.send(emqp.REQUEST, name.encode(), b"", job_payload(str(index))) for index in range(3)]
    worker.quiet("a request without a free slot")
    worker.ready(3)
    expect("in the order sent", sent, [worker.job("a waiting request")[3] for _ in sent])
    client.quiet("a REPLY for a request that waited")


@checks.check("core the highest weight is served first and equal weights take turns")
def _weights(t: Target) -> None:
    name = t.queue("weights")
    heavy, light = t.worker([(10, name)]), t.worker([(5, name)])
    heavy.ready(2)
    light.ready(2)
    t.wait_slots(heavy, 2)
    t.wait_slots(light, 2)
    client = t.client()
    sent = [client.send(emqp.REQUEST, name.encode(), b"", job_payload(str(index))) for index in range(3)]
    expect("the heavier worker's", sent[:2], [heavy.job("the first two")[3], heavy.job("the first two")[3]])
    expect("then the lighter one's", sent[2], light.job("the third")[3])
    even = t.queue("even")
    first, second = t.worker([(7, even)]), t.worker([(7, even)])
    first.ready(2)
    second.ready(2)
    t.wait_slots(first, 2)
    t.wait_slots(second, 2)
    sent = [client.send(emqp.REQUEST, even.encode(), b"", job_payload(str(index))) for index in range(4)]
    got_first = [first.job("turns")[3], first.job("turns")[3]]
    got_second = [second.job("turns")[3], second.job("turns")[3]]
    # Which of the two starts depends on whose READY the socket read first (ZeroMQ fair-queues
    # its peers): taking turns means one gets the 1st and 3rd request, the other the 2nd and 4th.
    turns = {(sent[0], sent[2]), (sent[1], sent[3])}
    expect("equal weights in turn", turns, {tuple(got_first), tuple(got_second)})


@checks.check("core a READY serves the worker's queues in the order it listed them")
def _ready_order(t: Target) -> None:
    urgent, bulk = t.queue("urgent"), t.queue("bulk")
    worker = t.worker([(1, urgent), (50, bulk)])
    client = t.client()
    client.send(emqp.REQUEST, bulk.encode(), b"", job_payload("bulk"))
    client.send(emqp.REQUEST, urgent.encode(), b"", job_payload("urgent"))
    worker.quiet("without a READY")
    worker.ready()
    expect("the first listed queue's", urgent.encode(), worker.job("the first")[4])
    worker.ready()
    expect("then the other's", bulk.encode(), worker.job("the second")[4])


@checks.check("core a worker's REPLY and READY keep it serving")
def _reply(t: Target) -> None:
    name = t.queue("replies")
    worker = t.worker([(10, name)])
    worker.ready()
    client = t.client()
    client.send(emqp.REQUEST, name.encode(), b"reply-requested", job_payload("1"))
    job = worker.job("the first")
    worker.send(emqp.REPLY, b'{"value": true}', job[3])
    worker.ready()
    msgid = client.send(emqp.REQUEST, name.encode(), b"", job_payload("2"))
    expect("the next request", msgid, worker.job("the second")[3])


@checks.check("core the broker sends its workers HEARTBEATs")
def _heartbeats(t: Target) -> None:
    worker = t.worker([(10, t.queue("hb"))])
    frames = worker.receive("a HEARTBEAT", t.heartbeat_interval + t.timeout, heartbeats=True)
    expect("HEARTBEAT", [b"", b"eMQP/1.0", b"HEARTBEAT"], frames[:3])
    try:
        stamp = float(frames[4])
    except (IndexError, ValueError):
        raise CheckFailed("HEARTBEAT carries a unix time", "a number", frames[4:]) from None
    expect("a unix time about now", True, abs(stamp - time.time()) < 60)


@checks.check("core KBYE takes the worker out: a request waits for another")
def _kbye(t: Target) -> None:
    name = t.queue("kbye")
    leaving = t.worker([(10, name)])
    leaving.ready(2)
    t.wait_slots(leaving, 2)
    leaving.send(emqp.KBYE)
    t.workers.remove(leaving)
    time.sleep(0.1)
    client = t.client()
    msgid = client.send(emqp.REQUEST, name.encode(), b"", job_payload("k"))
    leaving.quiet("a request for a worker that said KBYE")
    staying = t.worker([(10, name)])
    staying.ready()
    expect("the request", msgid, staying.job("the waiting request")[3])


@checks.check("core the admin socket answers STATUS, ROUTER_SHOW_WORKERS and ROUTER_SHOW_SCHEDULERS")
def _admin(t: Target) -> None:
    name = t.queue("admin")
    worker = t.worker([(30, name)])
    worker.ready(2)
    t.wait_slots(worker, 2)
    status = t.admin(emqp.STATUS)
    keys = {"inflight_messages_by_queue", "latency_messages_by_queue", "max_latency_messages_by_queue",
            "waiting_messages_by_queue", "processed_messages_by_queue", "processed_messages_by_worker"}
    expect("STATUS keys", keys, keys & set(status) if isinstance(status, dict) else status)
    shown = t.admin(emqp.ROUTER_SHOW_WORKERS)
    me = worker.identity.decode()
    try:
        entry = shown["connected_workers"][me]  # type: ignore[index]
        queue = shown["connected_queues"][name]  # type: ignore[index]
    except (KeyError, TypeError):
        raise CheckFailed("ROUTER_SHOW_WORKERS names the worker and its queue", me, shown) from None
    expect("its queues", [[30, name]], entry.get("queues"))
    expect("its free slots", 2, entry.get("available_slots"))
    expect("the queue's workers", [[30, me]], queue)
    schedulers = t.admin(emqp.ROUTER_SHOW_SCHEDULERS)
    expect("ROUTER_SHOW_SCHEDULERS", True, isinstance(schedulers, dict) and "connected_schedulers" in schedulers)


@checks.check("core a scheduler's INFORM on the frontend is answered ACK")
def _scheduler(t: Target) -> None:
    scheduler = t.client()
    sent = scheduler.send(emqp.INFORM, b"", emqp.SCHEDULER)
    ack = scheduler.receive("ACK")
    expect("ACK", [b"", b"eMQP/1.0", b"ACK", sent], [*ack[:3], ack[-1]])
    scheduler.send(emqp.KBYE)


# -- pub/sub --------------------------------------------------------------------------------------


@checks.check("pubsub PUBLISH goes out as [topic, message] to the subscribers of a matching prefix")
def _pubsub(t: Target) -> None:
    assert t.pubsub is not None
    topic = t.queue("news").encode()
    subscriber = t.context.socket(zmq.SUB)
    other = t.context.socket(zmq.SUB)
    for sock, prefix in ((subscriber, topic[:-2]), (other, topic + b"-not")):
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SUBSCRIBE, prefix)
        sock.connect(f"tcp://{t.pubsub[1]}")
    publisher = Peer(t, t.pubsub[0])
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
        expect("published frames", [topic, b'["update", "1"]'], subscriber.recv_multipart())
        expect("nothing for another prefix", 0, other.poll(int(QUIET_S * 1000)))
    finally:
        subscriber.close(linger=0)
        other.close(linger=0)


# -- robustness -----------------------------------------------------------------------------------


@checks.check("robustness binary identities, msgids and frames work")
def _binary(t: Target) -> None:
    name = t.queue("binary")
    worker = t.worker([(10, name)], identity=b"\x00\xff\xfe" + secrets.token_bytes(4))
    worker.ready()
    t.wait_slots(worker, 1)
    client = t.client(identity=b"\x80\x81" + secrets.token_bytes(4))
    client.send(emqp.REQUEST, name.encode(), b"\xfeh", b"\x00\x01\xff", msgid=b"\xff\x00id")
    expect("the forwarded frames", [b"\xff\x00id", name.encode(), b"\xfeh", b"\x00\x01\xff"],
           worker.job("a binary request")[3:])


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
    expect("a request still goes out", msgid, fresh.job("the request")[3])


@checks.check("robustness an INFORM that cannot be read is answered")
def _bad_inform(t: Target) -> None:
    peer = Peer(t, t.backend)
    peer.send(emqp.INFORM, b"[[10, 'single quotes']]", emqp.WORKER)
    answer = peer.receive("an answer")
    expect("an ACK or a DISCONNECT", True, answer[2:3] in ([emqp.ACK], [emqp.DISCONNECT]))


@checks.check("robustness a job whose worker goes is handed to another worker")
def _handed_on(t: Target) -> None:
    name = t.queue("handover")
    first = t.worker([(10, name)])
    first.ready()
    t.wait_slots(first, 1)
    client = t.client()
    msgid = client.send(emqp.REQUEST, name.encode(), b"", job_payload("h"))
    expect("the first worker's job", msgid, first.job("the job")[3])
    second = t.worker([(10, name)])
    second.ready()
    first.send(emqp.KBYE)
    t.workers.remove(first)
    expect("the same job", msgid, second.job("the job again")[3])


@checks.check("robustness requests past 10,000 waiting for a queue are all kept")
def _no_high_water_mark(t: Target) -> None:
    name = t.queue("many").encode()
    client = t.client()
    total = HIGH_WATER_MARK + 50
    for index in range(total):
        client.send(emqp.REQUEST, name, b"", b"%d" % index, msgid=b"%d" % index)
    worker = t.worker([(10, name.decode())])
    worker.ready(total)
    got = [worker.job("a waiting request")[3] for _ in range(total)]
    expect("every request, in order", [b"%d" % index for index in range(total)], got)


@checks.check("robustness a request for a queue nobody serves waits in it, not in default")
def _no_reroute(t: Target) -> None:
    default = t.worker([(10, "default")])
    default.ready()
    t.wait_slots(default, 1)
    name = t.queue("unserved")
    client = t.client()
    msgid = client.send(emqp.REQUEST, name.encode(), b"", job_payload("u"))
    default.quiet("a request for another queue")
    worker = t.worker([(10, name)])
    worker.ready()
    expect("the request, in its own queue", [msgid, name.encode()], worker.job("the request")[3:5])


# ---------------------------------------------------------------------------------------------


def make_context_factory(frontend: str, backend: str, admin: str | None, pubsub: tuple[str, str] | None,
                         timeout: float, heartbeat_interval: float) -> Callable[[str], AbstractContextManager[Target]]:
    run_id = secrets.token_hex(4)
    numbers = iter(range(1, 1_000_000))

    @contextmanager
    def make(name: str) -> Iterator[Target]:
        target = Target(frontend, backend, admin, pubsub, timeout, heartbeat_interval, run_id, next(numbers))
        try:
            yield target
        finally:
            with contextlib.suppress(zmq.ZMQError):
                target.close()

    return make


@click.command()
@click.option("--frontend", default=DEFAULT_FRONTEND, show_default=True, callback=address_option,
              help="The frontend socket (clients, schedulers), HOST:PORT.")
@click.option("--backend", default=DEFAULT_BACKEND, show_default=True, callback=address_option,
              help="The backend socket (jobmanagers), HOST:PORT.")
@click.option("--admin", default=DEFAULT_ADMIN, show_default=True, callback=address_option,
              help="The admin socket (emq-cli), HOST:PORT.")
@click.option("--pubsub-in", default=None, callback=address_option,
              help="The pub/sub device's input (PUBLISH), HOST:PORT: runs the pubsub checks with --pubsub-out.")
@click.option("--pubsub-out", default=None, callback=address_option,
              help="The pub/sub device's PUB socket, HOST:PORT.")
@click.option("--only", default=None, help="run only checks whose name contains this substring (e.g. core)")
@click.option("--timeout", default=DEFAULT_TIMEOUT_S, show_default=True, type=float,
              help="seconds to wait for any one expected answer")
@click.option("--heartbeat-interval", default=HEARTBEAT_INTERVAL_S, show_default=True, type=float,
              help="the broker's heartbeat interval in seconds (the heartbeat check waits for one)")
def command(frontend: str, backend: str, admin: str, pubsub_in: str | None, pubsub_out: str | None,
            only: str | None, timeout: float, heartbeat_interval: float) -> None:
    """Check that an eMQP broker behaves like EventMQ 0.3.13's router.

    Groups: `core` (the original's behaviour), `pubsub` (needs --pubsub-in and --pubsub-out) and
    `robustness` (what the original gets wrong). Prints `PASS name` or `FAIL name: reason` per
    check, then `N passed, M failed`; exits 0 only if every check passed.
    """
    pubsub = (pubsub_in, pubsub_out) if pubsub_in and pubsub_out else None
    selected = [check for check in checks.select(only) if pubsub or not check.name.startswith("pubsub ")]
    if not selected:
        raise click.UsageError(f"no check name contains {only!r}" if only else "no check to run")
    summary = run_checks(selected, make_context_factory(frontend, backend, admin, pubsub, timeout, heartbeat_interval),
                         lambda line: click.echo(line))
    raise SystemExit(0 if summary.failed == 0 else 1)
