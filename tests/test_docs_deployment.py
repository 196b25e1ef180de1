"""Blocks of the docs that name a deployment's machines, change the machine's settings or install another
Python, run as printed in a network and mount namespace of their own (tests/support/namespace.py): `/etc/hosts`
there names the machines (lookupd1 and lookupd2 are loopback addresses with an nsqlookupd each: nsq's own where
it is built, else its fake), `/etc/sysctl.d` and `/tmp/spark-env` are folders of the test's, a sysctl of the
network is the namespace's own, and pip installs from wheels built beforehand (the namespace has no network)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from test_docs_lookupd import programs

from support.namespace import namespace
from support.nsq_cluster import wait_until

ROOT = Path(__file__).resolve().parent.parent
BLOCK = re.compile(r"^```sh\n(.*?)^```$", re.MULTILINE | re.DOTALL)
DEPLOYMENT_NODE = "polymq serve --bind 0.0.0.0 --lookupd-tcp-address lookupd1:4160 --lookupd-tcp-address lookupd2:4160"
RESERVED_PORTS = "sysctl -w net.ipv4.ip_local_reserved_ports=47290-47299"
ANOTHER_PYTHON = "make install                                             # this clone's .venv has it (and polymq)"
# pip's wheels of polymq's dependencies and PySpark (from pip's cache, where make install left them), and what
# building polymq from the clone needs; this only turns a hang into a failure.
WHEELS_TIMEOUT_S = 600
# The machines the block names, on loopback addresses of the namespace.
HOSTS = {"lookupd1": "127.0.0.2", "lookupd2": "127.0.0.3"}


def page_block(page: str, start: str) -> str:
    return next(block for block in BLOCK.findall((ROOT / page).read_text()) if block.startswith(start))


def test_a_node_of_a_deployment_registers_with_both_lookupds_it_names(tmp_path: Path) -> None:
    block = page_block("docs/cluster.md", DEPLOYMENT_NODE)
    hosts = tmp_path / "hosts"
    hosts.write_text("127.0.0.1 localhost\n" + "".join(f"{address} {name}\n" for name, address in HOSTS.items()))
    with namespace({"/etc/hosts": hosts}) as space:
        path = programs(space.folder / "nsq-bin")
        for name, address in HOSTS.items():
            space.run(f"{path}/nsqlookupd --broadcast-address={address} --tcp-address={address}:4160 "
                      f"--http-address={address}:4161 > {name}.log 2>&1 & echo $! > {name}.pid")
        for address in HOSTS.values():
            wait_until(lambda address=address: space._run(f"curl -sf {address}:4161/ping").stdout == "OK",
                       f"the lookupd at {address}")
        # As printed: the reader's shell finds polymq on its PATH (the clone's .venv/bin).
        space.run(f"export PATH=$PWD/.venv/bin:$PATH\n{{\n{block}}} > node.log 2>&1 & echo $! > node.pid\n")
        for name, address in HOSTS.items():
            wait_until(lambda address=address: '"tcp_port":4150' in space._run(f"curl -s {address}:4161/nodes").stdout,
                       f"the node in {name}'s list")
        log = (space.folder / "node.log").read_text()
        assert re.search(r"listening nsq-tcp 0\.0\.0\.0:4150$", log, re.MULTILINE), log


def test_the_reserved_ports_are_set_now_and_for_the_next_boot(tmp_path: Path) -> None:
    block = page_block("docs/operations.md", RESERVED_PORTS)
    settings = tmp_path / "sysctl.d"
    settings.mkdir()
    with namespace({"/etc/sysctl.d": settings}) as space:
        space.run(block)
        assert space.run("sysctl -n net.ipv4.ip_local_reserved_ports").stdout.strip() == "47290-47299"
    assert (settings / "60-polymq.conf").read_text() == "net.ipv4.ip_local_reserved_ports = 47290-47299\n"


@pytest.mark.slow
def test_another_python_gets_polymq_and_its_spark_source_from_the_clone(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    block = page_block("docs/spark.md", ANOTHER_PYTHON)
    wheels, environment = tmp_path / "wheels", tmp_path / "spark-env"
    environment.mkdir()
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--wheel-dir", str(wheels), f"{ROOT}[spark]"],
                   check=True, capture_output=True, timeout=WHEELS_TIMEOUT_S)
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--dest", str(wheels), "setuptools>=77",
                    "wheel"], check=True, capture_output=True, timeout=WHEELS_TIMEOUT_S)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(wheels))
    with namespace({"/tmp/spark-env": environment}) as space:
        space.run(block, WHEELS_TIMEOUT_S)
        found = space.run("/tmp/spark-env/bin/python -c 'import polymq, pyspark, pyspark_polymq; "
                          "print(pyspark.__version__, pyspark_polymq.DefaultSource.name())'").stdout
    assert found.split() == ["4.2.1", "polymq"], found
