"""`polymq bench spark`: the Spark data source against a running gateway (docs/spark.md).

Scenarios: `endpoints` (the gateway alone: rows/s its publish endpoint accepts, in batches of
`--batch` rows, and rows/s its read endpoint serves, both over one HTTP connection, so that Spark's
figures can be told from the gateway's), `ceiling` (the same query over a trivial Python source
that yields pre-built Arrow batches, bench/spark_ceiling.py: what any Python stream source can
reach at this micro-batch size), `stream-read` (a Structured Streaming query reading a stream of
`--rows` messages to Spark's `noop` sink, Trigger.AvailableNow) and `batch-write` (a DataFrame of
`--rows` rows written with `.write.format("polymq")`). Spark runs in this process on `--master`
(local[2]); the JVM's start is not counted, and a first query over both sources warms the JVM and
the Python workers up unmeasured (the first query of a JVM runs several times slower).
"""

from __future__ import annotations

import json
import os
import secrets
import sys
import tempfile
import time
from typing import Any

import attrs
import click

from polymq.bench import common
from polymq.clients.stream import StreamClient, StreamClientError
from polymq.codecs import stream_rows

SCENARIOS = ("endpoints", "ceiling", "stream-read", "batch-write")
DEFAULT_ROWS = 1_000_000
DEFAULT_SIZE = 200
DEFAULT_MAX_ROWS = 250_000  # per micro-batch of the stream read: four batches of the million
WARM_UP_ROWS = 500_000  # rows of the unmeasured first queries (enough for the JVM's compiler to settle)
DEFAULT_BATCH = 20_000  # rows per publish request (about 4.4 MB of 200-byte rows: under nsqd's 5 MiB)


@attrs.frozen
class Result:
    scenario: str
    rows: int
    seconds: float

    @property
    def rate(self) -> float:
        return self.rows / self.seconds if self.seconds else 0.0


def _fill(client: StreamClient, topic: str, rows: int, size: int, batch: int) -> float:
    """Publish `rows` bodies of `size` bytes to `topic`; returns the seconds it took."""
    encoded = [stream_rows.encode_publish_row(b"x" * size)] * batch
    started = time.perf_counter()
    sent = 0
    while sent < rows:
        count = min(batch, rows - sent)
        client.publish(encoded[:count], topic)
        sent += count
    return time.perf_counter() - started


def _read_all(client: StreamClient, stream: str, layout: str) -> tuple[int, float]:
    """Read the whole stream through the read endpoint in `layout` (rows counted from the row heads
    or the column batch's head)."""
    offsets = client.offsets(stream)
    begin, end = offsets["start"], offsets["end"]
    count = 0
    started = time.perf_counter()
    while begin < end:
        raw = client.read_batch(stream, begin, end, layout=layout)
        if not raw:
            break
        if layout == "columns":
            columns = stream_rows.decode_read_column_buffers(raw)
            count += columns.rows
            begin = columns.last_position + 1
            continue
        offset = 0
        head, unpack = stream_rows.READ_HEAD.size, stream_rows.READ_HEAD.unpack_from
        while offset < len(raw):
            position, _, _, _, topic_len, headers_len, body_len, origin_len = unpack(raw, offset)
            offset += head + topic_len + headers_len + body_len + origin_len
            count += 1
        begin = position + 1
    return count, time.perf_counter() - started


def endpoints(gateway: str, rows: int, size: int, batch: int) -> list[Result]:
    name = f"bench-spark-{secrets.token_hex(4)}"
    with StreamClient(gateway) as client:
        client.open(name, [name])
        seconds = _fill(client, name, rows, size, batch)
        # The first read takes what spilled back from disk, in the layout the Spark source reads.
        first, first_seconds = _read_all(client, name, "columns")
        columns, columns_seconds = _read_all(client, name, "columns")
        again, again_seconds = _read_all(client, name, "rows")
        client.commit(name, client.offsets(name)["end"])
    return [Result("publish endpoint", rows, seconds),
            Result("read endpoint (first read, columns)", first, first_seconds),
            Result("read endpoint (again, columns)", columns, columns_seconds),
            Result("read endpoint (again, rows)", again, again_seconds)]


def _noop_query(reader: Any, scenario: str) -> Result:
    """Run a stream `reader` to the noop sink with Trigger.AvailableNow; the rows it read and when."""
    with tempfile.TemporaryDirectory(prefix="polymq-bench-spark-") as checkpoint:
        query = reader.load().writeStream.format("noop").option("checkpointLocation", checkpoint) \
            .trigger(availableNow=True)
        started = time.perf_counter()
        running = query.start()
        running.awaitTermination()
        seconds = time.perf_counter() - started
        got = sum(progress["numInputRows"] for progress in running.recentProgress)
    return Result(scenario, got, seconds)


def ceiling(spark: Any, rows: int, size: int, partitions: int, max_rows: int) -> Result:
    from polymq.bench.spark_ceiling import NAME, CeilingSource

    spark.dataSource.register(CeilingSource)
    reader = (spark.readStream.format(NAME).option("rows", str(rows)).option("size", str(size))
              .option("partitions", str(partitions)).option("maxRowsPerTrigger", str(max_rows)))
    return _noop_query(reader, "ceiling (pre-built Arrow)")


def stream_read(spark: Any, gateway: str, rows: int, size: int, batch: int, partitions: int,
                max_rows: int) -> Result:
    name = f"bench-spark-{secrets.token_hex(4)}"
    with StreamClient(gateway) as client:
        client.open(name, [name])
        _fill(client, name, rows, size, batch)
    reader = (spark.readStream.format("polymq").option("gateway", gateway).option("stream", name)
              .option("partitions", str(partitions)).option("maxRowsPerTrigger", str(max_rows)))
    return _noop_query(reader, "stream read (noop sink)")  # the query commits what it read


def warm_up(spark: Any, gateway: str, size: int, batch: int, partitions: int, max_rows: int) -> None:
    """Unmeasured: the JVM's first queries run several times slower than the ones after."""
    ceiling(spark, WARM_UP_ROWS, size, partitions, max_rows)
    stream_read(spark, gateway, WARM_UP_ROWS // 5, size, batch, partitions, max_rows)


def batch_write(spark: Any, gateway: str, rows: int, size: int, partitions: int) -> Result:
    from pyspark.sql import functions

    name = f"bench-spark-{secrets.token_hex(4)}"
    with StreamClient(gateway) as client:
        client.open(name, [name])
    frame = spark.range(rows, numPartitions=partitions).select(
        functions.lit(b"x" * size).alias("body")).cache()
    frame.count()  # the rows exist before the clock starts
    started = time.perf_counter()
    frame.write.format("polymq").option("gateway", gateway).option("topic", name).mode("append").save()
    seconds = time.perf_counter() - started
    frame.unpersist()
    with StreamClient(gateway) as client:
        written = client.offsets(name)
        client.commit(name, written["end"])
    return Result("batch write", rows, seconds)


def _spark(master: str) -> Any:
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    try:
        from pyspark.sql import SparkSession
    except ImportError:
        raise click.ClickException("PySpark is not installed: pip install 'polymq[spark]'") from None
    spark = (SparkSession.builder.master(master).appName("polymq-bench")
             .config("spark.ui.enabled", "false").config("spark.ui.showConsoleProgress", "false")
             .config("spark.driver.memory", "2g").getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    return spark


@click.command()
@click.option("--gateway", default="127.0.0.1:4181", show_default=True,
              help="The gateway's own HTTP listener HOST:PORT.")
@common.scenario_option(SCENARIOS)
@click.option("--rows", type=click.IntRange(min=1), default=DEFAULT_ROWS, show_default=True)
@click.option("--size", type=click.IntRange(min=1), default=DEFAULT_SIZE, show_default=True, help="Body bytes.")
@click.option("--batch", type=click.IntRange(min=1), default=DEFAULT_BATCH, show_default=True,
              help="Rows per publish request (endpoints, and filling the stream to read).")
@click.option("--master", default="local[2]", show_default=True, help="Spark master.")
@click.option("--partitions", type=click.IntRange(min=1), default=2, show_default=True,
              help="Partitions of the read and of the DataFrame written.")
@click.option("--max-rows-per-trigger", "max_rows", type=click.IntRange(min=1), default=DEFAULT_MAX_ROWS,
              show_default=True, help="The stream read's micro-batch size (the source's maxRowsPerTrigger).")
@click.option("--warm-up/--no-warm-up", "warm", default=True, show_default=True,
              help="Run an unmeasured first query over each source before the measured ones.")
@click.option("--json", "as_json", is_flag=True, help="Print the results as JSON instead of a table.")
def command(gateway: str, scenarios: tuple[str, ...], rows: int, size: int, batch: int, master: str,
            partitions: int, max_rows: int, warm: bool, as_json: bool) -> None:
    """Measure the Spark data source and the gateway's stream endpoints: rows per second."""
    chosen = common.chosen_scenarios(scenarios, SCENARIOS)
    results: list[Result] = []
    try:
        if "endpoints" in chosen:
            results += endpoints(gateway, rows, size, batch)
        if {"ceiling", "stream-read", "batch-write"} & set(chosen):
            spark = _spark(master)
            try:
                if warm:
                    warm_up(spark, gateway, size, batch, partitions, max_rows)
                if "ceiling" in chosen:
                    results.append(ceiling(spark, rows, size, partitions, max_rows))
                if "stream-read" in chosen:
                    results.append(stream_read(spark, gateway, rows, size, batch, partitions, max_rows))
                if "batch-write" in chosen:
                    results.append(batch_write(spark, gateway, rows, size, partitions))
            finally:
                spark.stop()
    except StreamClientError as error:
        raise click.ClickException(str(error)) from None
    if as_json:
        click.echo(json.dumps([{**attrs.asdict(r), "rows_per_s": round(r.rate)} for r in results], indent=2))
        return
    click.echo(f"{'scenario':<28} {'rows':>10} {'seconds':>8} {'rows/s':>10}")
    for result in results:
        click.echo(f"{result.scenario:<28} {result.rows:>10,} {result.seconds:>8.2f} {result.rate:>10,.0f}")
    by_name = {result.scenario: result for result in results}
    top, read = by_name.get("ceiling (pre-built Arrow)"), by_name.get("stream read (noop sink)")
    if top is not None and read is not None and top.rate:
        click.echo(f"stream read: {read.rate / top.rate:.2f}x the ceiling at {max_rows:,} rows per micro-batch")

