"""A benchmark pointed at nothing says so in one line naming the address: no traceback, and no
progress line written with carriage returns when stderr is not a terminal."""

from __future__ import annotations

import socket
import subprocess
import sys

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
