"""`polymq bench nsq`: short smoke runs, against a real gateway and against a sink.

The sink (`SinkServer`) is a trivial stand-in for nsqd: it answers OK to everything that wants
an answer, drops FINs, and streams pre-built message frames to a subscriber as fast as the socket
takes them. Run with a forking server (one process per connection) it measures the load
generator's own ceiling:

    .venv/bin/python tests/test_bench_nsq.py sink   # prints the port; then bench against it
"""

from __future__ import annotations

import json
import os
import socket
import socketserver
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from polymq.bench.nsq import SCENARIOS, STAMP, STAMP_MARKER
from polymq.codecs.nsq import FRAME_CLOSE_WAIT, FRAME_OK, FRAME_TYPE_MESSAGE, MAGIC_V2

# Messages per pre-built block the sink streams to a subscriber (one sendall each).
SINK_BLOCK_MESSAGES = 500
SINK_BODY_SIZE = 200
COMMANDS_WITH_BODY = {b"IDENTIFY", b"AUTH", b"PUB", b"MPUB", b"DPUB"}
COMMANDS_WITH_OK = {b"IDENTIFY", b"AUTH", b"PUB", b"MPUB", b"DPUB", b"SUB"}
# A bench subprocess must finish well within this (tiny counts; spawn start-up dominates).
BENCH_TIMEOUT_S = 120


def _message_block(count: int, size: int) -> list[bytes]:
    """Message frames whose bodies start with STAMP_MARKER, split there for `stamp.join`."""
    frames = []
    for i in range(count):
        body = STAMP_MARKER + b"x" * (size - len(STAMP_MARKER))
        data = struct.pack(">qH", 0, 1) + b"%016x" % i + body
        frames.append(struct.pack(">ii", 4 + len(data), FRAME_TYPE_MESSAGE) + data)
    return b"".join(frames).split(STAMP_MARKER)


class _SinkHandler(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        sock: socket.socket = self.request
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        stream = sock.makefile("rb", buffering=256 * 1024)
        if stream.read(4) != MAGIC_V2:
            return
        streaming = False
        subscribed = False
        while True:
            line = stream.readline()
            if not line:
                return
            name = line.rstrip(b"\r\n").split(b" ", 1)[0]
            if name in COMMANDS_WITH_BODY:
                (size,) = struct.unpack(">i", stream.read(4))
                stream.read(size)
            if name in COMMANDS_WITH_OK:
                subscribed = subscribed or name == b"SUB"
                sock.sendall(FRAME_OK)
            elif name == b"CLS":
                sock.sendall(FRAME_CLOSE_WAIT)
            elif name == b"RDY" and subscribed and not streaming:
                streaming = True
                threading.Thread(target=self._stream, args=(sock,), daemon=True).start()

    @staticmethod
    def _stream(sock: socket.socket) -> None:
        pieces = _message_block(SINK_BLOCK_MESSAGES, SINK_BODY_SIZE)
        clock = time.time_ns
        try:
            while True:
                sock.sendall(STAMP.pack(clock()).join(pieces))
        except OSError:
            return


class _ThreadingSink(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True


class _ForkingSink(socketserver.ForkingTCPServer):
    allow_reuse_address = True


@contextmanager
def sink_server(forking: bool = False) -> Iterator[str]:
    server_class = _ForkingSink if forking else _ThreadingSink
    server = server_class(("127.0.0.1", 0), _SinkHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def run_bench(*args: str) -> dict[str, Any]:
    completed = subprocess.run(
        [sys.executable, "-m", "polymq", "bench", "nsq", "--json", "--no-progress", *args],
        capture_output=True, text=True, timeout=BENCH_TIMEOUT_S,
    )
    assert completed.returncode == 0, completed.stderr + completed.stdout
    report = json.loads(completed.stdout)
    return {s["scenario"]: s for s in report["scenarios"]}


def test_bench_counts_against_gateway(gateway) -> None:
    # 1,000 messages: MPUB batches of 100 (10 commands); 2 publishers, 2 consumers, 1 in pub.
    scenarios = run_bench("--tcp", gateway.nsq_tcp, "--http", gateway.nsq_http, "--count", "1000", "--batch", "100")
    assert list(scenarios) == list(SCENARIOS)
    assert scenarios["mpub"]["published"] == 1000
    assert scenarios["sub"]["consumed"] == 1000
    assert scenarios["pub"]["published"] == 1000
    assert scenarios["pub"]["consumed"] == 1000
    assert scenarios["pubsub"]["published"] == 1000
    assert scenarios["pubsub"]["consumed"] == 1000
    for scenario in scenarios.values():
        assert not scenario["stalled"]
        assert scenario["redelivered"] == 0
    assert scenarios["pub"]["pub_rtt_us"]["count"] == 1000
    assert scenarios["pubsub"]["deliver_latency_us"]["count"] == 1000


def test_a_count_smaller_than_the_publishers_batches_is_published_whole_and_ends(gateway) -> None:
    # 150 messages in MPUBs of 200 over 2 publishers: one publishes the 150, the other has nothing to publish.
    scenarios = run_bench("--tcp", gateway.nsq_tcp, "--http", gateway.nsq_http, "--count", "150",
                          "--scenario", "mpub", "--scenario", "sub")
    assert scenarios["mpub"]["published"] == 150
    assert scenarios["sub"]["consumed"] == 150


def test_bench_table_and_single_process(gateway) -> None:
    # Everything in one worker process (selector loop); odd batch and size; server CPU column.
    completed = subprocess.run(
        [sys.executable, "-m", "polymq", "bench", "nsq", "--tcp", gateway.nsq_tcp, "--scenario", "pubsub",
         "--count", "300", "--batch", "7", "--size", "50", "--processes", "1", "--no-progress",
         "--server-pid", str(gateway.process.pid)],
        capture_output=True, text=True, timeout=BENCH_TIMEOUT_S,
    )
    assert completed.returncode == 0, completed.stderr
    row = next(line for line in completed.stdout.splitlines() if line.startswith("pubsub"))
    cells = row.split()
    assert cells[1:6] == ["2", "pub", "+", "2", "sub"]
    assert cells[6] == "300"  # published
    assert cells[9] == "300" and cells[10] != "of"  # consumed, all of it
    assert row.endswith("wait")


def test_bench_against_sink() -> None:
    with sink_server() as address:
        scenarios = run_bench("--tcp", address, "--count", "2000", "--scenario", "mpub", "--scenario", "pub",
                              "--pub-consumers", "0")
    assert scenarios["mpub"]["published"] == 2000
    assert scenarios["pub"]["published"] == 2000
    with sink_server() as address:
        scenarios = run_bench("--tcp", address, "--count", "3000", "--scenario", "sub", "--consumers", "1")
    # The sink streams without end: the consumer stops after the read that reached the target.
    assert scenarios["sub"]["consumed"] >= 3000


@pytest.mark.parametrize("bad", [["--size", "4"], ["--count", "5", "--duration", "1"], ["--tcp", "nohost"]])
def test_bench_rejects_bad_options(bad: list[str]) -> None:
    args = ["--tcp", "127.0.0.1:1", *bad] if bad[0] != "--tcp" else bad
    completed = subprocess.run([sys.executable, "-m", "polymq", "bench", "nsq", *args],
                               capture_output=True, text=True, timeout=BENCH_TIMEOUT_S)
    assert completed.returncode == 2, completed.stderr


if __name__ == "__main__" and sys.argv[1:] == ["sink"]:
    with sink_server(forking=True) as address:
        print(f"sink listening {address} (pid {os.getpid()}); Ctrl-C to stop", flush=True)
        threading.Event().wait()
