"""The ZeroMQ service skeleton (adapters/zmq_service.py) when the store fails: the answers that
promised durability become refusals, in order, with the store's error (a PZQ producer's `1`
becomes `0`; eMQP's "dispatched" REPLY becomes an ERROR REPLY). In-process, real sockets on
127.0.0.1, a store whose every sync reports a failure."""

from __future__ import annotations

import json
from collections.abc import Callable

import trio
import zmq

from polymq.adapters.emqp.broker import EMQPBroker
from polymq.adapters.pzq.service import PZQServer
from polymq.adapters.zmq_sockets import ZmqSockets
from polymq.clients.zmq_socket import open_socket
from polymq.codecs import emqp
from polymq.core.clock import SystemClock
from polymq.core.engine import Engine
from polymq.core.storage import MemoryStorage, SyncCallback

from support.zmq_units import emqp_specs, pzq_specs

MAX_MESSAGE = 1024 * 1024
STEP_TIMEOUT_S = 10.0
FAILURE = "No space left on device"


class FailingStore(MemoryStorage):
    """Every sync reports the error a full disk gives (the rest keeps nothing, as in memory)."""

    def sync(self, callback: SyncCallback) -> None:
        callback(OSError(28, FAILURE))


async def receive(sock: zmq.Socket) -> list[bytes]:
    with trio.fail_after(STEP_TIMEOUT_S):
        while not sock.poll(0):
            await trio.sleep(0.001)
    return sock.recv_multipart()


async def until(condition: Callable[[], bool]) -> None:
    with trio.fail_after(STEP_TIMEOUT_S):
        while not condition():
            await trio.sleep(0.001)


def connect(context: zmq.Context, kind: int, address: str, identity: bytes | None = None) -> zmq.Socket:
    return open_socket(context, kind, address, identity=identity)


async def test_pzq_acks_become_refusals_with_the_stores_error_in_order() -> None:
    sockets = ZmqSockets.bind("127.0.0.1", pzq_specs({"pzq-receive": 0}, MAX_MESSAGE))
    context = zmq.Context()
    producer = connect(context, zmq.DEALER, sockets.addresses["pzq-receive"])
    try:
        server = PZQServer(Engine(clock=SystemClock(), storage=FailingStore()), sockets)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(server.run)
            for number in range(3):
                producer.send_multipart([b"p%d" % number, b"", b"body"])
            producer.send_multipart([b"p3", b""])  # refused for itself: no body
            answers = [await receive(producer) for _ in range(4)]
            server.shutdown()
    finally:
        producer.close(linger=0)
        sockets.close()
        context.term()
    assert answers == [*([b"p%d" % number, b"0", b"", f"[Errno 28] {FAILURE}".encode()] for number in range(3)),
                       [b"p3", b"0", b"", b"Trying to save empty message"]]


async def test_emqp_dispatched_replies_become_refusals_with_the_stores_error() -> None:
    sockets = ZmqSockets.bind("127.0.0.1", emqp_specs({"emqp-backend": 0, "emqp-frontend": 0}, MAX_MESSAGE,
                                                      "127.0.0.1"))
    context = zmq.Context()
    worker = connect(context, zmq.DEALER, sockets.addresses["emqp-backend"], b"worker")
    client = connect(context, zmq.DEALER, sockets.addresses["emqp-frontend"], b"client")
    try:
        broker = EMQPBroker(Engine(clock=SystemClock(), storage=FailingStore()), sockets)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(broker.run)
            worker.send_multipart(emqp.client_message(emqp.INFORM, b"i", json.dumps([[10, "jobs"]]).encode(),
                                                      emqp.WORKER))
            assert (await receive(worker))[2] == emqp.ACK
            worker.send_multipart(emqp.client_message(emqp.READY, b"r"))
            await until(lambda: b"worker" in broker.workers and broker.workers[b"worker"].pool.tokens == 1)
            client.send_multipart(emqp.client_message(emqp.REQUEST, b"c1", b"jobs", b"", b"job"))
            refused = await receive(client)
            broker.shutdown()
    finally:
        for sock in (worker, client):
            sock.close(linger=0)
        sockets.close()
        context.term()
    assert refused[:3] == [b"", b"eMQP/1.0", b"REPLY"]
    assert refused[4:] == [b"c1", f"ERROR: not stored: [Errno 28] {FAILURE}".encode()]
