"""Streams read by position (the Spark source's reads) on nodes sharing a JetStream cluster: the same
positions and rows on every node, whichever node the rows came in by; commits shared too."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import pytest
import trio
from pyspark_polymq import source

from polymq.clients.ports import free_ports
from polymq.clients.stream import StreamClient, StreamClientError
from polymq.codecs import stream_rows
from polymq.jetstream import api
from polymq.jetstream.nats_connection import NatsConnection, NatsOptions
from polymq.jetstream.streams import consumer_name

from support.gateway import running_gateway
from support.nats_cluster import NatsCluster
from support.nsq_wire import publish


@pytest.fixture(scope="module")
def two_nodes(nats_cluster: NatsCluster) -> Iterator[tuple[StreamClient, StreamClient, str, str]]:
    """Two gateways on the cluster: their stream clients and NSQ addresses."""
    urls = ",".join(nats_cluster.urls)
    with running_gateway("--jetstream", urls, "--no-pzq", "--no-emqp") as a, \
            running_gateway("--jetstream", urls, "--no-pzq", "--no-emqp") as b, \
            StreamClient(a.http) as on_a, StreamClient(b.http) as on_b:
        yield on_a, on_b, a.nsq_tcp, b.nsq_tcp


def _bodies(rows: list[stream_rows.ReadRow]) -> list[bytes]:
    return [row.body for row in rows]


def test_every_node_hands_out_the_same_positions_and_rows_and_shares_commits(
        two_nodes: tuple[StreamClient, StreamClient, str, str]) -> None:
    on_a, on_b, _, nsq_b = two_nodes
    opened = on_a.open("job-1", ["clicks"])
    assert opened["start"] == opened["end"] == opened["committed"]
    publish(nsq_b, "clicks", [b"b%d" % i for i in range(5)])  # in by the other node
    on_a.publish([stream_rows.encode_publish_row(b"a%d" % i) for i in range(3)], topic="clicks")
    ends = {on_a.offsets("job-1")["end"], on_b.offsets("job-1")["end"]}
    assert len(ends) == 1
    [end] = ends
    expected = [b"b0", b"b1", b"b2", b"b3", b"b4", b"a0", b"a1", b"a2"]
    on_b_rows = on_b.read("job-1", opened["start"], end)
    assert _bodies(on_b_rows) == expected
    assert on_a.read("job-1", opened["start"], end, limit=3) == on_b_rows  # in pages of 3: the same rows
    assert {row.topic for row in on_b_rows} == {"clicks"}
    assert on_a.offsets("job-1")["shared"] == on_b.offsets("job-1")["shared"] != ""
    # A range holding 3 rows ends just after the third; the count says so on either node.
    ranged = on_b.offsets("job-1", on_b_rows[0].position, rows=3)
    assert (ranged["end"], ranged["rows"]) == (on_b_rows[2].position + 1, 3)
    assert on_a.offsets("job-1", on_b_rows[0].position, rows=100)["rows"] == 8
    bounds = on_a.split("job-1", opened["start"], end, 3)
    assert bounds[0] == opened["start"] and bounds[-1] == end
    assert [body for low, high in itertools.pairwise(bounds) for body in _bodies(on_b.read("job-1", low, high))
            ] == expected
    # Committed on one node: below it is gone on both, the rest still there on both.
    middle = on_b_rows[5].position
    committed = on_a.commit("job-1", middle)
    assert (committed["committed"], committed["finished"]) == (middle, 5)
    assert on_b.offsets("job-1")["committed"] == middle
    with pytest.raises(StreamClientError) as gone:
        on_b.read("job-1", opened["start"], end)
    assert gone.value.status == 410 and gone.value.code == "OFFSET_GONE"
    assert _bodies(on_b.read("job-1", middle, end)) == [b"a0", b"a1", b"a2"]
    assert on_b.commit("job-1", middle)["finished"] == 0  # again: nothing more


def test_a_commit_cut_between_its_two_steps_leaves_the_range_readable(
        two_nodes: tuple[StreamClient, StreamClient, str, str], nats_cluster: NatsCluster) -> None:
    """The consumer of the new end is made, the old one not deleted yet (the node died): the committed end
    is the old one, and the next commit finishes the job."""
    on_a, on_b, _, nsq_b = two_nodes
    start = on_a.open("job-2", ["views"])["start"]
    publish(nsq_b, "views", [b"v%d" % i for i in range(4)])
    rows = on_a.read("job-2", start, on_a.offsets("job-2")["end"])
    cut = rows[2].position
    async def make_the_new_end_only() -> None:
        async with trio.open_nursery() as nursery:
            connection = await NatsConnection.connect(NatsOptions(servers=nats_cluster.urls), nursery)
            config = {"durable_name": consumer_name("job-2", cut), "filter_subject": api.topic_subject("views"),
                      "ack_policy": "explicit", "deliver_policy": "by_start_sequence", "opt_start_seq": cut}
            await api.ensure_consumer(connection, "views", consumer_name("job-2", cut), config)
            await connection.close()
            nursery.cancel_scope.cancel()

    trio.run(make_the_new_end_only)
    assert on_b.offsets("job-2")["committed"] == start
    assert _bodies(on_b.read("job-2", start, cut)) == [b"v0", b"v1"]
    assert on_b.commit("job-2", cut)["committed"] == cut
    assert _bodies(on_a.read("job-2", cut, on_a.offsets("job-2")["end"])) == [b"v2", b"v3"]


def test_a_stream_takes_the_topics_backlog_and_reads_one_topic(
        two_nodes: tuple[StreamClient, StreamClient, str, str]) -> None:
    on_a, on_b, nsq_a, _ = two_nodes
    publish(nsq_a, "early", [b"before the stream", b"also before"])  # no queue yet: the topic keeps them
    opened = on_b.open("job-3", ["early"])
    assert _bodies(on_a.read("job-3", opened["start"], opened["end"])) == [b"before the stream", b"also before"]
    for call in (lambda: on_a.open("job-4", ["one", "two"]), lambda: on_a.open("job-3", ["another"])):
        with pytest.raises(StreamClientError) as refused:
            call()
        assert refused.value.status == 409 and "reads" in str(refused.value)
    with pytest.raises(StreamClientError) as missing:
        on_a.offsets("no-such-job")
    assert missing.value.status == 404


def test_a_replayed_group_of_rows_is_published_once_whichever_node_takes_the_replay(
        two_nodes: tuple[StreamClient, StreamClient, str, str]) -> None:
    """A Spark task's rows are numbered in a group; the group's record is kept in the cluster, so a replay
    through another node (the first one restarted, or gone) publishes only what is missing."""
    on_a, on_b, _, _ = two_nodes
    opened = on_a.open("job-5", ["written"])
    rows = [stream_rows.encode_publish_row(b"w%d" % number) for number in range(4)]
    first = on_a.publish(rows[:3], "written", "writer/7/0", 0)
    again = on_b.publish(rows, "written", "writer/7/0", 0)
    assert (first["published"], first["duplicates"]) == (3, 0)
    assert (again["published"], again["duplicates"]) == (1, 3)
    assert _bodies(on_a.read("job-5", opened["start"], on_b.offsets("job-5")["end"])) == [b"w0", b"w1", b"w2", b"w3"]


def test_a_read_task_whose_node_is_gone_reads_on_through_another_node_of_the_cluster(
        two_nodes: tuple[StreamClient, StreamClient, str, str]) -> None:
    """A Spark task's range names the node it was planned on and the others of its cluster: with the
    first unreachable, the next serves the same positions (the Spark source's `_rows`, without Spark)."""
    on_a, on_b, _, nsq_b = two_nodes
    start = on_a.open("job-6", ["handover"])["start"]
    publish(nsq_b, "handover", [b"h%d" % number for number in range(5)])
    end = on_a.offsets("job-6")["end"]
    [gone] = free_ports(1)  # nothing listens there
    options = source.Options.of({"stream": "job-6", "gateway": on_a.address})
    batches = list(source._rows(options, source.PositionRange(f"127.0.0.1:{gone}", start, end, (on_b.address,))))
    assert [body for batch in batches for body in batch.column("body").to_pylist()] == [
        b"h0", b"h1", b"h2", b"h3", b"h4"]
    with pytest.raises(source.PolymqSourceError, match="Connection refused"):
        list(source._rows(options, source.PositionRange(f"127.0.0.1:{gone}", start, end)))
