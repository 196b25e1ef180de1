"""PHPMQ's clients in a run: publishers (001) to PHPMQ's queue, consumers (002 with a window; 004
acknowledges, 005 puts back).

PHPMQ confirms no publish, so a publisher proves its publishes handled with a barrier after each
batch: a marker published on the same connection to a queue of its own, which a watcher connection
consumes. A connection is read in order and a durable queue's delivery leaves only once its records
are written, so when the marker arrives the batch before it was handled and written: that batch
counts as acknowledged.
"""

from __future__ import annotations

import threading
import time

from polymq.clients import phpmq
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

WINDOW = 20  # a consumer's 002 count
BARRIER_WINDOW = 100  # the watcher's 002 count (markers of batches before a kill may be waiting)
NO_TTL = 0  # 005's TTL packet: 0 means none (docs/protocols/phpmq.md)


def publisher(run: Run, index: int) -> threading.Thread:
    rng = run.worker_rng()
    flows = run.flows("phpmq")

    def session(gateway: GatewayProcess, generation: int) -> None:
        session_id = run.ledger.new_session()
        barrier_queue = f"torture_barrier_{index}_{session_id}"
        address = gateway.addresses["phpmq"]
        with phpmq.Connection(address, IO_TIMEOUT_S) as conn, phpmq.Connection(address, IO_TIMEOUT_S) as watcher:
            watcher.consume(barrier_queue, BARRIER_WINDOW)
            markers = 0
            while publisher_keeps_going(run, generation):
                flow = rng.choice(flows)
                if run.throttled(flow):
                    time.sleep(POLL_S / 10)
                    continue
                if run.roll(rng, run.settings.disconnect_p):
                    run.ledger.record_session_end("phpmq", 0, disconnected=True)
                    return
                made = run.bodies(flow, run.batch("phpmq", rng), rng)
                sent_at = time.monotonic()
                for _, body in made:
                    conn.publish(flow.topic, body)
                markers += 1
                marker = b"barrier-%d" % markers
                conn.publish(barrier_queue, marker)
                while True:
                    [delivery] = watcher.deliveries(1)
                    watcher.ack(barrier_queue, delivery.message_id)
                    if delivery.content == marker:
                        break
                run.ledger.record_acked("phpmq", [key for key, _ in made], time.monotonic() - sent_at)

    return client_thread(run, f"phpmq-publisher-{index}", session, run.publishing)


def consumer(run: Run, sink: Sink, index: int) -> threading.Thread:
    rng = run.worker_rng()

    def session(gateway: GatewayProcess, generation: int) -> None:
        state = ConsumerSession(run, sink.name, "phpmq", generation, rng)
        try:
            with phpmq.Connection(gateway.addresses["phpmq"], IO_TIMEOUT_S) as conn:
                conn.consume(sink.queue, WINDOW)
                if state.first():
                    conn.barrier()  # PHPMQ answers nothing: this proves the queue made
                state.subscribed()
                while state.keep_going():
                    if not conn.received and not conn.read_deliveries(time.monotonic() + POLL_S):
                        continue
                    delivery = conn.received.pop(0)
                    action = state.received(delivery.content)
                    if action == CRASH:
                        return
                    if action == REQUEUE:
                        conn.requeue(sink.queue, delivery.message_id, NO_TTL)
                        continue
                    conn.ack(sink.queue, delivery.message_id)
                    if action != ACK:
                        return  # a random disconnect
                state.ended_cleanly()
        finally:
            state.end()

    return client_thread(run, f"phpmq-consumer-{sink.name}-{index}", session, run.consuming)
