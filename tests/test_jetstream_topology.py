"""A node's topics and queues follow the cluster's (jetstream/topology.py): what any node sets up — a queue, a
binding, a re-binding, a deletion, a pause, an ephemeral channel — serves the clients of every node, and a
node started later knows it all before it serves. Two nodes in one trio run on the real three-server
cluster, as in test_jetstream_backend.py."""

from __future__ import annotations

from typing import Any

import pytest
import trio
from test_jetstream_backend import attached, name, node, until

from polymq.core.engine import MAX_ATTEMPTS_OPTION
from polymq.core.message import Message
from polymq.core.shared import SharedQueue
from polymq.jetstream import api

from support.nats_cluster import NatsCluster


async def test_a_queue_bound_on_one_node_is_the_same_queue_on_the_other_for_any_protocol(
        nats_cluster: NatsCluster) -> None:
    """An MQKS-style queue `billing` bound to `orders` on A; B's client names `billing` as PHPMQ does (the
    queue of its own name, bound to the topic of its name): it gets what A publishes to `orders`."""
    orders, billing = name("orders"), name("billing")
    async with node(nats_cluster) as a, node(nats_cluster) as b:
        a.engine.ensure_queue(billing, options={MAX_ATTEMPTS_OPTION: 3})
        a.engine.bind(billing, orders)
        _, stored = a.publish(orders, b"bound")  # stored once the binding is: the queue has it
        await stored.wait()
        await until(lambda: billing in b.engine.queues and orders in b.engine.queues[billing].topics,
                    "the binding followed on the other node")
        queue = b.engine.queues[billing]
        assert isinstance(queue, SharedQueue) and queue.max_attempts == 3  # its settings came with it
        consumer, got = b.consumer(billing, billing)  # PHPMQ's `002 billing` on B
        await until(lambda: len(got) == 1, "the message published to orders on A")
        assert got[0].body == b"bound" and got[0].topic == orders
        assert b.engine.queues[billing].topics == [orders, billing]
        consumer.finish(got[0].id)
        b.engine.delete_queue(billing)


async def test_a_topic_made_on_one_node_is_in_the_cluster_once_the_node_says_it_is_stored(
        nats_cluster: NatsCluster) -> None:
    """nsqd's `/topic/create` answers after the store's barrier: the barrier covers the topic's stream, so a topic
    answered made has its stream in the cluster (the next publish waits for no stream), seen by every node."""
    topic = name("made")
    async with node(nats_cluster) as a, node(nats_cluster) as b:
        a.engine.ensure_topic(topic)
        settled = trio.Event()
        told: list[tuple[Exception | None, bool]] = []  # the barrier's answer, and whether the stream was made then

        def answered(error: Exception | None) -> None:
            told.append((error, a.link.topics[topic].ready))
            settled.set()

        a.engine.settled(answered)
        await settled.wait()
        assert told == [(None, True)]
        assert await api.stream_names(b.link.connection, api.topic_subject(topic)) == [api.topic_stream(topic)]
        await until(lambda: topic in b.engine.topics, "the topic on the other node")
        a.engine.delete_topic(topic)


async def test_a_node_started_later_knows_every_queue_and_binding_before_it_serves(nats_cluster: NatsCluster) -> None:
    orders, billing = name("orders"), name("billing")
    async with node(nats_cluster) as a:
        a.engine.ensure_queue(billing)
        a.engine.bind(billing, orders)
        for index in range(3):
            _, stored = a.publish(orders, b"early %d" % index)
        await stored.wait()
        a.engine.queues[billing].set_paused(True)
        await until(lambda: a.link.topology.consumer(orders, billing) is not None
                    and a.link.topology.consumer(orders, billing).paused, "the pause kept in the cluster")
    async with node(nats_cluster) as later:
        queue = later.engine.queues.get(billing)  # known at once: no client of this node named it yet
        assert isinstance(queue, SharedQueue) and queue.topics == [orders] and queue.paused
        assert orders in later.engine.topics
        assert queue.depth == 3  # what the cluster holds for it, as read at start
        _, got = later.consumer(billing, billing)
        await trio.sleep(0.5)
        assert got == []  # paused in the cluster: paused here
        queue.set_paused(False)
        await until(lambda: len(got) == 3, "the three messages once unpaused")
        assert [m.body for m in got] == [b"early 0", b"early 1", b"early 2"]
        later.engine.delete_queue(billing)


async def test_a_rebinding_on_one_node_is_followed_by_the_other(nats_cluster: NatsCluster) -> None:
    old, new, queue_name = name("old"), name("new"), name("rebound")
    async with node(nats_cluster) as a, node(nats_cluster) as b:
        a.engine.ensure_queue(queue_name)
        a.engine.bind(queue_name, old)
        _, got = b.consumer(queue_name, old)
        await attached(b, queue_name)
        a.engine.set_bindings(queue_name, [new])
        await until(lambda: b.engine.queues[queue_name].topics == [new], "the new binding on the other node")
        _, stored_old = a.publish(old, b"to the old topic")
        _, stored_new = a.publish(new, b"to the new topic")
        await stored_old.wait()
        await stored_new.wait()
        await until(lambda: len(got) == 1, "the message of the new topic")
        await trio.sleep(0.3)
        assert [m.body for m in got] == [b"to the new topic"]
        b.engine.delete_queue(queue_name)


async def test_a_deletion_on_one_node_deletes_the_queue_on_the_other(nats_cluster: NatsCluster) -> None:
    topic, queue_name = name("topic"), name("deleted")
    async with node(nats_cluster) as a, node(nats_cluster) as b:
        closed: list[str] = []
        a.engine.ensure_queue(queue_name)
        a.engine.bind(queue_name, topic)
        b.engine.ensure_queue(queue_name)
        b.engine.bind(queue_name, topic)
        b.engine.attach(queue_name, lambda message: None, credit=10, on_close=closed.append)
        await attached(b, queue_name)
        a.engine.delete_queue(queue_name)
        await until(lambda: queue_name not in b.engine.queues, "the queue deleted on the other node")
        assert closed == ["queue deleted"]
        with trio.fail_after(30):
            while api.queue_consumer(queue_name) in await api.consumer_names(a.link.connection, topic):
                await trio.sleep(0.05)


async def test_a_topic_deleted_on_one_node_goes_from_the_other(nats_cluster: NatsCluster) -> None:
    topic, queue_name = name("gone"), name("its-queue")
    async with node(nats_cluster) as a, node(nats_cluster) as b:
        a.engine.ensure_queue(queue_name)
        a.engine.bind(queue_name, topic)
        await until(lambda: queue_name in b.engine.queues, "the queue on the other node")
        a.engine.delete_topic(topic)
        await until(lambda: topic not in b.engine.topics, "the topic gone from the other node")
        # Bound to nothing in the cluster and used by no client of B: B keeps nothing of it (A, where it was made,
        # keeps it unbound, as the embedded engine keeps a queue whose topic went).
        assert queue_name not in b.engine.queues
        assert a.engine.queues[queue_name].topics == []


async def test_a_queue_forgotten_on_one_node_stays_in_the_cluster_with_its_topic(nats_cluster: NatsCluster) -> None:
    """PHPMQ's forgetting of an empty, unused queue (its topic with it) is the node's own: the other node's
    queue, and the stream, stay."""
    from polymq.adapters.named_queue import named_queue

    queue_name = name("forget")
    async with node(nats_cluster) as a, node(nats_cluster) as b:
        named_queue(a.engine, queue_name, origin="phpmq", forget_empty_after=0.0)
        await attached(a, queue_name)
        consumer = a.engine.attach(queue_name, lambda message: None, credit=1)
        await until(lambda: queue_name in b.engine.queues, "the queue on the other node")
        _, got = b.consumer(queue_name, queue_name)
        consumer.detach()  # empty and unused on A: forgotten there
        assert queue_name not in a.engine.queues and queue_name not in a.engine.topics
        _, stored = b.publish(queue_name, b"still served")
        await stored.wait()
        await until(lambda: len(got) == 1, "the message, on the node that still uses the queue")
        assert queue_name not in a.engine.queues  # not made again on A by its reading of the cluster
        await trio.sleep(1.5)  # a refresh of every topic
        assert queue_name not in a.engine.queues


async def test_an_ephemeral_channel_of_a_shared_topic_gets_what_any_node_publishes_and_goes_with_its_clients(
        nats_cluster: NatsCluster) -> None:
    topic = name("tail")
    channel = f"{topic}/tail{name('x').replace('-', '')}#ephemeral"
    async with node(nats_cluster) as a, node(nats_cluster) as b:
        b.engine.ensure_topic(topic)
        b.engine.ensure_queue(channel, ephemeral=True, owner_topic=topic)
        b.engine.bind(channel, topic)
        got: list[Message] = []
        consumer = b.engine.attach(channel, got.append, credit=10, msg_timeout=30.0)
        settled = trio.Event()
        b.engine.settled(lambda error: settled.set())
        with trio.fail_after(30):
            await settled.wait()
        _, stored = a.publish(topic, b"from the other node")
        _, stored_here = b.publish(topic, b"from its own node")
        await stored.wait()
        await stored_here.wait()
        await until(lambda: len(got) == 2, "both publishes")
        assert sorted(m.body for m in got) == [b"from its own node", b"from the other node"]
        assert channel not in a.engine.queues  # an ephemeral channel is followed where its clients are
        for message in got:
            consumer.finish(message.id)
        consumer.detach()
        assert channel not in b.engine.queues
        with trio.fail_after(30):  # its consumer goes once no node reads it
            while api.queue_consumer(channel) in await api.consumer_names(b.link.connection, topic):
                await trio.sleep(0.1)


async def test_a_queue_bound_to_a_busy_and_an_idle_topic_gives_its_credit_to_the_busy_one(
        nats_cluster: NatsCluster) -> None:
    """A pull request holds its share of the consumers' credit until it ends: the idle topic keeps one request
    waiting, never the credit the busy topic's messages need (an MQKS binding beside a PHPMQ queue's own name)."""
    busy, idle, queue_name = name("busy"), name("idle"), name("both")
    async with node(nats_cluster) as a:
        a.engine.ensure_queue(queue_name)
        a.engine.bind(queue_name, busy)  # as PHPMQ finds a queue MQKS bound, then binds it to its own name
        a.engine.bind(queue_name, idle)
        got: list[Message] = []
        consumer = a.engine.attach(queue_name, got.append, credit=4, msg_timeout=30.0)
        await until(lambda: len(a.link.pullers.get(queue_name, ())) == 2, "both topics read")
        for index in range(20):
            _, stored = a.publish(busy, b"busy %d" % index)
        await stored.wait()
        idle_puller = next(p for p in a.link.pullers[queue_name] if p.topic == idle)
        finished = 0
        with trio.fail_after(60):
            while finished < 20:
                assert idle_puller.outstanding <= 1
                while finished < len(got):
                    consumer.finish(got[finished].id)
                    finished += 1
                await trio.sleep(0.01)
        assert sorted(m.body for m in got) == sorted(b"busy %d" % i for i in range(20))


async def test_an_mqks_publish_right_after_a_binding_elsewhere_is_kept_though_no_advisory_came_yet(
        nats_cluster: NatsCluster) -> None:
    """MQKS's rule drops a publish to an event no queue is bound to; a node whose advisories are late asks the
    cluster before it drops one (here: it never hears them)."""
    event, queue_name = name("event"), name("late")
    async with node(nats_cluster) as a, node(nats_cluster) as b:
        _, stored = a.publish(event, b"nobody", drop_if_unbound=True)
        await stored.wait()
        assert a.engine.dropped_count == 1  # the stream exists now; no queue anywhere
        for sid, subscription in list(a.link.connection._subs.items()):  # A hears no advisory from now on
            if subscription.subject.startswith("$JS.EVENT.ADVISORY."):
                a.link.connection.unsubscribe(sid)
        b.engine.ensure_queue(queue_name)
        b.engine.bind(queue_name, event)
        bound = trio.Event()
        b.engine.settled(lambda error: bound.set())
        with trio.fail_after(30):
            await bound.wait()
        _, stored = a.publish(event, b"kept", drop_if_unbound=True)
        await stored.wait()
        assert stored.errors == [None] and a.engine.dropped_count == 1
        _, got = b.consumer(queue_name, event)
        await until(lambda: len(got) == 1, "the publish made after the binding")
        assert got[0].body == b"kept"


async def test_an_empty_and_a_pause_heard_while_a_read_of_the_queue_was_on_its_way_are_kept(
        nats_cluster: NatsCluster, monkeypatch: pytest.MonkeyPatch) -> None:
    """A's channel is emptied and paused while B's read of its topic (taken before) is on its way: B makes the
    queue from that read, and still keeps it paused and delivers nothing emptied (nsqd's /channel/empty and
    /channel/pause over HTTP on one node, a consumer on the other)."""
    topic, queue_name = name("race"), name("raced")
    async with node(nats_cluster) as a, node(nats_cluster) as b:
        for sid, subscription in list(b.link.connection._subs.items()):  # B reads the topic only when told below
            if subscription.subject.startswith("$JS.EVENT.ADVISORY."):
                b.link.connection.unsubscribe(sid)
        a.engine.ensure_queue(queue_name)
        a.engine.bind(queue_name, topic)
        for body in (b"c1", b"c2"):
            _, stored = a.publish(topic, body)
        await stored.wait()
        real_list = api.consumer_list
        taken, heard = trio.Event(), trio.Event()

        async def stale_list(connection: Any, listed: str) -> api.ConsumerListing | None:
            listing = await real_list(connection, listed)
            if connection is b.link.connection and listed == topic:
                taken.set()
                with trio.fail_after(30):
                    await heard.wait()  # the empty and the pause came after the read was taken
            return listing

        monkeypatch.setattr(api, "consumer_list", stale_list)
        b.link.topology.changed(topic)
        with trio.fail_after(30):
            await taken.wait()
        shared = a.engine.queues[queue_name]
        shared.empty()
        shared.set_paused(True)
        floor_key = (queue_name, api.topic_stream(topic))
        await until(lambda: b.link.noticed_paused.get(queue_name) is True and floor_key in b.link.noticed_floors,
                    "B hearing the empty and the pause")
        heard.set()
        await until(lambda: queue_name in b.engine.queues, "the queue made on B from its stale read")
        assert b.engine.queues[queue_name].paused
        _, got = b.consumer(queue_name, topic)
        _, stored = a.publish(topic, b"after")
        await stored.wait()
        shared.set_paused(False)
        await until(lambda: len(got) == 1, "the delivery after the unpause")
        assert got[0].body == b"after"  # c1 and c2 were emptied


async def raw_pull(connection: Any, topic: str, queue_name: str) -> list[Any]:
    """What one pull request of one message (1 s) brings: a message, or the status that ends it."""
    answers: list[Any] = []
    answered = trio.Event()

    def heard(msg: Any) -> None:
        answers.append(msg)
        answered.set()

    inbox = connection.new_inbox()
    connection.subscribe(inbox, heard)
    connection.publish(api.pull_subject(topic, api.queue_consumer(queue_name)), api.pull_request(1, expires_s=1.0),
                       reply=inbox)
    with trio.fail_after(30):
        await answered.wait()
    return answers


async def settled(engine: Any) -> None:
    """Until the changes made so far hold for every client (what an answer to one waits for)."""
    done = trio.Event()
    engine.settled(lambda error: done.set())
    with trio.fail_after(30):
        await done.wait()


async def test_a_pause_once_answered_holds_every_pull_request_of_the_cluster(nats_cluster: NatsCluster) -> None:
    """nsqd's /channel/pause through A: once answered, JetStream's own consumer is paused, so a pull request of
    any node (one that has not heard of the pause yet), sent at once, waits beside the message and ends
    unserved."""
    topic, queue_name = name("held"), name("paused-at-once")
    async with node(nats_cluster) as a, node(nats_cluster) as b:
        a.engine.ensure_queue(queue_name)
        a.engine.bind(queue_name, topic)
        _, stored = a.publish(topic, b"held")
        await stored.wait()
        a.engine.queues[queue_name].set_paused(True)
        await settled(a.engine)
        answers = await raw_pull(b.link.connection, topic, queue_name)
        assert [msg.status for msg in answers] == [408]  # the request's end: no message given
        info = await api.consumer_info(a.link.connection, topic, api.queue_consumer(queue_name))
        assert info["paused"] is True and info["num_pending"] == 1
        a.engine.queues[queue_name].set_paused(False)
        _, got = a.consumer(queue_name, topic)
        await until(lambda: len(got) == 1, "the delivery after the unpause")
        assert got[0].body == b"held"


async def test_an_empty_once_answered_holds_for_every_pull_request_of_the_cluster(nats_cluster: NatsCluster) -> None:
    """nsqd's /channel/empty through A: once answered, JetStream's own consumer holds nothing emptied (it was
    reset to the stream's next message), so a pull request of a node that has not heard of the empty yet,
    sent at once, brings the next message published, not an emptied one; and what was given out before
    goes with it (nothing comes back after the ack wait)."""
    topic, queue_name = name("emptied"), name("emptied-at-once")
    async with node(nats_cluster) as a, node(nats_cluster) as b:
        a.engine.ensure_queue(queue_name)
        a.engine.bind(queue_name, topic)
        for body in (b"e1", b"e2", b"e3"):
            _, stored = a.publish(topic, body)
        await stored.wait()
        given_out = await raw_pull(b.link.connection, topic, queue_name)  # e1, held by no consumer of A's
        assert [msg.payload for msg in given_out] == [b"e1"]
        a.engine.queues[queue_name].empty()
        await settled(a.engine)
        info = await api.consumer_info(a.link.connection, topic, api.queue_consumer(queue_name))
        assert (info["num_pending"], info["num_ack_pending"]) == (0, 0)
        _, stored = a.publish(topic, b"after")
        await stored.wait()
        answers = await raw_pull(b.link.connection, topic, queue_name)
        assert [msg.payload for msg in answers] == [b"after"]
