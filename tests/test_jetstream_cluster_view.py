"""Every node of a JetStream cluster shows the whole cluster: its nodes, and each shared queue's depth, in-flight
and deferred counts and consumers over all nodes, in the admin API and /metrics, the same on every node;
nsqd's /stats counted once over the nodes; a traced message's whole path on any node. Two gateways on the
real three-server cluster, consumers on both."""

from __future__ import annotations

import json
import re
import urllib.request
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from selenium.common.exceptions import NoSuchElementException, StaleElementReferenceException
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

from polymq.clients import mqks_blocking
from polymq.clients import nsq as nsq_blocking
from polymq.codecs import nsq_client

from support import nsq_wire
from support.browser import chromium
from support.gateway import GatewayProcess, running_gateway
from support.nats_cluster import NatsCluster, NatsServer
from support.nsq_cluster import Lookupd, Program, http, http_json, nsq_tool, nsq_tool_label, wait_until

CLIENT_TIMEOUT_S = 30.0
RETRIED = (StaleElementReferenceException, NoSuchElementException)  # the page redraws its tables every poll
# Reports every 2 s, every topic read at least once a second: this only turns a hang into a failure.
SETTLED_S = 30.0


@pytest.fixture(scope="module")
def nodes(nats_cluster: NatsCluster) -> Iterator[tuple[GatewayProcess, GatewayProcess]]:
    with running_gateway("--jetstream", ",".join(nats_cluster.urls)) as one, \
            running_gateway("--jetstream", ",".join(nats_cluster.urls)) as two:
        yield one, two


def _state(gateway: GatewayProcess) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://{gateway.http}/api/state", timeout=10) as answer:
        return json.loads(answer.read())


def _queue(gateway: GatewayProcess, name: str) -> dict[str, Any] | None:
    return next((queue for queue in _state(gateway)["cluster"]["queues"] if queue["name"] == name), None)


def test_every_node_shows_the_clusters_numbers_of_a_queue_read_through_both(
        nodes: tuple[GatewayProcess, GatewayProcess], nats_cluster: NatsCluster) -> None:
    """10 messages in a channel whose consumers hold 2 on node 1 and 1 on node 2: on each node's admin API,
    7 ready, 3 in flight (2 on node 1, 1 on node 2), 2 consumers, both nodes listed; on each node's /metrics,
    the same series."""
    one, two = nodes
    topic, channel = f"view-{uuid.uuid4().hex[:8]}", "readers"
    queue = f"{topic}/{channel}"  # an NSQ channel's queue
    with nsq_blocking.Connection(one.nsq_tcp, CLIENT_TIMEOUT_S) as maker:
        maker.send(nsq_client.sub(topic, channel))  # the channel exists before the publishes
        maker.wait_for_ok("SUB")
    status, _ = http(one.nsq_http, f"/mpub?topic={topic}", "POST", b"\n".join(b"m%d" % i for i in range(10)))
    assert status == 200
    first = nsq_wire.holding(one.nsq_tcp, topic, channel, 2)
    second = nsq_wire.holding(two.nsq_tcp, topic, channel, 1)
    try:
        node_one, node_two = _state(one)["cluster"]["node"], _state(two)["cluster"]["node"]
        expected = {"depth": 7, "in_flight": 3, "deferred": 0, "consumers": 2,
                    "nodes": [{"node": node_one, "consumers": 1, "in_flight": 2, "held": 0},
                              {"node": node_two, "consumers": 1, "in_flight": 1, "held": 0}]}
        expected["nodes"].sort(key=lambda part: part["node"])

        def settled(gateway: GatewayProcess) -> dict[str, Any]:
            found = _queue(gateway, queue)
            assert found is not None, _state(gateway)["cluster"]
            assert {key: found[key] for key in expected} == expected, found
            return found

        for gateway in (one, two):
            found = wait_until(lambda gateway=gateway: settled(gateway), f"the cluster's numbers on {gateway.http}",
                               SETTLED_S)
            assert found["topics"] == [topic] and found["redelivered"] == 0
            cluster = _state(gateway)["cluster"]
            assert {node["node"] for node in cluster["nodes"]} >= {node_one, node_two}
            assert cluster["connected"] in nats_cluster.urls
            stream = wait_until(lambda gateway=gateway: next(  # type: ignore[misc]
                entry for entry in _state(gateway)["cluster"]["streams"] if entry["topic"] == topic),
                f"the topic's stream on {gateway.http}", SETTLED_S)
            servers = {server.name for server in nats_cluster.servers}
            assert stream["leader"] in servers and stream["messages"] == 10, stream
            assert {replica["server"] for replica in stream["replicas"]} == servers - {stream["leader"]}, stream
            assert cluster["reporter"] == min(node["node"] for node in cluster["nodes"])
            metrics = http(gateway.http, "/metrics")[1].decode()
            for name, value in (("depth", 7), ("in_flight", 3), ("consumers", 2)):
                assert re.search(rf'^polymq_cluster_queue_{name}{{queue="{queue}"}} {value}\.0$', metrics,
                                 re.MULTILINE), name
            assert re.search(rf'^polymq_cluster_stream_lag{{topic="{topic}"}} \d+\.0$', metrics, re.MULTILINE)
    finally:
        first.close()
        second.close()


def test_a_node_alone_shows_no_cluster(gateway: GatewayProcess) -> None:
    assert _state(gateway)["cluster"] is None
    assert "polymq_cluster_" not in http(gateway.http, "/metrics")[1].decode()


def _channel_stats(gateway: GatewayProcess, topic: str) -> dict[str, Any]:
    [found] = http_json(gateway.nsq_http, f"/stats?format=json&topic={topic}")["topics"]
    [channel] = found["channels"]
    return channel


@pytest.mark.parametrize("tool", [pytest.param("nsqadmin", id=nsq_tool_label("nsqadmin"))])
def test_nsqd_stats_summed_over_the_nodes_count_a_shared_channel_once_as_nsqadmin_shows_it(
        lookupd: Lookupd, nats_server: NatsServer, tool: str) -> None:
    """Two nodes behind a lookupd, 10 messages in a channel whose consumers hold 2 on one node and 1 on the
    other: each node's /stats gives its share (what it holds; the stored rest on one node only), so their sum,
    and nsqadmin's page of the channel over both, is 7 deep with 3 in flight."""
    args = ("--jetstream", nats_server.url, "--lookupd-tcp-address", lookupd.tcp_address,
            "--broadcast-address", "127.0.0.1")
    topic, channel = f"summed-{uuid.uuid4().hex[:8]}", "readers"
    with running_gateway(*args) as one, running_gateway(*args) as two:
        assert http(one.nsq_http, f"/topic/create?topic={topic}", "POST")[0] == 200
        assert http(one.nsq_http, f"/channel/create?topic={topic}&channel={channel}", "POST")[0] == 200
        status, _ = http(one.nsq_http, f"/mpub?topic={topic}", "POST", b"\n".join(b"m%d" % i for i in range(10)))
        assert status == 200
        first = nsq_wire.holding(one.nsq_tcp, topic, channel, 2)
        second = nsq_wire.holding(two.nsq_tcp, topic, channel, 1)
        admin = Program([*nsq_tool(tool).argv, "--http-address=127.0.0.1:0",
                         f"--lookupd-http-address={lookupd.http_address}"])
        try:
            def summed() -> tuple[int, int, int]:
                shares = [_channel_stats(gateway, topic) for gateway in (one, two)]
                assert sorted(share["in_flight_count"] for share in shares) == [1, 2], shares
                assert sorted(share["depth"] for share in shares) == [0, 7], shares  # one node has the stored
                totals = tuple(sum(share[key] for share in shares) for key in ("depth", "in_flight_count",
                                                                                 "deferred_count"))
                assert totals == (7, 3, 0), shares  # the nodes' reports and the cluster's counts read apart
                return totals  # type: ignore[return-value]

            wait_until(summed, "each node's share in /stats", SETTLED_S)
            address = admin.listening(1)["HTTP"]

            def shown() -> dict[str, Any]:
                page = http_json(address, f"/api/topics/{topic}/{channel}")
                assert len(page["nodes"]) == 2, page
                assert (page["depth"], page["in_flight_count"], page["deferred_count"]) == (7, 3, 0), page
                return page

            wait_until(shown, "nsqadmin's page of the channel over both nodes", SETTLED_S)
        finally:
            admin.stop()
            first.close()
            second.close()


def _post(gateway: GatewayProcess, path: str) -> Any:
    status, body = http(gateway.http, path, "POST")
    assert status == 200, (path, status, body)
    return json.loads(body)


def test_a_topic_traced_on_one_node_is_traced_on_both_and_either_shows_the_whole_path(
        nodes: tuple[GatewayProcess, GatewayProcess]) -> None:
    """Traced through node 1's admin API; published on node 1 over MQKS; delivered on node 2 over NSQ and
    requeued there; delivered again on node 1 over NSQ and finished: each node's timeline of it has the five
    events in order, each naming the node it happened on, and no gap."""
    one, two = nodes
    topic, channel = f"traced-{uuid.uuid4().hex[:8]}", "workers"
    assert _post(one, f"/api/trace/on?topic={topic}") == {"topic": topic, "traced": True}
    wait_until(lambda: any(entry["name"] == topic and entry["traced"]
                           for entry in http_json(two.http, "/api/trace")["topics"]), "the trace on node 2", SETTLED_S)
    name_one, name_two = (http_json(gateway.http, "/api/trace")["node"] for gateway in (one, two))
    assert name_one != name_two and all(re.fullmatch(r".+/\d+", name) for name in (name_one, name_two))
    with nsq_wire.consumer(two.nsq_tcp, topic, channel) as elsewhere:
        with mqks_blocking.Connection(one.host_port("mqks"), CLIENT_TIMEOUT_S) as producer:
            producer.request("p", "publish", f"{topic} traced body", confirm=True)
            assert producer.next_line() == b"p ok "
        elsewhere.send(nsq_client.rdy(1))
        first = elsewhere.read_message(CLIENT_TIMEOUT_S)
        elsewhere.send(nsq_client.rdy(0))
        elsewhere.send(nsq_client.req(first.msg_id, 0))
        with nsq_wire.consumer(one.nsq_tcp, topic, channel, rdy=1) as here:
            again = here.read_message(CLIENT_TIMEOUT_S)
            assert (again.msg_id, again.body, again.attempts) == (first.msg_id, b"traced body", 2)
            here.send(nsq_client.fin(again.msg_id))
            expected = [("published", name_one, "mqks"), ("delivered", name_two, "nsq"),
                        ("requeued", name_two, "nsq"), ("delivered", name_one, "nsq"), ("finished", name_one, "nsq")]

            for gateway in (one, two):
                def timeline(gateway: GatewayProcess = gateway) -> dict[str, Any]:
                    [found] = http_json(gateway.http, f"/api/trace/find?q={first.msg_id.decode()}")["messages"]
                    shown = [(event["event"], event["node"], event.get("protocol")) for event in found["events"]]
                    assert shown == expected, shown
                    return found

                found = wait_until(timeline, f"the whole path on {gateway.http}", SETTLED_S)
                assert found["gaps"] == [], found

            # The page of the node that only delivered shows the same path, each row naming its node.
            with chromium() as browser:
                browser.get(f"http://{two.http}/")
                wait = WebDriverWait(browser, CLIENT_TIMEOUT_S, ignored_exceptions=RETRIED)
                wait.until(lambda driver: driver.find_element(By.ID, "trace-query")).send_keys(first.msg_id.decode())
                browser.find_element(By.CSS_SELECTOR, "#trace-search button").click()
                wait.until(lambda driver: len(driver.find_elements(By.CSS_SELECTOR, "#trace-found tr[data-event]"))
                           == len(expected))
                rows = [[cell.text for cell in row.find_elements(By.TAG_NAME, "td")]
                        for row in browser.find_elements(By.CSS_SELECTOR, "#trace-found tr[data-event]")]
                assert [(row[1], row[7], row[3]) for row in rows] == expected, rows
                assert browser.find_element(By.CSS_SELECTOR, "#trace-found .ok").text == "Every copy came to an end."
