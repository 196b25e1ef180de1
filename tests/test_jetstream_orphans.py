"""Messages a topic's stream keeps that none of its consumers' leaders owes (a consumer's replicas come apart):
found by a node's reading of the cluster, and the consumers' leaders stepped down."""

from __future__ import annotations

import copy
from typing import Any

import trio
from test_jetstream_backend import attached, name, node, until

from polymq.core.clock import ManualClock
from polymq.jetstream import api
from polymq.jetstream.orphans import CHECK_EVERY_S, Orphans, kept_unowed, owed

from support.nats_cluster import NatsCluster


def _consumer(name_: str, leader: str, floor: int, pending: int = 0, ack_pending: int = 0) -> dict[str, Any]:
    return {"name": name_, "num_pending": pending, "num_ack_pending": ack_pending,
            "ack_floor": {"consumer_seq": floor, "stream_seq": floor}, "cluster": {"leader": leader}}


def _stream(retention: str, first: int, messages: int) -> dict[str, Any]:
    return {"config": {"retention": retention}, "state": {"first_seq": first, "last_seq": 5841, "messages": messages}}


def test_a_stream_keeping_what_every_consumers_leader_acknowledged_is_found() -> None:
    """What a node read after three SIGKILLs of one server: the channel's new leader owed nothing, its followers
    still had nine deliveries pending, and the stream (on their word) kept them."""
    infos = [_consumer("torture_5Fnsq_2Fc", "n3", 5841), _consumer("torture_5Fmqks_5Fnsq", "n1", 5841)]
    found = owed(infos)
    assert found is not None and not found.anything and found.floor == 5841
    assert kept_unowed(_stream("interest", 3648, 9), found.floor) == 3648
    assert kept_unowed(_stream("interest", 5842, 0), found.floor) == 0  # all gone: a consistent cluster
    assert kept_unowed(_stream("limits", 3648, 9), found.floor) == 0  # a stream that keeps what was acked
    busy = owed([*infos, _consumer("torture_5Femqp", "n2", 3647, ack_pending=9)])
    assert busy is not None and busy.anything and busy.floor == 3647
    assert owed([]) is None


async def test_a_consumer_whose_leader_says_it_owes_what_it_holds_is_stepped_down(nats_cluster: NatsCluster) -> None:
    """A real stream keeps a delivery its consumer has not acknowledged; the listing a diverged leader would give
    (nothing owed, the floor past it) is found once, then again a check later, and the real consumer's leader is
    stepped down. A consumer that owes what it holds, or a stream with nothing kept, is left alone."""
    topic, queue = name("diverged"), name("channel")
    async with node(nats_cluster) as a:
        a.engine.ensure_queue(queue)
        a.engine.bind(queue, topic)
        got: list[Any] = []
        consumer = a.engine.attach(queue, got.append, credit=1, msg_timeout=60.0)
        await attached(a, queue)
        _, stored = a.publish(topic, b"held")
        await stored.wait()
        await until(lambda: len(got) == 1, "the delivery")
        connection = a.link.connection
        consumer_name = api.queue_consumer(queue)

        async def leader() -> str:
            info = await api.consumer_info(connection, topic, consumer_name)
            return str((info.get("cluster") or {}).get("leader", ""))

        orphans = Orphans(connection, ManualClock())
        listing = await api.consumer_list(connection, topic)
        assert listing is not None
        await orphans.check(topic, listing)  # it owes the delivery it holds: nothing to look at
        assert (orphans.suspected, orphans.stepped_down) == ({}, 0)
        diverged = copy.deepcopy(listing)
        for info in diverged.infos:
            info["num_ack_pending"] = 0
            info["ack_floor"] = {"consumer_seq": 1, "stream_seq": 1}
        before = await leader()
        await orphans.check(topic, diverged)
        assert (orphans.suspected, orphans.stepped_down) == ({topic: 1}, 0)  # seen once: a replica may lag
        await orphans.check(topic, diverged)
        assert orphans.stepped_down == 0  # not again before CHECK_EVERY_S
        orphans.clock.advance(CHECK_EVERY_S)  # type: ignore[attr-defined]
        await orphans.check(topic, diverged)
        assert (orphans.suspected, orphans.stepped_down) == ({}, 1)
        with trio.fail_after(30):
            while (now := await leader()) in ("", before):
                await trio.sleep(0.1)
        assert now != before
        consumer.finish(got[0].id)
        # The node's own reading of the cluster checks the topic once nothing is owed, and finds it clean.
        await until(lambda: topic in a.link.orphans.clean, "the topic checked and found clean")
        assert a.link.orphans.stepped_down == 0
