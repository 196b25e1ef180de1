"""`polymq bench jetstream` end to end on a few messages: its own three nats-servers, nats-py beside a
gateway on them and an embedded gateway, every measure with a rate and no error."""

from __future__ import annotations

import json
import subprocess
import sys


def test_the_bench_measures_every_row_and_stops_what_it_started() -> None:
    result = subprocess.run([sys.executable, "-m", "polymq", "bench", "jetstream", "--messages", "300", "--json"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr + result.stdout
    rows = {row["label"]: row for row in json.loads(result.stdout)}
    assert list(rows) == ["nats-py, direct", "polymq on JetStream", "polymq embedded (--fsync=always)"]
    assert all(row["error"] is None for row in rows.values())
    assert set(rows["nats-py, direct"]["rates"]) == {"publish", "consume"}
    for label in ("polymq on JetStream", "polymq embedded (--fsync=always)"):
        assert set(rows[label]["rates"]) == {"NSQ MPUB", "NSQ PUB", "NSQ consume", "MQKS publish", "MQKS end to end"}
    assert all(rate > 0 for row in rows.values() for rate in row["rates"].values())
    leftover = subprocess.run(["pgrep", "-f", "polymq-bench-nats-"], capture_output=True, text=True)
    assert leftover.stdout == "", "a nats-server of the bench still runs"
