"""The records of a run, written by the client threads, and the check of them (pure: no sockets).

Every message copy (a body in one sink) is followed from its send to each acknowledgement a consumer
gave it. A consumer *session* is one connection of one consumer; it ends cleanly, or *hard*: a
random disconnect, a crash holding unacknowledged messages, or a gateway that went away. A copy
acknowledged twice is a duplicate; it is explained when the first acknowledgement's session ended
hard, or its gateway process ended (SIGKILL or stop) before the second came (the acknowledgement may
never have been read or stored), or a JetStream server was SIGKILLed between the two (an
acknowledgement on its way to it is lost with it), or a put-back of it was cut the same way (on
JetStream the copy at the tail is stored before the delivery it replaces is acknowledged); otherwise
it is a finding. A fault of the cluster's links or processes (a server cut off or paused, a gateway
paused: `--partitions`) between the two explains it as a server's SIGKILL does.

A queue with consumers that delivers nothing while acknowledged copies wait for it, for longer than the
bound a run is given, is a finding too (`stalled`): a consumer that never resumes loses nothing, and is
as bad.
"""

from __future__ import annotations

import collections
import itertools
import threading
import time
from collections import Counter, defaultdict

import attrs

from polymq.torture.bodies import BodyId, parse_body
from polymq.torture.topology import FLOWS, PROTOCOLS, SINKS

EXAMPLES = 5  # copies quoted per kind of problem


@attrs.frozen(slots=True)
class Finish:
    session: int
    generation: int
    order: int  # when, among the ledger's events (`Ledger.tick`)


@attrs.frozen(slots=True)
class Requeue:
    generation: int  # of the gateway asked to put the copy back
    order: int


@attrs.define(slots=True)
class ProtocolCounts:
    sent: int = 0  # copies of publishes written to a socket
    acked: int = 0  # copies of publishes the gateway confirmed
    delivered: int = 0  # distinct copies a consumer of this protocol acknowledged
    lost: int = 0
    duplicated: int = 0
    unexplained_duplicates: int = 0
    unexpected: int = 0
    receipts: int = 0  # deliveries received, redeliveries included
    requeues: int = 0
    crashes: int = 0  # consumer sessions ended holding unacknowledged messages
    disconnects: int = 0  # sessions (consumers and publishers) closed at a random moment
    refused: int = 0  # copies of publishes answered with the protocol's error (a shared engine out of reach)

    def line(self, protocol: str) -> str:
        return (f"{protocol}: acked={self.acked} delivered={self.delivered} lost={self.lost}"
                f" duplicated={self.duplicated} unexpected={self.unexpected} sent={self.sent}"
                f" receipts={self.receipts} requeues={self.requeues} crashes={self.crashes}"
                f" disconnects={self.disconnects} refused={self.refused}"
                f" unexplained_duplicates={self.unexplained_duplicates}")


@attrs.frozen(slots=True)
class Report:
    protocols: dict[str, ProtocolCounts]
    kills: int
    problems: tuple[str, ...]  # examples of each finding
    harness_errors: tuple[str, ...]
    server_kills: int = 0  # JetStream servers SIGKILLed (`--jetstream`)
    faults: int = 0  # servers cut off or paused, gateways paused (`--partitions`)
    stalls: tuple[str, ...] = ()  # queues that delivered nothing past the bound while copies waited

    def total(self) -> ProtocolCounts:
        total = ProtocolCounts()
        for counts in self.protocols.values():
            for field in attrs.fields(ProtocolCounts):
                setattr(total, field.name, getattr(total, field.name) + getattr(counts, field.name))
        return total

    @property
    def ok(self) -> bool:
        total = self.total()
        return not (total.lost or total.unexpected or total.unexplained_duplicates or self.harness_errors
                    or self.stalls)

    def last_line(self) -> str:
        total = self.total()
        return (f"acked={total.acked} delivered={total.delivered} lost={total.lost}"
                f" duplicated={total.duplicated} unexpected={total.unexpected} protocols={','.join(self.protocols)}")


class Ledger:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.sent: dict[bytes, BodyId] = {}  # body key → its id, from the moment it is written
        self.acked: set[bytes] = set()
        self.finishes: dict[tuple[bytes, str], list[Finish]] = defaultdict(list)
        self.missing: set[tuple[bytes, str]] = set()  # acknowledged copies not delivered yet
        self.unexpected: list[tuple[str, str]] = []  # (sink, what came)
        self.receipts: Counter[str] = Counter()  # by sink
        self.copy_receipts: Counter[tuple[bytes, str]] = Counter()  # by copy: what a lost one went through
        self.requeues: Counter[str] = Counter()  # by sink
        self.copy_requeues: dict[tuple[bytes, str], list[Requeue]] = defaultdict(list)
        self.crashes: Counter[str] = Counter()  # by protocol
        self.disconnects: Counter[str] = Counter()  # by protocol
        self.hard_ended: set[int] = set()  # consumer sessions
        self.kills: set[int] = set()  # generations ended by SIGKILL
        self.ended: dict[int, int] = {}  # generations ended by SIGKILL or a stop → when
        self.server_kills: list[int] = []  # when a JetStream server was SIGKILLed
        self.faults: list[int] = []  # when a server was cut off, paused or healed, a gateway paused or resumed
        # Stalls: acknowledged copies waiting per sink, since when some have, its last first delivery.
        self.waiting: Counter[str] = Counter()
        self.waiting_since: dict[str, float] = {}
        self.delivered_at: dict[str, float] = {}
        self.stalls: dict[str, str] = {}  # by sink: what the watch saw
        self._events = itertools.count()  # the order of finishes, ends and server kills
        self.errors: list[str] = []
        self.ack_latencies: defaultdict[str, list[float]] = defaultdict(list)  # by publishing protocol
        self.acked_in_window: Counter[str] = Counter()  # by publishing protocol, while measuring
        self.delivered_in_window: Counter[str] = Counter()  # by consuming protocol, while measuring
        self.measuring = False
        self.flow_sent: Counter[int] = Counter()  # copies, by flow
        self.flow_done: Counter[int] = Counter()  # distinct copies delivered, by flow
        self.subscribed: set[str] = set()  # consumer threads that have made their queue
        # A publish answered with the protocol's error is a refusal (nothing promised, nothing to lose)
        # where the servers under the gateways are SIGKILLed; elsewhere it is a finding.
        self.refusals_allowed = False
        # A late acknowledgement answered as one of an id not in flight (NSQ's E_FIN_FAILED) is the gateway's
        # right answer where gateways are paused past the ack wait; elsewhere it is a finding.
        self.late_acks_allowed = False
        self.refused: Counter[str] = Counter()  # copies, by publishing protocol
        self._sessions = itertools.count(1)

    # -- writers -----------------------------------------------------------------------------

    def new_session(self) -> int:
        with self.lock:
            return next(self._sessions)

    def record_subscribed(self, thread: str) -> None:
        with self.lock:
            self.subscribed.add(thread)

    def record_sent(self, bodies: list[tuple[bytes, BodyId]]) -> None:
        with self.lock:
            for key, body_id in bodies:
                self.sent[key] = body_id
                self.flow_sent[body_id.flow] += len(FLOWS[body_id.flow].sinks)

    def record_acked(self, protocol: str, keys: list[bytes], latency: float) -> None:
        with self.lock:
            for key in keys:
                if key in self.acked:
                    continue
                self.acked.add(key)
                body_id = self.sent[key]
                for sink in FLOWS[body_id.flow].sinks:
                    if not self.finishes.get((key, sink)):
                        self.missing.add((key, sink))
                        if not self.waiting[sink]:
                            self.waiting_since[sink] = time.monotonic()
                        self.waiting[sink] += 1
                if self.measuring:
                    self.acked_in_window[protocol] += 1
            if self.measuring:
                self.ack_latencies[protocol].append(latency)

    def record_receipt(self, sink: str, body: bytes) -> bytes | None:
        """A delivery arrived at `sink`: its body's key when it is one this run sent there, else
        None (counted as unexpected; the consumer acknowledges it all the same)."""
        body_id = parse_body(body)
        with self.lock:
            self.receipts[sink] += 1
            if body_id is None:
                self.unexpected.append((sink, f"corrupted or foreign body {body[:60]!r}"))
                return None
            key = body_id.key
            if key not in self.sent:
                self.unexpected.append((sink, f"never sent: {body[:60]!r}"))
                return None
            if sink not in FLOWS[body_id.flow].sinks:
                topic = FLOWS[body_id.flow].topic
                self.unexpected.append((sink, f"published to {topic}, not read here: {body[:60]!r}"))
                return None
            self.copy_receipts[(key, sink)] += 1
            return key

    def record_finish(self, sink: str, key: bytes, session: int, generation: int) -> None:
        with self.lock:
            finishes = self.finishes[(key, sink)]
            if not finishes:
                self.flow_done[self.sent[key].flow] += 1
                if self.measuring:
                    self.delivered_in_window[SINKS[sink].protocol] += 1
            finishes.append(Finish(session, generation, next(self._events)))
            if (key, sink) in self.missing:
                self.missing.discard((key, sink))
                self.waiting[sink] -= 1
                self.delivered_at[sink] = time.monotonic()

    def record_requeue(self, sink: str, key: bytes, generation: int) -> None:
        with self.lock:
            self.requeues[sink] += 1
            self.copy_requeues[(key, sink)].append(Requeue(generation, next(self._events)))

    def record_session_end(self, protocol: str, session: int, *, crashed: bool = False,
                           disconnected: bool = False, broken: bool = False) -> None:
        with self.lock:
            if crashed or disconnected or broken:
                self.hard_ended.add(session)
            if crashed:
                self.crashes[protocol] += 1
            if disconnected:
                self.disconnects[protocol] += 1

    def record_kill(self, generation: int) -> None:
        with self.lock:
            self.kills.add(generation)

    def record_restart(self, generation: int) -> None:
        with self.lock:
            self.ended.setdefault(generation, next(self._events))

    def record_server_kill(self) -> None:
        with self.lock:
            self.server_kills.append(next(self._events))

    def record_fault(self) -> None:
        """A server cut off or paused, or healed; a gateway paused or resumed."""
        with self.lock:
            self.faults.append(next(self._events))

    def watch_stalls(self, bound_s: float) -> list[str]:
        """Sinks whose acknowledged copies have waited past `bound_s` with none of them delivered meanwhile:
        each recorded once, and returned the first time."""
        now = time.monotonic()
        found = []
        with self.lock:
            for sink, count in self.waiting.items():
                if count <= 0 or sink in self.stalls:
                    continue
                idle = now - max(self.waiting_since[sink], self.delivered_at.get(sink, 0.0))
                if idle > bound_s:
                    self.stalls[sink] = (f"stalled: {sink} delivered nothing for {idle:.0f} s while {count}"
                                         " acknowledged copies waited for it")
                    found.append(self.stalls[sink])
        return found

    def record_refused(self, protocol: str, keys: list[bytes], answer: str) -> None:
        """A publish of these bodies was answered with the protocol's error: never acknowledged."""
        if not self.refusals_allowed:
            self.record_error(f"{protocol} publisher: unexpected answer {answer}")
            return
        with self.lock:
            self.refused[protocol] += sum(len(FLOWS[self.sent[key].flow].sinks) for key in keys)

    def record_error(self, text: str) -> None:
        with self.lock:
            self.errors.append(text)

    # -- readers -----------------------------------------------------------------------------

    def _explained(self, first: Finish, second: Finish, requeues: list[Requeue]) -> bool:
        """A copy acknowledged again: the first acknowledgement's connection ended hard, or its
        gateway process ended (SIGKILL, stop) before the second one's, or a JetStream server was
        SIGKILLed between the two; or the copy was put back at the tail (PHPMQ's 005) by a gateway
        that ended, or while a server was SIGKILLed, before the second: on JetStream the copy at the
        tail is stored before the delivery it replaces is acknowledged, and a crash between leaves both."""
        if first.session in self.hard_ended:
            return True
        ended = self.ended.get(first.generation)
        if ended is not None and ended < second.order:
            return True
        if any(first.order < kill < second.order for kill in (*self.server_kills, *self.faults)):
            return True
        return any(self._cut(requeue.generation, requeue.order, second.order) for requeue in requeues)

    def _cut(self, generation: int, begin: int, end: int) -> bool:
        """The gateway of `generation` ended, or a JetStream server was SIGKILLed, between the two."""
        ended = self.ended.get(generation)
        if ended is not None and begin < ended < end:
            return True
        return any(begin < kill < end for kill in (*self.server_kills, *self.faults))

    def backlog(self, flow: int) -> int:
        """Copies of `flow` sent and not delivered yet (publishers pause above a limit)."""
        with self.lock:
            return self.flow_sent[flow] - self.flow_done[flow]

    def progress(self) -> tuple[int, int]:
        """(deliveries received so far, acknowledged copies not delivered yet)."""
        with self.lock:
            return sum(self.receipts.values()), len(self.missing)

    def check(self) -> Report:
        with self.lock:
            counts = {protocol: ProtocolCounts() for protocol in PROTOCOLS}
            problems: list[str] = []
            for key, body_id in self.sent.items():
                flow = FLOWS[body_id.flow]
                counts[flow.publisher].sent += len(flow.sinks)
                if key in self.acked:
                    counts[flow.publisher].acked += len(flow.sinks)
            lost = sorted(self.missing)
            for _, sink in lost:
                counts[SINKS[sink].protocol].lost += 1
            if lost:
                by_sink = collections.Counter(sink for _, sink in lost)
                counted = ", ".join(f"{sink}={count}" for sink, count in sorted(by_sink.items()))
                problems.append(f"lost by sink: {counted}")
            problems += [f"lost: {key.decode()} in {sink}, received {self.copy_receipts[(key, sink)]} times, never"
                         " acknowledged" for key, sink in lost[:EXAMPLES]]
            unexplained = []
            for (key, sink), finishes in self.finishes.items():
                protocol = SINKS[sink].protocol
                counts[protocol].delivered += 1
                if len(finishes) > 1:
                    counts[protocol].duplicated += 1
                    requeues = self.copy_requeues.get((key, sink), [])
                    if not all(self._explained(first, second, requeues)
                               for first, second in itertools.pairwise(finishes)):
                        counts[protocol].unexplained_duplicates += 1
                        unexplained.append(f"unexplained duplicate: {key.decode()} in {sink} {finishes}"
                                           f" put back {requeues}")
            problems += unexplained[:EXAMPLES]
            for sink, _ in self.unexpected:
                counts[SINKS[sink].protocol].unexpected += 1
            problems += [f"unexpected in {sink}: {what}" for sink, what in self.unexpected[:EXAMPLES]]
            for sink, number in self.receipts.items():
                counts[SINKS[sink].protocol].receipts += number
            for sink, number in self.requeues.items():
                counts[SINKS[sink].protocol].requeues += number
            for protocol in PROTOCOLS:
                counts[protocol].crashes = self.crashes[protocol]
                counts[protocol].disconnects = self.disconnects[protocol]
                counts[protocol].refused = self.refused[protocol]
            return Report(counts, len(self.kills), tuple(problems), tuple(self.errors), len(self.server_kills),
                          len(self.faults), tuple(self.stalls.values()))
