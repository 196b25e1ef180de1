"""NSQ's own programs for cluster tests: nsqlookupd, nsqadmin and the nsq_* tools, when present.

They are looked for in POLYMQ_NSQ_BIN (default ~/ref/nsq/bin; docs/cluster.md says where to get
them); a test that needs one skips, naming what is missing, when it is not there. nsqadmin and
the tools nsq_tail, nsq_to_file, nsq_stat and to_nsq have fakes here (support/fake_<name>.py, for
CI, which has no Go): `nsq_tool` gives the real program when it is there, else its fake, and
POLYMQ_NSQ_FAKES=1 takes the fakes even then. Each program is started on 127.0.0.1 with port 0
where it listens, its log read for the address it took, and stopped by its PID. `Lookupd` is one
interface over the real nsqlookupd and the test lookupd (support/fake_lookupd.py), so the same
tests run against both.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import attrs
import pytest

from support.fake_lookupd import FakeLookupd

NSQ_BIN = Path(os.environ.get("POLYMQ_NSQ_BIN", "~/ref/nsq/bin")).expanduser()
# Named on purpose, the folder must hold the programs: a missing one is then a failure, not a skip.
NSQ_BIN_REQUIRED = "POLYMQ_NSQ_BIN" in os.environ
# Set to 1: the tools run as their fakes even where the real programs are (how CI runs them).
NSQ_FAKES = os.environ.get("POLYMQ_NSQ_FAKES", "") == "1"
# The programs that have a fake: support/fake_<name>.py.
FAKED_TOOLS = ("nsq_tail", "nsq_to_file", "nsq_stat", "to_nsq", "nsqadmin")
FAKES_DIR = Path(__file__).parent
START_TIMEOUT_S = 30.0
WAIT_TIMEOUT_S = 60.0
_LISTENING = re.compile(r"(TCP|HTTP): listening on (\S+:\d+)")


def nsq_program(name: str) -> Path:
    """The path of one of NSQ's programs, or a skip saying it is missing."""
    path = NSQ_BIN / name
    if not os.access(path, os.X_OK):
        if NSQ_BIN_REQUIRED:
            pytest.fail(f"{name} not found in POLYMQ_NSQ_BIN={NSQ_BIN}")
        pytest.skip(f"{name} not found in {NSQ_BIN} (set POLYMQ_NSQ_BIN to the folder of nsq's binaries; "
                    "docs/cluster.md): the test against the real program is skipped")
    return path


@attrs.frozen(slots=True)
class NsqTool:
    """How to run one of nsq's tools: its real program or its fake."""

    name: str
    argv: tuple[str, ...]
    fake: bool


def nsq_tool_is_fake(name: str) -> bool:
    """Whether `nsq_tool(name)` gives the fake: asked for, or the real program is not in POLYMQ_NSQ_BIN."""
    return NSQ_FAKES or not os.access(NSQ_BIN / name, os.X_OK)


def nsq_tool_label(name: str) -> str:
    """Which of the two `nsq_tool(name)` runs, known when tests are collected, for a test's id."""
    return f"fake {name}" if nsq_tool_is_fake(name) else f"{name} 1.3.0"


def nsq_tool(name: str) -> NsqTool:
    """One of the tools with a fake: the real program when present (a failure if POLYMQ_NSQ_BIN names a
    folder without it), else, or with POLYMQ_NSQ_FAKES=1, `python support/fake_<name>.py`."""
    if name not in FAKED_TOOLS:
        raise ValueError(f"{name} has no fake; nsq_program() runs it")
    if nsq_tool_is_fake(name):
        if NSQ_BIN_REQUIRED and not NSQ_FAKES:
            pytest.fail(f"{name} not found in POLYMQ_NSQ_BIN={NSQ_BIN}")
        return nsq_fake(name)
    return NsqTool(name, (str(NSQ_BIN / name),), fake=False)


def nsq_fake(name: str) -> NsqTool:
    """The fake of one of the tools, present or not the real one."""
    if name not in FAKED_TOOLS:
        raise ValueError(f"{name} has no fake")
    return NsqTool(name, (sys.executable, str(FAKES_DIR / f"fake_{name}.py")), fake=True)


def wait_until(check: Callable[[], Any], what: str, timeout: float = WAIT_TIMEOUT_S) -> Any:
    """Polls `check` until it returns something truthy; fails after `timeout` saying what was awaited."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while True:
        try:
            last = check()
        except (OSError, ValueError, KeyError, AssertionError) as error:
            last = error
        else:
            if last:
                return last
        if time.monotonic() > deadline:
            raise AssertionError(f"never got {what}; last: {last!r}")
        time.sleep(0.05)


def http(address: str, path: str, method: str = "GET", body: bytes | None = None,
         headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    request = urllib.request.Request(f"http://{address}{path}", data=body, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


def http_json(address: str, path: str, method: str = "GET", body: bytes | None = None) -> Any:
    status, data = http(address, path, method, body)
    assert status == 200, (address, path, status, data)
    return json.loads(data) if data else None


class Program:
    """One of NSQ's programs, run with its output collected; stopped by its PID."""

    def __init__(self, args: Sequence[str | Path], *, cwd: Path | None = None) -> None:
        # Output and log each in a pipe of its own: through one pipe, a log line can land between a
        # message nsq_tail prints and its newline.
        self.process = subprocess.Popen([str(arg) for arg in args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                        text=True, cwd=cwd)
        # The program's path; a fake's (support/fake_<tool>.py), not python's, for a fake.
        self.name = str(args[1] if str(args[0]) == sys.executable and len(args) > 1 else args[0])
        self.lines: list[str] = []  # whole lines of both, in the order they were read
        self._changed = threading.Condition()
        self._pumps = [threading.Thread(target=self._pump, args=(stream,), daemon=True)
                       for stream in (self.process.stdout, self.process.stderr)]
        for pump in self._pumps:
            pump.start()

    def _pump(self, stream: Any) -> None:
        for line in stream:
            with self._changed:
                self.lines.append(line.rstrip("\n"))
                self._changed.notify_all()
        with self._changed:
            self._changed.notify_all()

    def wait(self, timeout: float) -> int:
        """Its exit status once it has ended and all it wrote is in `lines`."""
        status = self.process.wait(timeout)
        for pump in self._pumps:
            pump.join(timeout)
        return status

    def wait_for_lines(self, check: Callable[[list[str]], Any], timeout: float = START_TIMEOUT_S) -> Any:
        deadline = time.monotonic() + timeout
        with self._changed:
            while not (found := check(self.lines)):
                left = deadline - time.monotonic()
                if left <= 0 or (self.process.poll() is not None and not found):
                    raise AssertionError(f"{self.name}: not in its output:\n" + "\n".join(self.lines[-20:]))
                self._changed.wait(min(left, 0.5))
            return found

    def listening(self, count: int) -> dict[str, str]:
        """The addresses it logged (`TCP: listening on …`, `HTTP: listening on …`), once `count` are there."""
        def found(lines: list[str]) -> dict[str, str] | None:
            addresses = dict(match.groups() for line in lines if (match := _LISTENING.search(line)))
            return addresses if len(addresses) >= count else None
        return self.wait_for_lines(found)

    def stop(self, sig: int = signal.SIGTERM) -> int:
        if self.process.poll() is None:
            os.kill(self.process.pid, sig)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                os.kill(self.process.pid, signal.SIGKILL)
                self.process.wait(30)
        return self.process.returncode


class Lookupd:
    """An nsqlookupd for a test: the real program, or the test lookupd in this process."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.program: Program | None = None
        self.fake: FakeLookupd | None = None
        self.tcp_address = self.http_address = ""

    def start(self, tcp_port: int = 0, http_port: int = 0) -> None:
        if self.kind == "nsqlookupd":
            self.program = Program([nsq_program("nsqlookupd"), f"--tcp-address=127.0.0.1:{tcp_port}",
                                    f"--http-address=127.0.0.1:{http_port}", "--broadcast-address=127.0.0.1"])
            addresses = self.program.listening(2)
            self.tcp_address, self.http_address = addresses["TCP"], addresses["HTTP"]
        else:
            self.fake = FakeLookupd(tcp_port, http_port)
            self.fake.start()
            self.tcp_address, self.http_address = self.fake.tcp_address, self.fake.http_address

    def stop(self) -> None:
        if self.program is not None:
            self.program.stop()
            self.program = None
        if self.fake is not None:
            self.fake.close()
            self.fake = None

    def restart(self) -> None:
        """Stopped and started again on the same ports: it has forgotten every node."""
        tcp_port, http_port = (int(address.rsplit(":", 1)[1]) for address in (self.tcp_address, self.http_address))
        self.stop()
        self.start(tcp_port, http_port)

    def get(self, path: str) -> Any:
        return http_json(self.http_address, path)

    def registered(self, node_tcp_port: int) -> set[str]:
        """What the node on this TCP port has registered now, as nsqlookupd's /debug keys it
        (`topic:t:`, `channel:t:c`); nsqlookupd keeps a key with no producer left, /debug does not list it."""
        return {key for key, producers in self.get("/debug").items()
                if key != "client::" and any(p["tcp_port"] == node_tcp_port for p in producers)}

    def node_ports(self) -> set[int]:
        return {node["tcp_port"] for node in self.get("/nodes")["producers"]}


@contextmanager
def running_lookupd(kind: str) -> Iterator[Lookupd]:
    lookupd = Lookupd(kind)
    lookupd.start()
    try:
        yield lookupd
    finally:
        lookupd.stop()


@pytest.fixture(params=["test lookupd", "nsqlookupd"])
def lookupd(request: pytest.FixtureRequest) -> Iterator[Lookupd]:
    """Each test twice: against the suite's own lookupd, and against nsq's nsqlookupd when its binaries
    are there (a skip of that half otherwise)."""
    with running_lookupd(request.param) as found:
        yield found
