"""`python restart_gateway.py STATE_FILE`: stop the gateway whose PID the state file holds (SIGTERM)
and start it again with the same arguments, detached; returns once the new one is ready.

The state file is JSON: {"pid": …, "args": [...]}, written by the test that started the first
gateway; this script writes the new PID into it. A restart command for conformance suites.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

READY_TIMEOUT_S = 20.0


def main(state_file: Path) -> int:
    state = json.loads(state_file.read_text())
    pid = state["pid"]
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline and _alive(pid):
        time.sleep(0.02)
    log = state_file.with_suffix(".log").open("a")
    process = subprocess.Popen(state["args"], stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    state["pid"] = process.pid
    state_file.write_text(json.dumps(state))
    while time.monotonic() < deadline:
        if process.poll() is not None:
            print(f"the gateway exited with status {process.returncode}", file=sys.stderr)
            return 1
        if state_file.with_suffix(".log").read_text().rstrip().endswith("ready"):
            return 0
        time.sleep(0.02)
    print("the gateway did not become ready", file=sys.stderr)
    return 1


def _alive(pid: int) -> bool:
    """Running (a zombie that its parent has not reaped yet has stopped all the same)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
