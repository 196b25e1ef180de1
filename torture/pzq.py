"""PZQ's clients in a run: DEALER producers waiting for `1`, ROUTER consumers answering `1` (done)
or `0` (send it again).

ZeroMQ reports no dead peer: a client leaves a gateway when the run has moved to the next process,
and a crashed consumer's deliveries come back with the ACK timeout or the next process life.
"""

from __future__ import annotations

import threading
import time

import zmq

from polymq.clients import zmq_socket
from polymq.codecs import pzq
from polymq.torture.gateway import GatewayProcess
from polymq.torture.topology import Sink
from polymq.torture.worker import (
    ACK,
    CRASH,
    IO_TIMEOUT_S,
    POLL_S,
    REQUEUE,
    ConsumerSession,
    Run,
    client_thread,
    publisher_keeps_going,
)

POLL_MS = int(POLL_S * 1000)


def publisher(run: Run, index: int) -> threading.Thread:
    rng = run.worker_rng()
    flows = run.flows("pzq")

    def session(gateway: GatewayProcess, generation: int) -> None:
        with zmq.Context() as context:
            sock = zmq_socket.open_socket(context, zmq.DEALER, gateway.addresses["pzq-receive"])
            pending: dict[bytes, tuple[bytes, float]] = {}  # producer id → (key, sent at)
            try:
                idle_since = time.monotonic()
                while publisher_keeps_going(run, generation) or (pending and run.gateways.alive(generation)):
                    flow = rng.choice(flows)
                    if (publisher_keeps_going(run, generation) and len(pending) < run.window("pzq")
                            and not run.throttled(flow)):
                        if run.roll(rng, run.settings.disconnect_p):
                            run.ledger.record_session_end("pzq", 0, disconnected=True)
                            return
                        for key, body in run.bodies(flow, 1, rng):
                            pending[key] = (key, time.monotonic())
                            zmq_socket.send(sock, [key, pzq.DELIMITER, body])
                        continue
                    if not sock.poll(POLL_MS):
                        if pending and time.monotonic() - idle_since > IO_TIMEOUT_S:
                            raise TimeoutError("no answer to a produce")
                        continue
                    idle_since = time.monotonic()
                    answer = zmq_socket.receive(sock)
                    sent = pending.pop(answer[0], None)
                    if sent is not None and answer[1:3] == [pzq.ACK_FAILED, b""]:
                        run.ledger.record_refused("pzq", [sent[0]], repr(answer))
                        continue
                    if sent is None or answer[1:3] != [pzq.ACK_OK, b""]:
                        run.ledger.record_error(f"pzq producer: unexpected answer {answer!r}")
                        continue
                    run.ledger.record_acked("pzq", [sent[0]], time.monotonic() - sent[1])
            finally:
                sock.close(linger=0)

    return client_thread(run, f"pzq-publisher-{index}", session, run.publishing)


def consumer(run: Run, sink: Sink, index: int) -> threading.Thread:
    rng = run.worker_rng()

    def session(gateway: GatewayProcess, generation: int) -> None:
        state = ConsumerSession(run, sink.name, "pzq", generation, rng)
        try:
            with zmq.Context() as context:
                sock = zmq_socket.open_socket(context, zmq.ROUTER, gateway.addresses["pzq-send"])
                state.subscribed()  # PZQ's queue is the gateway's own, there from its start
                try:
                    while state.keep_going():
                        if not sock.poll(POLL_MS):
                            continue
                        # [peer, key `<id>|<n>`, sent µs, timeout µs, '', body]
                        frames = zmq_socket.receive(sock)
                        action = state.received(frames[5] if len(frames) == 6 else b"")
                        if action == CRASH:
                            return
                        zmq_socket.send(sock, [frames[0], frames[1],
                                               pzq.ACK_FAILED if action == REQUEUE else pzq.ACK_OK])
                        if action not in (ACK, REQUEUE):
                            return  # a random disconnect
                    state.ended_cleanly()
                finally:
                    sock.close(linger=0 if state.crashed else 1000)
        finally:
            state.end()

    return client_thread(run, f"pzq-consumer-{sink.name}-{index}", session, run.consuming)
