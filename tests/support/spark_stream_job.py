"""A Spark driver process for the crash tests: a streaming query from a polymq stream, each
micro-batch written to `OUT/batch-<id>.json` (overwritten when the batch runs again). With
`--stall-batch N` the query announces batch N (`OUT/started-<N>`) and then never finishes it, so a
test can SIGKILL the driver in the middle of it.

    python spark_stream_job.py GATEWAY STREAM TOPIC OUT CHECKPOINT [--stall-batch N]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from support.spark import spark_session

ROWS_PER_BATCH = "10"


def main() -> None:
    parser = argparse.ArgumentParser()
    for name in ("gateway", "stream", "topic", "out", "checkpoint"):
        parser.add_argument(name)
    parser.add_argument("--stall-batch", type=int, default=None)
    args = parser.parse_args()
    out = Path(args.out)
    spark = spark_session(app="polymq-crash-test")

    def write(batch: Any, batch_id: int) -> None:
        (out / f"started-{batch_id}").write_text("")
        rows = [{"position": row.position, "body": bytes(row.body).decode()} for row in batch.collect()]
        if batch_id == args.stall_batch:
            time.sleep(3600)  # killed here
        (out / f"batch-{batch_id}.json").write_text(json.dumps(rows))

    query = (spark.readStream.format("polymq").option("gateway", args.gateway).option("stream", args.stream)
             .option("topics", args.topic).option("maxRowsPerTrigger", ROWS_PER_BATCH).load()
             .writeStream.foreachBatch(write).option("checkpointLocation", args.checkpoint)
             .trigger(availableNow=True).start())
    query.awaitTermination()
    spark.stop()


if __name__ == "__main__":
    main()
