"""The PySpark data source over a cluster: three real gateways, named or found through a lookupd.

A stream read across the nodes delivers every row once, with a position per node in the
checkpoint; a node restarted between two runs of the query loses nothing and repeats nothing;
writes spread over the nodes (a task always to the same one, where its replays are de-duplicated);
a batch read takes a snapshot on every node.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from polymq.clients.ports import restartable_port
from polymq.clients.stream import StreamClient
from polymq.codecs import stream_rows

from support.gateway import GatewayProcess, running_gateway
from support.nats_cluster import NatsCluster
from support.nsq_cluster import Lookupd, wait_until
from support.spark import spark_session

pytestmark = pytest.mark.slow
NODES = 3


@pytest.fixture(scope="module")
def spark() -> Iterator[Any]:
    session = spark_session("local[2]")
    yield session
    session.stop()


@contextlib.contextmanager
def cluster(tmp_path: Path, lookupd: Lookupd | None = None, admin_ports: dict[int, int] | None = None
            ) -> Iterator[list[GatewayProcess]]:
    """`NODES` gateways; `admin_ports`: node number → the admin port it listens on."""
    extra = ("--lookupd-tcp-address", lookupd.tcp_address) if lookupd is not None else ()
    ports = admin_ports or {}
    with contextlib.ExitStack() as stack:
        yield [stack.enter_context(running_gateway(
                   *extra, *(("--admin-port", str(ports[number])) if number in ports else ()),
                   data_dir=tmp_path / f"node{number}"))
               for number in range(NODES)]


def publish(gateway: GatewayProcess, topic: str, bodies: list[bytes]) -> None:
    with StreamClient(gateway.http) as client:
        client.publish([stream_rows.encode_publish_row(body) for body in bodies], topic)


def read_available(spark: Any, reader_options: dict[str, str], checkpoint: Path) -> list[bytes]:
    reader = spark.readStream.format("polymq")
    for key, value in reader_options.items():
        reader = reader.option(key, value)
    seen: list[bytes] = []
    query = (reader.load().writeStream
             .foreachBatch(lambda batch, _: seen.extend(bytes(row.body) for row in batch.collect()))
             .option("checkpointLocation", str(checkpoint)).trigger(availableNow=True).start())
    query.awaitTermination(180)
    assert query.exception() is None, query.exception()
    return seen


def test_a_stream_reads_three_gateways_each_row_once_and_a_restarted_node_loses_nothing(
        spark: Any, tmp_path: Path) -> None:
    # Node 1 comes back on its admin port below: one nothing else is handed meanwhile.
    port = restartable_port()
    with cluster(tmp_path, admin_ports={1: port}) as nodes:
        addresses = ",".join(node.http for node in nodes)
        for node in nodes:
            with StreamClient(node.http) as client:
                client.open("orders-stream", ["orders"])
        for number, node in enumerate(nodes):
            publish(node, "orders", [b"n%d-%02d" % (number, row) for row in range(20)])
        options = {"gateway": addresses, "stream": "orders-stream", "topics": "orders", "maxRowsPerTrigger": "12"}
        first = read_available(spark, options, tmp_path / "checkpoint")
        assert sorted(first) == sorted(b"n%d-%02d" % (number, row) for number in range(NODES) for row in range(20))
        # A node stops and comes back on its store and address; rows published meanwhile on the others,
        # and after on it.
        data_dir = Path(nodes[1].process.args[nodes[1].process.args.index("--data-dir") + 1])
        nodes[1].stop()
        publish(nodes[0], "orders", [b"late-0"])
        with running_gateway("--admin-port", str(port), data_dir=data_dir) as again:
            assert again.http == nodes[1].http
            publish(again, "orders", [b"late-1"])
            second = read_available(spark, options, tmp_path / "checkpoint")  # the same checkpoint
    assert sorted(second) == [b"late-0", b"late-1"]


def test_lookupd_finds_the_nodes_of_a_topic_and_writes_spread_over_them(
        spark: Any, tmp_path: Path, lookupd: Lookupd) -> None:
    with cluster(tmp_path, lookupd) as nodes:
        for node in nodes:
            with StreamClient(node.http) as client:
                client.open("totals-stream", ["totals"])  # the topic registers with the lookupd
        wait_until(lambda: len(lookupd.get("/lookup?topic=totals")["producers"]) == NODES,
                   "every node registered topic totals")
        frame = spark.createDataFrame([(b"r%03d" % number,) for number in range(60)], "body binary").repartition(6)
        write = frame.write.format("polymq").option("lookupd", lookupd.http_address).option("topic", "totals")
        write.mode("append").save()
        per_node = []
        for node in nodes:
            with StreamClient(node.http) as client:
                offsets = client.offsets("totals-stream")
                per_node.append(offsets["end"] - offsets["start"])
        assert sum(per_node) == 60 and all(count > 0 for count in per_node)  # 6 tasks over 3 nodes
        snapshot = (spark.read.format("polymq").option("lookupd", lookupd.http_address)
                    .option("queue", "totals-stream").load().collect())
        assert sorted(bytes(row.body) for row in snapshot) == [b"r%03d" % number for number in range(60)]
        rows = read_available(spark, {"lookupd": lookupd.http_address, "stream": "totals-stream",
                                      "topics": "totals"}, tmp_path / "checkpoint")
        assert sorted(rows) == [b"r%03d" % number for number in range(60)]  # the snapshot consumed nothing


def test_a_stream_on_two_jetstream_nodes_reads_each_row_once_and_goes_on_through_one_when_the_other_dies(
        spark: Any, tmp_path: Path, nats_cluster: NatsCluster) -> None:
    """Nodes sharing a JetStream cluster answer with one stream: read once, whichever node the rows came in
    by, under the cluster's key in the checkpoint; with one node gone the other serves the same positions."""
    urls = ",".join(nats_cluster.urls)
    with running_gateway("--jetstream", urls, "--no-pzq", "--no-emqp") as first, \
            running_gateway("--jetstream", urls, "--no-pzq", "--no-emqp") as second:
        with StreamClient(first.http) as client:
            opened = client.open("shared-stream", ["shared-orders"])
        publish(first, "shared-orders", [b"a%02d" % row for row in range(20)])
        publish(second, "shared-orders", [b"b%02d" % row for row in range(20)])
        options = {"gateway": f"{first.http},{second.http}", "stream": "shared-stream", "topics": "shared-orders",
                   "maxRowsPerTrigger": "12"}
        rows = read_available(spark, options, tmp_path / "checkpoint")
        assert sorted(rows) == sorted([b"a%02d" % row for row in range(20)] + [b"b%02d" % row for row in range(20)])
        first.stop()
        publish(second, "shared-orders", [b"late"])
        assert read_available(spark, options, tmp_path / "checkpoint") == [b"late"]  # the same checkpoint
        with StreamClient(second.http) as client:
            offsets = client.offsets("shared-stream")
        # Spark commits a micro-batch as it starts the next: the first run's last, by the second run, through
        # the node left (the last one's comes with the next run).
        assert opened["start"] + 40 <= offsets["committed"] < offsets["end"]
