"""Nodes on JetStream behind nsqlookupd: each registers what its clients use, whatever protocol made it,
as a node on the embedded store does (the test lookupd in CI; nsq 1.3.0's nsqlookupd where present)."""

from __future__ import annotations

from support.gateway import running_gateway
from support.mqks_wire import MQKSWire
from support.nats_cluster import NatsServer
from support.nsq_cluster import Lookupd, http, wait_until


def test_two_nodes_on_jetstream_register_what_their_clients_use(lookupd: Lookupd, nats_server: NatsServer) -> None:
    args = ("--jetstream", nats_server.url, "--lookupd-tcp-address", lookupd.tcp_address,
            "--broadcast-address", "127.0.0.1")
    with running_gateway(*args) as publishing, running_gateway(*args) as consuming:
        assert http(publishing.nsq_http, "/pub?topic=js-orders", "POST", b"one")[0] == 200
        with MQKSWire(consuming.host_port("mqks")) as mqks:  # queue js-audit on the other node
            mqks.send(b"c1 consume --confirm js-audit js-orders\n")
            assert mqks.line() == b"c1 ok "
            assert mqks.line().endswith(b" event=js-orders one")  # the backlog, published on the first node
        first, second = publishing.host_port("nsq-tcp")[1], consuming.host_port("nsq-tcp")[1]
        wait_until(lambda: "topic:js-orders:" in lookupd.registered(first), "the topic on the publishing node")
        wait_until(lambda: {"topic:js-orders:", "channel:js-orders:js-audit"} <= lookupd.registered(second),
                   "the topic and its queue on the consuming node")
        producers = {p["tcp_port"] for p in lookupd.get("/lookup?topic=js-orders")["producers"]}
        assert producers == {first, second}
