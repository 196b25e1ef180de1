"""`polymq bench phpmq`: short runs of both scenarios against a real gateway (spawning the worker
processes dominates): everything published is consumed, the table and JSON have their shape, and a
server that is not there is an error."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys

from support.gateway import GatewayProcess

BENCH_TIMEOUT_S = 120


def run_bench(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "polymq", "bench", "phpmq", "--no-progress", *args],
                          capture_output=True, text=True, timeout=BENCH_TIMEOUT_S)


def test_both_scenarios_consume_what_they_published(module_gateway: GatewayProcess) -> None:
    host, port = module_gateway.host_port("phpmq")
    done = run_bench("--addr", f"{host}:{port}", "--json", "--producers", "2", "--consumers", "2",
                     "--messages", "700", "--latency-messages", "100", "--window", "50",
                     "--server-pid", str(module_gateway.process.pid))
    assert done.returncode == 0, done.stderr + done.stdout
    results = {r["name"]: r for r in json.loads(done.stdout)}
    assert list(results) == ["throughput", "latency"]
    for name, expected in (("throughput", 1400), ("latency", 200)):
        r = results[name]
        assert (r["produced"], r["consumed"], r["producers"], r["consumers"]) == (expected, expected, 2, 2)
        assert r["latency"]["count"] == expected
        assert 0 <= r["latency"]["p50_us"] <= r["latency"]["p99_us"] <= r["latency"]["max_us"]
        assert r["server_cpu"] is not None


def test_the_table_puts_the_latency_beside_the_original_s(module_gateway: GatewayProcess) -> None:
    host, port = module_gateway.host_port("phpmq")
    done = run_bench("--addr", f"{host}:{port}", "--scenario", "latency", "--producers", "1", "--consumers", "1",
                     "--latency-messages", "50")
    assert done.returncode == 0, done.stderr + done.stdout
    lines = done.stdout.splitlines()
    assert lines[0].split()[:3] == ["scenario", "conns", "produced"]
    assert lines[2].startswith("latency") and "1 prod + 1 cons" in lines[2]
    assert re.fullmatch(r"latency: p50 \d+\.\d\d ms, p99 \d+\.\d\d ms \(the original: ~153 ms\)", lines[-1]), lines[-1]
    assert "target" not in done.stdout and "NOT met" not in done.stdout


def test_no_server_is_an_error() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    done = run_bench("--addr", f"127.0.0.1:{port}", "--scenario", "latency", "--latency-messages", "10")
    assert done.returncode != 0
    assert f"the benchmark failed against 127.0.0.1:{port}" in done.stderr
