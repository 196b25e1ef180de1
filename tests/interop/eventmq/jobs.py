"""Jobs the real `emq-jobmanager` runs in the interop tests (imported by its worker processes).

Each run appends one JSON line to the file named by EMQP_JOB_LOG as it ends: the job's tag, the
jobmanager that ran it (EMQP_WORKER_NAME) and the process, so the test counts runs per job and per
worker.
"""

from __future__ import annotations

import json
import os
import time

# How often a job waiting for its gate looks for it.
GATE_POLL_S = 0.05


def record(tag: str, seconds: float = 0.0, gate: str = "") -> dict[str, str]:
    """Run for `seconds`, or until the file `gate` exists; a line in EMQP_JOB_LOG + ".started" says
    the job began."""
    with open(os.environ["EMQP_JOB_LOG"] + ".started", "a", encoding="utf-8") as started:
        started.write(json.dumps({"tag": tag, "worker": os.environ.get("EMQP_WORKER_NAME", "?")}) + "\n")
    while gate and not os.path.exists(gate):
        time.sleep(GATE_POLL_S)
    if seconds:
        time.sleep(seconds)
    line = json.dumps({"tag": tag, "worker": os.environ.get("EMQP_WORKER_NAME", "?"), "pid": os.getpid()})
    with open(os.environ["EMQP_JOB_LOG"], "a", encoding="utf-8") as log:
        log.write(line + "\n")
    return {"tag": tag}
