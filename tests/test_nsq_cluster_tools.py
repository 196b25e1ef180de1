"""nsqadmin and nsq's tools, unchanged, against three polymq nodes behind a lookupd.

Each test runs against the real nsqlookupd (skipped without it) and against the test lookupd.
nsqadmin, nsq_tail, nsq_to_file, nsq_stat and to_nsq are nsq 1.3.0's programs when POLYMQ_NSQ_BIN
(default ~/ref/nsq/bin; docs/cluster.md) has them, else their fakes (support/fake_<name>.py; always
with POLYMQ_NSQ_FAKES=1), and the test's id says which. nsqd has no fake: its test skips, saying so,
without the binaries. Every process is started on 127.0.0.1 and stopped by its PID; every
wait is for a state, with a generous deadline.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import attrs
import pytest

from support.gateway import GatewayProcess, running_gateway
from support.nsq_cluster import (
    Lookupd,
    Program,
    http,
    http_json,
    nsq_program,
    nsq_tool,
    nsq_tool_label,
    running_lookupd,
    wait_until,
)

NODES = 3


def with_tool(name: str) -> pytest.MarkDecorator:
    """The test gets `tool`, the name of one of nsq's tools; its id says whether the real program or
    its fake runs."""
    return pytest.mark.parametrize("tool", [pytest.param(name, id=nsq_tool_label(name))])


@attrs.define
class Cluster:
    lookupd: Lookupd
    nodes: list[GatewayProcess]

    def publish(self, topic: str, counts: list[int], prefix: str = "m") -> list[bytes]:
        """Publishes `counts[i]` messages on node i; returns every body."""
        bodies = []
        for index, (gateway, count) in enumerate(zip(self.nodes, counts, strict=True)):
            batch = [f"{prefix}-{index}-{n}".encode() for n in range(count)]
            if batch:
                assert http(gateway.nsq_http, f"/mpub?topic={topic}", "POST", b"\n".join(batch))[0] == 200
            bodies += batch
        return bodies

    def on_every_node(self, path: str) -> None:
        for gateway in self.nodes:
            assert http(gateway.nsq_http, path, "POST")[0] == 200

    def topic_stats(self, topic: str) -> list[dict[str, Any] | None]:
        """Each node's /stats of the topic (None where it has no such topic)."""
        found = []
        for gateway in self.nodes:
            topics = http_json(gateway.nsq_http, f"/stats?format=json&topic={topic}")["topics"] or []
            found.append(topics[0] if topics else None)
        return found

    def channel_stats(self, topic: str, channel: str) -> list[dict[str, Any] | None]:
        return [next((c for c in stats["channels"] if c["channel_name"] == channel), None) if stats else None
                for stats in self.topic_stats(topic)]

    def registered(self, topic: str) -> None:
        """Waits until every node's topic is registered (what a consumer's lookup then finds)."""
        ports = {gateway.host_port("nsq-tcp")[1] for gateway in self.nodes}
        wait_until(lambda: {p["tcp_port"] for p in self.lookupd.get(f"/lookup?topic={topic}")["producers"]} == ports,
                   f"topic {topic} registered by every node")


@pytest.fixture(scope="module", params=["nsqlookupd", "test lookupd"])
def cluster(request: pytest.FixtureRequest) -> Iterator[Cluster]:
    with ExitStack() as stack:
        lookupd = stack.enter_context(running_lookupd(request.param))
        nodes = [stack.enter_context(running_gateway(
            "--lookupd-tcp-address", lookupd.tcp_address, "--broadcast-address", "127.0.0.1", "--in-memory",
            "--no-mqks", "--no-phpmq", "--no-pzq", "--no-emqp")) for _ in range(NODES)]
        cluster = Cluster(lookupd, nodes)
        wait_until(lambda: len(lookupd.get("/nodes")["producers"]) == NODES, "every node in lookupd's list")
        yield cluster


@pytest.fixture(scope="module", params=[pytest.param("nsqadmin", id=nsq_tool_label("nsqadmin"))])
def admin(cluster: Cluster, request: pytest.FixtureRequest) -> Iterator[str]:
    """nsqadmin's HTTP address, nsqadmin (or its fake; the id says which) reading the cluster's lookupd."""
    program = Program([*nsq_tool(request.param).argv, "--http-address=127.0.0.1:0",
                       f"--lookupd-http-address={cluster.lookupd.http_address}"])
    try:
        yield program.listening(1)["HTTP"]
    finally:
        program.stop()


def admin_action(admin: str, method: str, path: str, action: str | None = None) -> None:
    body = json.dumps({"action": action}).encode() if action else None
    status, data = http(admin, path, method, body, {"Content-Type": "application/json"})
    assert status == 200, (path, action, status, data)


def test_nsqadmin_lists_every_node_and_totals_topics_and_channels(cluster: Cluster, admin: str) -> None:
    for gateway in cluster.nodes:
        assert http(gateway.nsq_http, "/topic/create?topic=adm", "POST")[0] == 200
    cluster.on_every_node("/channel/create?topic=adm&channel=c")
    cluster.publish("adm", [1, 2, 3])
    cluster.registered("adm")
    nodes = http_json(admin, "/api/nodes")["nodes"]
    assert sorted(node["tcp_port"] for node in nodes) == sorted(g.host_port("nsq-tcp")[1] for g in cluster.nodes)
    assert all(node["version"] == "1.3.0" and {"topic": "adm", "tombstoned": False} in node["topics"]
               for node in nodes)
    assert "adm" in http_json(admin, "/api/topics")["topics"]
    topic = http_json(admin, "/api/topics/adm")
    assert (topic["message_count"], len(topic["nodes"])) == (6, NODES)
    assert sorted(node["message_count"] for node in topic["nodes"]) == [1, 2, 3]
    (channel,) = topic["channels"]
    assert (channel["channel_name"], channel["depth"], channel["message_count"]) == ("c", 6, 6)
    channel = http_json(admin, "/api/topics/adm/c")
    assert (channel["depth"], channel["in_flight_count"], len(channel["nodes"])) == (6, 0, NODES)
    node_page = http_json(admin, f"/api/nodes/127.0.0.1:{cluster.nodes[2].host_port('nsq-http')[1]}")
    assert node_page["total_messages"] == 3 and [t["topic_name"] for t in node_page["topics"]] == ["adm"]


def test_nsqadmin_actions_reach_every_node(cluster: Cluster, admin: str) -> None:
    for gateway in cluster.nodes:
        assert http(gateway.nsq_http, "/topic/create?topic=act", "POST")[0] == 200
    cluster.on_every_node("/channel/create?topic=act&channel=c")
    cluster.on_every_node("/channel/create?topic=act&channel=d")
    cluster.publish("act", [2, 2, 2])
    cluster.registered("act")
    admin_action(admin, "POST", "/api/topics/act", "pause")
    assert all(stats and stats["paused"] for stats in cluster.topic_stats("act"))
    admin_action(admin, "POST", "/api/topics/act", "unpause")
    assert not any(stats and stats["paused"] for stats in cluster.topic_stats("act"))
    admin_action(admin, "POST", "/api/topics/act/c", "pause")
    assert all(stats and stats["paused"] for stats in cluster.channel_stats("act", "c"))
    admin_action(admin, "POST", "/api/topics/act/c", "unpause")
    assert not any(stats and stats["paused"] for stats in cluster.channel_stats("act", "c"))
    admin_action(admin, "POST", "/api/topics/act/c", "empty")
    assert [stats and stats["depth"] for stats in cluster.channel_stats("act", "c")] == [0, 0, 0]
    assert [stats and stats["depth"] for stats in cluster.channel_stats("act", "d")] == [2, 2, 2]
    admin_action(admin, "POST", "/api/topics/act", "empty")  # the topic's own backlog: none here
    admin_action(admin, "DELETE", "/api/topics/act/d")
    assert cluster.channel_stats("act", "d") == [None, None, None]
    wait_until(lambda: "d" not in {c for c in cluster.lookupd.get("/lookup?topic=act")["channels"]},
               "channel d gone from lookupd")
    admin_action(admin, "DELETE", "/api/topics/act")
    assert cluster.topic_stats("act") == [None, None, None]
    wait_until(lambda: all("topic:act:" not in cluster.lookupd.registered(g.host_port("nsq-tcp")[1])
                           for g in cluster.nodes), "topic act unregistered by every node")


@with_tool("nsq_tail")
def test_nsq_tail_reads_every_node_found_through_lookupd(cluster: Cluster, tool: str) -> None:
    nsq_tail = nsq_tool(tool)
    for gateway in cluster.nodes:
        assert http(gateway.nsq_http, "/topic/create?topic=tail", "POST")[0] == 200
    cluster.registered("tail")
    tail = Program([*nsq_tail.argv, f"--lookupd-http-address={cluster.lookupd.http_address}", "--topic=tail",
                    "-n", "6"])
    try:
        # nsq_tail subscribes an ephemeral channel of its own on each node it finds.
        wait_until(lambda: all(stats and any(c["client_count"] for c in stats["channels"])
                               for stats in cluster.topic_stats("tail")), "nsq_tail subscribed on every node")
        bodies = cluster.publish("tail", [1, 2, 3], prefix="tail")
        assert tail.wait(60) == 0
        assert sorted(line.encode() for line in tail.lines if line.startswith("tail-")) == sorted(bodies)
    finally:
        tail.stop()


@with_tool("nsq_to_file")
def test_nsq_to_file_writes_every_nodes_messages(cluster: Cluster, tool: str, tmp_path: Path) -> None:
    nsq_to_file = nsq_tool(tool)
    for gateway in cluster.nodes:
        assert http(gateway.nsq_http, "/topic/create?topic=tofile", "POST")[0] == 200
    cluster.on_every_node("/channel/create?topic=tofile&channel=archive")
    bodies = cluster.publish("tofile", [3, 1, 2], prefix="file")
    cluster.registered("tofile")
    writer = Program([*nsq_to_file.argv, f"--lookupd-http-address={cluster.lookupd.http_address}", "--topic=tofile",
                      "--channel=archive", f"--output-dir={tmp_path}", "--sync-interval=100ms"])
    try:
        # It finishes each message once its file is synced: then no node holds one.
        wait_until(lambda: all(stats and stats["depth"] == 0 and stats["in_flight_count"] == 0
                               and stats["message_count"] > 0 for stats in cluster.channel_stats("tofile", "archive")),
                   "every message written and finished")
    finally:
        assert writer.stop(signal.SIGTERM) == 0
    written = [line for path in sorted(tmp_path.iterdir()) for line in path.read_bytes().splitlines()]
    assert sorted(written) == sorted(bodies)


@with_tool("nsq_stat")
def test_nsq_stat_totals_a_channel_over_the_nodes(cluster: Cluster, tool: str) -> None:
    nsq_stat = nsq_tool(tool)
    for gateway in cluster.nodes:
        assert http(gateway.nsq_http, "/topic/create?topic=stat", "POST")[0] == 200
    cluster.on_every_node("/channel/create?topic=stat&channel=c")
    cluster.publish("stat", [1, 1, 2])
    cluster.registered("stat")
    result = subprocess.run([*nsq_stat.argv, f"--lookupd-http-address={cluster.lookupd.http_address}", "--topic=stat",
                             "--channel=c", "--count=1", "--interval=100ms"], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    *_, last = result.stdout.splitlines()
    # ingress egress | total mem disk inflt def | req t-o msgs clients
    assert last.split() == ["0", "0", "|", "4", "4", "0", "0", "0", "|", "0", "0", "4", "0"], result.stdout


@with_tool("to_nsq")
def test_to_nsq_publishes_to_a_node(cluster: Cluster, tool: str) -> None:
    to_nsq = nsq_tool(tool)
    gateway = cluster.nodes[0]
    result = subprocess.run([*to_nsq.argv, f"--nsqd-tcp-address={gateway.nsq_tcp}", "--topic=tonsq"],
                            input=b"one\ntwo\nthree\n", capture_output=True, timeout=60, env={**os.environ})
    assert result.returncode == 0, result.stderr
    (stats,) = http_json(gateway.nsq_http, "/stats?format=json&topic=tonsq")["topics"]
    assert stats["message_count"] == 3
    wait_until(lambda: [p["tcp_port"] for p in cluster.lookupd.get("/lookup?topic=tonsq")["producers"]]
               == [gateway.host_port("nsq-tcp")[1]], "the new topic registered by its node")


@with_tool("nsq_tail")
def test_polymq_nodes_and_an_nsqd_are_one_cluster(cluster: Cluster, admin: str, tool: str, tmp_path: Path) -> None:
    nsqd = Program([nsq_program("nsqd"), "--tcp-address=127.0.0.1:0", "--http-address=127.0.0.1:0",
                    f"--lookupd-tcp-address={cluster.lookupd.tcp_address}", "--broadcast-address=127.0.0.1",
                    f"--data-path={tmp_path}"])
    try:
        nsqd_http = nsqd.listening(2)["HTTP"]
        assert http(nsqd_http, "/pub?topic=mixed", "POST", b"from-nsqd")[0] == 200
        bodies = [b"from-nsqd", *cluster.publish("mixed", [1, 1, 1], prefix="from-polymq")]
        wait_until(lambda: len(cluster.lookupd.get("/lookup?topic=mixed")["producers"]) == NODES + 1,
                   "the topic registered by the three polymq nodes and nsqd")
        topic = http_json(admin, "/api/topics/mixed")
        assert (topic["message_count"], len(topic["nodes"])) == (4, NODES + 1)
        # Kept by each node's topic until a first channel takes them: nsq_tail's, on every node.
        tail = Program([*nsq_tool(tool).argv, f"--lookupd-http-address={cluster.lookupd.http_address}",
                        "--topic=mixed", "-n", "4"])
        try:
            assert tail.wait(60) == 0
        finally:
            tail.stop()
        assert sorted(line.encode() for line in tail.lines if line.startswith("from-")) == sorted(bodies)
    finally:
        nsqd.stop()
