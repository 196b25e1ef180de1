"""Real client libraries discover polymq nodes through lookupd: pynsq's and nsqjs's Readers are
given only the lookupd's HTTP address and read a topic published on three polymq nodes, each
message once. Against the test lookupd, and against the real nsqlookupd when POLYMQ_NSQ_BIN has it.
docs/cluster.md
"""

from __future__ import annotations

import base64
import os
import subprocess
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest

from support.gateway import GatewayProcess, running_gateway
from support.interop_drivers import run_driver_script
from support.nsq_cluster import Lookupd, http, running_lookupd, wait_until

HERE = Path(__file__).resolve().parent
INTEROP_DIR = Path(os.environ.get("INTEROP_DIR", HERE.parent.parent / ".interop"))
DEADLINE_S = 60.0


@pytest.fixture(scope="module")
def client_envs() -> Path:
    done = subprocess.run(["bash", str(HERE / "setup_envs.sh"), "pynsq", "nsqjs"], capture_output=True, text=True,
                          timeout=900, env={**os.environ, "INTEROP_DIR": str(INTEROP_DIR)})
    if done.returncode != 0:
        pytest.fail(f"tests/interop/setup_envs.sh pynsq nsqjs failed:\n{done.stdout}\n{done.stderr}")
    return INTEROP_DIR


@pytest.fixture(params=["test lookupd", "nsqlookupd"])
def cluster(request: pytest.FixtureRequest, client_envs: Path) -> Iterator[tuple[Lookupd, list[GatewayProcess]]]:
    with ExitStack() as stack:
        lookupd = stack.enter_context(running_lookupd(request.param))
        nodes = [stack.enter_context(running_gateway(
            "--lookupd-tcp-address", lookupd.tcp_address, "--broadcast-address", "127.0.0.1", "--in-memory",
            "--no-mqks", "--no-phpmq", "--no-pzq", "--no-emqp")) for _ in range(3)]
        yield lookupd, nodes


def run_reader(client: str, request: dict) -> dict:
    return run_driver_script(client, "lookupd_reader", request, DEADLINE_S + 30)[0]


@pytest.mark.interop
@pytest.mark.parametrize("client", ["pynsq", "nsqjs"])
def test_a_reader_given_only_lookupd_reads_every_node_each_message_once(
        client: str, cluster: tuple[Lookupd, list[GatewayProcess]]) -> None:
    lookupd, nodes = cluster
    topic = f"found_{client}"
    bodies = []
    for index, gateway in enumerate(nodes):  # published before the reader starts: kept for its channel
        batch = [f"{client}-{index}-{n}".encode() for n in range(5 + index)]
        assert http(gateway.nsq_http, f"/mpub?topic={topic}", "POST", b"\n".join(batch))[0] == 200
        bodies += batch
    ports = {gateway.host_port("nsq-tcp")[1] for gateway in nodes}
    wait_until(lambda: {p["tcp_port"] for p in lookupd.get(f"/lookup?topic={topic}")["producers"]} == ports,
               "the topic registered by the three nodes")
    result = run_reader(client, {"lookupd_http": [lookupd.http_address], "topic": topic, "channel": "readers",
                                 "count": len(bodies), "quiet_s": 1.0, "deadline_s": DEADLINE_S})
    assert result["errors"] == []
    received = [base64.b64decode(message["body"]) for message in result["received"]]
    assert sorted(received) == sorted(bodies)  # every message, each once
    assert all(message["attempts"] == 1 for message in result["received"])
    assert len(result["connected"]) == 3  # a connection to each node lookupd named
