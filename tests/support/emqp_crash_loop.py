"""The kill -9 crash loop over eMQP (docs/protocols/emqp.md): clients send REQUESTs on the frontend,
jobmanager-style workers take them on the backend (INFORM, READYs, a READY after each job), and the
gateway is SIGKILLed just after a worker got a job, at random moments (`support.crash_loop`).

What the protocol shows, and what the loop reads besides:

- A REQUEST is acknowledged by its "dispatched" REPLY, which the gateway sends once the request is
  stored; a request that waits for a worker gets none. So the loop also reads the gateway's state:
  at the start of each process life, before any client connects, a snapshot of the queue (the
  stream endpoints' `/stream/snapshot`, on the gateway's own HTTP listener) lists what the gateway restored, each
  message with its attempts. Those requests were stored: they must be delivered in that process
  life or a later one (`check`'s `held`).
- A worker's REQUEST shows no attempt count. The engine counts one attempt per delivery, and the
  snapshot gives the count each message came back with, so the n-th delivery of a message in a
  process life is its attempt `restored + n`. A job that left before the record of its attempt was
  written comes back after a kill with the count it had before: that attempt is then handed out
  twice (`repeated_attempts`), and `--emqp-max-attempts` would let the job run more often than set.
"""

from __future__ import annotations

import json
import random
import threading
import uuid

import attrs
import zmq

from polymq.clients.stream import StreamClient, StreamClientError
from polymq.codecs import emqp, stream_rows

from support.crash_loop import CrashLoop, CrashLoopConfig, Delivery
from support.gateway import GatewayProcess

QUEUE = "crash"
# READYs each worker keeps out: more than the clients' requests in flight (2 clients x a window of
# 8), so most requests go to a worker at once and get their "dispatched" REPLY.
SLOTS = 20
# No worker is taken for gone within one process life (its jobs would then come twice in one life).
HEARTBEAT_TIMEOUT_MS = 600_000
# A client waits this long for a REPLY before it looks at its window again (a wait, not a deadline).
POLL_MS = 50


def emqp_config(config: CrashLoopConfig) -> CrashLoopConfig:
    return attrs.evolve(config, kill_on_delivery=True, gateway_args=(
        *config.gateway_args, "--emqp-heartbeat-timeout", str(HEARTBEAT_TIMEOUT_MS)))


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


class EMQPCrashLoop(CrashLoop):
    def __init__(self, config: CrashLoopConfig) -> None:
        super().__init__(config)
        self.restored: dict[int, dict[bytes, int]] = {}  # epoch → body → attempts the gateway came back with

    def publish_address(self, gateway: GatewayProcess) -> str:
        return gateway.addresses["emqp-frontend"]

    def consume_address(self, gateway: GatewayProcess) -> str:
        return gateway.addresses["emqp-backend"]

    def epoch_started(self, gateway: GatewayProcess, epoch: int) -> None:
        held = queue_attempts(gateway.http, QUEUE, self.config.io_timeout_s)
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

    # -- clients and workers ---------------------------------------------------------------------

    def _publisher(self, address: str, epoch: int, rng: random.Random, stop: threading.Event) -> None:
        config, ledger = self.config, self.ledger
        context = zmq.Context()
        sock = context.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, str(uuid.uuid4()).encode())
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(f"tcp://{address}")
        bodies: dict[bytes, bytes] = {}  # msgid → body of every request sent
        waiting: set[bytes] = set()  # bodies neither dispatched nor delivered yet: the window
        try:
            while not stop.is_set():
                with ledger.lock:
                    waiting = {body for body in waiting if body not in ledger.delivered}
                if len(waiting) < config.window and ledger.backlog() <= config.max_backlog:
                    [body] = self._bodies(rng, 1)
                    msgid = body.split(b".", 1)[0]
                    bodies[msgid] = body
                    waiting.add(body)
                    ledger.record_sent([body], epoch)  # before the send: a kill may come mid-write
                    sock.send_multipart(emqp.client_message(emqp.REQUEST, msgid, QUEUE.encode(), b"", body))
                elif sock.poll(POLL_MS):
                    self._answer(sock.recv_multipart(), bodies, waiting, epoch)
            while sock.poll(POLL_MS):  # REPLYs the dead process sent before the kill may still be buffered
                self._answer(sock.recv_multipart(), bodies, waiting, epoch)
        finally:
            sock.close(linger=0)
            context.term()

    def _answer(self, frames: list[bytes], bodies: dict[bytes, bytes], waiting: set[bytes], epoch: int) -> None:
        # "Dispatched": ['', 'eMQP/1.0', 'REPLY', its msgid, the request's msgid]; a refusal adds a reason.
        body = bodies.get(frames[4]) if len(frames) == 5 and frames[2] == emqp.REPLY else None
        if body is None:
            self.ledger.record_error(f"client epoch {epoch}: unexpected answer {frames!r}")
            return
        waiting.discard(body)
        self.ledger.record_acked([body])

    def _consumer(self, address: str, epoch: int, index: int, subscribed: threading.Event,
                  stop: threading.Event) -> None:
        config, ledger = self.config, self.ledger
        context = zmq.Context()
        sock = context.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, b"worker-%d-%d" % (epoch, index))
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(f"tcp://{address}")
        try:
            try:
                inform = b"inform-%d" % index
                sock.send_multipart(emqp.client_message(emqp.INFORM, inform, json.dumps([[10, QUEUE]]).encode(),
                                                        emqp.WORKER))
                ack = self._next(sock, config.io_timeout_s)
                assert ack is not None and ack[2] == emqp.ACK and ack[4:] == [inform], f"INFORM answered {ack!r}"
                for number in range(SLOTS):
                    sock.send_multipart(emqp.client_message(emqp.READY, b"ready-%d" % number))
            except (AssertionError, zmq.ZMQError) as exc:
                ledger.record_error(f"worker {index} epoch {epoch}: could not join: {exc!r}")
                return
            finally:
                subscribed.set()
            jobs = 0
            while not stop.is_set():
                frames = self._next(sock, 0.2)  # short: notice `stop` soon
                if frames is None:
                    continue
                if frames[2] != emqp.REQUEST:
                    ledger.record_error(f"worker {index} epoch {epoch}: unexpected {frames!r}")
                    continue
                # ['', 'eMQP/1.0', 'REQUEST', msgid, queue, headers, payload]; recorded before the READY
                # that ends the job: a kill between the two makes a redelivery legal.
                ledger.record_delivery(Delivery(frames[6], 0, epoch, frames[3], index))
                jobs += 1
                sock.send_multipart(emqp.client_message(emqp.READY, b"done-%d" % jobs))
        finally:
            sock.close(linger=0)
            context.term()

    @staticmethod
    def _next(sock: zmq.Socket, timeout: float) -> list[bytes] | None:
        """The next message other than a HEARTBEAT; None when none came within `timeout`."""
        while sock.poll(int(timeout * 1000)):
            frames = sock.recv_multipart()
            if frames[2] != emqp.HEARTBEAT:
                return frames
        return None
