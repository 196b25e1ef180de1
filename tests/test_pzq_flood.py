"""Bad input on PZQ's sockets: oversized messages, garbage identities and frames from many sockets
at once (to the receive, send and monitor sockets), consumers that never answer. Each gets a clear
outcome, the gateway survives, and another client's messages all arrive."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from polymq.codecs import pzq

from support.gateway import GatewayProcess, running_gateway
from support.pzq_wire import Consumer, Monitor, Producer, endpoint

MAX_MESSAGE = 4096


@pytest.fixture
def gateway(tmp_path: Path) -> Iterator[GatewayProcess]:
    # A short ACK timeout: deliveries that went to a flooder (whoever connects to the send socket is a
    # consumer) come back soon after it has gone.
    with running_gateway("--pzq-max-message", str(MAX_MESSAGE), "--pzq-ack-timeout", "300",
                         data_dir=tmp_path) as process:
        yield process


def test_an_oversized_message_is_dropped_and_others_go_on(gateway: GatewayProcess, context: zmq.Context) -> None:
    with Producer(context, gateway.addresses["pzq-receive"], timeout_ms=1000) as big, \
            Producer(context, gateway.addresses["pzq-receive"]) as small:
        big.sock.send_multipart([b"big", b"", b"x" * (MAX_MESSAGE * 4)])
        with pytest.raises(zmq.Again):
            big.sock.recv_multipart()  # ZeroMQ dropped it as it arrived: no answer, nothing stored
        assert small.produce(b"fine")[1] == b"1"
    with Consumer(context, gateway.addresses["pzq-send"]) as consumer, \
            Monitor(context, gateway.addresses["pzq-monitor"]) as monitor:
        delivery = consumer.receive()
        assert delivery[5:] == [b"fine"]
        consumer.ack(delivery)
        assert consumer.nothing_within(200)
        assert monitor.stats()["messages"] in (0, 1)


def test_garbage_from_many_sockets_costs_nobody_else_a_message(gateway: GatewayProcess, context: zmq.Context) -> None:
    rng = random.Random(7)
    flooders = []
    for kind, name in ((zmq.DEALER, "pzq-receive"), (zmq.ROUTER, "pzq-send"), (zmq.DEALER, "pzq-monitor"),
                       (zmq.DEALER, "pzq-send")):
        for _ in range(10):
            sock = context.socket(kind)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(endpoint(gateway.addresses[name]))
            flooders.append((kind, sock))
    try:
        _flood_while_producing(gateway, context, flooders, rng)
    finally:
        for _, sock in flooders:
            if not sock.closed:
                sock.close(linger=0)
    assert gateway.process.poll() is None


def _flood_while_producing(gateway: GatewayProcess, context: zmq.Context, flooders: list[tuple[int, zmq.Socket]],
                           rng: random.Random) -> None:
    with Producer(context, gateway.addresses["pzq-receive"]) as producer, \
            Consumer(context, gateway.addresses["pzq-send"]) as consumer:
        sent = [b"precious %d" % number for number in range(50)]
        for number, body in enumerate(sent):
            for kind, sock in flooders:
                if kind == zmq.ROUTER:
                    continue  # a silent consumer: it takes deliveries and never answers
                frames = [bytes(rng.randrange(256) for _ in range(rng.randrange(0, 40)))
                          for _ in range(rng.randrange(1, 6))]
                sock.send_multipart(frames, zmq.NOBLOCK)
            assert producer.produce(body)[1] == b"1", number
        for _, sock in flooders:
            sock.close(linger=0)
        got = []
        while len(got) < len(sent):
            delivery = consumer.receive()
            consumer.ack(delivery)
            if delivery[5:6] and delivery[5].startswith(b"precious") and delivery[5] not in got:
                got.append(delivery[5])
            else:  # a flooder's message that was well formed: stored like any other
                assert delivery[4] == pzq.DELIMITER
    assert sorted(got) == sorted(sent)
