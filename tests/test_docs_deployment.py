"""Blocks of the docs that name a deployment's machines, change the machine's settings or install another
Python, run as printed in a network and mount namespace of their own (tests/support/namespace.py): `/etc/hosts`
there names the machines (lookupd1 and lookupd2 are loopback addresses with an nsqlookupd each: nsq's own where
it is built, else its fake), `/etc/sysctl.d` and `/tmp/spark-env` are folders of the test's, a sysctl of the
network is the namespace's own, and pip installs from wheels built beforehand (the namespace has no network)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from test_docs_commands import blocks
from test_docs_lookupd import programs

from support.namespace import namespace
from support.nsq_cluster import wait_until

ROOT = Path(__file__).resolve().parent.parent
DEPLOYMENT_NODE = "polymq serve --bind 0.0.0.0 --lookupd-tcp-address lookupd1:4160 --lookupd-tcp-address lookupd2:4160"
RESERVED_PORTS = "sysctl -w net.ipv4.ip_local_reserved_ports=47290-47299"
CLUSTER_JOB = "pip install '/path/to/polymq[spark]'"
ANOTHER_PYTHON = "make install                                             # this clone's .venv has it (and polymq)"
# pip's wheels of polymq's dependencies and PySpark (from pip's cache, where make install left them), and what
# building polymq from the clone needs; this only turns a hang into a failure.
WHEELS_TIMEOUT_S = 600
# A standalone Spark cluster's start, the job's first micro-batches on it (JVMs on a loaded 2-core machine);
# this only turns a hang into a failure.
SPARK_TIMEOUT_S = 300
# Orders of one minute, then one 2 minutes later: the watermark (30 s of lateness) closes the first minute.
ORDERS = [{"order": f"o{index}", "source": "nsq", "sku": "s", "amount": 10 * index, "at": at}
          for index, at in enumerate((1767614410.0, 1767614420.0, 1767614430.0, 1767614550.0), 1)]
# The machines the block names, on loopback addresses of the namespace.
HOSTS = {"lookupd1": "127.0.0.2", "lookupd2": "127.0.0.3"}


def page_block(page: str, start: str) -> str:
    return next(block.text for block in blocks() if block.page == page and block.text.startswith(start))


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


def _offline_pip(wheels: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """pip, in the namespace, installs polymq with its Spark extra from `wheels` (built here beforehand)."""
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--wheel-dir", str(wheels), f"{ROOT}[spark]"],
                   check=True, capture_output=True, timeout=WHEELS_TIMEOUT_S)
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--dest", str(wheels), "setuptools>=77",
                    "wheel"], check=True, capture_output=True, timeout=WHEELS_TIMEOUT_S)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(wheels))


@pytest.mark.slow
def test_another_python_gets_polymq_and_its_spark_source_from_the_clone(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    block = page_block("docs/spark.md", ANOTHER_PYTHON)
    environment = tmp_path / "spark-env"
    environment.mkdir()
    _offline_pip(tmp_path / "wheels", monkeypatch)
    with namespace({"/tmp/spark-env": environment}) as space:
        space.run(block, WHEELS_TIMEOUT_S)
        found = space.run("/tmp/spark-env/bin/python -c 'import polymq, pyspark, pyspark_polymq; "
                          "print(pyspark.__version__, pyspark_polymq.DefaultSource.name())'").stdout
    assert found.split() == ["4.2.1", "polymq"], found


def _spark_class() -> str:
    found = subprocess.run([str(ROOT / ".venv" / "bin" / "python"), "-c",
                            "import os, pyspark; print(os.path.dirname(pyspark.__file__))"],
                           check=True, capture_output=True, text=True, timeout=60)
    return str(Path(found.stdout.strip()) / "bin" / "spark-class")


# What reads the totals topic's channel in the namespace: one message's body.
READ_ONE = """.venv/bin/python - <<'EOF'
from polymq.clients import nsq
from polymq.codecs import nsq_client
with nsq.Connection('127.0.0.1:4150', 30) as connection:
    connection.send(nsq_client.sub('order-totals', 'check'))
    connection.wait_for_ok('SUB')
    connection.send(nsq_client.rdy(1))
    while not (frame := connection.next_frame(30)).is_message:
        pass
    print(nsq_client.decode_message(frame.data).body.decode())
EOF
"""


@pytest.mark.slow
def test_the_example_job_runs_on_a_spark_cluster_as_submitted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The block as printed, its names filled in: the clone installed into /opt/polymq (the namespace's own),
    a standalone Spark master and worker of PySpark's on loopback (MASTER), a gateway on its default ports
    (GATEWAY), a checkpoint folder (CHECKPOINT); the job reads the orders published over NSQ and the first
    minute's totals reach a channel of the totals topic."""
    block = page_block("docs/spark.md", CLUSTER_JOB)
    opt = tmp_path / "opt-polymq"
    opt.mkdir()
    _offline_pip(tmp_path / "wheels", monkeypatch)
    monkeypatch.setenv("SPARK_LOCAL_IP", "127.0.0.1")  # the cluster's and the job's processes on loopback
    with namespace({"/opt/polymq": opt}) as space:
        space.run("python3 -m venv /opt/polymq")  # the Python the reader's Spark nodes run
        space.run(".venv/bin/polymq serve --in-memory > gateway.log 2>&1 & echo $! > gateway.pid\n"
                  ".venv/bin/polymq wait\n"
                  "curl -sf -X POST '127.0.0.1:4151/topic/create?topic=order-totals'\n"
                  "curl -sf -X POST '127.0.0.1:4151/channel/create?topic=order-totals&channel=check'\n")
        orders = "\n".join(json.dumps(order) for order in ORDERS)
        space.run(f"curl -sf --data-binary @- '127.0.0.1:4151/mpub?topic=orders' <<'EOF'\n{orders}\nEOF\n")
        spark_class = _spark_class()
        space.run(f"{spark_class} org.apache.spark.deploy.master.Master --host 127.0.0.1 --port 7077 "
                  "--webui-port 8080 > master.log 2>&1 & echo $! > master.pid\n"
                  f"{spark_class} org.apache.spark.deploy.worker.Worker --cores 2 --memory 1g --webui-port 8081 "
                  "--work-dir spark-work spark://127.0.0.1:7077 > worker.log 2>&1 & echo $! > worker.pid\n")
        wait_until(lambda: '"aliveworkers" : 1' in space._run("curl -s 127.0.0.1:8080/json/").stdout,
                   "the Spark worker in its master's list", SPARK_TIMEOUT_S)
        filled = (block.replace("/path/to/polymq", str(space.folder)).replace("MASTER", "127.0.0.1")
                  .replace("GATEWAY", "127.0.0.1").replace("CHECKPOINT", "file://$PWD/checkpoint"))
        space.run(f"export PATH=/opt/polymq/bin:$PATH\n{{\n{filled}}} > job.log 2>&1 & echo $! > job.pid\n")

        def totals() -> str | None:
            stats = json.loads(space._run("curl -s '127.0.0.1:4151/stats?format=json&topic=order-totals'").stdout)
            [channel] = stats["topics"][0]["channels"]
            if channel["depth"] < 1:
                assert "Traceback" not in (space.folder / "job.log").read_text()
                return None
            return space.run(READ_ONE).stdout

        try:
            found = wait_until(totals, "the first minute's totals on the totals topic", SPARK_TIMEOUT_S)
        except AssertionError as error:
            logs = "\n".join(f"-- {name}\n" + (space.folder / name).read_text()[-3000:]
                             for name in ("job.log", "worker.log", "gateway.log"))
            raise AssertionError(f"{error}\n{logs}") from None
        assert json.loads(found) == {"minute": "2026-01-05 12:00", "orders": 3, "amount": 60, "from_phpmq": 0,
                                     "from_nsq": 3}, found
