"""The measuring tools the docs name run as printed (docs/performance.md)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

import polymq

TOOLS = Path(polymq.__file__).resolve().parent / "tools"


@pytest.mark.parametrize("flag", [[], ["--manual-ack"]])
def test_the_mqks_replay_delivers_every_message_and_prints_its_cpu(flag: list[str]) -> None:
    out = subprocess.run([sys.executable, str(TOOLS / "mqks_replay.py"), "--messages", "4000", *flag],
                         capture_output=True, text=True, check=True).stdout
    kind = "manual" if flag else "auto"
    assert re.fullmatch(rf"{kind}-ack, (compiled|pure Python): \d+\.\d\d us per message\n", out), out
