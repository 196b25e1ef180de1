"""Running one of the interop drivers (tests/interop/drivers): a real client library in its own
environment (.interop/<client>, or node for nsqjs), a JSON request on stdin, a JSON result line out."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
INTEROP_DIR = Path(os.environ.get("INTEROP_DIR", ROOT / ".interop"))
DRIVERS = ROOT / "tests" / "interop" / "drivers"


def run_driver_script(client: str, stem: str, request: dict[str, Any], timeout: float) -> tuple[dict[str, Any], str]:
    """Run `<client>_<stem>` (`.py` in the client's environment, `.js` with node) on `request`; its
    last JSON line and its stderr's tail."""
    if client == "nsqjs":
        command = ["node", str(DRIVERS / f"nsqjs_{stem}.js")]
    else:
        command = [str(INTEROP_DIR / client / "bin" / "python"), str(DRIVERS / f"{client}_{stem}.py")]
    env = {**os.environ, "NODE_PATH": str(INTEROP_DIR / "node" / "node_modules")}
    env.pop("PYTHONPATH", None)  # the client's own environment, not the project's
    done = subprocess.run(command, input=json.dumps(request), capture_output=True, text=True, env=env,
                          timeout=timeout, cwd=str(DRIVERS))
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if not lines:
        raise AssertionError(f"{client} {stem} printed no result (exit {done.returncode}):\n"
                             f"stdout: {done.stdout[-2000:]}\nstderr: {done.stderr[-4000:]}")
    return json.loads(lines[-1]), done.stderr[-4000:]
