"""A `polymq serve` child process on loopback with OS-chosen ports, its listeners read from its log.

The gateway logs one line per listener, `listening <name> <host>:<port>`, then `ready`; the run
(and the tests' `support.gateway`) read those lines, so nobody guesses at free ports. The process is
stopped by its PID only.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import attrs

# How long a start may take before it counts as failed: a cold Python start plus the store's
# recovery on a loaded 2-core machine stay well under it.
READY_TIMEOUT_S = 20.0

# Every listener on an OS-chosen port (0).
ANY_PORT_ARGS = (
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
)

# The gateway's log lines `… INFO gateway listening nsq-tcp 127.0.0.1:4150` and `… INFO gateway ready`.
LISTENING = re.compile(r" (?:gateway +)?listening (\S+) (\S+:\d+)$")
READY = re.compile(r" ready$")


class GatewayDidNotStart(RuntimeError):
    pass


# How long to wait for a line the gateway is about to log: a loaded machine's delays stay well
# under it, and it only costs time when the line never comes.
LOG_LINE_TIMEOUT_S = 20.0


@attrs.define
class GatewayProcess:
    process: subprocess.Popen[str]
    addresses: dict[str, str]
    log_lines: list[str]
    reader: threading.Thread | None = None  # reads the output into log_lines until its end

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

    def wait_for_log(self, wanted: Callable[[str], bool], timeout: float = LOG_LINE_TIMEOUT_S) -> str:
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
        if self.reader is not None:
            self.reader.join(timeout)  # every line it wrote is in log_lines
        return self.process.returncode


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


def serve_command(data_dir: Path, extra_args: Sequence[str] = (), prefix: Sequence[str] = ()) -> list[str]:
    """`python -m polymq serve` on 127.0.0.1, every port OS-chosen, storing in `data_dir` (unless
    `extra_args` ask for --in-memory, which refuses a data dir)."""
    storage = () if "--in-memory" in extra_args else ("--data-dir", str(data_dir))
    return [*prefix, sys.executable, "-m", "polymq", "serve", "--bind", "127.0.0.1", *ANY_PORT_ARGS,
            *storage, *extra_args]


def start_gateway(data_dir: Path, extra_args: Sequence[str] = (), prefix: Sequence[str] = (),
                  ready_timeout: float = READY_TIMEOUT_S) -> GatewayProcess:
    """Start the gateway and return once it logged `ready`; GatewayDidNotStart (its output in the
    message, the process stopped) when it did not in time."""
    process = subprocess.Popen(serve_command(data_dir, extra_args, prefix), stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, bufsize=1)
    lines: list[str] = []
    addresses: dict[str, str] = {}
    ready = threading.Event()
    reader = threading.Thread(target=read_announcements, args=(process.stdout, lines, ready, addresses), daemon=True)
    reader.start()
    gateway = GatewayProcess(process, addresses, lines, reader)
    if not ready.wait(ready_timeout) or process.poll() is not None:
        gateway.stop(signal.SIGKILL)
        raise GatewayDidNotStart("gateway did not start:\n" + "\n".join(lines))
    return gateway
