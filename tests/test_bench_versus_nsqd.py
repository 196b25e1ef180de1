"""`polymq bench versus-nsqd`'s table, and `durable-pub`'s refusal without nsq's tools: each polymq mode's ratio
to the nsqd mode it is compared with, and the default beside nsqd's durable mode; and the README's command run
as printed, against nsq 1.3.0's nsqd, bench_writer and bench_reader where they are built in ~/ref/nsq/bin, and
against their fakes (support/fake_nsqd.py, support/fake_bench_tools.py) given to it in the same place."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from polymq.bench import versus_nsqd
from polymq.bench.versus_nsqd import Result

from support.nsq_programs import REAL, home_with_nsq_programs

ROOT = Path(__file__).resolve().parent.parent
# The README's command; it finds nsq's programs in ~/ref/nsq/bin.
PRINTED = ".venv/bin/polymq bench versus-nsqd"
# Six servers, each filled with 2,000,000 messages; this only turns a hang into a failure.
RUN_TIMEOUT_S = 1800


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


@pytest.mark.slow
@pytest.mark.parametrize("programs", ["fakes", REAL])
def test_the_readmes_command_measures_every_server_as_printed(programs: str, tmp_path: Path) -> None:
    home = home_with_nsq_programs(tmp_path / "home", programs)
    run = subprocess.run(PRINTED.split(), cwd=ROOT, env={**os.environ, "HOME": str(home)}, capture_output=True,
                         text=True, timeout=RUN_TIMEOUT_S)
    assert run.returncode == 0, f"{run.stdout}\n{run.stderr[-3000:]}"
    assert run.stderr.count("measuring ") == len(versus_nsqd.SERVERS), run.stderr
    lines = run.stdout.splitlines()
    for server in versus_nsqd.SERVERS:
        [row] = [line for line in lines if line.startswith(server.label + " ")]
        cells = [cell.strip() for cell in row[len(server.label):].split("  ") if cell.strip()]
        assert len(cells) == 3 and all(re.match(r"(>= )?[1-9][0-9,]*( |$)", cell) for cell in cells), row
    assert lines[-1].startswith(f"polymq's default against nsqd's durable mode ({versus_nsqd.NSQD_DURABLE}): "
                                "PUB "), run.stdout
