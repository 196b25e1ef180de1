"""Schedules on the shared engine: kept in JetStream for every node, fired by the lease holder only, taken
over by another node when the holder dies; and a node's own trace of a message. Nodes (engines) in one
trio run, on a real three-server cluster; a message id's top bits name the node that published it."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import pytest
import trio
import zmq
from test_jetstream_backend import DEADLINE_S, Node, attached, name, node, until

from polymq.clients.link_proxy import LinkProxy
from polymq.codecs import emqp
from polymq.core.engine import MAX_ATTEMPTS_OPTION
from polymq.core.ids import ID_BITS, NODE_BITS
from polymq.core.schedules import FOREVER
from polymq.core.trace import Event, Tracer
from polymq.jetstream.schedules import SharedScheduleKeeper

from support.emqp_wire import Client, Worker, admin_json
from support.gateway import running_gateway
from support.nats_cluster import NatsCluster

WORKER_WAIT_S = 20.0  # a firing a second; the first nodes on a cluster make their streams first


async def test_a_schedule_added_on_one_node_fires_once_per_time_on_the_lease_holder_only(
        nats_cluster: NatsCluster) -> None:
    topic, queue, key = name("ticks"), name("tick-reader"), name("job")
    async with node(nats_cluster) as a, node(nats_cluster) as b:
        consumer, got = b.consumer(queue, topic)
        await attached(b, queue)
        await until(lambda: keeper(a).holding != keeper(b).holding, "one node holding the lease")
        adder = b if keeper(a).holding else a  # the other node fires it
        adder.engine.schedules.add(key, topic, b"tick", interval=0.2, run_count=4)
        await until(lambda: len(got) == 4, "four firings")
        await until(lambda: key not in a.engine.schedules.by_key and key not in b.engine.schedules.by_key,
                    "the schedule gone from both nodes after its last run")
        assert [message.body for message in got] == [b"tick"] * 4
        holder = a if adder is b else b
        assert {publisher_of(message.id) for message in got} == {holder.engine.node}
        for message in got:
            consumer.finish(message.id)


async def test_a_node_started_later_knows_the_schedules_and_another_takes_over_when_the_holder_dies(
        nats_cluster: NatsCluster) -> None:
    topic, queue, key = name("beats"), name("beat-reader"), name("beat")
    async with trio.open_nursery() as nursery:
        holder = await background_node(nursery, nats_cluster)
        await until(lambda: keeper(holder).holding, "the first node holding the lease")
        reader = await background_node(nursery, nats_cluster)
        consumer, got = reader.consumer(queue, topic)
        await attached(reader, queue)
        reader.engine.schedules.add(key, topic, b"beat", interval=0.5, run_count=FOREVER)
        await until(lambda: len(got) >= 2, "firings of the holder, added on the other node")
        assert not keeper(reader).holding
        late = await background_node(nursery, nats_cluster)
        await until(lambda: key in late.engine.schedules.by_key, "the schedule loaded by the late node")
        assert late.engine.schedules.by_key[key].interval == 0.5
        assert not keeper(late).holding
        holder.cancel.cancel()  # the holder dies without a word: its lease lapses
        await until(lambda: keeper(reader).holding or keeper(late).holding, "another node taking the lease over")
        fired_at_takeover = len(got)
        await until(lambda: len(got) >= fired_at_takeover + 2, "firings from the new holder")
        assert all(message.body == b"beat" for message in got)
        assert keeper(reader).holding != keeper(late).holding
        new_holder = reader if keeper(reader).holding else late
        assert {publisher_of(message.id) for message in got[:fired_at_takeover]} == {holder.engine.node}
        assert publisher_of(got[-1].id) == new_holder.engine.node
        reader.engine.schedules.remove(key)
        await until(lambda: key not in late.engine.schedules.by_key, "the removal on the other node")
        for message in got:
            consumer.finish(message.id)
        nursery.cancel_scope.cancel()


async def test_a_lease_holder_cut_off_hears_the_changes_made_meanwhile_and_one_node_fires_on(
        nats_cluster: NatsCluster) -> None:
    """The lease holder's link goes silent (a switch dropping packets) while the other node adds a schedule and
    removes one: the cut node leaves the silent link, and its watch of the schedules, made again on the new
    link, brings both changes; the lease stays with one node (the cut one, back before it lapsed, or the other),
    which fires the new schedule."""
    topic, queue, key, added = name("cut-beats"), name("cut-beat-reader"), name("cut-beat"), name("added")
    with LinkProxy.to(nats_cluster.urls[0]) as proxy:
        async with trio.open_nursery() as nursery:
            holder = await background_node(nursery, nats_cluster, servers=[proxy.url])
            await until(lambda: keeper(holder).holding, "the node behind the proxy holding the lease")
            other = await background_node(nursery, nats_cluster)
            consumer, got = other.consumer(queue, topic)
            await attached(other, queue)
            other.engine.schedules.add(key, topic, b"beat", interval=0.5, run_count=FOREVER)
            await until(lambda: len(got) >= 2, "firings of the holder")
            proxy.cut()
            other.engine.schedules.remove(key)
            other.engine.schedules.add(added, topic, b"later", interval=0.5, run_count=FOREVER)
            await until(lambda: holder.link.connection.connected_url not in (None, proxy.url),
                        "the cut node on another server")
            await until(lambda: added in holder.engine.schedules.by_key and key not in holder.engine.schedules.by_key,
                        "the changes made during the cut, on the cut node")
            await until(lambda: sum(message.body == b"later" for message in got) >= 2, "the new schedule's firings")
            assert keeper(holder).holding != keeper(other).holding
            other.engine.schedules.remove(added)
            for message in got:
                consumer.finish(message.id)
            nursery.cancel_scope.cancel()


def publisher_of(message_id: int) -> int:
    return message_id >> (ID_BITS - NODE_BITS)


def keeper(of: Node) -> SharedScheduleKeeper:
    assert of.link.schedule_keeper is not None
    return of.link.schedule_keeper


async def background_node(nursery: trio.Nursery, cluster: NatsCluster, servers: list[str] | None = None) -> Node:
    """A node in a task of its own: its `cancel` ends it alone, as a process that dies."""
    started: list[Node] = []
    ready = trio.Event()

    async def run() -> None:
        async with node(cluster, servers=servers) as running:
            started.append(running)
            ready.set()
            await trio.sleep_forever()

    nursery.start_soon(run)
    with trio.fail_after(DEADLINE_S):
        await ready.wait()
    return started[0]


# -- eMQP's SCHEDULE through two gateways --------------------------------------------------------------


@pytest.fixture
def context() -> Iterator[zmq.Context]:
    with zmq.Context() as made:
        yield made


def test_an_emqp_schedule_sent_to_one_gateway_feeds_a_worker_on_the_other_and_outlives_both(
        nats_cluster: NatsCluster, context: zmq.Context) -> None:
    # The worker sends no heartbeat while it waits for a job: the gateways do not count it gone meanwhile.
    args = ("--jetstream", ",".join(nats_cluster.urls), "--emqp-heartbeat-timeout", str(int(WORKER_WAIT_S * 3000)))
    payload = json.dumps(["run", {"path": "jobs", "callable": "tick", "args": [], "kwargs": {}}]).encode()
    key = emqp.schedule_key(payload)
    with running_gateway(*args) as first, running_gateway(*args) as second:
        with Worker(context, second.addresses["emqp-backend"]) as worker, \
                Client(context, first.addresses["emqp-frontend"]) as client:
            worker.inform([(10, "shared-cron")])
            worker.ready(5)
            client.send(emqp.SCHEDULE, b"shared-cron", b"nohaste", b"1", payload, b"")
            jobs = [worker.job(timeout=WORKER_WAIT_S) for _ in range(2)]
        assert [job[4:] for job in jobs] == [[b"shared-cron", b"reply-requested", payload]] * 2
        assert jobs[0][3] != jobs[1][3]  # one request per firing
        for gateway in (first, second):
            shown = admin_json(context, gateway.addresses["emqp-admin"], emqp.STATUS)["polymq"]["schedules"]  # type: ignore[index]
            assert shown[key]["queue"] == "shared-cron" and shown[key]["interval"] == 1  # type: ignore[index]
    with running_gateway(*args) as later, Client(context, later.addresses["emqp-frontend"]) as client:
        shown = admin_json(context, later.addresses["emqp-admin"], emqp.STATUS)["polymq"]["schedules"]  # type: ignore[index]
        assert list(shown) == [key]  # type: ignore[arg-type]
        client.send(emqp.UNSCHEDULE, b"shared-cron", b"", b"1", payload, b"")
        deadline = time.monotonic() + DEADLINE_S
        while admin_json(context, later.addresses["emqp-admin"], emqp.STATUS)["polymq"]["schedules"]:  # type: ignore[index]
            assert time.monotonic() < deadline, "the schedule still there after UNSCHEDULE"
            time.sleep(0.05)


# -- tracing on a node of the shared engine ------------------------------------------------------------


async def test_a_traced_message_on_a_node_shows_its_publish_deliveries_requeue_and_dead_letter(
        nats_cluster: NatsCluster) -> None:
    """Tracing is the node's own: what its clients published, and what its consumers did with the copies
    it fetched, in order, the dead letter included."""
    topic, queue = name("traced"), name("traced-worker")
    async with node(nats_cluster) as a:
        tracer = Tracer(a.engine, {}, node=str(a.engine.node))
        seen: list[Event] = []
        tracer.listeners.append(seen.append)
        tracer.trace(topic)
        consumer, got = a.consumer(queue, topic, options={MAX_ATTEMPTS_OPTION: 2})
        await attached(a, queue)
        message_id, _ = a.publish(topic, b"traced body")
        await until(lambda: len(got) == 1, "the first delivery")
        consumer.requeue(got[0].id)
        await until(lambda: len(got) == 2, "the second delivery")
        consumer.requeue(got[1].id)
        await until(lambda: any(event.kind == "dead_lettered" for event in seen), "the dead letter")
        steps = [(event.kind, event.queue or event.topic, event.attempt) for event in seen
                 if event.message.id == message_id]
        assert steps[:6] == [("published", topic, None), ("delivered", queue, 1), ("requeued", queue, 1),
                             ("delivered", queue, 2), ("requeued", queue, 2), ("dead_lettered", queue, 2)]
