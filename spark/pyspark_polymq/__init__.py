"""The polymq data source, where Spark finds it by itself: Spark imports every top-level module
whose name starts with `pyspark_` and registers its `DefaultSource` under its `name()` ("polymq").
The source itself is `pyspark_polymq.source` (docs/spark.md)."""

from pyspark_polymq.source import DefaultSource

__all__ = ["DefaultSource"]
