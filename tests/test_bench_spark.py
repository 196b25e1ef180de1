"""`polymq bench spark`: the endpoints scenario accounts for every row (the Spark scenarios run the
same source the Spark tests cover, on a JVM of their own); a gateway that is not there is one
clear line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from support.gateway import running_gateway

BENCH_TIMEOUT_S = 120
SPARK_BENCH_TIMEOUT_S = 600  # a JVM of its own, on a loaded machine


def run_bench(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "polymq", "bench", "spark", *args], capture_output=True, text=True,
                          timeout=BENCH_TIMEOUT_S)


def test_the_endpoints_scenario_publishes_and_reads_every_row(tmp_path: Path) -> None:
    with running_gateway(data_dir=tmp_path) as gateway:
        done = run_bench("--gateway", gateway.http, "--scenario", "endpoints", "--rows", "2500", "--batch", "1000",
                         "--json")
    assert done.returncode == 0, done.stderr + done.stdout
    results = {r["scenario"]: r for r in json.loads(done.stdout)}
    assert list(results) == ["publish endpoint", "read endpoint (first read, columns)",
                             "read endpoint (again, columns)", "read endpoint (again, rows)"]
    assert all(r["rows"] == 2500 and r["seconds"] > 0 and r["rows_per_s"] > 0 for r in results.values())


def test_the_endpoints_table_is_the_figures_alone(tmp_path: Path) -> None:
    with running_gateway(data_dir=tmp_path) as gateway:
        done = run_bench("--gateway", gateway.http, "--scenario", "endpoints", "--rows", "2500", "--batch", "1000")
    assert done.returncode == 0, done.stderr + done.stdout
    lines = done.stdout.splitlines()
    assert lines[0].split() == ["scenario", "rows", "seconds", "rows/s"]
    assert [line.split("  ")[0] for line in lines[1:]] == [
        "publish endpoint", "read endpoint (first read, columns)", "read endpoint (again, columns)",
        "read endpoint (again, rows)"]


def test_the_ceiling_and_the_stream_read_count_every_row(tmp_path: Path) -> None:
    with running_gateway(data_dir=tmp_path) as gateway:
        done = subprocess.run(
            [sys.executable, "-m", "polymq", "bench", "spark", "--gateway", gateway.http, "--scenario", "ceiling",
             "--scenario", "stream-read", "--rows", "30000", "--max-rows-per-trigger", "10000", "--batch", "5000",
             "--master", "local[1]", "--no-warm-up", "--json"],
            capture_output=True, text=True, timeout=SPARK_BENCH_TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-3000:] + done.stdout
    results = {r["scenario"]: r for r in json.loads(done.stdout)}
    assert list(results) == ["ceiling (pre-built Arrow)", "stream read (noop sink)"]
    assert all(r["rows"] == 30000 and r["rows_per_s"] > 0 for r in results.values()), results


def test_no_gateway_is_one_clear_line() -> None:
    done = run_bench("--gateway", "127.0.0.1:9", "--scenario", "endpoints", "--rows", "10")
    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == [
        "Error: polymq gateway at 127.0.0.1:9: POST /stream/open failed: [Errno 111] Connection refused"]
