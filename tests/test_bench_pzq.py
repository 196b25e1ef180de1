"""`polymq bench pzq`: short runs of every scenario against a real gateway: what is produced is
acknowledged and consumed, the JSON has its shape, and a server that is not there is an error."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from polymq.bench import pzq as pzq_bench
from polymq.bench.common import LatencySummary
from polymq.bench.flows import FlowResult

from support.gateway import running_gateway

BENCH_TIMEOUT_S = 180


def run_bench(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "polymq", "bench", "pzq", "--no-progress", *args],
                          capture_output=True, text=True, timeout=BENCH_TIMEOUT_S)


def test_every_scenario_accounts_for_every_message(tmp_path: Path) -> None:
    with running_gateway(data_dir=tmp_path) as gateway:  # a PZQ server has one queue: a gateway of its own
        done = run_bench("--receive", gateway.addresses["pzq-receive"], "--send", gateway.addresses["pzq-send"],
                         "--json", "--messages", "500", "--latency-messages", "50", "--interval", "0.002",
                         "--server-pid", str(gateway.process.pid))
    assert done.returncode == 0, done.stderr + done.stdout
    results = {r["name"]: r for r in json.loads(done.stdout)}
    assert list(results) == ["produce", "consume", "both", "latency"]
    assert (results["produce"]["produced"], results["produce"]["consumed"]) == (1000, 0)
    assert (results["consume"]["produced"], results["consume"]["consumed"]) == (0, 1000), "the produce backlog"
    assert (results["both"]["produced"], results["both"]["consumed"]) == (1000, 1000)
    assert (results["latency"]["produced"], results["latency"]["consumed"]) == (100, 100)
    latency = results["latency"]["latency"]
    assert latency["count"] == 100 and 0 <= latency["p50_us"] <= latency["p99_us"] <= latency["max_us"]
    assert results["both"]["server_cpu"] is not None


def test_no_server_is_an_error() -> None:
    done = run_bench("--receive", "127.0.0.1:1", "--send", "127.0.0.1:2", "--scenario", "latency",
                     "--latency-messages", "5", "--producers", "1", "--consumers", "1")
    assert done.returncode != 0 and "is a PZQ server there?" in done.stderr


def test_the_lines_under_the_table_compare_with_the_original_and_nothing_else() -> None:
    slow = FlowResult("both", producers=2, consumers=2, produced=1_000, consumed=600, produce_seconds=1.0,
                      consume_seconds=2.0, latency=None)
    assert pzq_bench.verdicts(slow) == ["both: 1,000 msgs/s produced with ACKs, 0.2x the original's ~5,000",
                                        "both: 300 msgs/s consumed with ACKs, 0.2x the original's ~1,500"]
    latency = FlowResult("latency", 1, 1, 10, 10, 1.0, 1.0, LatencySummary(10, 400, 900, 1500))
    assert pzq_bench.verdicts(latency) == ["latency: p50 0.40 ms, p99 0.90 ms"]
