"""The `polymq` command itself: help texts, start-up lines, clean shutdown by signal."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import polymq
from polymq.codecs import nsq_client

from support.gateway import running_gateway


def _polymq(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "polymq", *args], capture_output=True, text=True, timeout=30)


def test_help_names_every_command() -> None:
    result = _polymq("--help")
    assert result.returncode == 0
    for name in ("serve", "bench", "conformance", "torture"):
        assert f"polymq {name}" in result.stdout


@pytest.mark.parametrize("args", [("serve", "--help"), ("bench", "nsq", "--help"), ("conformance", "nsq", "--help"),
                                  ("torture", "--help")])
def test_subcommand_help(args: tuple[str, ...]) -> None:
    result = _polymq(*args)
    assert result.returncode == 0
    assert "Usage: python -m polymq" in result.stdout


@pytest.mark.parametrize("flag", ["--version", "-V"])
def test_the_version_is_printed_by_either_flag(flag: str) -> None:
    result = _polymq(flag)
    assert result.returncode == 0
    assert result.stdout == f"polymq, version {polymq.__version__}\n"


def test_the_license_is_the_one_pyproject_names() -> None:
    root = Path(__file__).resolve().parent.parent
    assert 'license = "MIT"' in (root / "pyproject.toml").read_text()
    assert (root / "LICENSE").read_text().startswith("MIT License\n")


def test_pyproject_names_the_pythons_from_the_least_it_requires() -> None:
    project = tomllib.loads((Path(__file__).resolve().parent.parent / "pyproject.toml").read_text())["project"]
    assert project["requires-python"] == ">=3.11"
    named = [classifier.rsplit(" :: ", 1)[1] for classifier in project["classifiers"]
             if classifier.startswith("Programming Language :: Python :: 3.")]
    assert named == ["3.11", "3.12", "3.13"]


def test_serve_announces_loopback_listeners_and_stops_cleanly_on_sigterm() -> None:
    with running_gateway() as gateway:
        host, port = gateway.host_port("nsq-tcp")
        assert host == "127.0.0.1"
        assert gateway.host_port("nsq-http")[0] == "127.0.0.1"
        # A connected, subscribed client must not keep the process from exiting.
        with socket.create_connection((host, port), timeout=5) as client:
            client.sendall(nsq_client.magic() + nsq_client.sub("shutdown", "c") + nsq_client.rdy(1))
            reader = nsq_client.FrameReader()
            while not (frames := reader.frames()):
                reader.receive_data(client.recv(65536))
            assert frames[0].data == b"OK"
            assert gateway.stop(signal.SIGTERM) == 0
            # The server closed our connection on its way out.
            client.settimeout(5)
            assert client.recv(65536) == b""


def test_sigint_also_exits_zero() -> None:
    with running_gateway() as gateway:
        assert gateway.stop(signal.SIGINT) == 0
