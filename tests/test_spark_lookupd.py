"""The PySpark data source on a cluster found through a lookupd (the test lookupd, and nsqlookupd
1.3.0 when nsq's binaries are there): three `polymq serve` nodes with their own data dirs, one
local[2] Spark for the module (docs/spark.md, *A cluster*).

A streaming query opened before any node holds its topic reads every node the lookupd lists, and
nodes that join later from the stream's start there; the checkpoint's offsets name each node, so a
replayed micro-batch reads exactly its rows again; a node restarted with nothing new (its positions
then jump to a new segment) makes no micro-batch and loses nothing; a write finds nodes even when
none holds its topic yet.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from polymq.clients.ports import restartable_port
from polymq.clients.stream import StreamClient

from support.gateway import GatewayProcess, running_gateway
from support.nsq_cluster import Lookupd, http, http_json, wait_until
from support.spark import spark_session

pytestmark = pytest.mark.slow
STREAM, TOPIC = "orders-spark", "orders"
# Often enough that a test waits little for a micro-batch; each empty trigger only asks the lookupd
# and the nodes where the stream ends.
TRIGGER = "300 milliseconds"
# A micro-batch on a loaded 2-core machine takes well under this; it only turns a hang into a failure.
QUERY_TIMEOUT_S = 180.0
# Where a stream's positions go after a restart of its gateway with nothing new: the first position
# of the store's next segment (`segment << 32 | index`, core/disk_storage.py).
SECOND_SEGMENT = 1 << 32


@pytest.fixture(scope="module")
def spark() -> Iterator[Any]:
    session = spark_session("local[2]")
    yield session
    session.stop()


def node(lookupd: Lookupd, data_dir: Path, *extra: str) -> contextlib.AbstractContextManager[GatewayProcess]:
    return running_gateway("--lookupd-tcp-address", lookupd.tcp_address, "--broadcast-address", "127.0.0.1",
                           "--no-mqks", "--no-phpmq", "--no-pzq", "--no-emqp", *extra, data_dir=data_dir)


def registered(lookupd: Lookupd, count: int) -> None:
    wait_until(lambda: len(lookupd.get("/nodes")["producers"]) == count, f"{count} nodes registered with the lookupd")


def nsq_publish(gateway: GatewayProcess, bodies: list[bytes]) -> None:
    """A producer of another protocol: nsqd's HTTP MPUB."""
    status, answer = http(gateway.nsq_http, f"/mpub?topic={TOPIC}", "POST", b"\n".join(bodies))
    assert status == 200, answer


class Collected:
    """What a query's micro-batches gave, by batch id (foreachBatch runs on the driver, here)."""

    def __init__(self) -> None:
        self.batches: dict[int, list[bytes]] = {}

    def __call__(self, frame: Any, batch_id: int) -> None:
        self.batches[batch_id] = sorted(bytes(row.body) for row in frame.collect())

    def bodies(self) -> list[bytes]:
        return sorted(body for rows in self.batches.values() for body in rows)

    def has(self, count: int) -> Callable[[], bool]:
        return lambda: len(self.bodies()) >= count


def start_query(spark: Any, lookupd: Lookupd, checkpoint: Path, sink: Collected, **trigger: Any) -> Any:
    frame = (spark.readStream.format("polymq").option("lookupd", lookupd.http_address).option("stream", STREAM)
             .option("topics", TOPIC).option("maxRowsPerTrigger", "40").load())
    return (frame.writeStream.foreachBatch(sink).option("checkpointLocation", str(checkpoint))
            .trigger(**trigger).start())


def run_available_now(spark: Any, lookupd: Lookupd, checkpoint: Path) -> dict[int, list[bytes]]:
    sink = Collected()
    query = start_query(spark, lookupd, checkpoint, sink, availableNow=True)
    query.awaitTermination(QUERY_TIMEOUT_S)
    assert query.exception() is None, query.exception()
    return sink.batches


def stream_offsets(gateway: GatewayProcess, begin: int | None = None) -> dict[str, Any]:
    with StreamClient(gateway.http) as client:
        return client.offsets(STREAM, begin, rows=1000) if begin is not None else client.offsets(STREAM)


def test_a_lookupd_without_a_polymq_node_is_named_in_the_error(lookupd: Lookupd) -> None:
    from pyspark_polymq.source import Options, PolymqSourceError

    with pytest.raises(PolymqSourceError, match=f"no polymq gateway is registered with lookupd {lookupd.http_address}"):
        Options.of({"lookupd": lookupd.http_address, "stream": STREAM}).every_node()


def test_a_write_finds_nodes_before_any_holds_its_topic(spark: Any, tmp_path: Path, lookupd: Lookupd) -> None:
    with node(lookupd, tmp_path / "node0") as first, node(lookupd, tmp_path / "node1") as second:
        registered(lookupd, 2)
        assert http(lookupd.http_address, "/lookup?topic=audit")[0] == 404  # no node holds it
        frame = spark.createDataFrame([(b"a%02d" % number,) for number in range(12)], "body binary").repartition(4)
        frame.write.format("polymq").option("lookupd", lookupd.http_address).option("topic", "audit") \
            .mode("append").save()
        depths = [http_json(gateway.nsq_http, "/stats?format=json&topic=audit")["topics"][0]["depth"]
                  for gateway in (first, second)]
    assert depths == [6, 6]  # 4 tasks over the 2 nodes, in turn


def test_a_stream_opened_before_the_topic_reads_every_node_as_it_comes_replays_exactly_and_survives_a_restart(
        spark: Any, tmp_path: Path, lookupd: Lookupd) -> None:
    checkpoint = tmp_path / "checkpoint"
    with contextlib.ExitStack() as nodes:
        # The second node comes back on its admin port below: one nothing else is handed meanwhile.
        admin_port = restartable_port()
        first = nodes.enter_context(node(lookupd, tmp_path / "node0"))
        second = nodes.enter_context(node(lookupd, tmp_path / "node1", "--admin-port", str(admin_port)))
        registered(lookupd, 2)
        assert http(lookupd.http_address, f"/lookup?topic={TOPIC}")[0] == 404  # no node holds the topic yet

        sink = Collected()
        query = start_query(spark, lookupd, checkpoint, sink, processingTime=TRIGGER)
        try:
            # The stream is opened on both nodes, which then hold the topic.
            wait_until(lambda: len(lookupd.get(f"/lookup?topic={TOPIC}")["producers"]) == 2, "the stream on both nodes")
            nsq_publish(first, [b"first-%02d" % number for number in range(20)])
            wait_until(sink.has(20), "the first node's rows", QUERY_TIMEOUT_S)
            # A third node joins once the query runs, and its producer starts at once.
            third = nodes.enter_context(node(lookupd, tmp_path / "node2"))
            nsq_publish(third, [b"third-%02d" % number for number in range(15)])
            wait_until(sink.has(35), "the joining node's rows", QUERY_TIMEOUT_S)
            nsq_publish(second, [b"second-%02d" % number for number in range(10)])
            spark.createDataFrame([(b"spark-%02d" % number,) for number in range(12)], "body binary") \
                .repartition(3).write.format("polymq").option("lookupd", lookupd.http_address) \
                .option("topic", TOPIC).mode("append").save()
            wait_until(sink.has(57), "every row", QUERY_TIMEOUT_S)
            # Stopped once Spark logged the batch done: the replay below starts from a known log.
            wait_until(lambda: (checkpoint / "commits" / str(max(sink.batches))).exists(), "the last batch logged done",
                       QUERY_TIMEOUT_S)
        finally:
            query.stop()
        assert query.exception() is None, query.exception()
        expected = sorted([b"first-%02d" % n for n in range(20)] + [b"third-%02d" % n for n in range(15)]
                          + [b"second-%02d" % n for n in range(10)] + [b"spark-%02d" % n for n in range(12)])
        assert sink.bodies() == expected  # every row once
        last = max(sink.batches)
        offsets = json.loads((checkpoint / "offsets" / str(last)).read_text().splitlines()[-1])
        assert sorted(offsets["positions"]) == sorted(gateway.http for gateway in (first, second, third))

        # The last micro-batch as if the driver died before Spark logged it done: its replay reads
        # exactly its rows again, from every node, and nothing else.
        for logged in (str(last), f".{last}.crc"):  # the commit log's entry and its checksum file
            (checkpoint / "commits" / logged).unlink()
        assert run_available_now(spark, lookupd, checkpoint) == {last: sink.batches[last]}

        # A node restarted on its store and address, nothing new published: its stream's end is the
        # next segment's first position, the range up to it is empty, and no micro-batch comes of it.
        before = stream_offsets(second)
        second.stop()
        registered(lookupd, 2)
        again = nodes.enter_context(node(lookupd, tmp_path / "node1", "--admin-port", str(admin_port)))
        assert again.http == second.http
        registered(lookupd, 3)
        after = stream_offsets(again, before["end"])
        assert before["end"] < SECOND_SEGMENT and (after["end"], after["rows"]) == (SECOND_SEGMENT, 0)
        assert run_available_now(spark, lookupd, checkpoint) == {}
        nsq_publish(again, [b"after-restart"])
        nsq_publish(first, [b"late"])
        batches = run_available_now(spark, lookupd, checkpoint)
    assert list(batches.values()) == [[b"after-restart", b"late"]]
