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
- A worker's REQUEST shows no attempt count: the loop counts it (`CountedAttemptsLoop`); a job
  handed out twice with one attempt count would let `--emqp-max-attempts` run it more often than set.
"""

from __future__ import annotations

import json
import random
import threading
import uuid

import attrs
import zmq

from polymq.codecs import emqp

from support.crash_loop import CountedAttemptsLoop, CrashLoopConfig, Delivery
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


class EMQPCrashLoop(CountedAttemptsLoop):
    queue = QUEUE

    def publish_address(self, gateway: GatewayProcess) -> str:
        return gateway.addresses["emqp-frontend"]

    def consume_address(self, gateway: GatewayProcess) -> str:
        return gateway.addresses["emqp-backend"]

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
