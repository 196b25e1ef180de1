"""Interop: the real NSQ client libraries, unchanged, against a `polymq serve` gateway.

Every test starts its own gateway, runs one scenario of one client as a subprocess inside that
client's own environment (tests/interop/drivers/, environments built by setup_envs.sh under
.interop/), and asserts exactly what the client saw: bodies byte for byte, counts, attempts,
timing of deferred and timed-out deliveries, and the compression the client negotiated.

Only the scenarios a client's API offers are generated (see CAPABILITIES and README.md); nothing
is skipped to pretend coverage.
"""

from __future__ import annotations

import base64
import collections
import os
import random
import re
import socket
import struct
import subprocess
import sys
import time
import urllib.parse
from pathlib import Path

import pytest

from support.gateway import running_gateway
from support.interop_drivers import run_driver_script
from support.nsq_cluster import http_json, wait_until

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
INTEROP_DIR = Path(os.environ.get("INTEROP_DIR", ROOT / ".interop"))

ALL = ("pub", "mpub", "dpub", "http_pub", "http_mpub", "fin", "req", "touch", "timeout",
       "deflate", "snappy", "ephemeral")

# What each client's own API offers. Left out, and why (also in README.md):
#   pynsq     http_pub, http_mpub: pynsq 0.9.1 has no HTTP publisher.
#   ansq      deflate, snappy: ansq 0.3.0 raises NotImplementedError when nsqd agrees to them.
#   nsqpy     dpub: no deferred publish in nsq-py 0.1.12; deflate, snappy: its compression
#             socket modules just `raise ImportError`, so Connection refuses both options.
#   nsqjs     http_pub, http_mpub: nsqjs 0.13.0 has no HTTP publisher.
# gnsq 1.0.2 has no msg_timeout option: its fin/touch/timeout scenarios run against a gateway
# started with `--msg-timeout 1000` (the nsqd `--msg-timeout` equivalent) instead of IDENTIFY.
CAPABILITIES: dict[str, tuple[str, ...]] = {
    "pynsq": tuple(s for s in ALL if s not in ("http_pub", "http_mpub")),
    "gnsq": ALL,
    "ansq": tuple(s for s in ALL if s not in ("deflate", "snappy")),
    "nsqpy": tuple(s for s in ALL if s not in ("dpub", "deflate", "snappy")),
    "asyncnsq": ALL,
    "nsqjs": tuple(s for s in ALL if s not in ("http_pub", "http_mpub")),
}

# Class names the clients themselves use for a negotiated compression (read from the client's
# connection object by the driver), per scenario.
COMPRESSION_EVIDENCE = {
    "pynsq": {"deflate": "DeflateEncoder", "snappy": "SnappyEncoder"},
    "gnsq": {"deflate": "DefalteSocket", "snappy": "SnappySocket"},
    "asyncnsq": {"deflate": "DeflateReader", "snappy": "SnappyReader"},
    "nsqjs": {"deflate": "DeflateRaw", "snappy": "SnappyStream"},
}

# HTTP bodies: ansq and asyncnsq decode every HTTP body as UTF-8 text and only have the newline
# separated /mpub, so they get text without newlines; gnsq and nsq-py use binary /mpub.
TEXT_ONLY_HTTP = {"ansq", "asyncnsq"}

MSG_TIMEOUT_MS = 1000
DEFER_MS = 500

_rng = random.Random(20240611)
BINARY_BODIES = [
    b"hello",
    bytes(range(256)),  # every byte value, including NUL, \n, \r, 0xff
    "h\u00e9llo w\u00f6rld \u2603".encode(),
    b"x" * 70000,  # compressible, bigger than one 64 KiB read
    _rng.randbytes(20000),  # incompressible
]
TEXT_BODIES = [b"hello", "h\u00e9llo \u2603".encode(), b"tab\there and spaces", b"y" * 1000]
SINGLE_BODY = [b"one body \x00\xff\n"]
DPUB_BODIES = [b"deferred \x01", b"immediate"]

ID_RE = re.compile(r"^[0-9a-f]{16}$")


def _params():
    for client, scenarios in CAPABILITIES.items():
        for scenario in scenarios:
            yield pytest.param(client, scenario, id=f"{client}-{scenario}")


# --------------------------------------------------------------------------- environments

@pytest.fixture(scope="session")
def interop_envs() -> Path:
    """Build (or just check the stamps of) every client environment, once per session."""
    proc = subprocess.run(["bash", str(HERE / "setup_envs.sh")], capture_output=True, text=True,
                          timeout=900, env={**os.environ, "INTEROP_DIR": str(INTEROP_DIR)})
    if proc.returncode != 0:
        pytest.fail(f"tests/interop/setup_envs.sh failed:\n{proc.stdout}\n{proc.stderr}")
    return INTEROP_DIR


def run_driver(client: str, request: dict) -> dict:
    result, stderr = run_driver_script(client, "driver", request, request["deadline_s"] + 15)
    for message in result["received"]:
        message["body"] = base64.b64decode(message["body"])
    result["stderr"] = stderr
    return result


# --------------------------------------------------------------------------- a bare NSQ probe

class BareNSQ:
    """Minimal stdlib NSQ V2 connection used only to look at the gateway from outside."""

    def __init__(self, address: str) -> None:
        host, port = address.rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)), timeout=5)
        self.buf = b""
        self.sock.sendall(b"  V2")

    def command(self, line: bytes, body: bytes | None = None) -> None:
        data = line + b"\n"
        if body is not None:
            data += struct.pack(">i", len(body)) + body
        self.sock.sendall(data)

    def frame(self, timeout: float) -> tuple[int, bytes] | None:
        end = time.monotonic() + timeout
        while True:
            if len(self.buf) >= 4:
                (size,) = struct.unpack(">i", self.buf[:4])
                if len(self.buf) >= 4 + size:
                    frame_type = struct.unpack(">i", self.buf[4:8])[0]
                    data = self.buf[8:4 + size]
                    self.buf = self.buf[4 + size:]
                    return frame_type, data
            left = end - time.monotonic()
            if left <= 0:
                return None
            self.sock.settimeout(left)
            try:
                chunk = self.sock.recv(65536)
            except TimeoutError:
                return None
            if not chunk:
                raise ConnectionError("gateway closed the probe connection")
            self.buf += chunk

    def expect_ok(self) -> None:
        frame = self.frame(5)
        assert frame == (0, b"OK"), f"expected OK, got {frame!r}"

    def close(self) -> None:
        self.sock.close()


# --------------------------------------------------------------------------- assertions

def bodies_for(client: str, scenario: str) -> list[bytes]:
    if scenario in ("req", "touch", "timeout"):
        return SINGLE_BODY
    if scenario == "dpub":
        return DPUB_BODIES
    if scenario.startswith("http") and client in TEXT_ONLY_HTTP:
        return TEXT_BODIES
    return BINARY_BODIES


def event_times(result: dict, name: str) -> list[float]:
    return [e["t"] for e in result["events"] if e["name"] == name]


def describe(result: dict) -> str:
    summary = [(m["body"][:40], m["attempts"], m["id"], m["t"]) for m in result["received"]]
    return (f"received={summary}\nevents={result['events']}\nerrors={result['errors']}\n"
            f"info={result['info']}\ndriver stderr tail:\n{result['stderr'][-1500:]}")


def assert_all_delivered_once(result: dict, bodies: list[bytes]) -> None:
    got = [m["body"] for m in result["received"]]
    assert collections.Counter(got) == collections.Counter(bodies), describe(result)
    assert len(got) == len(bodies), describe(result)
    assert [m["attempts"] for m in result["received"]] == [1] * len(bodies), describe(result)
    ids = [m["id"] for m in result["received"]]
    assert all(ID_RE.match(i) for i in ids), f"message ids not 16 lowercase hex: {ids}"
    assert len(set(ids)) == len(ids), f"duplicate message ids: {ids}"


@pytest.mark.interop
@pytest.mark.parametrize(("client", "scenario"), list(_params()))
def test_client_scenario(client: str, scenario: str, interop_envs: Path, request) -> None:
    needs_server_timeout = client == "gnsq" and scenario in ("fin", "touch", "timeout")
    if needs_server_timeout:
        with running_gateway("--msg-timeout", str(MSG_TIMEOUT_MS)) as gw:
            _run_and_check(client, scenario, gw)
    else:
        _run_and_check(client, scenario, request.getfixturevalue("gateway"))


def _run_and_check(client: str, scenario: str, gateway) -> None:
    bodies = bodies_for(client, scenario)
    topic = f"interop_{client}_{scenario}"
    channel = "ch#ephemeral" if scenario == "ephemeral" else "ch"
    req = {
        "scenario": scenario, "tcp": gateway.nsq_tcp, "http": gateway.nsq_http,
        "topic": topic, "channel": channel, "bodies": [base64.b64encode(b).decode() for b in bodies],
        "defer_ms": DEFER_MS, "msg_timeout_ms": MSG_TIMEOUT_MS,
        "quiet_s": 1.3, "hold_s": 1.8, "touch_every_s": 0.3, "deadline_s": 10.0,
    }
    result = run_driver(client, req)
    assert result["errors"] == [], describe(result)
    received = result["received"]

    if scenario in ("pub", "mpub", "http_pub", "http_mpub", "deflate", "snappy", "ephemeral"):
        assert_all_delivered_once(result, bodies)

    if scenario in ("deflate", "snappy"):
        expected = COMPRESSION_EVIDENCE[client][scenario]
        assert result["info"]["compression"] == {"producer": expected, "consumer": expected}, describe(result)

    elif scenario == "dpub":
        assert_all_delivered_once(result, bodies)
        assert [m["body"] for m in received] == [DPUB_BODIES[1], DPUB_BODIES[0]], describe(result)
        (acked,) = event_times(result, "dpub_acked")
        waited = received[1]["t"] - acked
        assert DEFER_MS / 1000 - 0.05 <= waited <= DEFER_MS / 1000 + 1.5, \
            f"deferred message arrived {waited:.3f}s after DPUB OK (defer {DEFER_MS} ms)\n{describe(result)}"

    elif scenario == "fin":
        # FIN'd with msg_timeout 1 s, then listened 1.3 s: nothing may come back.
        assert_all_delivered_once(result, bodies)
        assert not event_times(result, "unexpected_delivery"), describe(result)

    elif scenario == "req":
        assert [(m["body"], m["attempts"]) for m in received] == [(bodies[0], 1), (bodies[0], 2)], \
            describe(result)
        assert received[0]["id"] == received[1]["id"], describe(result)

    elif scenario == "touch":
        # Held for 1.8 s (msg_timeout 1 s), touching every 0.3 s, then FIN and 1.3 s of quiet.
        assert [(m["body"], m["attempts"]) for m in received] == [(bodies[0], 1)], describe(result)
        touches = event_times(result, "touch_sent")
        (fin_at,) = event_times(result, "fin_sent")
        assert len(touches) >= 4, describe(result)
        assert fin_at - received[0]["t"] > 1.5 * MSG_TIMEOUT_MS / 1000, describe(result)

    elif scenario == "timeout":
        assert [(m["body"], m["attempts"]) for m in received] == [(bodies[0], 1), (bodies[0], 2)], \
            describe(result)
        assert received[0]["id"] == received[1]["id"], describe(result)
        gap = received[1]["t"] - received[0]["t"]
        assert MSG_TIMEOUT_MS / 1000 - 0.05 <= gap <= MSG_TIMEOUT_MS / 1000 + 2.0, \
            f"redelivery {gap:.3f}s after the first delivery (msg_timeout {MSG_TIMEOUT_MS} ms)\n" \
            f"{describe(result)}"

    if scenario == "ephemeral":
        _wait_for_no_channel(gateway.nsq_http, topic)
        _assert_ephemeral_channel_gone(gateway.nsq_tcp, topic)


def _wait_for_no_channel(http_address: str, topic: str) -> None:
    """Until the nsqd API's /stats shows `topic` without channels: the gateway has seen the
    driver's consumer go (the driver has exited)."""
    def without_channels() -> bool:
        stats = http_json(http_address, f"/stats?format=json&topic={urllib.parse.quote(topic)}")
        return any(found["topic_name"] == topic and not found["channels"] for found in stats["topics"])

    wait_until(without_channels, f"{topic} without channels")


def _assert_ephemeral_channel_gone(address: str, topic: str) -> None:
    """After its last consumer left, `ch#ephemeral` must be gone. Seen from outside: the topic then
    has no channel, so a message published now is kept for the next channel created (nsqd's
    backlog rule). Were the ephemeral channel still there, it would take the only copy and a new
    channel created afterwards would get nothing."""
    marker = b"after-ephemeral-consumer-left"
    probe = BareNSQ(address)
    try:
        probe.command(b"PUB " + topic.encode(), marker)
        probe.expect_ok()
        probe.command(b"SUB " + topic.encode() + b" probe")
        probe.expect_ok()
        probe.command(b"RDY 1")
        frame = probe.frame(3)
        while frame is not None and frame == (0, b"_heartbeat_"):
            frame = probe.frame(3)
        assert frame is not None and frame[0] == 2, (
            "a message published after the #ephemeral channel's last consumer left never reached a "
            f"new channel: the ephemeral channel was not deleted (got {frame!r})")
        assert frame[1][26:] == marker
    finally:
        probe.close()


if __name__ == "__main__":  # pragma: no cover - convenience: python tests/interop/test_clients.py
    sys.exit(pytest.main([__file__, "-m", "interop", "-v"]))
