"""`polymq-ceiling`: a trivial streaming source of pre-built Arrow record batches, the ceiling a
Python data source can reach on a Spark master (`polymq bench spark --scenario ceiling`).

It reads nothing: every partition yields slices of one record batch built once per worker, with the
schema of the `polymq` source and 200-byte bodies, so the figure is Spark's own cost of a Python
stream source at a given micro-batch size. Spark's Python workers import this module by name.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from pyspark.sql.datasource import DataSource, DataSourceStreamReader, InputPartition
from pyspark.sql.streaming.datasource import ReadLimit, ReadMaxRows, SupportsTriggerAvailableNow
from pyspark.sql.types import StructType

NAME = "polymq-ceiling"
# The `polymq` source's schema (spark/pyspark_polymq/source.py), so both hand Spark the same rows.
SCHEMA = ("position long, topic string, id string, body binary, attempts int, timestamp timestamp, "
          "headers map<string,string>, protocol string")
SLICE_ROWS = 100_000  # rows of the batch each partition slices its range from (a read endpoint's answer)


@dataclass
class Range(InputPartition):
    start: int
    end: int

    def __init__(self, start: int, end: int) -> None:
        self.start, self.end = start, end


@functools.cache
def _batch(size: int) -> Any:
    import pyarrow as pa

    rows = SLICE_ROWS
    return pa.RecordBatch.from_arrays([
        pa.array(range(rows), pa.int64()),
        pa.array(["ceiling"] * rows, pa.string()),
        pa.array([f"{n:016x}" for n in range(rows)], pa.string()),
        pa.array([b"x" * size] * rows, pa.binary()),
        pa.array([1] * rows, pa.int32()),
        pa.array([1_700_000_000_000_000] * rows, pa.timestamp("us", tz="UTC")),
        pa.nulls(rows, pa.map_(pa.string(), pa.string())),
        pa.array(["http"] * rows, pa.string()),
    ], names=["position", "topic", "id", "body", "attempts", "timestamp", "headers", "protocol"])


class CeilingSource(DataSource):
    """Options: `rows` (the stream's length), `size` (body bytes), `partitions`, `maxRowsPerTrigger`."""

    @classmethod
    def name(cls) -> str:
        return NAME

    def schema(self) -> str:
        return SCHEMA

    def streamReader(self, schema: StructType) -> DataSourceStreamReader:
        return CeilingReader(int(self.options["rows"]), int(self.options.get("size", 200)),
                             int(self.options.get("partitions", 2)), int(self.options["maxRowsPerTrigger"]))


class CeilingReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    def __init__(self, rows: int, size: int, partitions: int, max_rows: int) -> None:
        self.rows, self.size, self.parts, self.max_rows = rows, size, partitions, max_rows

    def initialOffset(self) -> dict[str, Any]:
        return {"position": 0}

    def getDefaultReadLimit(self) -> ReadLimit:
        return ReadMaxRows(self.max_rows)

    def prepareForTriggerAvailableNow(self) -> None:
        pass  # the stream's end is fixed

    def latestOffset(self, start: dict[str, Any], limit: ReadLimit) -> dict[str, Any]:
        budget = limit.max_rows if isinstance(limit, ReadMaxRows) else self.rows
        return {"position": min(self.rows, int(start["position"]) + budget)}

    def partitions(self, start: dict[str, Any], end: dict[str, Any]) -> Sequence[InputPartition]:
        low, high = int(start["position"]), int(end["position"])
        bounds = [low + (high - low) * part // self.parts for part in range(self.parts + 1)]
        return [Range(a, b) for a, b in itertools.pairwise(bounds) if a < b]

    def read(self, partition: InputPartition) -> Iterator[Any]:
        assert isinstance(partition, Range)
        batch = _batch(self.size)
        at = partition.start
        while at < partition.end:
            count = min(SLICE_ROWS, partition.end - at)
            yield batch.slice(0, count)
            at += count

    def commit(self, end: dict[str, Any]) -> None:
        pass
