"""Bad input on the eMQP sockets at once: oversized frames, and garbage from many sockets (random
frames, garbage identities, well-enveloped messages with random commands and frame counts) on the
backend, frontend, admin and pub/sub sockets while a real client's requests go to a real worker.
Each gets a clear outcome, the gateway survives, and every request of the well-behaved pair arrives
exactly once."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from polymq.codecs import emqp

from support.emqp_wire import Client, Worker, admin_json
from support.gateway import GatewayProcess, running_gateway

MAX_MESSAGE = 4096
COMMANDS = (emqp.INFORM, emqp.READY, emqp.REQUEST, emqp.REPLY, emqp.HEARTBEAT, emqp.KBYE, emqp.DISCONNECT,
            emqp.SCHEDULE, emqp.UNSCHEDULE, emqp.PUBLISH, emqp.STATUS, emqp.ACK, emqp.KBAI, b"FROBNICATE")
FLOODED = ("emqp-backend", "emqp-frontend", "emqp-admin", "emqp-pubsub-in")
FLOODERS_PER_SOCKET = 8


@pytest.fixture
def gateway(tmp_path: Path) -> Iterator[GatewayProcess]:
    with running_gateway("--emqp-max-message", str(MAX_MESSAGE), data_dir=tmp_path) as process:
        yield process


def random_bytes(rng: random.Random, most: int) -> bytes:
    return bytes(rng.randrange(256) for _ in range(rng.randrange(0, most)))


def garbage(rng: random.Random) -> list[bytes]:
    """Either random frames or an eMQP envelope with a random command and random body frames."""
    if rng.random() < 0.5:
        return [random_bytes(rng, 40) for _ in range(rng.randrange(1, 7))]
    body = [random_bytes(rng, 30) for _ in range(rng.randrange(0, 5))]
    return [b"", emqp.VERSION, rng.choice(COMMANDS), random_bytes(rng, 20), *body]


def test_an_oversized_frame_is_dropped_and_others_go_on(gateway: GatewayProcess, context: zmq.Context) -> None:
    with Worker(context, gateway.addresses["emqp-backend"]) as worker, \
            Client(context, gateway.addresses["emqp-frontend"]) as big, \
            Client(context, gateway.addresses["emqp-frontend"]) as small:
        worker.inform([(10, "sized")])
        big.request("sized", b"x" * (MAX_MESSAGE * 4))  # ZeroMQ drops it (and the connection) on arrival
        sent = small.request("sized", b"[1]")
        worker.ready()
        job = worker.job()
        assert job[3:] == [sent, b"sized", b"", b"[1]"]
        worker.ready()
        assert worker.nothing_within(200)


def test_garbage_from_many_sockets_costs_nobody_else_a_request(gateway: GatewayProcess,
                                                                context: zmq.Context) -> None:
    rng = random.Random(13)
    flooders = []
    for name in FLOODED:
        for number in range(FLOODERS_PER_SOCKET):
            sock = context.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            # Garbage identities too: binary, and one that a well-behaved peer might have had.
            sock.setsockopt(zmq.IDENTITY, b"\xff\x00" + random_bytes(rng, 12) + bytes([number]))
            sock.connect(f"tcp://{gateway.addresses[name]}")
            flooders.append(sock)
    try:
        with Worker(context, gateway.addresses["emqp-backend"]) as worker, \
                Client(context, gateway.addresses["emqp-frontend"]) as client:
            worker.inform([(10, "precious")])
            sent = []
            for number in range(60):
                for sock in flooders:
                    sock.send_multipart(garbage(rng), zmq.NOBLOCK)
                sent.append(client.request("precious", b"[%d]" % number))
            for sock in flooders:
                sock.close(linger=0)
            got = []
            worker.ready(len(sent))
            while len(got) < len(sent):
                frames = worker.receive()
                if frames[2] == emqp.REQUEST:
                    got.append(frames[3])
            assert sorted(got) == sorted(sent)
            assert worker.nothing_within(200)  # and exactly once
        status = admin_json(context, gateway.addresses["emqp-admin"], emqp.STATUS)
        assert status["polymq"]["invalid"] > 0  # type: ignore[index]
    finally:
        for sock in flooders:
            if not sock.closed:
                sock.close(linger=0)
    assert gateway.process.poll() is None
