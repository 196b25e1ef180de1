"""`polymq bench mqks`: short smoke runs of every scenario against a real gateway.

Tiny counts (spawning the worker processes dominates): every message published must be consumed,
the JSON and the table must have their shape, and a server that is not there is an error.
"""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
from typing import Any

import trio

from polymq.bench.mqks import SCENARIOS
from polymq.clients.mqks import MQKSClient

from support.gateway import GatewayProcess

# A bench subprocess must finish well within this (tiny counts; spawn start-up dominates).
BENCH_TIMEOUT_S = 120


def run_bench(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "polymq", "bench", "mqks", "--no-progress", *args],
                          capture_output=True, text=True, timeout=BENCH_TIMEOUT_S)


def addr(gateway: GatewayProcess) -> str:
    host, port = gateway.host_port("mqks")
    return f"{host}:{port}"


def test_every_scenario_delivers_what_it_published(gateway: GatewayProcess) -> None:
    # 3 publishers x 400 (not a multiple of 3 per queue: the round-robin still adds up), all
    # throughput connections in one process (the selector path); latency: 2 x 100 paced; client: 300.
    completed = run_bench("--addr", addr(gateway), "--json", "--clients", "3", "--messages", "400",
                          "--processes", "1", "--latency-clients", "2", "--latency-messages", "100",
                          "--interval", "0.0005", "--client-messages", "300", "--server-pid", str(gateway.process.pid))
    assert completed.returncode == 0, completed.stderr + completed.stdout
    report = json.loads(completed.stdout)
    assert report["reference"]["original_e2e_msgs_per_s"] > 0
    scenarios: dict[str, dict[str, Any]] = {s["scenario"]: s for s in report["scenarios"]}
    assert list(scenarios) == list(SCENARIOS)
    for name, expected, clients in (("auto", 1200, 3), ("manual", 1200, 3), ("latency", 200, 2), ("client", 300, 1)):
        s = scenarios[name]
        assert (s["published"], s["consumed"], s["expected_consumed"]) == (expected, expected, expected), name
        assert (s["publishers"], s["consumers"]) == (clients, clients)
        assert s["e2e_msgs_per_s"] > 0 and s["pub_msgs_per_s"] > 0
        latency = s["latency_us"]
        assert latency["count"] == expected
        assert 0 <= latency["p50_us"] <= latency["p99_us"] <= latency["max_us"]
        assert latency["avg_us"] <= latency["max_us"]
        assert s["redelivered"] == 0 and not s["stalled"]
        assert s["server_cpu_user"] is not None
    assert scenarios["auto"]["processes"] == 1
    assert scenarios["latency"]["processes"] == 4  # paced publishers always get their own process
    assert scenarios["latency"]["interval_s"] == 0.0005
    assert scenarios["client"]["processes"] == 1  # the bench process itself


def test_client_scenario(gateway: GatewayProcess) -> None:
    # The project's trio MQKSClient, one publisher and one auto-ack consumer in the bench process.
    completed = run_bench("--addr", addr(gateway), "--scenario", "client", "--client-messages", "500")
    assert completed.returncode == 0, completed.stderr + completed.stdout
    lines = completed.stdout.splitlines()
    assert lines[0].endswith("; client: 1 x 500 through MQKSClient")
    rows = [line.split() for line in lines[4:] if line.startswith("client ")]
    assert len(rows) == 1
    row = rows[0]
    assert row[1:6] == ["1", "pub", "+", "1", "sub"]
    assert row[6] == "500" and row[8] == "500"  # published, consumed (no "of N": all of them)
    assert len(row) == 18 and row[11::2] == ["ms"] * 4  # latency avg, p50, p99, max
    assert any(line.startswith("client: the project's trio MQKSClient") for line in lines)
    # The queue was deleted at the end (the bench's consumer does not ask for delete-when-unused).
    assert run_eval(gateway, "len(state.queues)") == "0"


def run_eval(gateway: GatewayProcess, code: str) -> str:
    host, port = gateway.host_port("mqks")

    async def ask() -> str:
        async with MQKSClient(host, port) as client:
            return await client.eval(code)

    return trio.run(ask)


def test_table_output(gateway: GatewayProcess) -> None:
    completed = run_bench("--addr", addr(gateway), "--scenario", "manual", "--scenario", "latency",
                          "--clients", "2", "--messages", "200", "--latency-clients", "1", "--latency-messages", "50")
    assert completed.returncode == 0, completed.stderr + completed.stdout
    lines = completed.stdout.splitlines()
    assert lines[0].startswith(f"polymq bench mqks  {addr(gateway)}  32-byte messages")
    assert lines[2].split() == ["scenario", "conns", "published", "pub", "msgs/s", "consumed", "e2e", "msgs/s",
                                "latency", "avg", "p50", "p99", "max"]
    rows = {line.split()[0]: line for line in lines[4:6]}
    assert set(rows) == {"manual", "latency"}
    assert rows["manual"].split()[1:6] == ["2", "pub", "+", "2", "sub"]
    assert rows["manual"].split()[6] == "400" and rows["manual"].split()[8] == "400"
    assert rows["latency"].split()[6] == "50" and rows["latency"].split()[8] == "50"
    compared = [line for line in lines if "the original's" in line]
    assert len(compared) == 2, lines
    assert re.fullmatch(r"manual: [\d,]+ msgs/s end-to-end = [\d.]+x the original's auto-ack ~5,800", compared[0])
    assert re.fullmatch(r"latency: avg [\d.,]+ ms vs the original's ~3\.00 ms; p99 [\d.,]+ ms", compared[1])
    assert "target" not in completed.stdout and "NOT met" not in completed.stdout


def test_no_server_is_an_error() -> None:
    with socket.socket() as sock:  # a port nobody listens on: bound, never listening
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        completed = run_bench("--addr", f"127.0.0.1:{port}", "--scenario", "auto", "--messages", "10")
    assert completed.returncode != 0
    assert "scenario auto" in completed.stderr and "Connection refused" in completed.stderr
