"""A benchmark pointed at nothing says so in one line naming the address: no traceback, and no
progress line written with carriage returns when stderr is not a terminal."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest


def _closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.mark.parametrize("protocol", ["nsq", "mqks", "phpmq", "pzq", "emqp"])
def test_a_bench_with_no_server_ends_in_one_line_naming_the_address(protocol: str) -> None:
    port, other = _closed_port(), _closed_port()
    address, second = f"127.0.0.1:{port}", f"127.0.0.1:{other}"
    flags = {"nsq": ["--tcp", address, "--http", second], "mqks": ["--addr", address], "phpmq": ["--addr", address],
             "pzq": ["--receive", address, "--send", second], "emqp": ["--frontend", address, "--backend", second]}
    result = subprocess.run([sys.executable, "-m", "polymq", "bench", protocol, *flags[protocol]],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert "Traceback" not in result.stderr and "\r" not in result.stderr
    [line] = [line for line in result.stderr.splitlines() if line.strip()]
    assert line.startswith("Error: ") and f"127.0.0.1:{port if protocol != 'emqp' else other}" in line, line


def _children(pid: int) -> list[int]:
    """The processes whose parent is `pid` (Linux /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                found.append(int(entry.name))
    return found


def _running(pid: int) -> bool:
    """Alive and not a zombie waiting for whoever inherited it to reap it."""
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the workers' end with the bench is Linux's prctl")
def test_a_killed_benchs_workers_end_with_it() -> None:
    """SIGKILL skips the bench's exit handlers; its workers must not go on driving the server (a
    ZeroMQ one reconnecting to a port nobody listens on can end up connected to itself there)."""
    with socket.create_server(("127.0.0.1", 0)) as silent:  # accepts, never answers
        silent.settimeout(60)
        bench = subprocess.Popen([sys.executable, "-m", "polymq", "bench", "mqks", "--addr",
                                  f"127.0.0.1:{silent.getsockname()[1]}", "--scenario", "auto", "--no-progress"],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            peers = [silent.accept()[0] for _ in range(8)]  # every worker connected: 4 + 4
            workers = [pid for pid in _children(bench.pid) if _running(pid)]
            assert len(workers) >= 8
        finally:
            bench.kill()
            bench.wait()
        deadline = time.monotonic() + 20
        while any(_running(pid) for pid in workers) and time.monotonic() < deadline:
            time.sleep(0.05)
        left = [pid for pid in workers if _running(pid)]
        for pid in left:
            os.kill(pid, signal.SIGKILL)  # not to leave them to the tests after this one
        for peer in peers:
            peer.close()
        assert not left, f"workers still running 20 s after their bench was killed: {left}"
