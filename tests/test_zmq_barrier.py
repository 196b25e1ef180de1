"""The store barrier of the ZeroMQ protocols (adapters/zmq_service.py): a delivery of a durable queue
reaches its consumer only once the store has written its attempt record, and the ADD record of the
message; a PUB copy of eMQP's pub/sub only once the queues' copies are written.

In-process, real parts: a `DiskStorage` with its committer (`--fsync=always`), the PZQ server, the eMQP
broker and the pub/sub device on ZeroMQ sockets over 127.0.0.1. The gateway's delivery socket is
wrapped (`HandOff`): when the last frame of a message has gone to ZeroMQ, the consumer's socket
receives that message right there, while the gateway's loop waits in the call (so the store cannot
write meanwhile), and the test reads the store's files. What they hold at that moment is what a
crash right after the delivery would leave.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import attrs
import trio
import zmq

from polymq.adapters.emqp.broker import EMQPBroker, EMQPLimits
from polymq.adapters.emqp.pubsub import EMQPPubSub
from polymq.adapters.pzq.service import PZQLimits, PZQServer
from polymq.adapters.zmq_sockets import ZmqSockets
from polymq.clients.zmq_socket import open_socket
from polymq.codecs import emqp, pzq
from polymq.core import records
from polymq.core.clock import SystemClock
from polymq.core.disk_storage import DiskStorage, FsyncPolicy
from polymq.core.engine import Engine, Message
from polymq.gateway.committer import Committer
from polymq.gateway.serve import TimerTask

from support.zmq_units import emqp_specs, pzq_specs

MAX_MESSAGE = 1024 * 1024
# Bounds of waiting for what must come (a loaded CI machine may be slow; nothing waits this long
# when it works).
RECEIVE_TIMEOUT_MS = 10_000
STEP_TIMEOUT_S = 10.0


def on_disk(log_dir: Path) -> tuple[dict[int, int], dict[int, int]]:
    """What a log's segment files hold: (message id → position of its ADD, position → highest attempts)."""
    added: dict[int, int] = {}
    attempts: dict[int, int] = {}
    for path in sorted(log_dir.glob("*.seg")):
        segment = int(path.stem)
        for _, kind, payload in records.scan(path.read_bytes()):
            if kind == records.ADD:
                for entry in records.decode_add(payload):
                    position = segment << records.SEGMENT_SHIFT | entry.index
                    added[entry.id] = position
                    attempts[position] = max(attempts.get(position, 0), entry.attempts)
            elif kind == records.STATE:
                for position, count, _ in records.decode_states(payload):
                    attempts[position] = max(attempts.get(position, 0), count)
    return added, attempts


@attrs.define
class Checks:
    """What the consumers found on disk at the moment they received each delivery."""

    checked: list[tuple[int, int]] = attrs.Factory(list)  # (message id, attempts) of each delivery
    problems: list[str] = attrs.Factory(list)

    def check(self, engine: Engine, queue: str, message: Message | None, what: str = "") -> None:
        """`message` was received (None: it was not even in its queue yet, so not on disk either)."""
        if message is None:
            self.checked.append((0, 0))
            self.problems.append(f"{queue}: {what} received before the queue had it")
            return
        stored = engine.queue(queue)
        assert stored is not None and stored.log is not None, f"queue {queue} is not durable"
        added, attempts = on_disk(stored.log.dir)
        self.checked.append((message.id, message.attempts))
        position = added.get(message.id)
        if position is None:
            self.problems.append(f"{queue}: message {message.id} attempt {message.attempts} received, not on disk")
        elif attempts.get(position, 0) < message.attempts:
            self.problems.append(f"{queue}: message {message.id} attempt {message.attempts} received, the disk "
                                 f"says {attempts.get(position, 0)}")


class HandOff:
    """A gateway socket that calls `sent` with each whole message once it has gone to ZeroMQ."""

    def __init__(self, sock: zmq.Socket, sent: Callable[[list[bytes]], None]) -> None:
        self._sock = sock
        self._sent = sent
        self._frames: list[bytes] = []

    def __getattr__(self, name: str) -> object:
        return getattr(self._sock, name)

    def send(self, data: bytes, flags: int = 0) -> None:
        self._sock.send(data, flags)
        self._frames.append(data)
        if not flags & zmq.SNDMORE:
            frames, self._frames = self._frames, []
            self._sent(frames)


def receive_now(sock: zmq.Socket) -> list[bytes]:
    """The next message of a peer socket, waiting for it (inside the gateway's call, so blocking)."""
    assert sock.poll(RECEIVE_TIMEOUT_MS), "the message sent to ZeroMQ did not arrive"
    return sock.recv_multipart()


async def receive(sock: zmq.Socket) -> list[bytes]:
    """The next message of a peer socket, letting the gateway's tasks run while it waits."""
    with trio.fail_after(STEP_TIMEOUT_S):
        while not sock.poll(0):
            await trio.sleep(0.001)
    return sock.recv_multipart()


async def until(condition: Callable[[], bool], what: str) -> None:
    with trio.fail_after(STEP_TIMEOUT_S):
        while not condition():
            await trio.sleep(0.001)


@attrs.define
class Store:
    engine: Engine
    storage: DiskStorage


@asynccontextmanager
async def durable_engine(directory: Path) -> AsyncIterator[tuple[Store, trio.Nursery]]:
    """An engine on a DiskStorage (`--fsync=always`) with its committer and timers running."""
    storage = DiskStorage(directory, SystemClock(), policy=FsyncPolicy("always"))
    engine = Engine(clock=storage.clock, storage=storage)
    engine.restore()
    committer = Committer(storage)
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(committer.run)
            nursery.start_soon(TimerTask(engine).run)
            yield Store(engine, storage), nursery
            nursery.cancel_scope.cancel()
    finally:
        await committer.flush()
        storage.close()


def connect(context: zmq.Context, kind: int, address: str, identity: bytes | None = None) -> zmq.Socket:
    return open_socket(context, kind, address, identity=identity)


async def test_pzq_deliveries_reach_the_consumer_only_after_their_records_are_written(tmp_path: Path) -> None:
    sockets = ZmqSockets.bind("127.0.0.1", pzq_specs(
        {"pzq-receive": 0, "pzq-send": 0, "pzq-monitor": 0}, MAX_MESSAGE))
    context = zmq.Context()
    consumer = connect(context, zmq.ROUTER, sockets.addresses["pzq-send"])
    producer = connect(context, zmq.DEALER, sockets.addresses["pzq-receive"])
    checks = Checks()
    received: list[list[bytes]] = []
    server: PZQServer

    def delivered(_: list[bytes]) -> None:
        frames = receive_now(consumer)  # [gateway, key, sent_us, timeout_us, '', body…]
        received.append(frames)
        message_id = pzq.parse_key(frames[1])
        assert message_id is not None and server.consumer is not None
        message = server.consumer.in_flight[message_id]
        checks.check(server.engine, "pzq", message)

    sockets.sockets["pzq-send"] = HandOff(sockets.sockets["pzq-send"], delivered)  # type: ignore[assignment]
    try:
        async with durable_engine(tmp_path) as (store, nursery):
            # A window of 2: the rest of a burst waits, and goes out from the bursts of ACKs.
            server = PZQServer(store.engine, sockets, PZQLimits(window=2, ack_timeout=60.0))
            nursery.start_soon(server.run)
            await until(lambda: server.consumer is not None and server.consumers_connected == 1, "the consumer")

            # One producer burst: the first two are delivered while it is handled.
            for number in range(5):
                producer.send_multipart([b"p%d" % number, b"", b"body %d" % number])
            await until(lambda: len(received) == 2, "two deliveries")
            acks = [(await receive(producer))[:2] for _ in range(5)]
            assert sorted(acks) == [[b"p%d" % number, b"1"] for number in range(5)]

            # A `1` makes room for the third; a `0` sends the second again (attempt 2).
            consumer.send_multipart([received[0][0], received[0][1], b"1"])
            await until(lambda: len(received) == 3, "the third delivery")
            consumer.send_multipart([received[1][0], received[1][1], b"0"])
            await until(lambda: len(received) == 4, "the second again")
            assert [frames[5] for frames in received] == [b"body 0", b"body 1", b"body 2", b"body 1"]
            assert received[3][1] == received[1][1], "every delivery of a message has its key"
            assert [attempts for _, attempts in checks.checked] == [1, 1, 1, 2]

            # A message another protocol publishes, outside any burst of the PZQ sockets.
            for frames in received[2:]:
                consumer.send_multipart([frames[0], frames[1], b"1"])
            await until(lambda: len(received) == 6, "the last two of the burst")
            consumer.send_multipart([received[4][0], received[4][1], b"1"])
            await until(lambda: server.consumer is not None and len(server.consumer.in_flight) == 1, "one in flight")
            store.engine.publish("pzq", b"from elsewhere", origin="test")
            await until(lambda: len(received) == 7, "the other protocol's message")
            assert received[6][5] == b"from elsewhere"
            server.shutdown()
    finally:
        for sock in (consumer, producer):
            sock.close(linger=0)
        sockets.close()
        context.term()
    assert len(checks.checked) == 7
    assert not checks.problems, "\n".join(checks.problems)


async def test_emqp_jobs_reach_the_worker_only_after_their_records_are_written(tmp_path: Path) -> None:
    sockets = ZmqSockets.bind("127.0.0.1", emqp_specs(
        {"emqp-backend": 0, "emqp-frontend": 0, "emqp-admin": 0}, MAX_MESSAGE, "127.0.0.1"))
    context = zmq.Context()
    workers = {name: connect(context, zmq.DEALER, sockets.addresses["emqp-backend"], name)
               for name in (b"worker-1", b"worker-2")}
    client = connect(context, zmq.DEALER, sockets.addresses["emqp-frontend"], b"client")
    checks = Checks()
    jobs: list[tuple[bytes, list[bytes]]] = []  # (worker, REQUEST frames)
    told: list[tuple[bytes, list[bytes]]] = []  # everything else the workers got
    broker: EMQPBroker

    def sent_to_worker(_: list[bytes]) -> None:
        # Whichever worker it was for: the one whose socket has it.
        poller = zmq.Poller()
        for sock in workers.values():
            poller.register(sock, zmq.POLLIN)
        ready = dict(poller.poll(RECEIVE_TIMEOUT_MS))
        assert ready, "the message sent to ZeroMQ did not arrive"
        name, sock = next((name, sock) for name, sock in workers.items() if sock in ready)
        frames = sock.recv_multipart()
        if frames[2] != emqp.REQUEST:
            told.append((name, frames))
            return
        jobs.append((name, frames))
        message = broker.workers[name].by_msgid[frames[3]]
        checks.check(broker.engine, "jobs", message)

    sockets.sockets["emqp-backend"] = HandOff(sockets.sockets["emqp-backend"], sent_to_worker)  # type: ignore[assignment]
    try:
        async with durable_engine(tmp_path) as (store, nursery):
            broker = EMQPBroker(store.engine, sockets, EMQPLimits(heartbeat_timeout=600.0, worker_processes=2))
            nursery.start_soon(broker.run)
            first = workers[b"worker-1"]
            first.send_multipart(emqp.client_message(emqp.INFORM, b"i1", json.dumps([[10, "jobs"]]).encode(),
                                                     emqp.WORKER))
            await until(lambda: any(frames[2] == emqp.ACK for _, frames in told), "the INFORM's ACK")
            first.send_multipart(emqp.client_message(emqp.READY, b"r1"))  # its two processes start
            first.send_multipart(emqp.client_message(emqp.READY, b"r2"))
            await until(lambda: broker.workers[b"worker-1"].pool.tokens == 2, "two slots")

            # One burst of requests: two go to the worker while it is handled, one waits.
            for number in range(3):
                client.send_multipart(emqp.client_message(emqp.REQUEST, b"c%d" % number, b"jobs", b"",
                                                          b"job %d" % number))
            await until(lambda: len(jobs) == 2, "two jobs")
            dispatched = sorted([(await receive(client))[4] for _ in range(2)])
            assert dispatched == [b"c0", b"c1"]

            # A READY ends the first job and takes the waiting one.
            first.send_multipart(emqp.client_message(emqp.READY, b"r3"))
            await until(lambda: len(jobs) == 3, "the waiting job")

            # The first worker goes: its two jobs go to the second one (two free slots), their second attempt.
            second = workers[b"worker-2"]
            second.send_multipart(emqp.client_message(emqp.INFORM, b"i2", json.dumps([[10, "jobs"]]).encode(),
                                                      emqp.WORKER))
            await until(lambda: b"worker-2" in broker.workers, "the second worker")
            second.send_multipart(emqp.client_message(emqp.READY, b"r4"))
            second.send_multipart(emqp.client_message(emqp.READY, b"r5"))
            await until(lambda: broker.workers[b"worker-2"].pool.tokens == 2, "its two slots")
            first.send_multipart(emqp.client_message(emqp.KBYE, b"k1"))
            await until(lambda: len(jobs) == 5, "the first worker's jobs again")
            assert [(name, frames[3], frames[6]) for name, frames in jobs] == [
                (b"worker-1", b"c0", b"job 0"), (b"worker-1", b"c1", b"job 1"), (b"worker-1", b"c2", b"job 2"),
                (b"worker-2", b"c1", b"job 1"), (b"worker-2", b"c2", b"job 2")]
            broker.shutdown()
    finally:
        for sock in (*workers.values(), client):
            sock.close(linger=0)
        sockets.close()
        context.term()
    assert [attempts for _, attempts in checks.checked] == [1, 1, 1, 2, 2]
    assert not checks.problems, "\n".join(checks.problems)


async def test_pubsub_copies_leave_only_after_the_queues_copies_are_written(tmp_path: Path) -> None:
    sockets = ZmqSockets.bind("127.0.0.1", emqp_specs({"emqp-pubsub-in": 0, "emqp-pubsub-out": 0}, MAX_MESSAGE))
    context = zmq.Context()
    publisher = connect(context, zmq.DEALER, sockets.addresses["emqp-pubsub-in"])
    checks = Checks()
    device: EMQPPubSub

    def published(frames: list[bytes]) -> None:
        # The PUB copy ([topic, payload]) has gone to ZeroMQ: the queue's copy must be on disk already.
        queue = device.engine.queue("news")
        assert queue is not None
        message = next((message for message in queue.ready if message.body == frames[1]), None)
        checks.check(device.engine, "news", message, f"the PUB copy of {frames[1]!r}")

    sockets.sockets["emqp-pubsub-out"] = HandOff(sockets.sockets["emqp-pubsub-out"], published)  # type: ignore[assignment]
    try:
        async with durable_engine(tmp_path) as (store, nursery):
            store.engine.ensure_queue("news")
            store.engine.bind("news", "news")
            device = EMQPPubSub(store.engine, sockets)
            nursery.start_soon(device.run)
            for number in range(3):
                publisher.send_multipart(emqp.client_message(emqp.PUBLISH, b"m%d" % number, b"news",
                                                             b"item %d" % number))
            await until(lambda: len(checks.checked) == 3, "three PUB copies")
            device.shutdown()
    finally:
        publisher.close(linger=0)
        sockets.close()
        context.term()
    assert not checks.problems, "\n".join(checks.problems)
