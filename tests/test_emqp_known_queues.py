"""The eMQP broker forgets the queue names clients and workers mention once their queues are gone:
a worker that INFORMs thousands of invented names leaves nothing behind once it goes and the empty
queues are forgotten (`--emqp-forget-empty`). In-process, real parts: the engine with its timers, the
broker on ZeroMQ sockets over 127.0.0.1, a worker's and a client's DEALERs."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Callable

import attrs
import trio
import zmq

from polymq.adapters.emqp.broker import EMQPBroker, EMQPLimits
from polymq.adapters.zmq_sockets import ZmqSockets
from polymq.clients.zmq_socket import open_socket
from polymq.codecs import emqp
from polymq.core.clock import SystemClock
from polymq.core.engine import Engine
from polymq.gateway.serve import TimerTask

from support.zmq_units import emqp_specs

MAX_MESSAGE = 1024 * 1024
NAMES = 2000  # invented queue names, more than any real worker serves
# Bound of waiting for what must happen (a loaded machine may be slow; it takes about a second).
STEP_TIMEOUT_S = 20.0


async def until(condition: Callable[[], bool]) -> None:
    with trio.fail_after(STEP_TIMEOUT_S):
        while not condition():
            await trio.sleep(0.01)


@attrs.frozen
class Setup:
    engine: Engine
    broker: EMQPBroker
    worker: zmq.Socket
    client: zmq.Socket


@contextlib.asynccontextmanager
async def running_broker() -> AsyncIterator[Setup]:
    """A broker on the engine with its timers, forgetting empty queues at once; a worker's (of one
    process) and a client's DEALER connected to it."""
    sockets = ZmqSockets.bind("127.0.0.1", emqp_specs(
        {"emqp-backend": 0, "emqp-frontend": 0, "emqp-admin": 0}, MAX_MESSAGE, "127.0.0.1"))
    context = zmq.Context()
    worker = open_socket(context, zmq.DEALER, sockets.addresses["emqp-backend"], identity=b"worker")
    client = open_socket(context, zmq.DEALER, sockets.addresses["emqp-frontend"], identity=b"client")
    engine = Engine(clock=SystemClock())
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(TimerTask(engine).run)
            broker = EMQPBroker(engine, sockets, EMQPLimits(heartbeat_timeout=600.0, forget_empty_after=0.0,
                                                           worker_processes=1))
            nursery.start_soon(broker.run)
            yield Setup(engine, broker, worker, client)
            broker.shutdown()
            nursery.cancel_scope.cancel()
    finally:
        for sock in (worker, client):
            sock.close(linger=0)
        sockets.close()
        context.term()


async def test_names_of_queues_that_are_gone_are_forgotten_and_one_that_holds_a_job_is_kept() -> None:
    names = [f"invented-{number}" for number in range(NAMES)]
    async with running_broker() as setup:
        broker, worker = setup.broker, setup.worker
        queues = json.dumps([[10, name] for name in names]).encode()
        worker.send_multipart(emqp.client_message(emqp.INFORM, b"i1", queues, emqp.WORKER))
        setup.client.send_multipart(emqp.client_message(emqp.REQUEST, b"c1", b"kept", b"", b"a job"))
        await until(lambda: len(broker.known_queues) == NAMES + 1)
        worker.send_multipart(emqp.client_message(emqp.KBYE, b"k1"))
        await until(lambda: not broker.workers)
        # Empty and no worker: the engine forgets them, then the broker's sweep their names.
        await until(lambda: broker.known_queues == {"kept"})
        assert setup.engine.queue("kept") is not None and setup.engine.queue(names[0]) is None
        assert broker.status()["waiting_messages_by_queue"] == {"kept": 1}


async def test_counters_of_queues_and_workers_that_are_gone_are_dropped() -> None:
    """STATUS's counters by queue and by worker keep only the queues the engine holds and the workers
    still here: a jobmanager reconnects under a new identity each time, so they would grow forever."""
    async with running_broker() as setup:
        broker, worker = setup.broker, setup.worker
        worker.send_multipart(emqp.client_message(emqp.INFORM, b"i1", json.dumps([[10, "done"]]).encode(),
                                                  emqp.WORKER))
        await until(lambda: b"worker" in broker.workers)
        worker.send_multipart(emqp.client_message(emqp.READY, b"r1"))
        await until(lambda: broker.workers[b"worker"].pool.tokens == 1)
        setup.client.send_multipart(emqp.client_message(emqp.REQUEST, b"c1", b"done", b"", b"a job"))
        await until(lambda: broker.processed_by_queue["done"] == 1)
        worker.send_multipart(emqp.client_message(emqp.READY, b"r2"))  # the job is done
        await until(lambda: not broker.workers[b"worker"].jobs)
        status = broker.status()
        assert status["processed_messages_by_queue"] == {"done": 1}
        assert status["processed_messages_by_worker"] == {"worker": 1}
        assert status["polymq"]["handed_out_by_queue"] == {"done": 1}
        worker.send_multipart(emqp.client_message(emqp.KBYE, b"k1"))
        await until(lambda: not broker.workers and not broker.known_queues)
        await until(lambda: not broker.processed_by_queue)
        status = broker.status()
        assert status["processed_messages_by_queue"] == {}
        assert status["processed_messages_by_worker"] == {}
        assert status["polymq"]["handed_out_by_queue"] == {}
