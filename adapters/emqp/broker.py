"""The eMQP (EventMQ) broker over ZeroMQ: backend ROUTER (jobmanagers), frontend ROUTER (clients and
schedulers), admin ROUTER.

Model (docs/architecture.md): a REQUEST for queue `q` publishes to topic `q`, whose queue `q` is
bound to it (as PHPMQ and PZQ name theirs), so eMQP workers, PHPMQ consumers and PZQ consumers of one
name compete on one queue, and NSQ channels and MQKS queues of the topic get copies. The client's
msgid and headers travel in the message's headers and come back in the REQUEST a worker gets; a
message another protocol published gets a msgid made from its id.

A worker (a jobmanager) is one engine consumer per queue it INFORMed, all spending one credit pool:
its slots. The pool offers a slot to the worker's queues in the order it listed them, and among
the workers of one queue the highest weight is served first, equal weights in turn (the original's
rules, docs/protocols/emqp.md). Other protocols' consumers of the queue rank as the default weight,
10. A READY adds a slot. It is sent after each job but also once by each worker process as it
starts, and nothing tells the two apart, so a worker's jobs are ended by READYs only past its
processes' start-up READYs (`EMQPLimits.worker_processes`, the jobmanager's default): the job's
REPLY (with `reply-requested`) names it and ended it already; else the oldest job that expects no
REPLY (the jobmanager says READY, not which job; with `reply-requested` only the REPLY does). A
worker that goes may so hand back jobs it finished (duplicates), not lose jobs it never ran. A job
whose worker goes (KBYE, silence past the heartbeat timeout, a new INFORM from the same identity)
goes back to its queue and to the next worker, its attempts counted: the original loses it.
"""

from __future__ import annotations

import functools
import itertools
import json
import logging
import time
import uuid
from collections import Counter, deque
from collections.abc import Callable
from typing import Any, Final

import attrs

from polymq.adapters.named_queue import named_queue
from polymq.adapters.zmq_pump import Frames
from polymq.adapters.zmq_service import ZmqService
from polymq.adapters.zmq_sockets import ZmqSockets
from polymq.codecs import emqp
from polymq.core.engine import (
    Consumer,
    CreditMode,
    CreditPool,
    Engine,
    Queue,
)
from polymq.core.message import Message
from polymq.core.schedules import FOREVER, InvalidSchedule, Schedule
from polymq.core.timers import Timer
from polymq.core.trace import Client

# Requests of this node's clients on shared queues (JetStream) still waiting to hear whether a worker, on any
# node, took them as they arrived (their "dispatched" REPLY); past it the oldest are forgotten (a request that
# waited for a READY never hears).
DISPATCHED_KEPT: Final = 10_000
# What a node whose worker took a request as it arrived tells the node its client sent it to
# (`Engine.tell_maker_of`): the message's id, in decimal.
DISPATCHED_KIND: Final = "emqp-dispatched"

log = logging.getLogger("polymq.emqp")

# The original's defaults (eventmq/conf.py).
HEARTBEAT_INTERVAL_S: Final = 3.0  # HEARTBEAT_INTERVAL: the broker heartbeats every worker and scheduler
HEARTBEAT_TIMEOUT_S: Final = 5.0  # HEARTBEAT_TIMEOUT: a peer silent this long is gone
# The original looks for silent peers every 10 s (gone 5 to 15 s after their last word); polymq
# looks every second, or more often with a shorter timeout.
SWEEP_INTERVAL_S: Final = 1.0
# The largest message (all its frames) taken; libzmq drops a larger one as it arrives. The
# original has no bound.
DEFAULT_MAX_MESSAGE: Final = 16 * 1024 * 1024
# Deliveries after which a job whose worker went (again) is moved to `<queue>.dead` instead of
# being handed out once more: a job that kills its jobmanager (a malformed one makes it reconnect)
# must not go round forever. The original never hands a job out twice.
DEFAULT_MAX_ATTEMPTS: Final = 5
# The jobmanager's CONCURRENT_JOBS default: the worker processes, each sending one READY as it
# starts, that a worker's READYs are first taken to be (they end no job).
DEFAULT_WORKER_PROCESSES: Final = 4
# The PHPMQ unit's default: a minute for a worker to come back before its empty queue goes.
FORGET_EMPTY_AFTER_S: Final = 60.0
# Admin commands are a word and a msgid.
ADMIN_MAX_MESSAGE: Final = 64 * 1024
# Where a message's eMQP fields travel in the engine (any protocol's consumer sees them as headers).
ORIGIN: Final = "emqp"  # the protocol the engine keeps with what comes in here
MSGID_HEADER: Final = "emqp-msgid"
HEADERS_HEADER: Final = "emqp-headers"
# Every refusal is a REPLY whose body starts `ERROR: `: the one error code the metrics count.
ERROR_CODE: Final = "ERROR"
_REPLY_REQUESTED: Final = emqp.REPLY_REQUESTED.encode()
# The engine schedules eMQP keeps: this prefix, then the job identity.
SCHEDULE_KEY_PREFIX: Final = "emqp:"
# The admin command emq-cli sends on connecting, expecting no answer.
HELLO: Final = b"HELLO"


@attrs.frozen
class EMQPLimits:
    heartbeat_interval: float = HEARTBEAT_INTERVAL_S
    heartbeat_timeout: float = HEARTBEAT_TIMEOUT_S
    max_message: int = DEFAULT_MAX_MESSAGE
    # Requests a queue may hold waiting for a worker before more are refused (with a REPLY); 0: no
    # limit. The original drops silently past 10,000.
    max_depth: int = 0
    # A request for a queue nobody consumes goes to `default` (the original's behaviour) instead of
    # waiting in its own queue.
    reroute_unknown: bool = False
    # DISCONNECT on the admin socket stops the gateway (the original: any peer's DISCONNECT stops it).
    admin_disconnect: bool = False
    # Set on the queues eMQP makes (0: no limit).
    max_attempts: int = DEFAULT_MAX_ATTEMPTS
    # Seconds after its last worker left that an empty queue eMQP made is deleted, with its topic
    # when nothing else uses it (None: kept). The original keeps no queue objects at all.
    forget_empty_after: float | None = FORGET_EMPTY_AFTER_S
    # A worker's first this many READYs may be its processes starting: only READYs past them end
    # jobs. Fewer than the jobmanager's processes loses jobs of a worker that goes; more hands back
    # jobs it finished.
    worker_processes: int = DEFAULT_WORKER_PROCESSES


def _text(raw: bytes) -> str:
    """Identities as JSON keys and log text (any bytes: the original's are uuid text)."""
    return raw.decode("utf-8", "backslashreplace")


# The broker's own msgids: uuid text, unique without a uuid4 (os.urandom) per message: a random
# prefix for this run, the last group counted.
_MSGID_PREFIX: Final = str(uuid.uuid4())[:24].encode()
_msgid_numbers = itertools.count(1)


def _msgid() -> bytes:
    return b"%s%012x" % (_MSGID_PREFIX, next(_msgid_numbers))


@attrs.define(eq=False)
class Worker:
    """A jobmanager known by its identity: its queues, its slots and the jobs it holds."""

    identity: bytes
    queues: list[tuple[int, str]]  # (weight, queue) in the order it listed them
    pool: CreditPool
    last_seen: float
    consumers: list[Consumer] = attrs.Factory(list)
    # The deliveries it holds, oldest first → their msgid.
    jobs: dict[Message, bytes] = attrs.Factory(dict)
    # Those of them sent without reply-requested, oldest first: what a READY ends, found without
    # walking the jobs that wait for their REPLY.
    without_reply: dict[Message, None] = attrs.Factory(dict)
    by_msgid: dict[bytes, Message] = attrs.Factory(dict)
    readies: int = 0  # READYs it sent
    ended: int = 0  # jobs it finished (by a REPLY or a READY) or that left it (their queue deleted)
    # When each of its free slots came (wall-clock ns of its READY), oldest first: a job handed to it counts as
    # handed over as it arrived when a slot was free before the job's request was published (shared queues).
    free_since_ns: deque[int] = attrs.Factory(deque)

    def take(self, message: Message) -> None:
        msgid = self.jobs.pop(message, None)
        self.without_reply.pop(message, None)
        if msgid is not None and self.by_msgid.get(msgid) is message:
            del self.by_msgid[msgid]

    def finished_by_ready(self) -> Message | None:
        """The job a READY ends: the oldest that expects no REPLY, else the oldest."""
        return next(iter(self.without_reply), None) or next(iter(self.jobs), None)

    def clear(self) -> None:
        self.jobs.clear()
        self.without_reply.clear()
        self.by_msgid.clear()
        self.free_since_ns.clear()


@attrs.define
class Counters:
    invalid: int = 0  # messages that were not eMQP, or bodies their command cannot carry
    unknown_peer: int = 0  # backend messages from an identity that is not a worker (the original drops them too)
    refused: int = 0  # requests refused with a REPLY (queue full, bad name, store failure)
    redelivered: int = 0  # jobs handed to another worker after theirs went
    ignored_disconnects: int = 0  # DISCONNECTs that stopped nothing


class EMQPBroker(ZmqService):
    log = log

    # At shutdown the KBYEs get this long to reach the peers, in ms.
    linger_ms = 200

    def __init__(self, engine: Engine, sockets: ZmqSockets, limits: EMQPLimits | None = None,
                 *, stop_gateway: Callable[[], None] | None = None) -> None:
        super().__init__(engine)
        self.limits = limits or EMQPLimits()
        self.stop_gateway = stop_gateway
        self.workers: dict[bytes, Worker] = {}
        self.schedulers: dict[bytes, float] = {}  # identity → last seen, the newest last
        self.counters = Counters()
        # STATUS's processed counts, as the original keeps them: requests handed to a worker as they
        # arrived (one that waited for a READY is not counted); every job handed out is in `handed_out`.
        self.processed_by_queue: Counter[str] = Counter()
        self.processed_by_worker: Counter[bytes] = Counter()
        self.handed_out_by_queue: Counter[str] = Counter()
        # The queues eMQP requests or workers named, for STATUS; the sweep forgets those the engine
        # no longer holds (deleted, or forgotten empty: --emqp-forget-empty), so names clients
        # invent take no memory beyond the engine's own queues.
        self.known_queues: set[str] = set()
        # Message id → worker of what was delivered while a REQUEST is published.
        self._delivered_now: dict[int, bytes] | None = None
        # Requests of this node's clients on an engine that hands over later (shared queues), by id: the
        # client's identity and msgid, for the "dispatched" REPLY a worker's node asks for (`_dispatched`).
        self._awaiting: dict[int, tuple[bytes, bytes]] = {}
        self._timers: list[Timer] = []
        self.backend = self.add_pump("emqp-backend", sockets.get("emqp-backend"), self._backend)
        self.frontend = self.add_pump("emqp-frontend", sockets.get("emqp-frontend"), self._frontend)
        self.admin = self.add_pump("emqp-admin", sockets.get("emqp-admin"), self._admin)
        engine.schedules.on_fire = self._fired
        engine.listeners[DISPATCHED_KIND] = self._dispatched

    async def run(self) -> None:
        self._schedule_heartbeat()
        self._schedule_sweep()
        await super().run()

    def shutdown(self) -> None:
        """KBYE to every worker and scheduler; their jobs go back to the queues; the sockets close."""
        for timer in self._timers:
            timer.cancel()
        for identity in list(self.workers):
            self._send_backend(emqp.kbye(identity, _msgid()))
            self._remove_worker(identity, "the gateway stops")
        for identity in self.schedulers:
            self._send_frontend(emqp.kbye(identity, _msgid()))
        self.schedulers.clear()
        super().shutdown()  # the KBYEs go out if the peers are there

    def _send_backend(self, frames: list[bytes]) -> None:
        if self.backend is not None:
            self.backend.send(frames)

    def _send_frontend(self, frames: list[bytes]) -> None:
        if self.frontend is not None:
            self.frontend.send(frames)

    # -- heartbeats ----------------------------------------------------------------------------

    def _schedule_heartbeat(self) -> None:
        now = self.engine.clock.now()
        self._timers.append(self.engine.timers.schedule(now + self.limits.heartbeat_interval, self._heartbeat))

    def _heartbeat(self) -> None:
        now = time.time()
        for identity in self.workers:
            self._send_backend(emqp.heartbeat(identity, _msgid(), now))
        for identity in self.schedulers:
            self._send_frontend(emqp.heartbeat(identity, _msgid(), now))
        self._timers = [timer for timer in self._timers if not timer.cancelled]
        self._schedule_heartbeat()

    def _schedule_sweep(self) -> None:
        interval = min(SWEEP_INTERVAL_S, self.limits.heartbeat_timeout / 5)
        self._timers.append(self.engine.timers.schedule(self.engine.clock.now() + interval, self._sweep))

    def _sweep(self) -> None:
        """Peers silent for the heartbeat timeout are gone; a worker's jobs go to other workers; the
        names and counters of queues that are gone, and the counters of workers gone, are forgotten."""
        limit = self.engine.clock.now() - self.limits.heartbeat_timeout
        for identity in [identity for identity, worker in self.workers.items() if worker.last_seen <= limit]:
            self._remove_worker(identity, f"silent for {self.limits.heartbeat_timeout:g} s")
        for identity in [identity for identity, seen in self.schedulers.items() if seen <= limit]:
            log.info("scheduler %s gone: silent for %g s", _text(identity), self.limits.heartbeat_timeout)
            del self.schedulers[identity]
        engine = self.engine
        self.known_queues = {name for name in self.known_queues if engine.queue(name) is not None}
        # STATUS's counters keep the queues the engine holds and the workers still here (a jobmanager
        # comes back under a new identity each time: kept forever, they would grow without end).
        for by_queue in (self.processed_by_queue, self.handed_out_by_queue):
            for name in [name for name in by_queue if engine.queue(name) is None]:
                del by_queue[name]
        for identity in [identity for identity in self.processed_by_worker if identity not in self.workers]:
            del self.processed_by_worker[identity]
        self._timers = [timer for timer in self._timers if not timer.cancelled]
        self._schedule_sweep()

    # -- workers (the backend) -----------------------------------------------------------------

    def _backend(self, batch: list[Frames]) -> None:
        now = self.engine.clock.now()  # a burst is read at once: one time for its peers' last word
        for frames in batch:
            self._backend_message(frames, now)

    def _backend_message(self, frames: Frames, now: float) -> None:
        message = emqp.parse(frames)
        if isinstance(message, emqp.Invalid):
            self.counters.invalid += 1
            log.info("backend: %s", message.reason)
            return
        command = message.command
        worker = self.workers.get(message.identity)
        if command == emqp.INFORM:
            self._inform_worker(message)
            return
        if worker is None:
            # Unknown: reaped after a silence, or never INFORMed (the original drops these as well).
            self.counters.unknown_peer += 1
            log.info("backend: %s from %s, which is not a worker (INFORM first)", command[:20], _text(message.identity))
            return
        worker.last_seen = now
        if command == emqp.READY:
            self._ready(worker)
        elif command == emqp.REPLY:
            self._worker_reply(worker, message)
        elif command in (emqp.KBYE, emqp.KBAI):
            self._remove_worker(message.identity, "it said KBYE")
        elif command == emqp.DISCONNECT:
            self.counters.ignored_disconnects += 1  # the original crashes here
            log.info("backend: DISCONNECT from worker %s ignored", _text(message.identity))
        elif command != emqp.HEARTBEAT:
            self.counters.invalid += 1
            log.info("backend: unknown command %r from %s", command[:20], _text(message.identity))

    def _inform_worker(self, message: emqp.Message) -> None:
        inform = emqp.parse_inform(message.body)
        problem = inform.reason if isinstance(inform, emqp.Invalid) else None
        if isinstance(inform, emqp.Inform) and inform.peer_type != emqp.WORKER:
            problem = f"INFORM of a {inform.peer_type[:20]!r} on the worker socket (workers say 'worker')"
        names: list[tuple[int, str]] = []
        if isinstance(inform, emqp.Inform) and problem is None:
            for weight, raw in inform.queues:
                name = emqp.queue_name(raw)
                if isinstance(name, emqp.Invalid):
                    problem = f"INFORM queue: {name.reason}"
                    break
                names.append((weight, name))
        if problem is not None:
            # The original leaves the jobmanager waiting for its ACK forever: it is told instead.
            self.counters.invalid += 1
            log.info("backend: %s from %s; answered DISCONNECT", problem, _text(message.identity))
            self._send_backend(emqp.disconnect(message.identity, _msgid(), problem))
            return
        if message.identity in self.workers:
            self._remove_worker(message.identity, "it INFORMed again")  # the original resets its slots
        worker = Worker(message.identity, names, CreditPool(), self.engine.clock.now())
        self.workers[message.identity] = worker
        for weight, name in dict((name, (weight, name)) for weight, name in names).values():
            queue = self._queue(name)
            worker.consumers.append(self.engine.attach(
                queue.name, self._deliver, mode=CreditMode.TOKENS, pool=worker.pool,
                priority=weight - emqp.DEFAULT_WEIGHT,  # the default weight ranks with other protocols' consumers
                tag=worker, on_close=functools.partial(self._consumer_closed, worker),
                client=identity_client(worker.identity)))
        log.info("worker %s joined %s", _text(message.identity),
                 ", ".join(f"{name} ({weight})" for weight, name in names))
        self.engine.settled(functools.partial(self._informed, message.identity, message.msgid))

    def _informed(self, identity: bytes, msgid: bytes, error: OSError | None) -> None:
        """The worker's queues took effect for every client (`Engine.settled`): its ACK."""
        if error is not None:
            self._send_backend(emqp.disconnect(identity, _msgid(), f"its queues could not be made: {error}"))
            return
        self._send_backend(emqp.ack(identity, _msgid(), msgid))
        # The jobmanager starts its worker processes at the broker's first heartbeat: send it now.
        self._send_backend(emqp.heartbeat(identity, _msgid(), time.time()))

    def _consumer_closed(self, worker: Worker, reason: str) -> None:
        """A queue of the worker was deleted (another protocol's admin): its jobs there are gone."""
        closed = [consumer for consumer in worker.consumers if consumer.closed]
        worker.consumers = [consumer for consumer in worker.consumers if not consumer.closed]
        for message in [message for message in worker.jobs if message.owner in closed]:
            worker.take(message)
            worker.ended += 1  # it still sends the job's READY

    def _ready(self, worker: Worker) -> None:
        worker.readies += 1
        # Each process sends one READY as it starts, then one per job: the READYs past the
        # processes' count as many finished jobs.
        if worker.ended < worker.readies - self.limits.worker_processes:
            job = worker.finished_by_ready()
            if job is not None:
                self._end_job(worker, job)
                worker.ended += 1
        if not self.engine.hands_over_at_once:
            worker.free_since_ns.append(self.engine.clock.wall_ns())
        worker.pool.add(1)

    def _worker_reply(self, worker: Worker, message: emqp.Message) -> None:
        reply = emqp.parse_worker_reply(message.body)
        if isinstance(reply, emqp.Invalid):
            self.counters.invalid += 1
            log.info("backend: %s from %s", reply.reason, _text(worker.identity))
            return
        job = worker.by_msgid.get(reply.original_msgid)
        if job is None:
            # A READY ended it already (it held no job without reply-requested), or it was
            # handed to this jobmanager under an identity it had before it reconnected.
            if log.isEnabledFor(logging.DEBUG):  # no identity escaped for a line nobody reads
                log.debug("backend: REPLY from %s for %r, a job it does not hold", _text(worker.identity),
                          reply.original_msgid[:60])
            return
        self._end_job(worker, job)
        worker.ended += 1

    def _end_job(self, worker: Worker, message: Message) -> None:
        worker.take(message)
        owner = message.owner
        if isinstance(owner, Consumer) and message.id in owner.in_flight:
            owner.finish(message.id, refill=False)

    def _remove_worker(self, identity: bytes, why: str) -> None:
        worker = self.workers.pop(identity, None)
        if worker is None:
            return
        returned = len(worker.jobs)
        self.counters.redelivered += returned
        worker.clear()
        for consumer in worker.consumers:
            consumer.detach()  # its jobs go back ahead of newer requests
        log.info("worker %s gone (%s): %d jobs back to their queues", _text(identity), why, returned)

    def _deliver(self, message: Message) -> None:
        consumer = message.owner
        assert isinstance(consumer, Consumer)
        worker: Worker = consumer.tag
        name = consumer.queue.name
        msgid, headers = _emqp_fields(message)
        worker.jobs[message] = msgid
        if _REPLY_REQUESTED not in headers.split(b","):
            worker.without_reply[message] = None
        worker.by_msgid[msgid] = message
        self.handed_out_by_queue[name] += 1
        if self._delivered_now is not None:
            self._delivered_now[message.id] = worker.identity
        elif worker.free_since_ns and worker.free_since_ns.popleft() <= message.timestamp_ns:
            # Shared queues: the slot was free when the request came, whichever node it came to. Counted here;
            # its client hears "dispatched" from the node it sent the request to.
            self.processed_by_queue[name] += 1
            self.processed_by_worker[worker.identity] += 1
            self.engine.tell_maker_of(message.id, DISPATCHED_KIND, [b"%d" % message.id])
        assert self.backend is not None  # a worker INFORMed on it
        # A durable queue's job leaves once its attempt is on record: --emqp-max-attempts counts every run.
        self.deliver(self.backend, emqp.request(worker.identity, msgid, name.encode(), headers, message.body),
                     consumer.queue.durable)

    # -- clients and schedulers (the frontend) -------------------------------------------------

    def _queue(self, name: str) -> Queue:
        """Queue `name`, bound to topic `name`, made (with the max attempts) if missing."""
        self.known_queues.add(name)
        return named_queue(self.engine, name, origin=ORIGIN, max_attempts=self.limits.max_attempts,
                           forget_empty_after=self.limits.forget_empty_after)

    def _frontend(self, batch: list[Frames]) -> None:
        replies: list[list[bytes]] = []
        for frames in batch:
            self._frontend_message(frames, replies)
        if replies:
            assert self.frontend is not None
            self.send_when_stored(self.frontend, replies, _not_stored)  # "dispatched" only once stored

    def _frontend_message(self, frames: Frames, replies: list[list[bytes]]) -> None:
        message = emqp.parse(frames)
        if isinstance(message, emqp.Invalid):
            self.counters.invalid += 1
            log.info("frontend: %s", message.reason)
            return
        command, identity = message.command, message.identity
        if identity in self.schedulers:
            self.schedulers[identity] = self.engine.clock.now()
        if command == emqp.REQUEST:
            self._request(message, replies)
        elif command == emqp.INFORM:
            self._inform_scheduler(message)
        elif command in (emqp.SCHEDULE, emqp.UNSCHEDULE):
            self._schedule(message, replies)
        elif command in (emqp.KBYE, emqp.KBAI):
            if self.schedulers.pop(identity, None) is not None:
                log.info("scheduler %s gone (it said KBYE)", _text(identity))
        elif command == emqp.DISCONNECT:
            self.counters.ignored_disconnects += 1  # the original stops for anyone who asks
            log.info("frontend: DISCONNECT from %s ignored (the admin socket stops the gateway, if enabled)",
                     _text(identity))
        elif command != emqp.HEARTBEAT:
            self.counters.invalid += 1
            log.info("frontend: unknown command %r from %s", command[:20], _text(identity))

    def _refuse(self, message: emqp.Message, reason: str, replies: list[list[bytes]]) -> None:
        self.counters.refused += 1
        self.traffic.error(ERROR_CODE)
        # Summed up when they repeat: a flood of requests to a full queue writes a few lines.
        self.refusals.note(reason.split(":")[0][:60], f"frontend: request {message.msgid[:60]!r} from "
                                                      f"{_text(message.identity)} refused: {reason}")
        replies.append(emqp.refusal(message.identity, _msgid(), message.msgid, reason))

    def _request(self, message: emqp.Message, replies: list[list[bytes]]) -> None:
        request = emqp.parse_request(message.body)
        if isinstance(request, emqp.Invalid):
            self.counters.invalid += 1
            self._refuse(message, request.reason, replies)
            return
        name = emqp.queue_name(request.queue)
        if isinstance(name, emqp.Invalid):
            self._refuse(message, name.reason, replies)
            return
        engine = self.engine
        if self.limits.reroute_unknown and name != emqp.DEFAULT_QUEUE.decode():
            existing = engine.queue(name)
            if existing is None or not existing.consumers:
                name = emqp.DEFAULT_QUEUE.decode()
        queue = self._queue(name)
        if engine.storage.failure is not None:
            self._refuse(message, f"the store failed: {engine.storage.failure}", replies)
            return
        refusal = engine.publish_refusal(name)
        if refusal is not None:
            self._refuse(message, refusal, replies)
            return
        if self.limits.max_depth and queue.depth >= self.limits.max_depth:
            self._refuse(message, f"queue {name} holds {queue.depth} requests (the limit)", replies)
            return
        delivered: dict[int, bytes] = {}
        self._delivered_now = delivered
        try:
            # Who published is looked up only while something is traced.
            message_id = engine.publish(name, request.payload, origin=ORIGIN, headers={
                MSGID_HEADER: message.msgid.decode("latin-1"), HEADERS_HEADER: request.headers.decode("latin-1")},
                client=None if engine.tracer is None else identity_client(message.identity))
        finally:
            self._delivered_now = None
        worker = delivered.get(message_id)
        if worker is not None:
            # Handed to a worker at once: the original's "dispatched" REPLY and STATUS count (never for
            # a buffered one).
            self.processed_by_queue[name] += 1
            self.processed_by_worker[worker] += 1
            replies.append(emqp.reply(message.identity, _msgid(), message.msgid))
        elif not engine.hands_over_at_once:
            # Queues shared with other nodes: stored first, then fetched by the node of a worker with a free
            # slot, which says so if the slot was free as the request came (`_dispatched`).
            self._awaiting[message_id] = (message.identity, message.msgid)
            if len(self._awaiting) > DISPATCHED_KEPT:
                del self._awaiting[next(iter(self._awaiting))]  # it waited for a READY: no REPLY

    def _dispatched(self, frames: list[bytes]) -> None:
        """A worker, of this node or another, took a request of this node's client as it arrived: its REPLY."""
        try:
            message_id = int(frames[0])
        except (IndexError, ValueError):
            return
        awaiting = self._awaiting.pop(message_id, None)
        if awaiting is not None:
            identity, msgid = awaiting
            self._send_frontend(emqp.reply(identity, _msgid(), msgid))

    def _inform_scheduler(self, message: emqp.Message) -> None:
        inform = emqp.parse_inform(message.body)
        if isinstance(inform, emqp.Invalid) or inform.peer_type != emqp.SCHEDULER:
            self.counters.invalid += 1
            problem = inform.reason if isinstance(inform, emqp.Invalid) else "workers INFORM on the worker socket"
            log.info("frontend: INFORM from %s refused: %s", _text(message.identity), problem)
            self._send_frontend(emqp.disconnect(message.identity, _msgid(), problem))
            return
        self.schedulers.pop(message.identity, None)
        self.schedulers[message.identity] = self.engine.clock.now()  # the newest gets the next SCHEDULE
        log.info("scheduler %s joined", _text(message.identity))
        self._send_frontend(emqp.ack(message.identity, _msgid(), message.msgid))
        self._send_frontend(emqp.heartbeat(message.identity, _msgid(), time.time()))

    def _schedule(self, message: emqp.Message, replies: list[list[bytes]]) -> None:
        """SCHEDULE and UNSCHEDULE. With an emq-scheduler connected, as the original: SCHEDULE to the
        newest scheduler, UNSCHEDULE to every one. Without, the gateway keeps the schedule itself
        (in the store) and each firing is a request of its queue. UNSCHEDULE also removes the
        gateway's own schedule of that job."""
        schedule = emqp.parse_schedule(message.body)
        key = emqp.schedule_key(schedule.payload) if isinstance(schedule, emqp.Schedule) else schedule
        if isinstance(key, emqp.Invalid):  # the schedule's own problem, or its job's
            self.counters.invalid += 1
            self._refuse(message, key.reason, replies)
            return
        assert isinstance(schedule, emqp.Schedule)
        unschedule = message.command == emqp.UNSCHEDULE
        if unschedule and self.engine.schedules.remove(SCHEDULE_KEY_PREFIX + key):
            log.info("schedule %s removed", key)
        if self.schedulers:
            targets = list(self.schedulers) if unschedule else list(self.schedulers)[-1:]
            for identity in targets:
                self._send_frontend(emqp.forward(identity, message))
            return
        if unschedule:
            return
        name = emqp.queue_name(schedule.queue)
        headers = emqp.parse_headers(schedule.headers)
        try:
            run_count = int(headers.get(emqp.RUN_COUNT, FOREVER))
        except ValueError:
            run_count = None
        if isinstance(name, emqp.Invalid) or run_count is None:
            self.counters.invalid += 1
            self._refuse(message, name.reason if isinstance(name, emqp.Invalid)
                         else f"run_count:{headers[emqp.RUN_COUNT][:20]} is not a number", replies)
            return
        queue = self._queue(name)
        try:
            self.engine.schedules.add(
                SCHEDULE_KEY_PREFIX + key, queue.name, schedule.payload,
                headers={HEADERS_HEADER: emqp.REPLY_REQUESTED},  # as the original scheduler's requests
                interval=schedule.interval, cron=schedule.cron.decode("utf-8", "replace") or None,
                run_count=run_count, at_once=emqp.NOHASTE not in headers, origin=ORIGIN)
        except InvalidSchedule as error:
            self.counters.invalid += 1
            self._refuse(message, str(error), replies)
            return
        log.info("schedule %s: %s on queue %s", key, f"every {schedule.interval} s" if schedule.interval is not None
                 else f"cron {schedule.cron.decode('utf-8', 'replace')!r}", name)

    def _fired(self, schedule: Schedule) -> None:
        """A schedule of eMQP's fires: its queue is there (made again if it was deleted)."""
        if schedule.key.startswith(SCHEDULE_KEY_PREFIX):
            self._queue(schedule.topic)

    # -- the admin socket ----------------------------------------------------------------------

    def _admin(self, batch: list[Frames]) -> None:
        for frames in batch:
            message = emqp.parse(frames)
            if isinstance(message, emqp.Invalid):
                self.counters.invalid += 1
                log.info("admin: %s", message.reason)
                continue
            answer = self._admin_answer(message)
            if answer is not None:
                assert self.admin is not None
                self.admin.send(answer)

    def _admin_answer(self, message: emqp.Message) -> list[bytes] | None:
        command, identity = message.command, message.identity
        if command == emqp.STATUS:
            return emqp.reply(identity, _msgid(), json.dumps(self.status()).encode())
        if command == emqp.ROUTER_SHOW_WORKERS:
            return emqp.reply(identity, _msgid(), json.dumps(self.show_workers()).encode())
        if command == emqp.ROUTER_SHOW_SCHEDULERS:
            return emqp.reply(identity, _msgid(), json.dumps(self.show_schedulers()).encode())
        if command == emqp.DISCONNECT:
            if not self.limits.admin_disconnect or self.stop_gateway is None:
                self.counters.ignored_disconnects += 1
                self.traffic.error(ERROR_CODE)
                return emqp.refusal(identity, _msgid(), message.msgid,
                                    "DISCONNECT is turned off on this gateway (--emqp-admin-disconnect turns it on)")
            log.info("admin: DISCONNECT from %s: stopping", _text(identity))
            self.stop_gateway()
            return emqp.ack(identity, _msgid(), message.msgid)
        if command == HELLO:
            return None  # emq-cli's greeting: it reads no answer
        self.traffic.error(ERROR_CODE)
        return emqp.refusal(identity, _msgid(), message.msgid, f"unknown admin command {_text(command[:40])!r}")

    def status(self) -> dict[str, Any]:
        """The original's STATUS keys, with what polymq knows: requests held by workers, their age
        since published (mean and oldest, ms), requests waiting, requests handed to workers."""
        in_flight: Counter[str] = Counter()
        ages: dict[str, list[int]] = {}
        now_ns = time.time_ns()
        for worker in self.workers.values():
            for message in worker.jobs:
                owner = message.owner
                name = owner.queue.name if isinstance(owner, Consumer) else "?"
                in_flight[name] += 1
                ages.setdefault(name, []).append((now_ns - message.timestamp_ns) // 1_000_000)
        waiting = {}
        for name in sorted(self.known_queues):
            queue = self.engine.queue(name)
            if queue is not None and queue.depth + queue.deferred_count:
                waiting[name] = queue.depth + queue.deferred_count
        return {
            "inflight_messages_by_queue": dict(in_flight),
            "latency_messages_by_queue": {name: sum(values) // len(values) for name, values in ages.items()},
            "max_latency_messages_by_queue": {name: max(values) for name, values in ages.items()},
            "waiting_messages_by_queue": waiting,
            "processed_messages_by_queue": dict(self.processed_by_queue),
            "processed_messages_by_worker": {_text(identity): count
                                             for identity, count in self.processed_by_worker.items()},
            "polymq": {**attrs.asdict(self.counters), "schedules": self.schedules(),
                       "handed_out_by_queue": dict(self.handed_out_by_queue)},
        }

    def schedules(self) -> dict[str, dict[str, Any]]:
        """The gateway's own eMQP schedules by job identity: queue, interval or cron, runs left, next firing."""
        shown = {}
        for key, schedule in self.engine.schedules.by_key.items():
            if key.startswith(SCHEDULE_KEY_PREFIX):
                shown[key.removeprefix(SCHEDULE_KEY_PREFIX)] = {
                    "queue": schedule.topic, "interval": schedule.interval, "cron": schedule.cron,
                    "runs_left": schedule.runs_left, "next": schedule.next_wall}
        return shown

    def show_workers(self) -> dict[str, Any]:
        queues: dict[str, list[tuple[int, str]]] = {}
        for identity, worker in self.workers.items():
            for weight, name in worker.queues:
                queues.setdefault(name, []).append((weight, _text(identity)))
        return {
            "connected_workers": {
                _text(identity): {"queues": [[weight, name] for weight, name in worker.queues],
                                  "hb": worker.last_seen, "available_slots": worker.pool.tokens}
                for identity, worker in self.workers.items()},
            "connected_queues": {name: [list(pair) for pair in sorted(pairs, key=lambda pair: -pair[0])]
                                 for name, pairs in queues.items()},
        }

    def show_schedulers(self) -> dict[str, Any]:
        return {"connected_schedulers": {_text(identity): {"hb": seen} for identity, seen in self.schedulers.items()}}


def _not_stored(reply: Frames, error: OSError) -> Frames:
    """A "dispatched" REPLY whose request the store failed to store becomes a refusal."""
    if len(reply) != 6:  # a refusal already
        return reply
    return emqp.refusal(reply[0], reply[4], reply[5], f"not stored: {error}")


def shown_id(message: Message) -> str:
    """The msgid an eMQP worker sees for a message (the same at every attempt)."""
    return _emqp_fields(message)[0].decode("latin-1")


def identity_client(identity: bytes) -> Client:
    """A client or worker as traces show it: its ZeroMQ identity (ZeroMQ hides its address)."""
    return Client(ORIGIN, "", identity.decode("utf-8", "backslashreplace"))


def _emqp_fields(message: Message) -> tuple[bytes, bytes]:
    """The msgid and headers a worker gets: the client's, or for a message without one (another
    protocol's, a schedule's firing) a msgid made from its id (the same at every attempt)."""
    headers = message.headers
    msgid: object = None
    csv: object = None
    if type(headers) is dict:
        msgid, csv = headers.get(MSGID_HEADER), headers.get(HEADERS_HEADER)
    # latin-1 carries the client's bytes unchanged; "replace": such a header set by another protocol
    return (msgid.encode("latin-1", "replace") if type(msgid) is str else str(uuid.UUID(int=message.id)).encode(),
            csv.encode("latin-1", "replace") if type(csv) is str else b"")
