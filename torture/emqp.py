"""eMQP's clients in a run: clients sending REQUESTs (acknowledged by the "dispatched" REPLY, which
comes once the request is stored and handed to a worker), and jobmanager-style workers (INFORM,
READY slots, a READY after each job, HEARTBEATs). A worker cannot give a job back: no requeues.

A request that waits for a free worker gets no REPLY: it stays unacknowledged (and is delivered
all the same). A worker that goes silent loses its jobs to the others after the heartbeat timeout.
"""

from __future__ import annotations

import json
import threading
import time

import zmq

from polymq.clients import zmq_socket
from polymq.codecs import emqp
from polymq.torture.gateway import GatewayProcess
from polymq.torture.topology import Sink
from polymq.torture.worker import (
    ACK,
    CRASH,
    IO_TIMEOUT_S,
    POLL_S,
    ConsumerSession,
    Refused,
    Run,
    client_thread,
    publisher_keeps_going,
)

POLL_MS = int(POLL_S * 1000)
# READYs a worker sends when it joins (its processes, `--emqp-slots`, 1 by default), then one per
# job; the run tells the gateway that count (`--emqp-worker-processes`), so start-up READYs end no
# job (docs/testing.md, "What torture found").
# A worker's HEARTBEAT every second, far inside the gateway's timeout the run sets (HEARTBEAT_TIMEOUT_MS).
HEARTBEAT_EVERY_S = 1.0
# The gateway's --emqp-heartbeat-timeout in a run: long enough that a live worker on a loaded
# machine is never taken for gone (its jobs would come twice), short enough that a crashed one's
# jobs come back within a run.
HEARTBEAT_TIMEOUT_MS = 20_000
# Requests a client keeps awaiting their REPLY: one, so that a worker of its queue (two, one slot
# each) is free as each comes and it is confirmed; a deeper window mostly makes requests that wait,
# which get no REPLY (a flood uses the flood's window).
CLIENT_WINDOW = 1
# A request with no REPLY this long is taken as waiting for a worker: it leaves the client's window.
WAITING_S = 2.0


def publisher(run: Run, index: int) -> threading.Thread:
    rng = run.worker_rng()
    flows = run.flows("emqp")

    def session(gateway: GatewayProcess, generation: int) -> None:
        with zmq.Context() as context:
            identity = b"torture-client-%d-%d" % (index, run.ledger.new_session())
            sock = zmq_socket.open_socket(context, zmq.DEALER, gateway.addresses["emqp-frontend"], identity=identity)
            pending: dict[bytes, tuple[bytes, float]] = {}  # msgid → (key, sent at)
            try:
                while publisher_keeps_going(run, generation):
                    now = time.monotonic()
                    for msgid in [msgid for msgid, (_, sent_at) in pending.items() if now - sent_at > WAITING_S]:
                        del pending[msgid]
                    flow = rng.choice(flows)
                    window = run.window("emqp") if run.flooding("emqp") else CLIENT_WINDOW
                    if len(pending) < window and not run.throttled(flow):
                        if run.roll(rng, run.settings.disconnect_p):
                            run.ledger.record_session_end("emqp", 0, disconnected=True)
                            return
                        for key, body in run.bodies(flow, 1, rng):
                            msgid = b"r" + key
                            pending[msgid] = (key, time.monotonic())
                            zmq_socket.send(sock, emqp.client_message(emqp.REQUEST, msgid, flow.topic.encode(),
                                                                      b"", body))
                        continue
                    if not sock.poll(POLL_MS):
                        continue
                    answer(run, zmq_socket.receive(sock), pending)
                while run.gateways.alive(generation) and sock.poll(POLL_MS):
                    answer(run, zmq_socket.receive(sock), pending)
            finally:
                sock.close(linger=0)

    return client_thread(run, f"emqp-publisher-{index}", session, run.publishing)


def answer(run: Run, frames: list[bytes], pending: dict[bytes, tuple[bytes, float]]) -> None:
    # "Dispatched": ['', 'eMQP/1.0', 'REPLY', its msgid, the request's msgid]; a refusal adds a reason.
    if len(frames) == 5 and frames[2] == emqp.REPLY:
        sent = pending.pop(frames[4], None)
        if sent is not None:
            run.ledger.record_acked("emqp", [sent[0]], time.monotonic() - sent[1])
        return  # the REPLY of a request that had left the window: still unacknowledged
    if len(frames) == 6 and frames[2] == emqp.REPLY and frames[5].startswith(emqp.ERROR_PREFIX):
        refused = pending.pop(frames[4], None)
        if refused is not None:
            run.ledger.record_refused("emqp", [refused[0]], repr(frames))
        return
    if frames[2:3] != [emqp.HEARTBEAT]:
        run.ledger.record_error(f"emqp client: unexpected answer {frames!r}")


def consumer(run: Run, sink: Sink, index: int) -> threading.Thread:
    rng = run.worker_rng()

    def session(gateway: GatewayProcess, generation: int) -> None:
        state = ConsumerSession(run, sink.name, "emqp", generation, rng, requeue=False)
        try:
            with zmq.Context() as context:
                identity = b"torture-worker-%d" % state.id
                sock = zmq_socket.open_socket(context, zmq.DEALER, gateway.addresses["emqp-backend"],
                                              identity=identity)
                try:
                    zmq_socket.send(sock, emqp.client_message(emqp.INFORM, b"inform", json.dumps([[10, sink.queue]])
                                                              .encode(), emqp.WORKER))
                    informed = False
                    deadline = time.monotonic() + IO_TIMEOUT_S
                    beat = time.monotonic()
                    jobs = 0
                    while state.keep_going():
                        now = time.monotonic()
                        if now - beat >= HEARTBEAT_EVERY_S:
                            beat = now
                            zmq_socket.send(sock, emqp.client_message(emqp.HEARTBEAT, b"beat-%d" % jobs,
                                                                      repr(time.time()).encode()))
                        if not informed and now > deadline:
                            raise TimeoutError("no ACK to INFORM")
                        if not sock.poll(POLL_MS):
                            continue
                        frames = zmq_socket.receive(sock)
                        command = frames[2:3]
                        if command == [emqp.ACK] and not informed:
                            informed = True
                            state.subscribed()
                            for number in range(run.settings.emqp_slots):
                                zmq_socket.send(sock, emqp.client_message(emqp.READY, b"ready-%d" % number))
                            continue
                        if command == [emqp.HEARTBEAT]:
                            continue
                        if command == [emqp.KBYE]:
                            return  # the gateway stops: its jobs go back
                        if command == [emqp.DISCONNECT] and not informed and run.ledger.refusals_allowed:
                            raise Refused(repr(frames))  # its queues could not be made for now
                        if command != [emqp.REQUEST] or len(frames) != 7:
                            run.ledger.record_error(f"emqp worker: unexpected {frames!r}")
                            continue
                        # ['', 'eMQP/1.0', 'REQUEST', msgid, queue, headers, payload]
                        action = state.received(frames[6])
                        if action == CRASH:
                            return
                        jobs += 1
                        zmq_socket.send(sock, emqp.client_message(emqp.READY, b"done-%d" % jobs))
                        if action != ACK:
                            return  # a random disconnect
                    state.ended_cleanly()
                finally:
                    sock.close(linger=0 if state.crashed else 1000)
        finally:
            state.end()

    return client_thread(run, f"emqp-worker-{sink.name}-{index}", session, run.consuming)
