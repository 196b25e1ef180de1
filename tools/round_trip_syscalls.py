"""The gateway's system calls per request/response round trip, counted by strace.

Starts a gateway (`--in-memory` unless other options are given after `--`), warms one connection
up, then attaches `strace -c -f` to the gateway's PID while one client makes N round trips: an NSQ
`PUB` answered `OK`, an MQKS `publish --confirm` answered `ok` (to an event a queue is bound
to), and a PHPMQ ack answered by the next delivery of a backlog (a consumer with a window of one).
Prints each protocol's calls per round trip by name, and the rate of the traced run (strace
slows it: the counts are the figure, not the rate).

    .venv/bin/python tools/round_trip_syscalls.py --round-trips 20000
"""

from __future__ import annotations

import os
import re
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import click

from polymq.clients import phpmq
from polymq.codecs import mqks_client
from polymq.torture.gateway import start_gateway

BODY = b"x" * 200  # nsq's bench_writer's default size
WARM_UP = 2000  # round trips before the trace: imports, first allocations and the JIT-less warm paths
# strace -c's summary line: `% time seconds usecs/call calls [errors] syscall`.
SUMMARY_LINE = re.compile(r"^\s*[\d.]+\s+[\d.]+\s+\d+\s+(\d+)\s+(?:\d+\s+)?(\w+)$")
ATTACH_WAIT_S = 1.0  # strace prints nothing when it is attached: give it this long


def _connect(address: str) -> socket.socket:
    host, port = address.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=10)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def _exactly(sock: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise click.ClickException("the gateway closed the connection")
        data += chunk
    return data


def _line(sock: socket.socket) -> bytes:
    data = b""
    while not data.endswith(b"\n"):
        chunk = sock.recv(4096)
        if not chunk:
            raise click.ClickException("the gateway closed the connection")
        data += chunk
    return data


def nsq_round_trips(address: str, count: int) -> float:
    with _connect(address) as sock:
        sock.sendall(b"  V2")
        frame = b"PUB round_trips\n" + struct.pack(">I", len(BODY)) + BODY
        started = time.perf_counter()
        for _ in range(count):
            sock.sendall(frame)
            size, = struct.unpack(">I", _exactly(sock, 4))
            _exactly(sock, size)
        return count / (time.perf_counter() - started)


def mqks_round_trips(address: str, count: int) -> float:
    # A queue bound to the event, so its publishes are kept; its consumer leaves (the queue stays), so
    # the trace holds the publishes' round trips only, no deliveries.
    with _connect(address) as binder:
        binder.sendall(mqks_client.request("bind", "consume", b"round_trips round_trips", confirm=True))
        _line(binder)
    with _connect(address) as sock:
        started = time.perf_counter()
        for number in range(count):
            sock.sendall(mqks_client.request(f"r{number}", "publish",
                                             b"round_trips " + mqks_client.publish_data(BODY), confirm=True))
            _line(sock)
        return count / (time.perf_counter() - started)


def phpmq_fill(address: str, count: int) -> None:
    """`count` messages waiting in the queue the PHPMQ round trips read (untraced)."""
    with phpmq.Connection(address, 10) as conn:
        for _ in range(count):
            conn.publish("round_trips", BODY)
        conn.barrier()


def phpmq_round_trips(address: str, count: int) -> float:
    """A consumer with a window of one: each ack (004) is answered by the next delivery (003) of the
    queue's backlog, the path of a delivery whose consumer is waiting."""
    with phpmq.Connection(address, 10) as conn:
        conn.consume("round_trips", 1)
        started = time.perf_counter()
        [delivery] = conn.deliveries(1)
        for _ in range(count - 1):
            conn.ack("round_trips", delivery.message_id)
            [delivery] = conn.deliveries(1)
        conn.ack("round_trips", delivery.message_id)
        return count / (time.perf_counter() - started)


def traced(pid: int, run: callable) -> tuple[dict[str, int], float]:  # type: ignore[valid-type]
    with tempfile.NamedTemporaryFile(suffix=".strace") as output:
        tracer = subprocess.Popen(["strace", "-c", "-f", "-p", str(pid), "-o", output.name],
                                  stderr=subprocess.DEVNULL)
        time.sleep(ATTACH_WAIT_S)
        try:
            rate = run()
        finally:
            os.kill(tracer.pid, signal.SIGINT)
            tracer.wait(30)
        calls = {}
        for line in Path(output.name).read_text().splitlines():
            match = SUMMARY_LINE.match(line)
            if match and match.group(2) != "total":
                calls[match.group(2)] = int(match.group(1))
        return calls, rate


@click.command()
@click.option("--round-trips", type=click.IntRange(min=100), default=20_000, show_default=True)
@click.argument("gateway_args", nargs=-1)
def main(round_trips: int, gateway_args: tuple[str, ...]) -> None:
    """Count the gateway's system calls per NSQ and MQKS round trip (GATEWAY_ARGS: `polymq serve`
    options, after `--`; default `--in-memory`)."""
    with tempfile.TemporaryDirectory(prefix="polymq-syscalls-") as folder:
        args = gateway_args or ("--in-memory",)
        gateway = start_gateway(Path(folder) / "data", ("--no-pzq", "--no-emqp", *args))
        try:
            for name, run in (("nsq", nsq_round_trips), ("mqks", mqks_round_trips), ("phpmq", phpmq_round_trips)):
                address = gateway.addresses[{"nsq": "nsq-tcp"}.get(name, name)]
                if name == "phpmq":
                    phpmq_fill(address, WARM_UP + round_trips)
                run(address, WARM_UP)
                calls, rate = traced(gateway.process.pid, lambda: run(address, round_trips))  # noqa: B023
                relevant = {call: count for call, count in calls.items() if count >= round_trips // 2}
                per_trip = ", ".join(f"{call} {count / round_trips:.2f}" for call, count in
                                     sorted(relevant.items(), key=lambda item: -item[1]))
                total = sum(relevant.values()) / round_trips
                click.echo(f"{name}: {total:.2f} system calls per round trip ({per_trip}); "
                           f"{rate:,.0f} round trips/s under strace")
        finally:
            gateway.stop()


if __name__ == "__main__":
    sys.exit(main())
