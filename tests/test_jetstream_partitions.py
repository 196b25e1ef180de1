"""Faults quieter than a kill on the shared path: a node's link to its server cut as a failing switch cuts it
(held silent, no FIN: torture/link_proxy.py). Two nodes in one trio run on the real three-server cluster, as
in test_jetstream_backend.py; node B reaches the cluster only through the proxy at first (the servers'
INFO names the others, which it reconnects to, as a NATS client does)."""

from __future__ import annotations

import trio
from test_jetstream_backend import attached, name, node, until

from polymq.jetstream.nats_connection import STALE_LINK_S
from polymq.torture.link_proxy import LinkProxy

from support.nats_cluster import NatsCluster

# A delivery given to a pull request of the link that went silent comes back after the ack wait.
ACK_WAIT_S = 3.0


async def test_a_node_cut_off_from_its_server_delivers_again_on_its_own(nats_cluster: NatsCluster) -> None:
    """B's consumer of a queue gets what A publishes before the cut, during it and after it: B leaves the
    silent link (STALE_LINK_S), reconnects to another server and asks for its queue's messages again; a
    copy the cluster gave to a request of the dead link is given again after the ack wait."""
    topic, queue = name("cut"), name("cut-reader")
    host, port = nats_cluster.urls[0].removeprefix("nats://").rsplit(":", 1)
    with LinkProxy((host, int(port))) as proxy:
        async with node(nats_cluster, ack_wait_s=ACK_WAIT_S) as a, \
                node(nats_cluster, ack_wait_s=ACK_WAIT_S, servers=[proxy.url]) as b:
            consumer, got = b.consumer(queue, topic)
            await attached(b, queue)
            a.engine.ensure_queue(queue)
            a.engine.bind(queue, topic)
            _, stored = a.publish(topic, b"before")
            await stored.wait()
            await until(lambda: len(got) == 1, "the delivery before the cut")
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
