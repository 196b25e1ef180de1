"""NSQ's clients in a run: publishers (PUB and MPUB, each confirmed by `OK`) to NSQ's topic and to
the queues of PHPMQ and eMQP, consumers of a channel (FIN, REQ)."""

from __future__ import annotations

import threading
import time
from collections import deque

from polymq.clients import nsq
from polymq.codecs import nsq_client
from polymq.codecs.nsq import HEARTBEAT, OK
from polymq.torture.gateway import GatewayProcess
from polymq.torture.topology import NSQ_CHANNEL, Sink
from polymq.torture.worker import (
    ACK,
    CRASH,
    IO_TIMEOUT_S,
    POLL_S,
    REQUEUE,
    ConsumerSession,
    Refused,
    Run,
    client_thread,
    publisher_keeps_going,
)

# Longer than any run's process life: no message times out (and comes back) while its consumer lives.
MSG_TIMEOUT_MS = 600_000
RDY = 20


def publisher(run: Run, index: int) -> threading.Thread:
    rng = run.worker_rng()
    flows = run.flows("nsq")

    def session(gateway: GatewayProcess, generation: int) -> None:
        with nsq.Connection(gateway.nsq_tcp, IO_TIMEOUT_S) as conn:
            pending: deque[tuple[list[bytes], float]] = deque()  # OKs come back in command order

            def read_ok() -> None:
                frame = conn.next_frame()
                if frame is None:
                    raise TimeoutError("no answer to a publish")
                keys, sent_at = pending.popleft()
                if frame.is_response and frame.data == OK:
                    run.ledger.record_acked("nsq", keys, time.monotonic() - sent_at)
                elif frame.is_error and frame.data.startswith((b"E_PUB_FAILED", b"E_MPUB_FAILED")):
                    run.ledger.record_refused("nsq", keys, repr(frame))
                else:
                    run.ledger.record_error(f"nsq publisher: unexpected answer {frame!r}")

            while publisher_keeps_going(run, generation):
                flow = rng.choice(flows)
                throttled = run.throttled(flow)
                if pending and (len(pending) >= run.window("nsq") or throttled):
                    read_ok()
                    continue
                if throttled:
                    time.sleep(POLL_S / 10)
                    continue
                if run.roll(rng, run.settings.disconnect_p):
                    run.ledger.record_session_end("nsq", 0, disconnected=True)
                    return  # what is pending stays unacknowledged
                made = run.bodies(flow, run.batch("nsq", rng), rng)
                pending.append(([key for key, _ in made], time.monotonic()))
                if len(made) == 1 and rng.random() < 0.5:
                    conn.send(nsq_client.pub(flow.topic, made[0][1]))
                else:
                    conn.send(nsq_client.mpub(flow.topic, [body for _, body in made]))
            while pending and run.gateways.alive(generation):
                read_ok()

    return client_thread(run, f"nsq-publisher-{index}", session, run.publishing)


def consumer(run: Run, sink: Sink, index: int) -> threading.Thread:
    rng = run.worker_rng()

    def session(gateway: GatewayProcess, generation: int) -> None:
        state = ConsumerSession(run, sink.name, "nsq", generation, rng)
        try:
            with nsq.Connection(gateway.nsq_tcp, IO_TIMEOUT_S) as conn:
                conn.send(nsq_client.identify({"feature_negotiation": True, "msg_timeout": MSG_TIMEOUT_MS}))
                reply = conn.next_frame()
                if reply is None or not reply.is_response:
                    raise TimeoutError(f"IDENTIFY answered {reply!r}")
                conn.send(nsq_client.sub(sink.queue, NSQ_CHANNEL))
                try:
                    conn.wait_for_ok("SUB")
                except nsq.ErrorFrame as error:
                    if not run.ledger.refusals_allowed:
                        raise
                    raise Refused(str(error)) from error
                conn.send(nsq_client.rdy(RDY))
                state.subscribed()
                while state.keep_going():
                    frame = conn.next_frame(POLL_S, heartbeats=True)
                    if frame is None:
                        continue
                    if frame.is_response and frame.data == HEARTBEAT:
                        conn.send(nsq_client.nop())
                        continue
                    if frame.is_error and run.ledger.late_acks_allowed and \
                            frame.data.startswith((b"E_FIN_FAILED", b"E_REQ_FAILED")):
                        continue  # its gateway was paused past the ack wait: the copy comes again
                    if not frame.is_message:
                        run.ledger.record_error(f"nsq consumer: unexpected frame {frame!r}")
                        continue
                    message = nsq_client.decode_message(frame.data)
                    action = state.received(message.body)
                    if action == CRASH:
                        return
                    if action == REQUEUE:
                        conn.send(nsq_client.req(message.msg_id, 0))
                        continue
                    conn.send(nsq_client.fin(message.msg_id))
                    if action != ACK:
                        return  # a random disconnect
                state.ended_cleanly()
        finally:
            state.end()

    return client_thread(run, f"nsq-consumer-{sink.name}-{index}", session, run.consuming)

