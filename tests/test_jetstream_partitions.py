"""Faults quieter than a kill on the shared path: a node's link to its server cut as a failing switch cuts it
(held silent, no FIN: clients/link_proxy.py). Two nodes in one trio run on the real three-server cluster, as
in test_jetstream_backend.py; node B reaches the cluster only through the proxy at first (the servers'
INFO names the others, which it reconnects to, as a NATS client does): its deliveries, its other
subscriptions and what another node tells it come again. Then a cluster whose every link goes
through a proxy, parted: a server cut off from everything, and a clean split with a node on each side."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import pytest
import trio
from test_jetstream_backend import Node, attached, name, node, until

from polymq.clients.link_proxy import LinkProxy
from polymq.clients.nats_servers import NatsCluster, NatsServer
from polymq.core.engine import Consumer
from polymq.core.message import Message
from polymq.jetstream import api
from polymq.jetstream.nats_connection import STALE_LINK_S, NatsConnection, NatsError, NatsOptions

# A delivery given to a pull request of the link that went silent comes back after the ack wait.
ACK_WAIT_S = 3.0
# Generous: an election on a loaded 2-core machine; this only turns a hang into a failure.
DEADLINE_S = 60.0


async def _delivered_to_b(a: Node, b: Node, topic: str, queue: str, body: bytes) -> tuple[Consumer, list[Message]]:
    """B's consumer of `queue`, bound to `topic` on both nodes, holding `body`, which A published."""
    consumer, got = b.consumer(queue, topic)
    await attached(b, queue)
    a.engine.ensure_queue(queue)
    a.engine.bind(queue, topic)
    _, stored = a.publish(topic, body)
    await stored.wait()
    await until(lambda: len(got) == 1, f"B's delivery of {body!r}")
    return consumer, got


async def test_a_node_cut_off_from_its_server_delivers_again_on_its_own(nats_cluster: NatsCluster) -> None:
    """B's consumer of a queue gets what A publishes before the cut, during it and after it: B leaves the
    silent link (STALE_LINK_S), reconnects to another server and asks for its queue's messages again; a
    copy the cluster gave to a request of the dead link is given again after the ack wait."""
    topic, queue = name("cut"), name("cut-reader")
    with LinkProxy.to(nats_cluster.urls[0]) as proxy:
        async with node(nats_cluster, ack_wait_s=ACK_WAIT_S) as a, \
                node(nats_cluster, ack_wait_s=ACK_WAIT_S, servers=[proxy.url]) as b:
            consumer, got = await _delivered_to_b(a, b, topic, queue, b"before")
            consumer.finish(got[0].id)
            proxy.cut()
            _, stored = a.publish(topic, b"during")
            await stored.wait()
            cut_at = trio.current_time()
            await until(lambda: b.link.connection.connected_url not in (None, proxy.url), "B on another server")
            assert trio.current_time() - cut_at <= STALE_LINK_S + 5  # noticed by its silence, not a close
            _, stored = a.publish(topic, b"after")
            await stored.wait()
            await until(lambda: {m.body for m in got[1:]} >= {b"after", b"during"}, "B's deliveries after it came back")
            later = got[1:]
            assert sorted(m.body for m in later if m.body != b"before") == [b"after", b"during"]
            # The FIN of `before` may have been on the link when it went silent: then it comes again, as a
            # redelivery.
            assert all(m.attempts > 1 for m in later if m.body == b"before")
            for message in later:
                consumer.finish(message.id)


async def test_a_node_cut_off_from_two_servers_goes_on_with_the_third(nats_cluster: NatsCluster) -> None:
    """B reaches each server through a proxy of its own, and only so (it takes none of the addresses INFO
    announces): the links to the server it talks to and to the next it would try go silent. It leaves the
    silent link, gives up on the next server's silence within its connect timeout, and goes on with the
    third; its queue delivers what A published during the cut and after."""
    topic, queue = name("two-cut"), name("two-cut-reader")
    with contextlib.ExitStack() as proxies_open:
        proxies = []
        for url in nats_cluster.urls:
            proxies.append(proxies_open.enter_context(LinkProxy.to(url)))
        async with node(nats_cluster, ack_wait_s=ACK_WAIT_S) as a, \
                node(nats_cluster, ack_wait_s=ACK_WAIT_S, servers=[p.url for p in proxies], discover=False) as b:
            consumer, got = b.consumer(queue, topic)
            await attached(b, queue)
            a.engine.ensure_queue(queue)
            a.engine.bind(queue, topic)
            on = [p.url for p in proxies].index(b.link.connection.connected_url)
            cut, left = [proxies[on], proxies[(on + 1) % 3]], proxies[(on + 2) % 3]
            for proxy in cut:
                proxy.cut()
            _, stored = a.publish(topic, b"during")
            await stored.wait()
            await until(lambda: b.link.connection.connected_url == left.url, "B on the server it can reach")
            _, stored = a.publish(topic, b"after")
            await stored.wait()
            await until(lambda: {m.body for m in got} >= {b"during", b"after"}, "B's deliveries after the cut")
            for message in got:
                consumer.finish(message.id)


async def test_after_a_silent_link_the_nodes_other_subscriptions_serve_again(nats_cluster: NatsCluster) -> None:
    """B leaves a silent link and reconnects elsewhere; what it hears besides its pull requests comes again on
    the new link: an acknowledgement by id made on A for a delivery B holds (PHPMQ's and MQKS's acks, which
    only B's subscription carries), the pause of the queue on A and its unpause, and a queue A binds anew."""
    topic, queue, later = name("relinked"), name("relinked-reader"), name("relinked-later")
    with LinkProxy.to(nats_cluster.urls[0]) as proxy:
        async with node(nats_cluster, ack_wait_s=60.0) as a, \
                node(nats_cluster, ack_wait_s=60.0, servers=[proxy.url]) as b:
            _, got = await _delivered_to_b(a, b, topic, queue, b"held by B")
            held = b.engine.queues[queue]
            proxy.cut()
            await until(lambda: b.link.connection.connected_url not in (None, proxy.url), "B on another server")
            a.engine.queues[queue].finish_any(got[0].id)
            await until(lambda: not held.in_flight, "the acknowledgement by id, forwarded to B")
            a.engine.queues[queue].set_paused(True)
            await until(lambda: held.paused, "the pause, on B")
            a.engine.queues[queue].set_paused(False)
            await until(lambda: not held.paused, "the unpause, on B")
            a.engine.ensure_queue(later)
            a.engine.bind(later, topic)
            await until(lambda: later in b.engine.queues and topic in b.engine.queues[later].topics,
                        "the queue A bound, on B")
            assert len(got) == 1  # acknowledged: not delivered again


async def test_a_notice_to_a_node_whose_link_is_silent_reaches_it_once_it_is_back(
        nats_cluster: NatsCluster) -> None:
    """What a node tells the node that made a message (eMQP's "dispatched", which that node turns into its
    client's REPLY) while that node's link is silent is asked again until the node, on another server, answers
    it has it."""
    topic = name("noticed")
    with LinkProxy.to(nats_cluster.urls[0]) as proxy:
        async with node(nats_cluster, ack_wait_s=ACK_WAIT_S) as a, \
                node(nats_cluster, ack_wait_s=ACK_WAIT_S, servers=[proxy.url]) as b:
            heard: list[list[bytes]] = []
            b.engine.listeners["notice"] = heard.append
            made_by_b, stored = b.publish(topic, b"a request of B's client")
            await stored.wait()
            proxy.cut()
            a.engine.tell_maker_of(made_by_b, "notice", [b"%d" % made_by_b])
            await until(lambda: b.link.connection.connected_url not in (None, proxy.url), "B on another server")
            await until(lambda: heard, "the notice, on B")
            assert set(map(tuple, heard)) == {(b"%d" % made_by_b,)}
            assert a.link.tell_retries >= 1 and a.link.told_dropped == 0


def _stream_view(server: NatsServer, stream: str) -> tuple[str | None, int]:
    """The stream's leader as `server` knows it, and the messages `server`'s replica holds."""
    status, body = server.monitor("/jsz?streams=true")
    if status != 200:
        return None, 0
    for account in json.loads(body).get("account_details", []):
        for detail in account.get("stream_detail", []):
            if detail["name"] == stream:
                return detail.get("cluster", {}).get("leader"), int(detail.get("state", {}).get("messages", 0))
    return None, 0


async def test_a_stream_leader_cut_off_acknowledges_nothing_and_the_majority_elects_another(tmp_path: Path) -> None:
    """Every link of the cluster through a proxy (clients.link_proxy): the leader of a three-replica stream cut
    off from the other two servers and from its clients (held silent, nothing closed). A publish sent to it is
    not acknowledged; the other two elect a leader of their own and acknowledge publishes; after the heal the
    old leader holds every acknowledged message."""
    subject, stream = "parted", "PARTED"
    with NatsCluster(tmp_path / "nats", 3, proxied=True) as cluster:
        async with trio.open_nursery() as nursery:
            setup = await NatsConnection.connect(NatsOptions(servers=cluster.urls), nursery)
            # Kept by limits (a topic's stream keeps only what its queues still want).
            await api.api(setup, f"STREAM.CREATE.{stream}", {"name": stream, "subjects": [subject], "num_replicas": 3,
                                                              "storage": "file"})
            acknowledged = 0
            for index in range(5):
                # Asked again while the new stream elects its leader (no responders yet); its key makes a
                # publish whose answer was lost count once.
                with trio.fail_after(DEADLINE_S):
                    while True:
                        try:
                            reply = await setup.request(subject, b"before %d" % index,
                                                        headers={"Nats-Msg-Id": f"before-{index}"})
                            api.parse_publish_ack(reply.payload)
                            break
                        except (NatsError, api.JetStreamError):
                            await trio.sleep(0.1)
                acknowledged += 1
            await setup.close()
            with trio.fail_after(DEADLINE_S):
                while (leader_name := _stream_view(cluster.servers[0], stream)[0]) is None:
                    await trio.sleep(0.1)
            leader = next(server for server in cluster.servers if server.name == leader_name)
            majority = [server for server in cluster.servers if server is not leader]
            to_leader = await NatsConnection.connect(NatsOptions(servers=[leader.url], request_timeout=3.0),
                                                     nursery)
            cluster.cut_off(leader)
            with pytest.raises(NatsError):  # no answer: the leader cannot reach a quorum (nor the client it)
                await to_leader.request(subject, b"to the cut-off leader")
            with trio.fail_after(DEADLINE_S):
                while _stream_view(majority[0], stream)[0] not in {server.name for server in majority}:
                    await trio.sleep(0.1)
            to_majority = await NatsConnection.connect(NatsOptions(servers=[server.url for server in majority]),
                                                       nursery)
            with trio.fail_after(DEADLINE_S):
                while True:
                    try:
                        reply = await to_majority.request(subject, b"to the majority")
                        api.parse_publish_ack(reply.payload)
                        break
                    except (NatsError, api.JetStreamError):
                        await trio.sleep(0.2)  # the new leader still settling
            acknowledged += 1
            assert _stream_view(leader, stream)[1] == 5  # no way around the proxies reached the cut-off replica
            cluster.heal(leader)
            with trio.fail_after(DEADLINE_S):
                while _stream_view(leader, stream)[1] < acknowledged:
                    await trio.sleep(0.1)
            await to_majority.close()
            await to_leader.close()


async def _stored_once(publisher: Node, topic: str, body: bytes) -> None:
    """Published and stored by the cluster, asked again while a stream's new leader settles."""
    with trio.fail_after(DEADLINE_S):
        while True:
            _, stored = publisher.publish(topic, body)
            await stored.wait()
            if stored.errors == [None]:
                return


async def _led_by(node_: Node, server: NatsServer, stepdown: str, info: str) -> None:
    """The stream's or consumer's leader moved to `server` (JetStream's stepdown with a preferred peer)."""
    with trio.fail_after(DEADLINE_S):
        while (await api.api(node_.link.connection, info)).get("cluster", {}).get("leader") != server.name:
            await api.api(node_.link.connection, stepdown, {"placement": {"preferred": server.name}})
            await trio.sleep(0.5)


async def test_a_clean_split_acknowledges_nothing_on_the_minority_and_the_majority_serves_on(tmp_path: Path) -> None:
    """A node with one server on one side, a node with the other two on the other ({A, n1} | {B, n2, n3}: the
    routes between the sides held silent, each node's own link left up). A's publish is not acknowledged: it
    fails once the publish timeout is over; B publishes and its consumer gets it, whichever server led the
    topic's stream and consumer before; after the heal A's publishes are acknowledged again and B gets them."""
    topic, queue = name("split"), name("split-reader")
    with NatsCluster(tmp_path / "nats", 3, proxied=True) as cluster:
        n1, n2, n3 = cluster.servers
        async with node(cluster, ack_wait_s=ACK_WAIT_S, servers=[n1.url]) as a, \
                node(cluster, ack_wait_s=ACK_WAIT_S, servers=[n2.url, n3.url]) as b:
            consumer, got = b.consumer(queue, topic)
            await attached(b, queue)
            await _stored_once(a, topic, b"before")
            await until(lambda: [m.body for m in got] == [b"before"], "the delivery before the split")
            consumer.finish(got[0].id)
            # The hard case: the stream and the queue's consumer led from the minority's server, so the
            # majority elects both again and B's pull requests must reach the new consumer leader.
            stream = api.topic_stream(topic)
            await _led_by(a, n1, f"STREAM.LEADER.STEPDOWN.{stream}", f"STREAM.INFO.{stream}")
            consumer_name = api.queue_consumer(queue)
            await _led_by(a, n1, f"CONSUMER.LEADER.STEPDOWN.{stream}.{consumer_name}",
                          f"CONSUMER.INFO.{stream}.{consumer_name}")
            cluster.split([n1])
            _, stored = a.publish(topic, b"to the minority")
            await stored.wait()
            [error] = stored.errors
            assert error is not None, "acknowledged by a server without a quorum"
            assert cluster.server_at(a.link.connection.connected_url) is n1  # A stayed on its side
            await _stored_once(b, topic, b"on the majority")
            await until(lambda: b"on the majority" in [m.body for m in got], "B's delivery during the split")
            cluster.rejoin([n1])
            await _stored_once(a, topic, b"after")
            await until(lambda: b"after" in [m.body for m in got], "A's publish after the heal, delivered by B")
            for message in got[1:]:
                consumer.finish(message.id)
