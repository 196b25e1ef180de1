"""Start a real `polymq serve` process for a test and stop it by its PID.

The gateway is started with every port set to 0; it logs one line per listener,
`listening <name> <host>:<port>`, then `ready`. This module reads those lines so tests never
guess at free ports.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

import attrs

READY_TIMEOUT_S = 20.0


@attrs.define
class GatewayProcess:
    process: subprocess.Popen[str]
    addresses: dict[str, str]
    log_lines: list[str]

    @property
    def nsq_tcp(self) -> str:
        return self.addresses["nsq-tcp"]

    @property
    def nsq_http(self) -> str:
        return self.addresses["nsq-http"]

    @property
    def http(self) -> str:
        """The gateway's own HTTP listener (the stream API)."""
        return self.addresses["http"]

    def host_port(self, name: str) -> tuple[str, int]:
        host, port = self.addresses[name].rsplit(":", 1)
        return host, int(port)

    def wait_for_log(self, wanted: Callable[[str], bool], timeout: float = 3.0) -> str:
        """The first output line for which `wanted` holds, waiting for it (a thread reads the output)."""
        deadline = time.monotonic() + timeout
        while True:
            for line in list(self.log_lines):
                if wanted(line):
                    return line
            if time.monotonic() > deadline:
                raise AssertionError("no such line in the gateway's output; the last ones:\n"
                                     + "\n".join(self.log_lines[-10:]))
            time.sleep(0.01)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 10.0) -> int:
        if self.process.poll() is None:
            os.kill(self.process.pid, sig)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                os.kill(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout)
        return self.process.returncode


# The gateway's log lines `… INFO gateway listening nsq-tcp 127.0.0.1:4150` and `… INFO gateway ready`.
LISTENING = re.compile(r" (?:gateway +)?listening (\S+) (\S+:\d+)$")
READY = re.compile(r" ready$")


def read_announcements(stream: Iterable[str], lines: list[str], ready: threading.Event,
                       addresses: dict[str, str]) -> None:
    """Collects the output's lines, each listener's address, and sets `ready` at the ready line (or the end)."""
    for raw in stream:
        line = raw.rstrip("\n")
        lines.append(line)
        if line.startswith("{"):  # --log-format json: the message is a field
            with contextlib.suppress(ValueError, KeyError, TypeError):
                line = " " + json.loads(line)["message"]
        listening = LISTENING.search(line)
        if listening:
            addresses[listening.group(1)] = listening.group(2)
        elif READY.search(line):
            ready.set()
    ready.set()


@contextmanager
def running_gateway(*extra_args: str, data_dir: Path | None = None,
                    prefix: tuple[str, ...] = ()) -> Iterator[GatewayProcess]:
    """Run `python -m polymq serve` on loopback with OS-chosen ports until the block ends.

    Without `data_dir` the gateway stores in a fresh temporary folder, removed afterwards. `prefix`
    is a command the gateway's command line is given to, which must exec it (the PID stays the
    gateway's): a private mount namespace, say.
    """
    own_dir = None
    if data_dir is None:
        own_dir = data_dir = Path(tempfile.mkdtemp(prefix="polymq-test-"))
    args = [
        *prefix,
        sys.executable, "-m", "polymq", "serve",
        "--bind", "127.0.0.1",
        "--nsq-tcp-port", "0",
        "--nsq-http-port", "0",
        "--mqks-port", "0",
        "--phpmq-port", "0",
        "--phpmq-console-port", "0",
        "--pzq-receive-port", "0",
        "--pzq-send-port", "0",
        "--pzq-monitor-port", "0",
        "--emqp-backend-port", "0",
        "--emqp-frontend-port", "0",
        "--emqp-admin-port", "0",
        "--emqp-pubsub-in-port", "0",
        "--emqp-pubsub-out-port", "0",
        "--admin-port", "0",
    ]
    args += ["--data-dir", str(data_dir)]
    args += list(extra_args)
    process = subprocess.Popen(
        args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1
    )
    lines: list[str] = []
    addresses: dict[str, str] = {}
    ready = threading.Event()
    pump = threading.Thread(target=read_announcements, args=(process.stdout, lines, ready, addresses), daemon=True)
    pump.start()
    gateway = GatewayProcess(process, addresses, lines)
    try:
        if not ready.wait(READY_TIMEOUT_S) or process.poll() is not None:
            raise RuntimeError("gateway did not start:\n" + "\n".join(lines))
        yield gateway
    finally:
        gateway.stop()
        if own_dir is not None:
            shutil.rmtree(own_dir, ignore_errors=True)
