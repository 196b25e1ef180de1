"""The measuring tools the docs name run as printed (docs/performance.md)."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

import polymq
from polymq.clients import nsq
from polymq.clients.ports import free_port
from polymq.codecs import nsq_client

TOOLS = Path(polymq.__file__).resolve().parent / "tools"
START_TIMEOUT_S = 30.0  # a Python process's start on a loaded 2-core machine, with room


@pytest.mark.parametrize("flag", [[], ["--manual-ack"]])
def test_the_mqks_replay_delivers_every_message_and_prints_its_cpu(flag: list[str]) -> None:
    out = subprocess.run([sys.executable, str(TOOLS / "mqks_replay.py"), "--messages", "4000", *flag],
                         capture_output=True, text=True, check=True).stdout
    kind = "manual" if flag else "auto"
    assert re.fullmatch(rf"{kind}-ack, (compiled|pure Python): \d+\.\d\d us per message\n", out), out


@pytest.mark.parametrize("loop", ["trio", "epoll", "reactor", "guest"])
def test_the_round_trip_ceiling_answers_identify_pub_and_mpub_ok_and_closes_on_anything_else(loop: str) -> None:
    port = free_port()
    server = subprocess.Popen([sys.executable, str(TOOLS / "round_trip_ceiling.py"), "--loop", loop,
                               "--port", str(port)], stderr=subprocess.PIPE)
    try:
        with _connected(port, server) as conn:
            conn.send(nsq_client.identify({"client_id": "writer"}) + nsq_client.pub("t", b"one")
                      + nsq_client.mpub("t", [b"a", b"b"]))
            for _ in range(3):
                conn.wait_for_ok("a command")
            whole = nsq_client.pub("t", b"x" * 300)  # split across sends: answered once whole
            conn.send(whole[:7])
            conn.send(whole[7:])
            conn.wait_for_ok("a PUB in two sends")
            conn.send(nsq_client.sub("t", "c"))
            assert conn.read_until_closed() == (b"", True)  # not a publish: closed, nothing said
    finally:
        server.terminate()
        server.wait(timeout=START_TIMEOUT_S)


def _connected(port: int, server: subprocess.Popen[bytes]) -> nsq.Connection:
    """A connection (the magic sent) once the server listens (it binds right after it starts)."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        try:
            return nsq.Connection(("127.0.0.1", port), START_TIMEOUT_S)
        except ConnectionRefusedError:
            assert server.poll() is None, server.stderr.read() if server.stderr else "exited"
            assert time.monotonic() < deadline, f"nothing listened on {port} within {START_TIMEOUT_S:.0f} s"
            time.sleep(0.05)
