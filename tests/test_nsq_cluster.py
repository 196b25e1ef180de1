"""polymq nodes behind nsqlookupd: `polymq serve` processes registering with a lookupd.

Each test runs against the test lookupd (support/fake_lookupd.py, always) and against the real
nsqlookupd 1.3.0 when its binary is in POLYMQ_NSQ_BIN (skipped, saying so, when not). What is
checked is what consumers and nsqadmin read from the lookupd's HTTP API (/lookup, /nodes, /topics,
/debug); every wait is for that state, with a generous deadline. docs/cluster.md
"""

from __future__ import annotations

from contextlib import AbstractContextManager

import zmq

from support.gateway import GatewayProcess, running_gateway
from support.mqks_wire import MQKSWire
from support.nsq_cluster import Lookupd, http, http_json, running_lookupd, wait_until
from support.phpmq_wire import PHPMQWire
from support.pzq_wire import Producer


def node(lookupd: Lookupd, *extra: str) -> AbstractContextManager[GatewayProcess]:
    return running_gateway("--lookupd-tcp-address", lookupd.tcp_address, "--broadcast-address", "127.0.0.1",
                           "--in-memory", *extra)


def tcp_port(gateway: GatewayProcess) -> int:
    return gateway.host_port("nsq-tcp")[1]


def test_every_protocols_topics_and_queues_are_found_through_lookupd(lookupd: Lookupd) -> None:
    with node(lookupd) as gateway:
        port = tcp_port(gateway)
        assert http(gateway.nsq_http, "/pub?topic=orders", "POST", b"one")[0] == 200
        assert http(gateway.nsq_http, "/channel/create?topic=orders&channel=billing", "POST")[0] == 200
        with PHPMQWire(gateway.host_port("phpmq")) as php:
            php.publish("Invoices", b"from php")  # topic Invoices, queue Invoices bound to it
            php.barrier()
        with MQKSWire(gateway.host_port("mqks")) as mqks:  # queue audit bound to orders and to refunds
            mqks.send(b"c1 consume --confirm audit orders refunds --manual-ack\n")
            assert mqks.line() == b"c1 ok "
        with zmq.Context() as context, Producer(context, gateway.addresses["pzq-receive"]) as producer:
            producer.produce(b"from pzq")  # topic pzq, queue pzq
        wanted = {"topic:orders:", "channel:orders:billing", "channel:orders:audit", "topic:refunds:",
                  "channel:refunds:audit", "topic:Invoices:", "channel:Invoices:Invoices", "topic:pzq:",
                  "channel:pzq:pzq"}
        wait_until(lambda: wanted <= lookupd.registered(port), "every topic and channel registered")
        # What a consumer asks: where is topic Invoices? This node, at its broadcast address and ports.
        found = lookupd.get("/lookup?topic=Invoices")
        assert found["channels"] == ["Invoices"]
        assert [(p["broadcast_address"], p["tcp_port"], p["http_port"], p["version"]) for p in found["producers"]] \
            == [("127.0.0.1", port, gateway.host_port("nsq-http")[1], "1.3.0")]
        assert sorted(lookupd.get("/lookup?topic=orders")["channels"]) == ["audit", "billing"]
        assert {"orders", "refunds", "Invoices", "pzq"} <= set(lookupd.get("/topics")["topics"])
        (listed,) = lookupd.get("/nodes")["producers"]
        assert {"orders", "refunds", "Invoices", "pzq"} <= set(listed["topics"])
        # The node says where it registers and what it tells: nsqd's /info and /config answers.
        assert http_json(gateway.nsq_http, "/info")["broadcast_address"] == "127.0.0.1"
        assert http_json(gateway.nsq_http, "/config/nsqlookupd_tcp_addresses") == [lookupd.tcp_address]
        assert http_json(gateway.nsq_http, "/config/broadcast_tcp_port") == port


def test_deleted_topics_and_channels_and_a_stopped_node_leave_lookupd(lookupd: Lookupd) -> None:
    with node(lookupd) as gateway, node(lookupd) as other:
        port = tcp_port(gateway)
        for name in ("kept", "gone"):
            assert http(gateway.nsq_http, f"/topic/create?topic={name}", "POST")[0] == 200
            assert http(gateway.nsq_http, f"/channel/create?topic={name}&channel=c", "POST")[0] == 200
            assert http(gateway.nsq_http, f"/channel/create?topic={name}&channel=d", "POST")[0] == 200
        assert http(other.nsq_http, "/topic/create?topic=kept", "POST")[0] == 200
        wait_until(lambda: {"channel:kept:c", "channel:kept:d", "channel:gone:c"} <= lookupd.registered(port),
                   "the channels registered")
        assert http(gateway.nsq_http, "/channel/delete?topic=kept&channel=d", "POST")[0] == 200
        assert http(gateway.nsq_http, "/topic/delete?topic=gone", "POST")[0] == 200
        wait_until(lambda: lookupd.registered(port) == {"topic:kept:", "channel:kept:c"},
                   "the deleted channel and topic unregistered")
        wait_until(lambda: len(lookupd.get("/lookup?topic=kept")["producers"]) == 2, "both nodes of topic kept")
        gateway.stop()  # the node closes its connection: lookupd forgets it and all it registered
        wait_until(lambda: lookupd.node_ports() == {tcp_port(other)}, "the stopped node gone from /nodes")
        wait_until(lambda: lookupd.registered(port) == set(), "the stopped node's registrations gone")
        assert [p["tcp_port"] for p in lookupd.get("/lookup?topic=kept")["producers"]] == [tcp_port(other)]


def test_a_restarted_lookupd_is_told_everything_again(lookupd: Lookupd) -> None:
    with node(lookupd) as gateway:
        port = tcp_port(gateway)
        assert http(gateway.nsq_http, "/topic/create?topic=t", "POST")[0] == 200
        assert http(gateway.nsq_http, "/channel/create?topic=t&channel=c", "POST")[0] == 200
        assert http(gateway.nsq_http, "/topic/create?topic=alone", "POST")[0] == 200
        wait_until(lambda: {"channel:t:c", "topic:alone:"} <= lookupd.registered(port), "registered")
        lookupd.restart()
        wait_until(lambda: lookupd.registered(port) == {"topic:t:", "channel:t:c", "topic:alone:"},
                   "registered again after the restart")


def test_the_lookupds_change_at_run_time_through_the_http_api(lookupd: Lookupd) -> None:
    with running_lookupd(lookupd.kind) as second, node(lookupd) as gateway:
        port = tcp_port(gateway)
        assert http(gateway.nsq_http, "/topic/create?topic=t", "POST")[0] == 200
        wait_until(lambda: "topic:t:" in lookupd.registered(port), "registered with the first")
        both = f'["{lookupd.tcp_address}","{second.tcp_address}"]'.encode()
        status, body = http(gateway.nsq_http, "/config/nsqlookupd_tcp_addresses", "PUT", both)
        assert (status, body) == (200, both)
        wait_until(lambda: "topic:t:" in second.registered(port), "registered with the second")
        only_second = f'["{second.tcp_address}"]'.encode()
        assert http(gateway.nsq_http, "/config/nsqlookupd_tcp_addresses", "PUT", only_second)[0] == 200
        wait_until(lambda: lookupd.node_ports() == set(), "the first lookupd left")
        assert http(gateway.nsq_http, "/topic/create?topic=u", "POST")[0] == 200
        wait_until(lambda: second.registered(port) == {"topic:t:", "topic:u:"}, "changes told to the second only")
        wait_until(lambda: lookupd.registered(port) == set(), "nothing left with the first")
        assert http_json(gateway.nsq_http, "/config/nsqlookupd_tcp_addresses") == [second.tcp_address]
