"""Snapshots of a shared queue (the Spark source's batch reads) on nodes sharing a JetStream cluster: every
message the queue holds, whichever node holds it, each once, in the embedded store's order (in flight, ready,
deferred) with its attempts; refused, not answered short, while JetStream gave out messages no node holds."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from typing import Any

import pytest
from test_jetstream_backend import attached, name, node, until

from polymq.clients.stream import StreamClient, StreamClientError
from polymq.codecs import nsq_client, stream_rows
from polymq.jetstream.snapshots import DELAYED

from support.gateway import GatewayProcess, running_gateway
from support.nats_cluster import NatsCluster
from support.nsq_cluster import http_json, wait_until
from support.nsq_wire import RawClient, consumer, publish
from support.spark import spark_session

# Long enough that nothing given back or deferred here comes due while a test runs.
REQ_MS = 300_000
DPUB_MS = 600_000


def _snapshot(client: StreamClient, queue: str) -> tuple[dict[str, Any], list[stream_rows.ReadRow]]:
    taken = client.snapshot(queue)
    rows = list(stream_rows.decode_read_rows(client.snapshot_rows(taken["snapshot"], 0, taken["rows"])))
    client.snapshot_close(taken["snapshot"])
    return taken, rows


def _in_flight_here(gateway: GatewayProcess, topic: str) -> int:
    [found] = http_json(gateway.nsq_http, f"/stats?format=json&topic={topic}")["topics"]
    return sum(channel["in_flight_count"] for channel in found["channels"])


@pytest.fixture(scope="module")
def two_nodes(nats_cluster: NatsCluster) -> Iterator[tuple[GatewayProcess, GatewayProcess]]:
    urls = ",".join(nats_cluster.urls)
    with running_gateway("--jetstream", urls, "--no-pzq", "--no-emqp") as a, \
            running_gateway("--jetstream", urls, "--no-pzq", "--no-emqp") as b:
        yield a, b


@pytest.mark.slow
def test_a_snapshot_through_any_node_holds_what_every_node_holds_each_once(
        two_nodes: tuple[GatewayProcess, GatewayProcess]) -> None:
    a, b = two_nodes
    bodies = [b"m%d" % n for n in range(6)]
    with consumer(a.nsq_tcp, "snap", "c") as on_a, consumer(b.nsq_tcp, "snap", "c") as on_b, \
            RawClient(b.nsq_tcp) as producer_b, StreamClient(a.http) as stream_a, StreamClient(b.http) as stream_b:
        stream_b.open("snap-job", ["snap"])  # a stream read by position beside the channel
        publish(a.nsq_tcp, "snap", bodies)
        producer_b.send(nsq_client.dpub("snap", DPUB_MS, b"later"))
        producer_b.expect_response()
        on_a.send(nsq_client.rdy(2))
        held_by_a = [on_a.read_message() for _ in range(2)]  # in flight on node A
        on_b.send(nsq_client.rdy(1))
        given_back = on_b.read_message()
        on_b.send(nsq_client.rdy(0))
        on_b.send(nsq_client.req(given_back.msg_id, REQ_MS))  # held by no node until due; node B remembers it
        wait_until(lambda: _in_flight_here(b, "snap") == 0, "the REQ on node B")
        ready = [body for body in bodies if body not in {m.body for m in [*held_by_a, given_back]}]

        taken_a, rows = _snapshot(stream_a, "snap/c")
        taken_b, rows_b = _snapshot(stream_b, "snap/c")
        assert [row.body for row in rows] == [*(m.body for m in held_by_a), *ready, given_back.body, b"later"]
        assert [row.attempts for row in rows] == [1, 1, 0, 0, 0, 1, 0]
        assert {row.topic for row in rows} == {"snap"}
        assert [(row.body, row.attempts, row.id) for row in rows_b] == [
            (row.body, row.attempts, row.id) for row in rows]
        assert taken_a["shared"] == taken_b["shared"] != ""  # one queue: a reader of both nodes reads it once
        assert taken_a["rows"] == 7

        # Spark's batch reads through both nodes: each message once.
        spark = spark_session()
        try:
            read = spark.read.format("polymq").option("gateway", f"{a.http},{b.http}").option("queue", "snap/c") \
                .load().select("body", "attempts").collect()
            read_stream = spark.read.format("polymq").option("gateway", f"{a.http},{b.http}") \
                .option("stream", "snap-job").load().select("body").collect()
        finally:
            spark.stop()
        assert sorted((bytes(row.body), row.attempts) for row in read) == sorted(
            (row.body, row.attempts) for row in rows)
        assert [bytes(row.body) for row in read_stream] == bodies  # the stream's rows, in order, once

        # Taking it changed nothing: the deliveries are still the clients' to finish.
        for message in held_by_a:
            on_a.send(nsq_client.fin(message.msg_id))
        wait_until(lambda: _snapshot(stream_b, "snap/c")[1][0].body == ready[0], "the finished ones gone")
        assert [row.body for row in _snapshot(stream_b, "snap/c")[1]] == [*ready, given_back.body, b"later"]


@pytest.mark.slow
def test_a_snapshot_is_refused_while_a_node_that_went_away_held_part_of_the_queue(
        nats_cluster: NatsCluster) -> None:
    """A node killed with deliveries in flight: JetStream counts them given out until its ack wait passes and a
    consumer takes them again. Until then a snapshot is refused (a part answered as the whole would be wrong);
    once another node's consumer holds them, it is whole again."""
    urls = ",".join(nats_cluster.urls)
    ack_wait = ("--jetstream-ack-wait", "2")
    with running_gateway("--jetstream", urls, "--no-pzq", "--no-emqp", *ack_wait) as a, \
            running_gateway("--jetstream", urls, "--no-pzq", "--no-emqp", *ack_wait) as b, \
            StreamClient(b.http) as stream_b, consumer(b.nsq_tcp, "orphans", "c") as on_b:
        publish(b.nsq_tcp, "orphans", [b"one", b"two", b"three"])
        on_a = consumer(a.nsq_tcp, "orphans", "c", rdy=2)
        lost = {on_a.read_message().body, on_a.read_message().body}
        assert [row.body for row in _snapshot(stream_b, "orphans/c")[1]][2:] == [
            body for body in (b"one", b"two", b"three") if body not in lost]
        a.stop(signal.SIGKILL)
        with pytest.raises(StreamClientError) as refused:
            stream_b.snapshot("orphans/c")
        assert refused.value.status == 409 and "that no node holds now" in str(refused.value), refused.value
        on_a.close()
        on_b.send(nsq_client.rdy(3))  # the lost ones come again here after the ack wait
        got = {on_b.read_message(10).body for _ in range(3)}
        assert got == {b"one", b"two", b"three"}
        rows = _snapshot(stream_b, "orphans/c")[1]
        assert sorted(row.body for row in rows) == [b"one", b"three", b"two"]
        assert sorted(row.attempts for row in rows if row.body in lost) == [2, 2]


async def test_a_copy_given_back_is_held_while_the_cluster_was_not_read_since_its_queue_was_made(
        nats_cluster: NatsCluster) -> None:
    """A node answers for a copy it gave back with a delay though its last read of the cluster does not show the
    queue yet (under load the next read can be seconds away): the queue is its own, not gone."""
    topic, queue = name("unread"), name("given-back")
    async with node(nats_cluster) as a:
        consumer_, got = a.consumer(queue, topic, credit=1)
        await attached(a, queue)
        _, stored = a.publish(topic, b"again later")
        await stored.wait()
        await until(lambda: len(got) == 1, "the delivery")
        assert consumer_.requeue(got[0].id, REQ_MS / 1000).name == "OK"
        a.link.topology.read.pop(topic, None)  # as before the read that shows the queue
        [held] = a.link.snapshots.holdings(queue)
        assert (held.topic, held.seq, held.attempts, held.state) == (topic, 1, 1, DELAYED)
