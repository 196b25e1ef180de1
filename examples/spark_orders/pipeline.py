"""The orders pipeline: a Structured Streaming job that reads orders from a polymq stream, totals
them per minute of the order's time, and publishes each closed minute's totals to a topic.

Whatever protocol the orders came in by (here PHPMQ and NSQ), Spark reads them as one stream; any
protocol's consumers read the totals (here MQKS and NSQ). Run it on its own or with spark-submit
(docs/spark.md):

    python examples/spark_orders/pipeline.py --gateway 127.0.0.1:4181 --checkpoint /tmp/orders-ck
    spark-submit --master spark://HOST:7077 examples/spark_orders/pipeline.py --gateway HOST:4181 ...
"""

from __future__ import annotations

import argparse
import os
import sys

ORDERS_TOPIC = "orders"
ORDERS_STREAM = "orders-spark"  # the job's own copy of the orders, read by position
TOTALS_TOPIC = "order-totals"
# How late an order may come and still count in its minute: a minute's totals go out once orders
# this much later than its end have arrived.
LATENESS_S = 30
LATENESS = f"{LATENESS_S} seconds"
ORDER_SCHEMA = "order string, source string, sku string, amount long, at double"


def build(spark, gateway: str, checkpoint: str, available_now: bool):  # type: ignore[no-untyped-def]
    """Start the query; returns it."""
    from pyspark.sql import functions as F

    orders = (spark.readStream.format("polymq").option("gateway", gateway).option("stream", ORDERS_STREAM)
              .option("topics", ORDERS_TOPIC).option("maxRowsPerTrigger", "10000").load()
              .select(F.from_json(F.col("body").cast("string"), ORDER_SCHEMA).alias("o")).select("o.*")
              .withColumn("time", F.timestamp_seconds("at")))
    totals = (orders.withWatermark("time", LATENESS)
              .groupBy(F.window("time", "1 minute"))
              .agg(F.count("*").alias("orders"), F.sum("amount").alias("amount"),
                   F.sum(F.when(F.col("source") == "phpmq", 1).otherwise(0)).alias("from_phpmq"),
                   F.sum(F.when(F.col("source") == "nsq", 1).otherwise(0)).alias("from_nsq")))
    out = totals.select(F.to_json(F.struct(
        F.date_format("window.start", "yyyy-MM-dd HH:mm").alias("minute"), "orders", "amount", "from_phpmq",
        "from_nsq")).alias("body"))
    writer = (out.writeStream.format("polymq").option("gateway", gateway).option("topic", TOTALS_TOPIC)
              .option("checkpointLocation", checkpoint).outputMode("append"))
    writer = writer.trigger(availableNow=True) if available_now else writer.trigger(processingTime="10 seconds")
    return writer.start()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gateway", default="127.0.0.1:4181", help="the gateway's own HTTP listener, HOST:PORT")
    parser.add_argument("--checkpoint", required=True, help="Spark's checkpoint directory for this query")
    parser.add_argument("--master", default=None, help="Spark master (spark-submit sets it); local[2] if unset")
    parser.add_argument("--available-now", action="store_true",
                        help="process what is there, then stop (else: run, a micro-batch every 10 s)")
    args = parser.parse_args()
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    from pyspark.sql import SparkSession

    builder = SparkSession.builder.appName("polymq-orders").config("spark.ui.showConsoleProgress", "false") \
        .config("spark.sql.shuffle.partitions", "2")
    if args.master:
        builder = builder.master(args.master)
    elif "PYSPARK_GATEWAY_PORT" not in os.environ:  # not under spark-submit, which sets the master
        builder = builder.master("local[2]")
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    query = build(spark, args.gateway, args.checkpoint, args.available_now)
    query.awaitTermination()
    spark.stop()


if __name__ == "__main__":
    main()
