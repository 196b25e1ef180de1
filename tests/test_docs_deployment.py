"""Blocks of the docs that name a deployment's machines or change the machine's settings, run as printed in a
network and mount namespace of their own (tests/support/namespace.py): `/etc/hosts` there names the machines
(lookupd1 and lookupd2 are loopback addresses with an nsqlookupd each: nsq's own where it is built, else its
fake), `/etc/sysctl.d` is a folder of the test's, and a sysctl of the network is the namespace's own."""

from __future__ import annotations

import re
from pathlib import Path

from test_docs_lookupd import programs

from support.namespace import namespace
from support.nsq_cluster import wait_until

ROOT = Path(__file__).resolve().parent.parent
BLOCK = re.compile(r"^```sh\n(.*?)^```$", re.MULTILINE | re.DOTALL)
DEPLOYMENT_NODE = "polymq serve --bind 0.0.0.0 --lookupd-tcp-address lookupd1:4160 --lookupd-tcp-address lookupd2:4160"
RESERVED_PORTS = "sysctl -w net.ipv4.ip_local_reserved_ports=47290-47299"
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
