"""`polymq bench versus-nsqd`'s table, and `durable-pub`'s refusal without nsq's tools (the measuring needs
nsq's Go tools; the rendering does not):
each polymq mode's ratio to the nsqd mode it is compared with, and the default beside nsqd's durable mode."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from polymq.bench import versus_nsqd
from polymq.bench.versus_nsqd import Result


def _result(label: str, pub: float, mpub: float, consume: float) -> Result:
    server = next(server for server in versus_nsqd.SERVERS if server.label == label)
    return Result(server, {"PUB": pub, "MPUB": mpub, "consume": consume})


def test_the_table_and_the_durable_line() -> None:
    table = versus_nsqd.render([
        _result("nsqd 1.3.0, defaults", 20_000, 300_000, 400_000),
        _result(versus_nsqd.NSQD_DURABLE, 2_000, 2_000, 1_000),
        _result(versus_nsqd.POLYMQ_DEFAULT, 5_000, 400_000, 300_000),
    ])
    lines = table.splitlines()
    assert any(line.startswith("polymq (default: --fsync=always)") and "5,000 (0.25x)" in line
               and "400,000 (1.33x)" in line and "300,000 (0.75x)" in line for line in lines), table
    assert lines[-1] == ("polymq's default against nsqd's durable mode (nsqd 1.3.0, --mem-queue-size=0 "
                         "--sync-every=1): PUB 2.5x, MPUB 200.0x, consume 300.0x")


def test_durable_pub_without_nsqs_tools_says_where_it_looked_in_one_line(tmp_path: Path) -> None:
    run = subprocess.run([sys.executable, "-m", "polymq", "bench", "durable-pub", "--nsq-bin", str(tmp_path)],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "Traceback" not in run.stderr
    assert f"{tmp_path} has no nsqd, bench_writer: put nsq 1.3.0's nsqd and bench_writer there" in run.stderr
