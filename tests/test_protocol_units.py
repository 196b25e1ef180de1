"""The protocol interface: a protocol defined here, outside polymq, is served by the unchanged gateway.

The test writes a small installed package (a module and its dist-info with an entry point in the
group `polymq.protocols`) into a folder on PYTHONPATH, as `pip install` of a third-party protocol
would leave it, and runs the real `polymq serve`: the protocol's listener, its options as a flag, a
POLYMQ_* variable and a config-file section, its switch, its help and a clean stop all come from
its one declaration.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import tomllib
import urllib.request
from pathlib import Path

import pytest

from polymq.adapters.registry import BUILTIN_UNITS, protocols

from support.gateway import running_gateway

# A line protocol: each line is published to the topic `echoed` and answered `<greeting> <line>`.
ECHO_UNIT = '''
from __future__ import annotations

import click

from polymq.adapters.protocol import PORT, Context, Endpoint, Protocol, Setting
from polymq.adapters.session import Listener, StreamSession, TcpService


class EchoSession(StreamSession):
    def __init__(self, server, transport):
        super().__init__(server.engine, transport)
        self.server = server
        self.pending = b""

    def handle(self, data):
        self.pending += data
        *lines, self.pending = self.pending.split(b"\\n")
        for line in lines:
            self.engine.publish("echoed", line, origin="echo")
            self.send(self.server.greeting + b" " + line + b"\\n")


class EchoServer(Listener):
    def __init__(self, engine, greeting):
        super().__init__()
        self.engine = engine
        self.greeting = greeting.encode()

    def new_session(self, transport):
        return EchoSession(self, transport)


def start(context: Context) -> TcpService:
    sock = context.listeners.get("echo")
    server = EchoServer(context.engine, context.options.greeting)
    return TcpService([(sock, server)] if sock is not None else [])


PROTOCOL = Protocol(
    name="echo",
    title="Echo (a test protocol)",
    settings=(
        Setting("port", "--echo-port", PORT, 7007, "Echo TCP port (0 = any free, -1 = off)."),
        Setting("greeting", "--echo-greeting", click.STRING, "hello", "What each answer starts with."),
    ),
    endpoints=(Endpoint("echo", "port"),),
    start=start,
)
'''


@pytest.fixture
def echo_installed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    site = tmp_path / "site"
    site.mkdir()
    (site / "polymq_echo.py").write_text(textwrap.dedent(ECHO_UNIT))
    info = site / "polymq_echo-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: polymq-echo\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[polymq.protocols]\necho = polymq_echo:PROTOCOL\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")])))
    return site


def _polymq(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "polymq", *args], capture_output=True, text=True, timeout=60)


def _echo(address: str, line: bytes) -> tuple[socket.socket, bytes]:
    host, port = address.rsplit(":", 1)
    client = socket.create_connection((host, int(port)), timeout=10)
    client.sendall(line + b"\n")
    answer = b""
    while not answer.endswith(b"\n"):
        chunk = client.recv(4096)
        assert chunk, f"connection closed after {answer!r}"
        answer += chunk
    return client, answer


def test_the_gateway_names_no_protocol() -> None:
    gateway = Path(__file__).resolve().parent.parent / "gateway"
    for path in gateway.glob("*.py"):
        text = path.read_text().lower()
        for unit in BUILTIN_UNITS:
            assert unit not in text, f"{path.name} imports {unit}"
    assert [unit.name for unit in protocols()] == ["nsq", "mqks", "phpmq", "pzq", "emqp"]


def test_serve_loads_no_benchmark_conformance_or_torture_code() -> None:
    probe = ("import sys, polymq.gateway.cli; print(sorted(m for m in sys.modules"
             " if m.startswith(('polymq.bench', 'polymq.conformance', 'polymq.torture'))))")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_an_installed_protocol_gets_a_flag_a_variable_a_config_section_and_help(echo_installed: Path,
                                                                                tmp_path: Path) -> None:
    helped = _polymq("serve", "--help")
    assert helped.returncode == 0, helped.stderr
    assert "--echo-port" in helped.stdout and "--echo-greeting" in helped.stdout
    assert "--echo / --no-echo" in helped.stdout
    assert "POLYMQ_ECHO_GREETING" in helped.stdout
    config = tmp_path / "polymq.toml"
    config.write_text('[echo]\ngreeting = "from the file"\nport = 7100\n')
    shown = tomllib.loads(_polymq("config", "--show", "--config", str(config)).stdout)
    assert shown["echo"] == {"enabled": True, "port": 7100, "greeting": "from the file"}
    os.environ["POLYMQ_ECHO_GREETING"] = "from the variable"
    try:
        shown = tomllib.loads(_polymq("config", "--show", "--config", str(config)).stdout)
    finally:
        del os.environ["POLYMQ_ECHO_GREETING"]
    assert shown["echo"]["greeting"] == "from the variable"
    wrong = _polymq("serve", "--config", str(config), "--echo-port", "x")
    assert wrong.returncode == 2 and "'--echo-port'" in wrong.stderr


def test_an_installed_protocol_is_served_and_stopped_by_the_unchanged_gateway(
        echo_installed: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = tmp_path / "polymq.toml"
    config.write_text('[echo]\ngreeting = "from the file"\n')
    monkeypatch.setenv("POLYMQ_ECHO_GREETING", "hi")
    data_dir = tmp_path / "data"
    with running_gateway("--config", str(config), "--echo-port", "0", data_dir=data_dir) as gateway:
        assert gateway.host_port("echo")[0] == "127.0.0.1"
        client, answer = _echo(gateway.addresses["echo"], b"one")
        with client:
            assert answer == b"hi one\n"  # the variable wins over the file
            stats = _polymq("bench", "--help")  # the CLI of the same install lists no echo bench: it has none
            assert stats.returncode == 0 and "echo" not in stats.stdout.split("Commands:")[1]
            assert gateway.stop(signal.SIGTERM) == 0
            client.settimeout(10)
            assert client.recv(4096) == b""  # its session was closed at the stop
    assert any(" stopped: " in line for line in gateway.log_lines)
    # The line it published is in the store: the engine is the shared one.
    with running_gateway("--no-echo", data_dir=data_dir) as again:
        assert "echo" not in again.addresses
        host, port = again.host_port("nsq-http")
        with urllib.request.urlopen(f"http://{host}:{port}/stats?format=json&topic=echoed", timeout=10) as reply:
            topics = json.load(reply)["topics"]
        assert [(topic["topic_name"], topic["depth"]) for topic in topics] == [("echoed", 1)]

