"""The PySpark data source `polymq` with a real local Spark (one JVM for the module) against real
gateways: streaming reads (exact rows, admission control, Trigger.AvailableNow, restarts from the
checkpoint), batch reads and writes, streaming writes whose replayed batch publishes nothing twice,
and the errors a Spark user sees (docs/spark.md)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from polymq.clients.stream import StreamClient
from polymq.codecs import stream_rows

from support.gateway import GatewayProcess, running_gateway
from support.spark import SPARK_ENV, spark_session

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def spark() -> Iterator[Any]:
    session = spark_session()
    yield session
    session.stop()


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    with running_gateway(data_dir=tmp_path_factory.mktemp("spark-gateway")) as process:
        yield process


def publish(gateway: GatewayProcess, topic: str, bodies: list[bytes], headers: dict[str, Any] | None = None) -> None:
    with StreamClient(gateway.http) as client:
        client.publish([stream_rows.encode_publish_row(body, headers=headers) for body in bodies], topic)


def stream_query(spark: Any, gateway: GatewayProcess, stream: str, topics: str, out: Path, **options: str) -> list[Any]:
    """One Trigger.AvailableNow run into parquet files under `out` (its checkpoint beside them);
    returns its micro-batches' input row counts."""
    reader = (spark.readStream.format("polymq").option("gateway", gateway.http).option("stream", stream)
              .option("topics", topics))
    for key, value in options.items():
        reader = reader.option(key, value)
    query = (reader.load().writeStream.format("parquet").option("path", str(out / "rows"))
             .option("checkpointLocation", str(out / "checkpoint")).trigger(availableNow=True).start())
    query.awaitTermination(120)
    assert query.exception() is None, query.exception()
    return [progress["numInputRows"] for progress in query.recentProgress if progress["numInputRows"]]


def test_a_stream_reads_what_every_protocol_published_in_batches_and_a_restart_reads_only_new_rows(
        spark: Any, gateway: GatewayProcess, tmp_path: Path) -> None:
    with StreamClient(gateway.http) as client:
        client.open("spark-orders", ["orders", "returns"])
    publish(gateway, "orders", [b"o%d" % number for number in range(25)], {"source": "web"})
    publish(gateway, "returns", [b"r0"])
    batches = stream_query(spark, gateway, "spark-orders", "orders,returns", tmp_path, maxRowsPerTrigger="10")
    assert batches == [10, 10, 6]  # admission control, then the rest (Trigger.AvailableNow stops there)
    rows = spark.read.parquet(str(tmp_path / "rows")).orderBy("position").collect()
    assert [(row.topic, bytes(row.body)) for row in rows] == (
        [("orders", b"o%d" % number) for number in range(25)] + [("returns", b"r0")])
    assert all(row.attempts == 0 and row.headers == {"source": "web"} for row in rows[:25])
    assert {row.protocol for row in rows} == {"http"}  # published through the gateway's stream endpoint
    assert len({row.id for row in rows}) == 26 and all(len(row.id) == 16 for row in rows)
    assert [row.position for row in rows] == sorted({row.position for row in rows})
    assert all(abs(row.timestamp.timestamp() - time.time()) < 600 for row in rows)  # when it was published

    publish(gateway, "orders", [b"late1", b"late2"])
    assert stream_query(spark, gateway, "spark-orders", "orders,returns", tmp_path) == [2]
    everything = spark.read.parquet(str(tmp_path / "rows")).orderBy("position").collect()
    assert [bytes(row.body) for row in everything[26:]] == [b"late1", b"late2"] and len(everything) == 28
    with StreamClient(gateway.http) as client:
        offsets = client.offsets("spark-orders")
    # Spark commits a batch's end to the source when it plans the next: the last run's first batch
    # committed the first run's rows; the second run's stay until the next run.
    assert offsets["committed"] == rows[-1].position + 1 and offsets["start"] <= offsets["end"]


def test_a_batch_read_is_a_snapshot_that_consumes_nothing_and_a_batch_write_publishes_each_row(
        spark: Any, gateway: GatewayProcess) -> None:
    with StreamClient(gateway.http) as client:
        client.open("spark-batch", ["batch-in"])
        client.open("spark-batch-out", ["batch-out"])
    publish(gateway, "batch-in", [b"%d" % number for number in range(7)])
    frame = (spark.read.format("polymq").option("gateway", gateway.http).option("stream", "spark-batch")
             .option("partitions", "3").load())
    assert frame.rdd.getNumPartitions() == 3
    assert sorted(bytes(row.body) for row in frame.collect()) == [b"%d" % number for number in range(7)]
    with StreamClient(gateway.http) as client:
        assert client.offsets("spark-batch")["committed"] == 0  # nothing consumed
        assert len(client.read("spark-batch", 0, client.offsets("spark-batch")["end"])) == 7

    out = spark.createDataFrame([(b"a", None, "id-1", {"k": "v"}), (b"b", "batch-out", None, None)],
                                "body binary, topic string, id string, headers map<string,string>")
    out.write.format("polymq").option("gateway", gateway.http).option("topic", "batch-out").mode(
        "append").save()
    spark.createDataFrame([("text body",)], "body string").write.format("polymq").option(
        "gateway", gateway.http).option("topic", "batch-out").mode("append").save()
    with StreamClient(gateway.http) as client:
        written = client.read("spark-batch-out", 0, client.offsets("spark-batch-out")["end"])
    assert [row.body for row in written] == [b"a", b"b", b"text body"]
    assert json.loads(written[0].headers) == {"k": "v", "msg_id": "id-1"}  # the row's own id
    assert written[1].headers == written[2].headers == b""


@pytest.mark.filterwarnings("ignore:Cannot infer the eval type")  # the UDF's type hints, for humans
def test_a_replayed_streaming_batch_publishes_no_row_twice(spark: Any, gateway: GatewayProcess,
                                                          tmp_path: Path) -> None:
    from pyspark.errors import StreamingQueryException
    from pyspark.sql import functions
    from pyspark.sql.types import StringType

    marker = tmp_path / "fail-once"
    marker.write_text("")

    def topic_of(body: bytes) -> str:
        # On the first try row "4" gets a topic the gateway refuses: the write task fails there,
        # after rows 0-3 went out in two requests (batchRows 2). The replay's row "4" is fine.
        import os

        if body == b"4" and os.path.exists(str(marker)):
            os.remove(str(marker))
            return "no\x01such topic"
        return "replay-out"

    topic = functions.udf(topic_of, StringType())
    with StreamClient(gateway.http) as client:
        client.open("spark-replay-out", ["replay-out"])
    checkpoint = tmp_path / "checkpoint"

    def run() -> Any:
        frame = (spark.readStream.format("polymq").option("gateway", gateway.http)
                 .option("stream", "spark-replay-in").option("topics", "replay-in").option("partitions", "1")
                 .load())
        out = frame.select(functions.concat(functions.lit(b"out-"), "body").alias("body"),
                           topic("body").alias("topic"))
        query = (out.writeStream.format("polymq").option("gateway", gateway.http).option("batchRows", "2")
                 .option("checkpointLocation", str(checkpoint)).trigger(availableNow=True).start())
        with contextlib.suppress(StreamingQueryException):  # the first run's: its exception() tells
            query.awaitTermination(120)
        return query

    with StreamClient(gateway.http) as client:
        client.open("spark-replay-in", ["replay-in"])
    publish(gateway, "replay-in", [b"%d" % number for number in range(8)])
    failed = run()
    assert failed.exception() is not None and "topic must be 1 to 1024 bytes" in str(failed.exception())
    with StreamClient(gateway.http) as client:
        partial = client.read("spark-replay-out", 0, client.offsets("spark-replay-out")["end"])
    assert [row.body for row in partial] == [b"out-0", b"out-1", b"out-2", b"out-3"]

    replayed = run()
    assert replayed.exception() is None
    with StreamClient(gateway.http) as client:
        rows = client.read("spark-replay-out", 0, client.offsets("spark-replay-out")["end"])
    assert [row.body for row in rows] == [b"out-%d" % number for number in range(8)]  # each once, in order


def test_errors_a_spark_user_sees(spark: Any, gateway: GatewayProcess, tmp_path: Path) -> None:
    from py4j.protocol import Py4JJavaError
    from pyspark.errors import PySparkException, StreamingQueryException

    errors = (PySparkException, Py4JJavaError)
    with pytest.raises(errors, match="no stream missing-stream"):
        spark.read.format("polymq").option("gateway", gateway.http).option("stream", "missing-stream").load() \
            .collect()
    with pytest.raises(errors, match=r"127\.0\.0\.1:9: GET /stream/offsets failed"):
        spark.read.format("polymq").option("gateway", "127.0.0.1:9").option("stream", "s").option(
            "timeout", "2").load().collect()
    with pytest.raises(errors, match="option stream or queue is required"):
        spark.read.format("polymq").option("gateway", gateway.http).load().collect()
    with pytest.raises(errors, match="has no body"):
        spark.createDataFrame([(None,)], "body binary").write.format("polymq").option(
            "gateway", gateway.http).option("topic", "t").mode("append").save()
    with pytest.raises(errors, match="needs a body column"):
        spark.createDataFrame([("x",)], "text string").write.format("polymq").option(
            "gateway", gateway.http).option("topic", "t").mode("append").save()
    with pytest.raises(errors, match="over the limit"):
        spark.createDataFrame([(b"x" * (1024 * 1024 + 1),)], "body binary").write.format("polymq").option(
            "gateway", gateway.http).option("topic", "t").mode("append").save()

    # An offset no longer available: the gateway committed past what the checkpoint says.
    with StreamClient(gateway.http) as client:
        client.open("spark-lost", ["lost"])
    publish(gateway, "lost", [b"1", b"2", b"3"])
    checkpoint = tmp_path / "checkpoint"
    frame = (spark.readStream.format("polymq").option("gateway", gateway.http).option("stream", "spark-lost")
             .option("topics", "lost").load())
    frame.writeStream.format("noop").option("checkpointLocation", str(checkpoint)).trigger(
        availableNow=True).start().awaitTermination(120)  # positions 0-2 read; not yet committed to the gateway
    publish(gateway, "lost", [b"4"])
    with StreamClient(gateway.http) as client:
        client.commit("spark-lost", client.offsets("spark-lost")["end"])  # somebody else took them
    query = frame.writeStream.format("noop").option("checkpointLocation", str(checkpoint)).trigger(
        availableNow=True).start()
    with pytest.raises(StreamingQueryException, match="set failOnDataLoss to false"):
        query.awaitTermination(120)
    # Relaxed, the same checkpoint reads on from what the gateway still has.
    publish(gateway, "lost", [b"5"])
    seen: list[bytes] = []
    relaxed_frame = (spark.readStream.format("polymq").option("gateway", gateway.http)
                     .option("stream", "spark-lost").option("failOnDataLoss", "false").load())
    relaxed = (relaxed_frame.writeStream
               .foreachBatch(lambda batch, _: seen.extend(bytes(row.body) for row in batch.collect()))
               .option("checkpointLocation", str(checkpoint)).trigger(availableNow=True).start())
    relaxed.awaitTermination(120)
    assert relaxed.exception() is None and seen == [b"5"]


REPO = Path(__file__).resolve().parent.parent
JOB = Path(__file__).resolve().parent / "support" / "spark_stream_job.py"


def wait_for(path: Path, process: subprocess.Popen[bytes], timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert process.poll() is None, f"the Spark driver ended ({process.returncode}) before {path.name}"
        assert time.monotonic() < deadline, f"no {path.name} within {timeout} s"
        time.sleep(0.05)


def test_a_driver_killed_mid_batch_re_reads_the_uncommitted_range_and_loses_nothing(
        gateway: GatewayProcess, tmp_path: Path) -> None:
    out, checkpoint = tmp_path / "out", tmp_path / "checkpoint"
    out.mkdir()
    with StreamClient(gateway.http) as client:
        client.open("spark-crash", ["crash"])
    publish(gateway, "crash", [b"m%02d" % number for number in range(25)])
    command = [sys.executable, str(JOB), gateway.http, "spark-crash", "crash", str(out), str(checkpoint)]
    # Its own session: SIGKILL goes to the driver and its JVM, as when the machine under it dies.
    driver = subprocess.Popen([*command, "--stall-batch", "1"], start_new_session=True, env={**os.environ, **SPARK_ENV})
    try:
        wait_for(out / "started-1", driver)
    finally:
        os.killpg(driver.pid, signal.SIGKILL)
        driver.wait(30)
    assert sorted(path.name for path in out.iterdir()) == ["batch-0.json", "started-0", "started-1"]
    publish(gateway, "crash", [b"late"])  # after the crash: not part of the replayed batch
    with StreamClient(gateway.http) as client:
        # Spark told the source batch 0's end as it planned batch 1; batch 1's range is still there.
        first_batch = json.loads((out / "batch-0.json").read_text())
        assert client.offsets("spark-crash")["committed"] == first_batch[-1]["position"] + 1

    subprocess.run(command, check=True, timeout=300, env={**os.environ, **SPARK_ENV}, start_new_session=True)
    batches = {int(path.stem.split("-")[1]): json.loads(path.read_text()) for path in out.glob("batch-*.json")}
    assert sorted(batches) == [0, 1, 2]
    assert [len(batches[number]) for number in range(3)] == [10, 10, 6]
    # Batch 1 again, exactly the range planned before the crash; the late message comes after it.
    assert [row["body"] for row in batches[1]] == [f"m{number:02d}" for number in range(10, 20)]
    every = [row["body"] for number in range(3) for row in batches[number]]
    assert every == [f"m{number:02d}" for number in range(25)] + ["late"]


def test_the_example_pipeline_runs_end_to_end_from_one_command() -> None:
    finished = subprocess.run([sys.executable, "examples/spark_orders/run.py"], cwd=REPO, capture_output=True,
                              text=True, timeout=600, env={**os.environ, **SPARK_ENV})
    assert finished.returncode == 0, finished.stdout[-3000:] + finished.stderr[-3000:]
    lines = finished.stdout.splitlines()
    for consumer in ("MQKS consumer", "NSQ consumer"):
        at = lines.index(f"{consumer} received 6 per-minute totals:")
        assert lines[at + 1] == "  2026-01-05 12:00   18 orders  amount   1872  (PHPMQ 9, NSQ 9)"
        assert lines[at + 6] == "  2026-01-05 12:05   18 orders  amount   2646  (PHPMQ 9, NSQ 9)"


def test_a_gateway_that_goes_away_mid_query_fails_it_with_its_address_not_a_hang(spark: Any, tmp_path: Path) -> None:
    from pyspark.errors import StreamingQueryException

    with running_gateway("--in-memory", data_dir=tmp_path / "data") as doomed:
        address = doomed.http
        publish(doomed, "t", [b"one"])  # the topic exists; the stream's copy starts with the next
        frame = (spark.readStream.format("polymq").option("gateway", address).option("stream", "s")
                 .option("topics", "t").option("timeout", "5").load())
        query = frame.writeStream.format("noop").option("checkpointLocation", str(tmp_path / "checkpoint")).trigger(
            processingTime="200 milliseconds").start()
        publish(doomed, "t", [b"two"])
        query.processAllAvailable()
    started = time.monotonic()
    with pytest.raises(StreamingQueryException, match=rf"polymq gateway at {address.replace('.', '[.]')}"):
        query.awaitTermination(60)
    assert time.monotonic() - started < 60


def test_a_batch_read_of_any_queue_reads_a_snapshot_of_it(spark: Any, gateway: GatewayProcess) -> None:
    import http.client

    host, port = gateway.nsq_http.rsplit(":", 1)
    connection = http.client.HTTPConnection(host, int(port), timeout=5)
    for path in ("/topic/create?topic=queued", "/channel/create?topic=queued&channel=workers"):
        connection.request("POST", path)  # an NSQ channel: an ordinary queue
        response = connection.getresponse()
        assert response.status == 200, response.read()
        response.read()
    connection.close()
    publish(gateway, "queued", [b"q%d" % number for number in range(5)])
    frame = (spark.read.format("polymq").option("gateway", gateway.http).option("queue", "queued/workers")
             .option("partitions", "2").load())
    assert frame.rdd.getNumPartitions() == 2
    rows = frame.orderBy("position").collect()
    assert [(row.position, bytes(row.body), row.protocol) for row in rows] == [
        (number, b"q%d" % number, "http") for number in range(5)]
    assert frame.count() == 5  # a new snapshot: nothing was consumed


def test_a_gateway_that_asks_for_its_token_is_read_and_written_with_the_token_option(
        spark: Any, tmp_path: Path) -> None:
    from py4j.protocol import Py4JJavaError
    from pyspark.errors import PySparkException

    token = "spark-test-token-0123456789"
    with running_gateway("--admin-token", token, "--in-memory", data_dir=tmp_path) as guarded:
        with StreamClient(guarded.http, token=token) as client:
            client.open("guarded", ["guarded-in"])
        spark.createDataFrame([(b"one",), (b"two",)], "body binary").write.format("polymq").option(
            "gateway", guarded.http).option("token", token).option("topic", "guarded-in").mode("append").save()
        frame = (spark.read.format("polymq").option("gateway", guarded.http).option("token", token)
                 .option("stream", "guarded").load())
        assert sorted(bytes(row.body) for row in frame.collect()) == [b"one", b"two"]
        with pytest.raises((PySparkException, Py4JJavaError), match="answered 401 UNAUTHORIZED"):
            spark.read.format("polymq").option("gateway", guarded.http).option("stream", "guarded").load().collect()
