"""Two gateways on the real three-server JetStream cluster behave as one polymq: what a client sets up through
one node (a binding over MQKS, an NSQ ephemeral channel) serves the clients of every protocol on every node,
also after the node that made it is killed (SIGKILL) and started again."""

from __future__ import annotations

import signal
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from polymq.clients import emqp as emqp_client
from polymq.clients import mqks_blocking
from polymq.clients import nsq as nsq_blocking
from polymq.clients import phpmq as phpmq_blocking
from polymq.codecs import nsq_client

from support.gateway import GatewayProcess, running_gateway, start_gateway
from support.nats_cluster import NatsCluster
from support.nsq_cluster import http

CLIENT_TIMEOUT_S = 30.0


def _args(cluster: NatsCluster) -> tuple[str, ...]:
    return ("--jetstream", ",".join(cluster.urls), "--emqp-heartbeat-timeout", "600000")


@pytest.fixture(scope="module")
def nodes(nats_cluster: NatsCluster) -> Iterator[tuple[GatewayProcess, GatewayProcess]]:
    with running_gateway(*_args(nats_cluster)) as one, running_gateway(*_args(nats_cluster)) as two:
        yield one, two


def _tag(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def _mqks_publish(gateway: GatewayProcess, event: str, body: str) -> None:
    with mqks_blocking.Connection(gateway.host_port("mqks"), CLIENT_TIMEOUT_S) as conn:
        conn.request("p", "publish", f"{event} {body}", confirm=True)
        assert conn.next_line() == b"p ok "


def _phpmq_take(gateway: GatewayProcess, queue: str, count: int) -> list[bytes]:
    with phpmq_blocking.Connection(gateway.host_port("phpmq"), CLIENT_TIMEOUT_S) as conn:
        conn.consume(queue, count)
        deliveries = conn.deliveries(count, CLIENT_TIMEOUT_S)
        for delivery in deliveries:
            conn.ack(queue, delivery.message_id)
        conn.barrier()
    return [delivery.content for delivery in deliveries]


def test_a_queue_bound_over_mqks_serves_phpmq_and_emqp_on_every_node_across_a_kill_of_its_maker(
        nats_cluster: NatsCluster, nodes: tuple[GatewayProcess, GatewayProcess], context: zmq.Context) -> None:
    """A bridge between PHP and Python services: MQKS binds the queue `billing` to `orders` on node 1 and
    leaves; node 2's PHPMQ consumer of `billing` gets what is published to `orders`; node 1 is killed and
    started again, and its PHPMQ consumer and eMQP worker of `billing` get what follows."""
    _, two = nodes
    orders, billing = _tag("orders"), _tag("billing")
    with tempfile.TemporaryDirectory(prefix="polymq-test-") as data_dir:
        one = start_gateway(Path(data_dir), _args(nats_cluster))
        try:
            with mqks_blocking.Connection(one.host_port("mqks"), CLIENT_TIMEOUT_S) as binder:
                binder.request("c1", "consume", f"{billing} {orders} --manual-ack", confirm=True)
                assert binder.next_line() == b"c1 ok "
            _mqks_publish(one, orders, "first")
            assert _phpmq_take(two, billing, 1) == [b"first"]
            one.stop(signal.SIGKILL)
            one = start_gateway(Path(data_dir), _args(nats_cluster))
            _mqks_publish(two, orders, "second")
            assert _phpmq_take(one, billing, 1) == [b"second"]
            _mqks_publish(one, orders, "third")
            with emqp_client.Worker(context, one.addresses["emqp-backend"]) as worker:
                worker.inform([(10, billing)])
                worker.ready()
                job = worker.job(CLIENT_TIMEOUT_S)
                assert (job[4], job[6]) == (billing.encode(), b"third")
                worker.reply(job)
                worker.leave()
        finally:
            one.stop()


def test_an_ephemeral_channel_on_one_node_hears_what_every_node_publishes_to_its_topic(
        nodes: tuple[GatewayProcess, GatewayProcess]) -> None:
    """As `nsq_tail --topic=T` against node 2 does, while node 1 and node 2 take `/pub?topic=T`."""
    one, two = nodes
    topic = _tag("tailed")
    with nsq_blocking.Connection(two.nsq_tcp, CLIENT_TIMEOUT_S) as tail:
        tail.send(nsq_client.sub(topic, f"tail{uuid.uuid4().int % 1000000}#ephemeral"))
        tail.wait_for_ok("SUB")
        tail.send(nsq_client.rdy(10))
        for gateway, body in ((one, b"hi from node 1"), (two, b"hi from node 2")):
            status, answer = http(gateway.nsq_http, f"/pub?topic={topic}", "POST", body)
            assert (status, answer) == (200, b"OK")
        got = []
        deadline = time.monotonic() + CLIENT_TIMEOUT_S
        while len(got) < 2 and time.monotonic() < deadline:
            frame = tail.next_frame(5)
            if frame is not None and frame.is_message:
                message = nsq_client.decode_message(frame.data)
                got.append(message.body)
                tail.send(nsq_client.fin(message.msg_id))
        assert sorted(got) == [b"hi from node 1", b"hi from node 2"]


def test_an_emqp_publish_on_one_node_reaches_the_subscribers_of_both(
        nodes: tuple[GatewayProcess, GatewayProcess], context: zmq.Context) -> None:
    one, two = nodes
    topic = _tag("upd").encode()
    subscribers = []
    try:
        for gateway in (one, two):
            sock = context.socket(zmq.SUB)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RCVTIMEO, int(CLIENT_TIMEOUT_S * 1000))
            sock.setsockopt(zmq.SUBSCRIBE, topic)
            sock.connect(f"tcp://{gateway.addresses['emqp-pubsub-out']}")
            subscribers.append(sock)
        with emqp_client.Peer(context, one.addresses["emqp-pubsub-in"]) as publisher:
            # A SUB's subscription reaches its PUB a moment after it connects: publish until both show.
            for sock in subscribers:
                poller = zmq.Poller()
                poller.register(sock, zmq.POLLIN)
                while True:
                    publisher.send(b"PUBLISH", topic + b"-warmup", b"w")
                    if poller.poll(50):
                        break
            publisher.send(b"PUBLISH", topic + b"-warmup", b"end")
            for sock in subscribers:
                while sock.recv_multipart() != [topic + b"-warmup", b"end"]:
                    pass
            publisher.send(b"PUBLISH", topic, b'["update", "1"]')
            for sock in subscribers:
                assert sock.recv_multipart() == [topic, b'["update", "1"]']
    finally:
        for sock in subscribers:
            sock.close()
