"""The measuring tools the docs name run as printed (docs/performance.md)."""

from __future__ import annotations

import re
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

import polymq
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


def _frame(sock: socket.socket) -> bytes:
    head = b""
    while len(head) < 8:
        chunk = sock.recv(8 - len(head))
        assert chunk, "closed before a frame"
        head += chunk
    size, frame_type = struct.unpack(">ii", head)
    body = b""
    while len(body) < size - 4:
        body += sock.recv(size - 4 - len(body))
    return struct.pack(">i", frame_type) + body


@pytest.mark.parametrize("loop", ["trio", "epoll"])
def test_the_round_trip_ceiling_answers_identify_pub_and_mpub_ok_and_closes_on_anything_else(loop: str) -> None:
    port = free_port()
    server = subprocess.Popen([sys.executable, str(TOOLS / "round_trip_ceiling.py"), "--loop", loop,
                               "--port", str(port)], stderr=subprocess.PIPE)
    try:
        sock = _connected(port, server)
        with sock:
            sock.sendall(b"  V2" + nsq_client.identify({"client_id": "writer"}) + nsq_client.pub("t", b"one")
                         + nsq_client.mpub("t", [b"a", b"b"]))
            assert [_frame(sock), _frame(sock), _frame(sock)] == [b"\x00\x00\x00\x00OK"] * 3
            # Split across sends: answered once whole.
            whole = nsq_client.pub("t", b"x" * 300)
            sock.sendall(whole[:7])
            sock.sendall(whole[7:])
            assert _frame(sock) == b"\x00\x00\x00\x00OK"
            sock.sendall(b"SUB t c\n")
            assert sock.recv(16) == b""  # not a PUB: closed
    finally:
        server.terminate()
        server.wait(timeout=30)


def _connected(port: int, server: subprocess.Popen[bytes]) -> socket.socket:
    """A connection once the server listens (it binds right after it starts)."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        try:
            return socket.create_connection(("127.0.0.1", port), timeout=START_TIMEOUT_S)
        except ConnectionRefusedError:
            assert server.poll() is None, server.stderr.read() if server.stderr else "exited"
            assert time.monotonic() < deadline, f"nothing listened on {port} within {START_TIMEOUT_S:.0f} s"
            time.sleep(0.05)
