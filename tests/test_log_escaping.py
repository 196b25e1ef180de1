"""What a client chooses cannot forge, garble or drive a log line, in either log format.

Hostile values go in through every way a client's words reach the log: an eMQP worker identity
(logged when it joins), an eMQP queue name, a PHPMQ packet that is refused with its queue name, and an MQKS
request line answered with an error. Each holds a newline followed by a forged log line, a NUL (ZeroMQ's own
identities start with one), a terminal escape sequence and a Unicode line separator.
"""

from __future__ import annotations

import json
import re
import socket
from pathlib import Path

import pytest
import zmq

from polymq.codecs import emqp, phpmq

from support.gateway import GatewayProcess, running_gateway

HOSTILE = "\n2026-11-26 00:00:00.000 ERROR   gateway  FORGED LINE\x00\x1b[2J\u2028"
ESCAPED = "\\x0a2026-11-26 00:00:00.000 ERROR   gateway  FORGED LINE\\x00\\x1b[2J\\u2028"
TEXT_LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3} (DEBUG|INFO|WARNING|ERROR)\s+([a-z_]+)\s+(\S.*)$")


def _hostile_clients(gateway: GatewayProcess) -> None:
    context = zmq.Context()
    try:
        worker = context.socket(zmq.DEALER)
        worker.setsockopt(zmq.IDENTITY, b"w" + HOSTILE.encode())
        worker.connect(f"tcp://{gateway.addresses['emqp-backend']}")
        queues = json.dumps([[10, "jobs" + HOSTILE]]).encode()
        worker.send_multipart(emqp.client_message(emqp.INFORM, b"m1", queues, emqp.WORKER))
        worker.setsockopt(zmq.RCVTIMEO, 10_000)
        assert worker.recv_multipart()[2] in (b"ACK", b"DISCONNECT")
    finally:
        context.destroy(linger=0)
    host, port = gateway.host_port("phpmq")
    with socket.create_connection((host, port), timeout=10) as php:
        php.sendall(phpmq.send(b"q" + HOSTILE.encode(), b"body"))
        php.sendall(b"H01999" + HOSTILE.encode())  # a message type that does not exist, then garbage
        php.settimeout(10)
        assert php.recv(4096) == b""  # refused: the connection is closed
    host, port = gateway.host_port("mqks")
    with socket.create_connection((host, port), timeout=10) as mqks:
        mqks.sendall(b"id1 frobnicate " + HOSTILE.encode("utf-8").replace(b"\n", b" ") + b"\x1b\n")
        mqks.settimeout(10)
        assert b"error" in mqks.recv(4096)


@pytest.mark.parametrize("log_format", ["text", "json"])
def test_hostile_client_strings_are_escaped_in_every_log_line(tmp_path: Path, log_format: str) -> None:
    with running_gateway("--log-format", log_format, "--log-level", "debug", data_dir=tmp_path) as gateway:
        _hostile_clients(gateway)
        gateway.wait_for_log(lambda line: "FORGED" in line and "mqks" in line, timeout=10)
        gateway.wait_for_log(lambda line: "FORGED" in line and "emqp" in line, timeout=10)
    lines = gateway.log_lines
    output = "\n".join(lines)
    assert "\x00" not in output and "\x1b" not in output and "\u2028" not in output
    for line in lines:
        if log_format == "text":
            assert TEXT_LINE.match(line), line
        else:
            json.loads(line)
    messages = [json.loads(line)["message"] for line in lines] if log_format == "json" else lines
    assert not any(message.lstrip().startswith("2026-11-26 00:00:00.000") for message in messages)
    escaped = [message for message in messages if ESCAPED in message]
    assert escaped, "the hostile value is logged, escaped"
