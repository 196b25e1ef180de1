"""MQKS's clients in a run: publishers (`publish --confirm`) to MQKS's event and to PZQ's queue,
consumers of a queue with `--manual-ack` (ack, reject)."""

from __future__ import annotations

import itertools
import threading
import time

from polymq.clients import mqks_blocking
from polymq.clients.mqks import consume_line
from polymq.codecs import mqks_client
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

_request_ids = itertools.count(1)


def publisher(run: Run, index: int) -> threading.Thread:
    rng = run.worker_rng()
    flows = run.flows("mqks")

    def session(gateway: GatewayProcess, generation: int) -> None:
        with mqks_blocking.Connection(gateway.addresses["mqks"], IO_TIMEOUT_S) as conn:
            pending: dict[str, tuple[bytes, float]] = {}  # request id → (key, sent at)

            def read_confirm() -> None:
                line = conn.next_line()
                if line is None:
                    raise TimeoutError("no answer to a publish")
                response = mqks_client.parse_response(line)
                sent = pending.pop(response.request_id, None)
                if sent is not None and not response.ok:
                    run.ledger.record_refused("mqks", [sent[0]], repr(line[:120]))
                    return
                if sent is None:
                    run.ledger.record_error(f"mqks publisher: unexpected answer {line[:120]!r}")
                    return
                run.ledger.record_acked("mqks", [sent[0]], time.monotonic() - sent[1])

            while publisher_keeps_going(run, generation):
                flow = rng.choice(flows)
                throttled = run.throttled(flow)
                if pending and (len(pending) >= run.window("mqks") or throttled):
                    read_confirm()
                    continue
                if throttled:
                    time.sleep(POLL_S / 10)
                    continue
                if run.roll(rng, run.settings.disconnect_p):
                    run.ledger.record_session_end("mqks", 0, disconnected=True)
                    return
                # The publisher's request id is the message's MQKS msg_id: unique within the run.
                lines = []
                for key, body in run.bodies(flow, 1 if not run.flooding("mqks") else run.batch("mqks", rng), rng):
                    request_id = f"p{key.decode()}"
                    pending[request_id] = (key, time.monotonic())
                    lines.append(mqks_client.request(request_id, "publish",
                                                     flow.topic.encode() + b" " + mqks_client.publish_data(body),
                                                     confirm=True))
                conn.send(b"".join(lines))
            while pending and run.gateways.alive(generation):
                read_confirm()

    return client_thread(run, f"mqks-publisher-{index}", session, run.publishing)


def consumer(run: Run, sink: Sink, index: int) -> threading.Thread:
    rng = run.worker_rng()

    def session(gateway: GatewayProcess, generation: int) -> None:
        state = ConsumerSession(run, sink.name, "mqks", generation, rng)
        consumer_id = f"c{state.id}"
        try:
            with mqks_blocking.Connection(gateway.addresses["mqks"], IO_TIMEOUT_S) as conn:
                conn.request(consumer_id, "consume", consume_line(sink.queue, sink.events, manual_ack=True),
                             confirm=True)
                while state.keep_going():
                    line = conn.next_line(POLL_S)
                    if line is None:
                        continue
                    response = mqks_client.parse_response(line)
                    if response.request_id == consumer_id and not response.ok and run.ledger.late_acks_allowed:
                        continue  # an ack after its gateway was paused past the ack wait: the copy comes again
                    if response.request_id != consumer_id or not response.ok:
                        run.ledger.record_error(f"mqks consumer: unexpected line {line[:120]!r}")
                        continue
                    if not response.data:
                        state.subscribed()  # the consume's confirmation
                        continue
                    if mqks_client.is_update(response.data):
                        continue
                    delivery = mqks_client.parse_delivery(response.data)
                    action = state.received(delivery.body)
                    if action == CRASH:
                        return
                    verb = "reject" if action == REQUEUE else "ack"
                    conn.request(f"a{next(_request_ids)}", verb, f"{consumer_id} {delivery.msg_id}")
                    if action not in (ACK, REQUEUE):
                        return  # a random disconnect
                state.ended_cleanly()
        finally:
            state.end()

    return client_thread(run, f"mqks-consumer-{sink.name}-{index}", session, run.consuming)


def bind_over_mqks(gateway: GatewayProcess, sinks: list[Sink]) -> None:
    """Bind other protocols' queues to their topics as an MQKS client does: a consume that names them
    (confirmed once the binding is shared), then the consumer's deletion, before anything is published."""
    with mqks_blocking.Connection(gateway.addresses["mqks"], IO_TIMEOUT_S) as conn:
        for sink in sinks:
            consumer_id = f"b{next(_request_ids)}"
            for request, expected in (((consumer_id, "consume",
                                        consume_line(sink.queue, sink.bound_over_mqks, manual_ack=True)),
                                       f"{consumer_id} ok "),
                                      ((f"d{consumer_id}", "delete_consumer", consumer_id), f"d{consumer_id} ok ")):
                conn.request(*request, confirm=True)
                line = conn.next_line()
                if line != expected.encode():
                    raise TimeoutError(f"binding {sink.queue} over MQKS: {line!r} where {expected!r}")
