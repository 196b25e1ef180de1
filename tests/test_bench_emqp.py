"""`polymq bench emqp`: short runs of every scenario against a real gateway: every request sent
reaches a worker, the JSON has its shape, and a broker that is not there is an error."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from support.gateway import running_gateway

BENCH_TIMEOUT_S = 180


def run_bench(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "polymq", "bench", "emqp", "--no-progress", *args],
                          capture_output=True, text=True, timeout=BENCH_TIMEOUT_S)


def test_every_scenario_accounts_for_every_request(tmp_path: Path) -> None:
    with running_gateway(data_dir=tmp_path) as gateway:
        done = run_bench("--frontend", gateway.addresses["emqp-frontend"],
                         "--backend", gateway.addresses["emqp-backend"], "--json", "--messages", "500",
                         "--latency-messages", "50", "--interval", "0.002", "--clients", "2", "--workers", "2",
                         "--slots", "5",
                         "--server-pid", str(gateway.process.pid))
    assert done.returncode == 0, done.stderr + done.stdout
    results = {r["name"]: r for r in json.loads(done.stdout)}
    assert list(results) == ["requests", "replies", "latency"]
    for name, count in (("requests", 1000), ("replies", 1000), ("latency", 100)):
        assert (results[name]["produced"], results[name]["consumed"]) == (count, count), name
        assert (results[name]["producers"], results[name]["consumers"]) == (2, 2)
    latency = results["latency"]["latency"]
    assert latency["count"] == 100 and 0 <= latency["p50_us"] <= latency["p99_us"] <= latency["max_us"]
    assert results["requests"]["server_cpu"] is not None


def test_no_broker_is_an_error() -> None:
    done = run_bench("--frontend", "127.0.0.1:1", "--backend", "127.0.0.1:2", "--scenario", "latency",
                     "--latency-messages", "5", "--clients", "1", "--workers", "1")
    assert done.returncode != 0 and "is an eMQP broker there?" in done.stderr, done.stderr
