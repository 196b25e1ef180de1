"""`polymq bench jetstream` end to end on a few messages: its own three nats-servers, the direct clients (nats-py,
atomic and fast-ingest batches) beside a gateway on them and an embedded gateway, every measure with a rate and no
error, the servers' CPU per message with each measure on the cluster, the gateway's CPU with each NSQ and MQKS
measure."""

from __future__ import annotations

import json
import subprocess
import sys


def test_the_bench_measures_every_row_and_stops_what_it_started() -> None:
    result = subprocess.run([sys.executable, "-m", "polymq", "bench", "jetstream", "--messages", "300", "--json"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr + result.stdout
    rows = {row["label"]: row for row in json.loads(result.stdout)}
    assert list(rows) == ["nats-py, direct", "direct, batching", "polymq on JetStream",
                          "polymq embedded (--fsync=always)"]
    assert all(row["error"] is None for row in rows.values())
    assert set(rows["nats-py, direct"]["rates"]) == {"publish", "publish, 32 in flight", "fetch + ack"}
    assert set(rows["direct, batching"]["rates"]) == {
        "atomic batches of 200, 2 in flight", "atomic batches of 200, 8 in flight", "atomic batches of 16, 2 in flight",
        "fast ingest, 1 batch at once, flow 500", "fast ingest, 8 batches at once, flow 500",
        "fast ingest, 1 batch at once, flow 16"}
    gateway = {"NSQ MPUB x2", "NSQ MPUB x8", "NSQ PUB x8", "NSQ PUB x32", "NSQ consume", "MQKS end to end",
               "PHPMQ end to end"}
    for label in ("polymq on JetStream", "polymq embedded (--fsync=always)"):
        assert set(rows[label]["rates"]) == gateway | {"MQKS publish"}
        assert set(rows[label]["gateway_cpu"]) == gateway
        assert all(len(shares) == 3 and all(share >= 0 for share in shares)
                   for shares in rows[label]["gateway_cpu"].values())
    assert all(rate > 0 for row in rows.values() for rate in row["rates"].values())
    for label in ("nats-py, direct", "direct, batching", "polymq on JetStream"):  # on the cluster: its servers' CPU
        assert set(rows[label]["servers_us"]) == set(rows[label]["rates"]) - {"MQKS publish"}
        assert all(us >= 0 for us in rows[label]["servers_us"].values())  # 300 messages: CPU ticks are 10 ms
    assert rows["polymq embedded (--fsync=always)"]["servers_us"] == {}
    leftover = subprocess.run(["pgrep", "-f", "polymq-bench-nats-"], capture_output=True, text=True)
    assert leftover.stdout == "", "a nats-server of the bench still runs"
