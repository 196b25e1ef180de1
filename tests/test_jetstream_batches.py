"""Publishes of several messages at once on JetStream nodes are atomic batches: an MPUB is stored whole or not at
all, also when the node's link fails in the middle of sending it and the node is killed before it can send it
again."""

from __future__ import annotations

import json
import signal
from collections import Counter
from pathlib import Path

import pytest
import trio

from polymq.clients.link_proxy import LinkProxy
from polymq.codecs import nsq_client
from polymq.jetstream.batches import HEADER_BATCH_COMMIT, HEADER_BATCH_ID, HEADER_BATCH_SEQUENCE
from polymq.jetstream.nats_connection import NatsConnection, NatsOptions

from support.gateway import running_gateway
from support.nats_cluster import NatsServer
from support.nsq_cluster import http, wait_until
from support.nsq_wire import RawClient, consumer

BATCH = 1000  # one atomic batch (nats-server's most)
BODY = 200
ROUNDS = 3
STREAM = "POLYMQ_T_atomic"


def _stored(server: NatsServer) -> int:
    status, body = server.monitor("/jsz?streams=true")
    assert status == 200, body
    for account in json.loads(body).get("account_details") or []:
        for found in account.get("stream_detail") or []:
            if found["name"] == STREAM:
                return int(found["state"]["messages"])
    return 0


def _mpub(number: int) -> bytes:
    return nsq_client.mpub("atomic", [b"%d-%d-" % (number, n) + b"x" * BODY for n in range(BATCH)])


@pytest.mark.slow
def test_an_mpub_cut_midway_by_its_link_and_a_kill_is_stored_whole_or_not_at_all(
        tmp_path: Path, nats_server: NatsServer) -> None:
    """Each round: a node, talking to the server through a link, stores an MPUB (answered OK); then the link
    passes only half of the next MPUB's bytes and goes silent, and the node is SIGKILLed before it can send the
    rest again. Read back through a new node: the first MPUBs whole, the cut ones not at all (one at a time,
    the first half of each would be stored)."""
    answered = []
    for round_number in range(ROUNDS):
        with LinkProxy.to(nats_server.url) as link, \
                running_gateway("--jetstream", link.url, data_dir=tmp_path / f"node{round_number}") as node:
            if round_number == 0:  # the channel first: the topic's messages are kept for it
                assert http(node.nsq_http, "/topic/create?topic=atomic", "POST")[0] == 200
                assert http(node.nsq_http, "/channel/create?topic=atomic&channel=check", "POST")[0] == 200
            with RawClient(node.nsq_tcp) as producer:
                whole = 2 * round_number
                producer.send(_mpub(whole))
                producer.expect_response()
                answered.append(whole)
                stored = _stored(nats_server)
                link.cut_after(BATCH * BODY // 2)
                producer.send(_mpub(whole + 1))
                wait_until(lambda: link.is_cut, "half the MPUB through the link")
                node.stop(signal.SIGKILL)
        assert _stored(nats_server) == stored  # nothing of the cut one (the commit never came)
    with running_gateway("--jetstream", nats_server.url, data_dir=tmp_path / "reader") as node, \
            consumer(node.nsq_tcp, "atomic", "check", rdy=100) as reader:
        count = _stored(nats_server)
        bodies = []
        for _ in range(count):
            message = reader.read_message()
            reader.send(nsq_client.fin(message.msg_id))
            bodies.append(message.body)
    per_mpub = Counter(int(body.split(b"-")[0]) for body in bodies)
    assert per_mpub == {number: BATCH for number in answered}, per_mpub
    assert len(set(bodies)) == len(bodies)


@pytest.mark.slow
def test_an_mpub_whose_answer_is_lost_is_sent_again_and_stored_once(tmp_path: Path, nats_server: NatsServer) -> None:
    """The link passes a whole MPUB's batch and then goes silent, JetStream's answer lost on it; once the link
    is back the node sends the batch again, JetStream finds its messages stored (duplicate ids) and the node
    answers OK: the MPUB is there once."""
    with LinkProxy.to(nats_server.url) as link, \
            running_gateway("--jetstream", link.url, data_dir=tmp_path / "node") as node, \
            RawClient(node.nsq_tcp) as producer:
        assert http(node.nsq_http, "/topic/create?topic=atomic", "POST")[0] == 200
        assert http(node.nsq_http, "/channel/create?topic=atomic&channel=check", "POST")[0] == 200
        before = link.forwarded_up
        producer.send(_mpub(0))
        producer.expect_response()
        size = link.forwarded_up - before  # the batch, and what else the node sent meanwhile
        link.cut_after(size + 1024)
        producer.send(_mpub(1))
        wait_until(lambda: link.is_cut and _stored(nats_server) == 2 * BATCH, "the second MPUB stored, its answer held")
        link.heal()
        producer.expect_response(timeout=30)
        assert _stored(nats_server) == 2 * BATCH  # sent again: none stored twice
        with consumer(node.nsq_tcp, "atomic", "check", rdy=100) as reader:
            bodies = []
            for _ in range(2 * BATCH):
                message = reader.read_message()
                reader.send(nsq_client.fin(message.msg_id))
                bodies.append(message.body)
    assert Counter(int(body.split(b"-")[0]) for body in bodies) == {0: BATCH, 1: BATCH}


def test_an_mpub_past_one_batch_goes_as_several_in_order(tmp_path: Path, nats_server: NatsServer) -> None:
    """2,500 messages: three batches (1,000 a batch, nats-server's most), stored in the MPUB's order."""
    bodies = [b"m%d" % n for n in range(2500)]
    with running_gateway("--jetstream", nats_server.url, data_dir=tmp_path / "node") as node, \
            consumer(node.nsq_tcp, "many", "check") as reader, RawClient(node.nsq_tcp) as producer:
        producer.send(nsq_client.mpub("many", bodies))
        producer.expect_response()
        reader.send(nsq_client.rdy(100))
        got = []
        for _ in bodies:
            message = reader.read_message()
            reader.send(nsq_client.fin(message.msg_id))
            got.append(message.body)
        assert got == bodies
        assert json.loads(http(node.http, "/api/state")[1])["backend"]["batches"] == 3


def test_single_publishes_that_come_together_go_as_one_batch_each_answered(
        tmp_path: Path, nats_server: NatsServer) -> None:
    """16 clients' PUBs sent at once: stored in batches (fewer than one publish each), every client answered OK
    once its message is stored, each message delivered once."""
    with running_gateway("--jetstream", nats_server.url, data_dir=tmp_path / "node") as node, \
            consumer(node.nsq_tcp, "together", "check") as reader:
        producers = [RawClient(node.nsq_tcp) for _ in range(16)]
        try:
            for round_number in range(5):
                for number, producer in enumerate(producers):
                    producer.send(nsq_client.pub("together", b"%d-%d" % (round_number, number)))
                for producer in producers:
                    producer.expect_response()
        finally:
            for producer in producers:
                producer.close()
        backend = json.loads(http(node.http, "/api/state")[1])["backend"]
        assert 1 <= backend["batches"] < 80, backend  # together, not one by one
        reader.send(nsq_client.rdy(100))
        got = []
        for _ in range(80):
            message = reader.read_message()
            reader.send(nsq_client.fin(message.msg_id))
            got.append(message.body)
        assert sorted(got) == sorted(b"%d-%d" % (r, n) for r in range(5) for n in range(16))


def test_an_mpub_waits_while_the_stream_has_all_its_batches_in_flight(tmp_path: Path, nats_server: NatsServer) -> None:
    """Another client holds the stream's 50 batches open (nats-server's most per stream): the node's batch is
    refused (10210) and sent again until a slot frees, then stored once and answered OK."""
    with running_gateway("--jetstream", nats_server.url, data_dir=tmp_path / "node") as node, \
            RawClient(node.nsq_tcp) as producer:
        assert http(node.nsq_http, "/topic/create?topic=crowded", "POST")[0] == 200
        assert http(node.nsq_http, "/channel/create?topic=crowded&channel=check", "POST")[0] == 200

        async def crowd() -> None:
            async with trio.open_nursery() as nursery:
                connection = await NatsConnection.connect(NatsOptions([nats_server.url]), nursery)
                subject = "polymq.t.crowded"
                for number in range(50):  # each batch's start, answered empty once the server holds it
                    started = await connection.request(subject, b"open", headers={
                        HEADER_BATCH_ID: f"crowd-{number}", HEADER_BATCH_SEQUENCE: "1"}, timeout=10)
                    assert started.payload == b"", started.payload
                producer.send(nsq_client.mpub("crowded", [b"one", b"two", b"three"]))
                with trio.fail_after(30):
                    while json.loads(http(node.http, "/api/state")[1])["backend"]["batches_sent_again"] < 1:
                        await trio.sleep(0.05)
                committed = await connection.request(subject, b"close", headers={
                    HEADER_BATCH_ID: "crowd-0", HEADER_BATCH_SEQUENCE: "2", HEADER_BATCH_COMMIT: "1"}, timeout=10)
                assert json.loads(committed.payload)["count"] == 2
                await connection.close()
                nursery.cancel_scope.cancel()

        trio.run(crowd)
        producer.expect_response(timeout=30)
        with consumer(node.nsq_tcp, "crowded", "check", rdy=10) as reader:
            got = [reader.read_message().body for _ in range(5)]
        assert sorted(got) == sorted([b"open", b"close", b"one", b"two", b"three"])
