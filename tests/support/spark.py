"""A local Spark for the tests: one JVM per test session, on loopback, UI off, Python workers
running this interpreter (so they import pyspark_polymq and polymq as the tests do)."""

from __future__ import annotations

import os
import sys
from typing import Any

# Before pyspark starts its JVM: Spark binds and advertises loopback only; its Python workers and
# the data source lookup run this interpreter (not whatever `python3` the PATH has).
SPARK_ENV = {"SPARK_LOCAL_IP": "127.0.0.1", "PYSPARK_PYTHON": sys.executable,
             "PYSPARK_DRIVER_PYTHON": sys.executable}


def spark_session(master: str = "local[1]", app: str = "polymq-tests") -> Any:
    os.environ.update(SPARK_ENV)
    from pyspark.sql import SparkSession

    spark = (SparkSession.builder.master(master).appName(app)
             .config("spark.ui.enabled", "false")
             .config("spark.ui.showConsoleProgress", "false")
             .config("spark.sql.shuffle.partitions", "1")
             .config("spark.driver.host", "127.0.0.1")
             .config("spark.driver.bindAddress", "127.0.0.1")
             .getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    return spark
