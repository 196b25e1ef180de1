"""The shared engine on a real three-server JetStream cluster: two nodes (two engines, each with its own
NATS connection) in one trio run, as two gateways would be.

Each test uses topics and queues of its own names. Waits are on what the engines report, with
deadlines a loaded 2-core machine keeps."""

from __future__ import annotations

import contextlib
import itertools
import json
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import pytest
import trio
from test_admin_api import HOST

from polymq.adapters.http import Later, Request
from polymq.core.dead_letters import Requeued
from polymq.core.engine import (
    DEAD_LETTER_QUEUE_HEADER,
    DEAD_LETTER_REASON_HEADER,
    DEAD_LETTER_SUFFIX,
    DEAD_LETTER_TOPIC_OPTION,
    MAX_ATTEMPTS_OPTION,
    Consumer,
    CreditMode,
    CreditPool,
)
from polymq.core.message import PUBLISHER_ID_HEADER, Message
from polymq.core.shared import SharedEngine, SharedQueue
from polymq.core.trace import Client
from polymq.gateway.admin_access import AdminAccess
from polymq.gateway.admin_api import AdminApi
from polymq.gateway.http import GatewayHttpApi
from polymq.jetstream import api
from polymq.jetstream import dead_letters as jetstream_dead_letters
from polymq.jetstream.backend import PULL_RETRY_S, JetStreamLink, JetStreamSettings, open_shared_engine
from polymq.jetstream.batches import BATCH_MAX
from polymq.jetstream.nats_connection import NatsOptions
from polymq.jetstream.streams import direct_get

from support.nats_cluster import NatsCluster

DEADLINE_S = 30.0
_names = itertools.count()


def name(prefix: str) -> str:
    return f"{prefix}-{next(_names)}"


class Stored:
    def __init__(self) -> None:
        self.event = trio.Event()
        self.errors: list[BaseException | None] = []

    def done(self, error: BaseException | None) -> None:
        self.errors.append(error)
        self.event.set()

    async def wait(self) -> None:
        with trio.fail_after(DEADLINE_S):
            await self.event.wait()


class Node:
    def __init__(self, engine: SharedEngine, link: JetStreamLink, cancel: trio.CancelScope) -> None:
        self.engine = engine
        self.link = link
        self.cancel = cancel

    def publish(self, topic: str, body: bytes, **kwargs: object) -> tuple[int, Stored]:
        """Publish; `Stored` is set once the shared engine stored it (the adapters' sync)."""
        message_id = self.engine.publish(topic, body, **kwargs)  # type: ignore[arg-type]
        stored = Stored()
        self.engine.storage.sync(stored.done)
        return message_id, stored

    def consumer(self, queue: str, topic: str, credit: int = 100, **kwargs: object) -> tuple[Consumer, list[Message]]:
        self.engine.ensure_queue(queue, **kwargs)  # type: ignore[arg-type]
        self.engine.bind(queue, topic)
        got: list[Message] = []
        consumer = self.engine.attach(queue, got.append, credit=credit, msg_timeout=30.0)
        return consumer, got


@asynccontextmanager
async def node(cluster: NatsCluster, *, ack_wait_s: float = 60.0, servers: list[str] | None = None,
               discover: bool = True) -> AsyncIterator[Node]:
    async with trio.open_nursery() as nursery:
        settings = JetStreamSettings(NatsOptions(servers=servers or cluster.urls, discover=discover),
                                     ack_wait_s=ack_wait_s)
        engine, link = await open_shared_engine(settings, nursery)
        nursery.start_soon(_timers, engine)
        try:
            yield Node(engine, link, nursery.cancel_scope)
        finally:
            nursery.cancel_scope.cancel()


async def _timers(engine: SharedEngine) -> None:
    while True:
        engine.run_timers()
        await trio.sleep(0.01)


async def until(condition: Callable[[], bool], what: str) -> None:
    with trio.move_on_after(DEADLINE_S):
        while not condition():
            await trio.sleep(0.01)
        return
    pytest.fail(f"not within {DEADLINE_S:.0f} s: {what}")


async def attached(node: Node, queue: str) -> None:
    await until(lambda: bool(node.link.pullers.get(queue)), f"the consumer of {queue} in JetStream")


async def test_a_batchs_messages_after_its_first_go_without_headers_and_are_read_back_with_their_ids(
        nats_cluster: NatsCluster) -> None:
    """An MPUB's messages are one atomic batch: its first carries its id (the batch's de-duplication key), the
    others whose id is the first's plus their place and that need no header of their own carry none; the
    other node reads their ids and origin from the batch's headers. One with headers of its own keeps only
    those."""
    topic, queue = name("batched"), name("its-queue")
    async with node(nats_cluster) as a, node(nats_cluster) as b:
        _, got = b.consumer(queue, topic)
        await attached(b, queue)
        first_id = a.engine.publish_many(topic, [b"one", b"two", b"three", b"four"], origin="nsq",
                                         each_headers=[{}, {}, {"kind": "own"}, {}])
        stored = Stored()
        a.engine.storage.sync(stored.done)
        await stored.wait()
        assert stored.errors == [None]
        await until(lambda: len(got) == 4, "the batch on the other node")
        assert [(m.body, m.id, m.origin) for m in got] == [
            (body, first_id + place, "nsq") for place, body in enumerate([b"one", b"two", b"three", b"four"])]
        assert got[2].headers == {"kind": "own"}
        stream = api.topic_stream(topic)
        kept = [msg.headers or {} for msg, _ in await direct_get(a.link.connection, stream, {"seq": 1, "batch": 4},
                                                                 topic)]
        own = [{name: value for name, value in headers.items() if not name.startswith("Nats-")} for headers in kept]
        assert own == [{api.HEADER_POLYMQ_ORIGIN: "nsq"}, {}, {api.HEADER_POLYMQ_HEADERS: '{"kind":"own"}'}, {}]
        assert [headers.get(api.HEADER_MSG_ID) for headers in kept] == [str(first_id), None, None, None]
        assert api.batch_member(kept[1]) == (first_id + 1, "nsq")


async def test_a_batch_member_whose_id_does_not_follow_carries_it_without_a_repeat_key_or_its_origin(
        nats_cluster: NatsCluster) -> None:
    """Single publishes to two topics in turn, gathered into one batch per topic: in each, the ids after the
    first skip one, so each member carries its id as `Polymq-Id` (no `Nats-Msg-Id`: the first's makes the batch
    count once) and not its origin, which the other node reads from the batch with the id."""
    topics, queues = [name("left"), name("right")], [name("left-queue"), name("right-queue")]
    async with node(nats_cluster) as a, node(nats_cluster) as b:
        readers = [b.consumer(queue, topic) for queue, topic in zip(queues, topics, strict=True)]
        for queue in queues:
            await attached(b, queue)
        sent: dict[str, list[tuple[int, bytes]]] = {topic: [] for topic in topics}
        for number in range(4):
            for topic in topics:
                body = b"%s %d" % (topic.encode(), number)
                sent[topic].append((a.engine.publish(topic, body, origin="mqks"), body))
        stored = Stored()
        a.engine.storage.sync(stored.done)
        await stored.wait()
        assert stored.errors == [None]
        for topic, (_, got) in zip(topics, readers, strict=True):
            await until(lambda got=got: len(got) == 4, f"the batch of {topic} on the other node")
            assert [(m.id, m.body, m.origin) for m in got] == [(mid, body, "mqks") for mid, body in sent[topic]]
            kept = [msg.headers or {} for msg, _ in await direct_get(a.link.connection, api.topic_stream(topic),
                                                                     {"seq": 1, "batch": 4}, topic)]
            assert [headers.get(api.HEADER_BATCH_SEQUENCE) for headers in kept] == ["1", "2", "3", "4"]
            own = [{key: value for key, value in headers.items()
                    if key == api.HEADER_MSG_ID or not key.startswith("Nats-")} for headers in kept]
            first_id = sent[topic][0][0]
            assert own == [{api.HEADER_MSG_ID: str(first_id), api.HEADER_POLYMQ_ORIGIN: "mqks"}] + [
                {api.HEADER_POLYMQ_ID: str(mid)} for mid, _ in sent[topic][1:]]


async def test_more_single_publishes_in_one_turn_than_a_batch_holds_go_as_several_batches(
        nats_cluster: NatsCluster) -> None:
    """Single publishes made in one turn of the loop are gathered into batches of at most BATCH_MAX: each
    batch's ids read back from its own first one."""
    topic, queue = name("gathered"), name("its-queue")
    async with node(nats_cluster) as a, node(nats_cluster) as b:
        _, got = b.consumer(queue, topic, credit=BATCH_MAX + 500)
        await attached(b, queue)
        bodies = [b"single %d" % number for number in range(BATCH_MAX + 500)]
        sent = [a.engine.publish(topic, body, origin="mqks") for body in bodies]
        stored = Stored()
        a.engine.storage.sync(stored.done)
        await stored.wait()
        assert stored.errors == [None]
        await until(lambda: len(got) == len(bodies), "every single publish on the other node")
        assert {m.id: (m.body, m.origin) for m in got} == {
            message_id: (body, "mqks") for message_id, body in zip(sent, bodies, strict=True)}


async def test_a_publishers_own_id_reaches_the_other_node_as_it_is_or_as_json(nats_cluster: NatsCluster) -> None:
    """The id an MQKS publisher chose goes as a header of its own when it is plain ASCII, inside the engine
    headers' JSON otherwise (or beside other headers): the other node's consumer sees it the same way."""
    topic, queue = name("chosen"), name("its-queue")
    ids = [b"r-17", b"r\xc3\xa9 \r\n", b"plain"]
    async with node(nats_cluster) as a, node(nats_cluster) as b:
        _, got = b.consumer(queue, topic)
        await attached(b, queue)
        a.engine.publish_many(topic, [b"one", b"two", b"three"], each_publisher_id=ids,
                              each_headers=[{}, {}, {"kind": "own"}])
        stored = Stored()
        a.engine.storage.sync(stored.done)
        await stored.wait()
        await until(lambda: len(got) == 3, "the three on the other node")
        assert [m.headers for m in got] == [{PUBLISHER_ID_HEADER: "r-17"}, {PUBLISHER_ID_HEADER: "ré \r\n"},
                                            {"kind": "own", PUBLISHER_ID_HEADER: "plain"}]
        kept = [msg.headers or {} for msg, _ in await direct_get(a.link.connection, api.topic_stream(topic),
                                                                 {"seq": 1, "batch": 3}, topic)]
        assert [(api.HEADER_POLYMQ_PUBLISHER in h, api.HEADER_POLYMQ_HEADERS in h) for h in kept] == [
            (True, False), (False, True), (False, True)]
        assert [api.HEADER_MSG_ID in h for h in kept] == [True, False, False]  # the others' ids from the batch's


async def test_one_message_dead_lettered_again_into_one_topic_is_another_letter(nats_cluster: NatsCluster) -> None:
    """A letter keeps its message's id; its key names its queue and when, so the message dead-lettered again
    into the same topic within JetStream's de-duplication window (by another queue here; its letters requeued
    is the other way) is another letter (it was taken for a repeat: answered stored, its copy gone, no letter)."""
    topic, dead = name("poisoned"), name("letters")
    queues = [name("first"), name("second")]
    async with node(nats_cluster) as a, node(nats_cluster) as b:
        options = {DEAD_LETTER_TOPIC_OPTION: dead}
        consumers = [a.consumer(queue, topic, options=options) for queue in queues]
        reader = name("reader")
        letters_reader, letters = b.consumer(reader, dead)
        await attached(b, reader)
        for queue in queues:
            await attached(a, queue)
        message_id, stored = a.publish(topic, b"poison")
        await stored.wait()
        await until(lambda: all(got for _, got in consumers), "the message in both queues")
        for count, (queue, (_, got)) in enumerate(zip(queues, consumers, strict=True), 1):
            assert a.engine.queues[queue].dead_letter(got[0].id).name == "OK"
            await until(lambda count=count: len(letters) == count, f"the letter of {queue}")
            letter = letters[-1]
            assert (letter.id, letter.body, letter.headers[DEAD_LETTER_QUEUE_HEADER]) == (message_id, b"poison",
                                                                                           queue)
            assert letters_reader.finish(letter.id).name == "OK"  # read and done: the next one is no twin of it


async def _letters_kept(node_: Node, queue: str) -> int:
    """How many letters the queue's dead-letter topic's stream keeps in the cluster."""
    dead_stream = api.topic_stream(queue + DEAD_LETTER_SUFFIX)
    try:
        return int((await api.api(node_.link.connection, f"STREAM.INFO.{dead_stream}"))["state"]["messages"])
    except api.JetStreamError as error:
        assert error.err_code == api.ERR_STREAM_NOT_FOUND  # none made yet
        return 0


async def _three_letters(a: Node, b: Node, topic: str, queue: str) -> tuple[Consumer, list[Message], list[int]]:
    """Three jobs published through A and dead-lettered there; the queue's consumer, what it got, the jobs' ids,
    once the three letters are in the cluster and node B knows the queue."""
    consumer, got = a.consumer(queue, topic)
    await attached(a, queue)
    sent = []
    for number in range(3):
        message_id, stored = a.publish(topic, b"job %d" % number)
        sent.append(message_id)
    await stored.wait()
    await until(lambda: len(got) == 3, "the three jobs")
    for message in got:
        assert a.engine.queues[queue].dead_letter(message.id).name == "OK"
    with trio.fail_after(DEADLINE_S):
        while await _letters_kept(b, queue) != 3:
            await trio.sleep(0.05)
    await until(lambda: queue in b.engine.queues, "the queue on the other node")
    return consumer, got, sent


async def test_a_queues_dead_letters_go_back_to_it_through_another_node_each_once(
        nats_cluster: NatsCluster) -> None:
    """Letters a node made, requeued through another node: each message back in the queue once (its id, body,
    no dead-letter headers, attempts afresh), stored before the letters are purged from their stream."""
    topic, queue = name("jobs"), name("worker")
    async with node(nats_cluster) as a, node(nats_cluster) as b:
        consumer, got, sent = await _three_letters(a, b, topic, queue)
        queue_on_b = b.engine.queues[queue]
        assert isinstance(queue_on_b, SharedQueue)
        # The admin API's action on node B: an answer that waits for the cluster.
        admin = AdminApi(b.engine, dict, AdminAccess(None))
        later = GatewayHttpApi(b.engine, admin.routes()).handle(
            Request("POST", "/api/queue/requeue-dead", f"queue={queue}".encode(), headers=(HOST,)))
        assert isinstance(later, Later)
        answer = await later.run()
        assert (answer.status, json.loads(answer.body)) == (200, {"queue": queue, "moved": 3, "left": 0})
        assert await _letters_kept(b, queue) == 0
        await until(lambda: len(got) == 6, "the three back in the queue")
        assert sorted((m.id, m.body, m.attempts, m.headers) for m in got[3:]) == [
            (message_id, b"job %d" % number, 1, None) for number, message_id in enumerate(sent)]
        for message in got[3:]:
            assert consumer.finish(message.id).name == "OK"
        assert await b.link.requeue_dead(queue_on_b) == Requeued(0, 0)


async def test_a_requeue_holds_its_bytes_of_letters_and_leaves_the_rest_for_the_next(
        nats_cluster: NatsCluster, monkeypatch: pytest.MonkeyPatch) -> None:
    """With room for less than one letter a request, each request moves one, the first in the stream, purges
    only it and says how many it left; the third moves the last."""
    monkeypatch.setattr(jetstream_dead_letters, "MAX_REQUEUE_BYTES", 1)
    topic, queue = name("jobs"), name("worker")
    async with node(nats_cluster) as a, node(nats_cluster) as b:
        _, got, sent = await _three_letters(a, b, topic, queue)
        queue_on_b = b.engine.queues[queue]
        assert isinstance(queue_on_b, SharedQueue)
        for left in (2, 1, 0):
            assert await b.link.requeue_dead(queue_on_b) == Requeued(1, left)
            assert await _letters_kept(b, queue) == left
            await until(lambda left=left: len(got) == 6 - left, "one more back in the queue")
            assert got[-1].id == sent[2 - left]  # in the stream's order
        assert await b.link.requeue_dead(queue_on_b) == Requeued(0, 0)


async def test_a_message_published_on_one_node_is_consumed_on_the_other_once(nats_cluster: NatsCluster) -> None:
    topic, queue = name("orders"), name("billing")
    async with node(nats_cluster) as a, node(nats_cluster) as b:
        assert a.engine.node != b.engine.node
        consumer, got = b.consumer(queue, topic)
        await attached(b, queue)
        sent = []
        before_ns = time.time_ns()
        for index in range(20):
            message_id, stored = a.publish(topic, b"order %d" % index)
            sent.append(message_id)
        await stored.wait()
        assert stored.errors == [None]
        await until(lambda: len(got) == 20, "20 deliveries on the other node")
        assert [m.body for m in got] == [b"order %d" % i for i in range(20)]
        assert [m.id for m in got] == sent
        # A first publish carries its id as its Nats-Msg-Id alone; its time is when the cluster stored it.
        (first, _), = await direct_get(a.link.connection, api.topic_stream(topic), {"seq": 1, "batch": 1}, topic)
        assert first.headers is not None and first.headers[api.HEADER_MSG_ID] == str(sent[0])
        assert [header for header in first.headers if not header.startswith("Nats-")] == []
        assert all(before_ns <= m.timestamp_ns <= time.time_ns() for m in got)
        assert {m.attempts for m in got} == {1}
        assert {m.topic for m in got} == {topic}
        for message in got:
            assert consumer.finish(message.id).name == "OK"
        info = {}

        async def settled() -> None:
            info.update(await api.consumer_info(b.link.connection, topic, api.queue_consumer(queue)))

        with trio.fail_after(DEADLINE_S):
            while True:
                await settled()
                if info["num_ack_pending"] == 0 and info["num_pending"] == 0:
                    break
                await trio.sleep(0.05)
        assert info["delivered"]["stream_seq"] == 20


async def test_a_topic_keeps_its_backlog_for_its_first_queue_only(nats_cluster: NatsCluster) -> None:
    topic, first, second = name("backlog"), name("first"), name("second")
    async with node(nats_cluster) as a, node(nats_cluster) as b:
        for index in range(3):
            _, stored = a.publish(topic, b"early %d" % index)
        await stored.wait()
        _, got_first = b.consumer(first, topic)
        await attached(b, first)
        await until(lambda: len(got_first) == 3, "the backlog in the first queue")
        _, got_second = a.consumer(second, topic)
        await attached(a, second)
        _, stored = a.publish(topic, b"late")
        await until(lambda: len(got_first) == 4 and len(got_second) == 1, "the later message in both queues")
        assert [m.body for m in got_first] == [b"early 0", b"early 1", b"early 2", b"late"]
        assert [m.body for m in got_second] == [b"late"]


async def test_a_requeue_with_a_delay_comes_back_after_it_with_its_attempts_counted(nats_cluster: NatsCluster) -> None:
    topic, queue = name("retry"), name("worker")
    async with node(nats_cluster) as a:
        consumer, got = a.consumer(queue, topic)
        await attached(a, queue)
        a.publish(topic, b"again")
        await until(lambda: len(got) == 1, "the first delivery")
        requeued_at = trio.current_time()
        assert consumer.requeue(got[0].id, 0.5).name == "OK"
        await until(lambda: len(got) == 2, "the delivery after the delay")
        assert trio.current_time() - requeued_at >= 0.45
        assert got[1].id == got[0].id and got[1].body == b"again"
        assert [m.attempts for m in got] == [1, 2]
        consumer.finish(got[1].id)


async def test_a_timed_out_delivery_goes_to_a_consumer_on_the_other_node(nats_cluster: NatsCluster) -> None:
    topic, queue = name("slow"), name("jobs")
    async with node(nats_cluster) as a, node(nats_cluster) as b:
        a.engine.ensure_queue(queue)
        a.engine.bind(queue, topic)
        got_a: list[Message] = []
        slow = a.engine.attach(queue, got_a.append, credit=1, msg_timeout=0.5)
        await attached(a, queue)
        a.publish(topic, b"job")
        await until(lambda: len(got_a) == 1, "the delivery on the slow node")
        slow.set_credit(0)  # it takes nothing more: the job can only go to the other node
        consumer_b, got_b = b.consumer(queue, topic)
        await attached(b, queue)
        await until(lambda: len(got_b) == 1, "the timed-out job on the other node")
        assert got_b[0].id == got_a[0].id
        assert got_b[0].attempts == 2
        assert slow.timeout_count == 1
        consumer_b.finish(got_b[0].id)


async def test_an_ack_by_id_on_the_other_node_finishes_the_delivery(nats_cluster: NatsCluster) -> None:
    topic, queue = name("phpmq"), name("Foo")
    async with node(nats_cluster) as a, node(nats_cluster) as b:
        consumer, got = a.consumer(queue, topic)
        await attached(a, queue)
        a.publish(topic, b"ack me elsewhere")
        await until(lambda: len(got) == 1, "the delivery")
        b.engine.ensure_queue(queue)
        b.engine.bind(queue, topic)
        remote = b.engine.queues[queue]
        assert isinstance(remote, SharedQueue)
        assert remote.finish_any(got[0].id).name == "OK"
        await until(lambda: not consumer.in_flight, "the forwarded ack on the node holding the delivery")
        assert a.link.forwarded_acks == 1
        assert consumer.finish_count == 1 and a.engine.queues[queue].finished_count == 1


async def test_max_attempts_moves_the_message_to_its_dead_letter_topic(nats_cluster: NatsCluster) -> None:
    topic, queue = name("mail"), name("sender")
    async with node(nats_cluster) as a, node(nats_cluster) as b:
        consumer, got = a.consumer(queue, topic, options={MAX_ATTEMPTS_OPTION: 2})
        await attached(a, queue)
        _, letters = b.consumer(name("dead-reader"), queue + ".dead")
        message_id, _ = a.publish(topic, b"undeliverable", headers={"msg_id": "m-1"})
        await until(lambda: len(got) == 1, "the first delivery")
        consumer.requeue(got[0].id)
        await until(lambda: len(got) == 2, "the second delivery")
        consumer.requeue(got[1].id)
        await until(lambda: len(letters) == 1, "the dead letter on the other node")
        letter = letters[0]
        assert (letter.id, letter.body) == (message_id, b"undeliverable")
        assert letter.headers == {"msg_id": "m-1", DEAD_LETTER_QUEUE_HEADER: queue,
                                  DEAD_LETTER_REASON_HEADER: "max attempts"}
        stream, consumer_name = api.topic_stream(topic), api.queue_consumer(queue)

        async def left_the_queue() -> bool:
            info = await api.api(a.link.connection, f"CONSUMER.INFO.{stream}.{consumer_name}")
            return info["num_ack_pending"] == 0 and info["num_pending"] == 0 and info["num_redelivered"] == 0

        with trio.fail_after(DEADLINE_S):
            while not await left_the_queue():
                await trio.sleep(0.05)


async def test_a_dead_nodes_deliveries_go_to_the_other_node_after_the_ack_wait(nats_cluster: NatsCluster) -> None:
    topic, queue = name("crash"), name("survivors")
    async with node(nats_cluster, ack_wait_s=1.0) as b:
        async with node(nats_cluster, ack_wait_s=1.0) as a:
            _, got_a = a.consumer(queue, topic)
            await attached(a, queue)
            for index in range(5):
                a.publish(topic, b"held %d" % index)
            await until(lambda: len(got_a) == 5, "five deliveries on the node that dies")
            a.cancel.cancel()  # the node stops without a word: no NAK, no ACK
        consumer_b, got_b = b.consumer(queue, topic)
        await until(lambda: len(got_b) == 5, "the dead node's deliveries on the other node")
        assert sorted(m.body for m in got_b) == [b"held %d" % i for i in range(5)]
        assert {m.attempts for m in got_b} == {2}
        for message in got_b:
            consumer_b.finish(message.id)


async def test_a_message_over_the_servers_max_payload_is_refused_and_holds_up_nothing(
        nats_cluster: NatsCluster) -> None:
    topic = name("big")
    async with node(nats_cluster) as a:
        _, too_big = a.publish(topic, b"x" * (9 << 20))  # the servers take 8 MB
        _, fine = a.publish(topic, b"small")
        await too_big.wait()
        await fine.wait()
        [error] = too_big.errors
        assert isinstance(error, OSError) and "max_payload" in str(error)
        # The sync after the small one waited for the refused one before it, but carries no error of it.
        assert fine.errors == [None]
        _, after = a.publish(topic, b"after")
        await after.wait()
        assert after.errors == [None]


async def test_a_phpmq_clients_publish_to_another_queue_is_delivered_only_after_its_earlier_ones_are_stored(
        nats_cluster: NatsCluster) -> None:
    """A PHPMQ publisher proves a batch handled by a marker it publishes after it to a queue of its own:
    the batch's topic here has no stream yet, so its publish waits for the stream while the marker's
    topic could take a publish at once."""
    batch, markers, watched = name("batch"), name("markers"), name("watched")
    async with node(nats_cluster) as a, node(nats_cluster) as b:
        seen: list[tuple[bytes, bool]] = []
        batch_stored = Stored()
        b.engine.ensure_queue(watched)
        b.engine.bind(watched, markers)
        b.engine.attach(watched, lambda message: seen.append((message.body, batch_stored.event.is_set())),
                        credit=10, msg_timeout=30.0)
        await attached(b, watched)
        _, warmed = a.publish(markers, b"the marker topic's stream known on node a")
        await warmed.wait()
        php = Client("phpmq", "127.0.0.1:5000", publishes_in_order=True)
        a.engine.publish(batch, b"batch", client=php)
        a.engine.storage.sync(batch_stored.done)
        a.engine.publish(markers, b"marker", client=php)
        await until(lambda: len(seen) == 2, "the marker on the other node")
        assert seen[1] == (b"marker", True)
        assert batch_stored.errors == [None]


async def test_a_deferred_publish_reaches_the_queues_when_it_is_due_with_its_first_attempt(
        nats_cluster: NatsCluster) -> None:
    topic, queue = name("dpub"), name("later")
    async with node(nats_cluster) as a, node(nats_cluster) as b:
        _, got = b.consumer(queue, topic)
        await attached(b, queue)
        published_at = trio.current_time()
        message_id, stored = a.publish(topic, b"in a second", delay=1.0)
        a.publish(topic, b"now")
        await stored.wait()
        assert stored.errors == [None]
        await until(lambda: len(got) == 2, "the deferred message")
        arrived_at = trio.current_time()
        assert [m.body for m in got] == [b"now", b"in a second"]
        assert got[1].id == message_id and got[1].attempts == 1
        assert got[1].timestamp_ns < got[0].timestamp_ns  # the time of its publish, not of its move
        assert arrived_at - published_at >= 0.95  # never before it is due
        assert b.link.deferred.moved + a.link.deferred.moved == 1


async def test_depths_follow_publishes_bindings_and_empties_and_an_unpaused_queue_delivers(
        nats_cluster: NatsCluster) -> None:
    topic, queue = name("depths"), name("counted")
    async with node(nats_cluster) as a:
        for index in range(3):
            _, stored = a.publish(topic, b"kept %d" % index)
        await stored.wait()
        assert a.engine.topics[topic].depth == 3  # kept for the topic's first queue
        a.engine.ensure_queue(queue)
        a.engine.bind(queue, topic)
        shared = a.engine.queues[queue]
        assert (a.engine.topics[topic].depth, shared.depth) == (0, 3)
        shared.set_paused(True)
        got: list[Message] = []
        a.engine.attach(queue, got.append, credit=10, msg_timeout=30.0)
        await attached(a, queue)
        assert got == []  # paused: nothing is fetched
        shared.set_paused(False)
        await until(lambda: len(got) == 3, "the deliveries after the unpause")
        assert [m.body for m in got] == [b"kept 0", b"kept 1", b"kept 2"]
        assert shared.message_count == 3


async def test_a_queue_paused_on_one_node_delivers_on_no_node_until_unpaused(nats_cluster: NatsCluster) -> None:
    topic, queue = name("paused"), name("held")
    async with node(nats_cluster) as a, node(nats_cluster) as b:
        _, got = b.consumer(queue, topic)
        await attached(b, queue)
        a.engine.ensure_queue(queue)
        a.engine.bind(queue, topic)
        await attached(a, queue)
        a.engine.queues[queue].set_paused(True)
        await until(lambda: b.engine.queues[queue].paused, "the pause on the other node")
        _, stored = a.publish(topic, b"held back")
        await stored.wait()
        await trio.sleep(0.5)  # a delivery a broken pause let through would show here (it cannot fail the other way)
        assert got == []
        a.engine.queues[queue].set_paused(False)
        await until(lambda: len(got) == 1, "the delivery after the unpause on the other node")
        assert got[0].body == b"held back"


async def test_a_delivery_held_past_the_ack_wait_stays_with_its_consumer(nats_cluster: NatsCluster) -> None:
    """The node's own timeout (PZQ's ack timeout, NSQ's msg_timeout) decides when a held delivery goes
    back, not JetStream's ack wait: the node reports it worked on, and no other node gets it."""
    topic, queue = name("long"), name("held")
    async with node(nats_cluster, ack_wait_s=1.0) as a, node(nats_cluster, ack_wait_s=1.0) as b:
        _, got_a = a.consumer(queue, topic)  # its msg_timeout is 30 s
        await attached(a, queue)
        _, got_b = b.consumer(queue, topic)
        await attached(b, queue)
        a.publish(topic, b"a long job")
        await until(lambda: len(got_a) + len(got_b) == 1, "the delivery")
        holder, other = (a, b) if got_a else (b, a)
        await until(lambda: holder.link.progress_reports >= 3, "three reports: past twice the ack wait")
        assert len(got_a) + len(got_b) == 1, "delivered again while its consumer held it"
        assert holder.engine.queues[queue].stale_count == 0
        assert other.engine.queues[queue].fetched_count == 0


async def test_a_copy_fetched_for_a_slot_another_queue_took_waits_without_an_attempt_more(
        nats_cluster: NatsCluster) -> None:
    """An eMQP worker's one free slot serves two queues: each fetches for it, one copy is delivered and the
    other waits on the node for the next slot, its attempt count untouched (never given back unseen)."""
    urgent, normal = name("urgent"), name("normal")
    async with node(nats_cluster) as a:
        pool = CreditPool()
        got: list[Message] = []
        for queue in (urgent, normal):
            a.engine.ensure_queue(queue)
            a.engine.bind(queue, queue)
            a.engine.attach(queue, got.append, mode=CreditMode.TOKENS, pool=pool)
            await attached(a, queue)
        for queue in (urgent, normal):
            _, stored = a.publish(queue, b"job of " + queue.encode())
            await stored.wait()
        pool.add(1)
        await until(lambda: len(got) == 1 and sum(len(a.engine.queues[q].ready) for q in (urgent, normal)) == 1,
                    "one job delivered, the other fetched and waiting")
        pool.add(1)
        await until(lambda: len(got) == 2, "the waiting job at the next slot")
        assert sorted(m.body for m in got) == sorted([b"job of " + urgent.encode(), b"job of " + normal.encode()])
        assert [m.attempts for m in got] == [1, 1]


async def test_a_copy_held_where_no_consumer_has_room_goes_to_another_nodes_consumer_without_an_attempt(
        nats_cluster: NatsCluster) -> None:
    """A node's consumer that keeps no credit (NSQ's RDY 0, a PZQ send socket with no peer) while the cluster
    still brings what its pull requests asked for: the copy waits on the node for the hold, then goes back,
    unseen, and another node's consumer gets it as a first delivery."""
    topic, queue = name("no-room"), name("no-room")
    async with node(nats_cluster) as a, node(nats_cluster) as b:
        stalled, held = b.consumer(queue, topic)
        await attached(b, queue)
        stalled.set_credit(0)  # its pull requests stay with the cluster until they end
        _, stored = a.publish(topic, b"for whoever has room")
        await stored.wait()
        shared = b.engine.queues[queue]
        assert isinstance(shared, SharedQueue)
        await until(lambda: len(shared.ready) == 1, "the copy fetched by B, waiting there")
        consumer, got = a.consumer(queue, topic)
        await until(lambda: len(got) == 1, "the copy given back by B, delivered by A")
        assert (got[0].body, got[0].attempts) == (b"for whoever has room", 1)
        assert held == [] and len(shared.ready) == 0
        consumer.finish(got[0].id)


async def test_copies_of_one_message_in_two_queues_go_back_unseen_and_both_are_delivered(
        nats_cluster: NatsCluster) -> None:
    """Two queues of one topic hold their copies of a message where no consumer has room, and give them back in
    turn: each copy goes back to its own queue (one stream holds both: the second put back is no repeat of the
    first)."""
    topic, queues = name("shared-stream"), [name("channel"), name("worker")]
    async with node(nats_cluster) as a, node(nats_cluster) as b:
        held = []
        for queue in queues:
            stalled, got = b.consumer(queue, topic)
            await attached(b, queue)
            stalled.set_credit(0)  # its pull request stays with the cluster and brings the copy
            held.append(got)
        _, stored = a.publish(topic, b"one for each")
        await stored.wait()
        shared = [b.engine.queues[queue] for queue in queues]
        await until(lambda: all(len(queue.ready) == 1 for queue in shared), "both copies fetched by B, waiting")
        for queue in shared:
            assert isinstance(queue, SharedQueue)
            queue.give_back()
            _, got = a.consumer(queue.name, topic)
            await until(lambda got=got: len(got) == 1, "the copy given back by B, delivered by A")
            assert (got[0].body, got[0].attempts) == (b"one for each", 1)
        assert held == [[], []]


async def test_copies_of_one_message_in_two_queues_requeued_to_their_tails_both_come_back(
        nats_cluster: NatsCluster) -> None:
    topic, first, second = name("tails"), name("Foo"), name("Bar")
    async with node(nats_cluster) as a:
        consumers = [a.consumer(queue, topic) for queue in (first, second)]
        for queue in (first, second):
            await attached(a, queue)
        _, stored = a.publish(topic, b"again in both")
        await stored.wait()
        await until(lambda: all(len(got) == 1 for _, got in consumers), "the message in both queues")
        for queue, (_, got) in zip((first, second), consumers, strict=True):
            shared = a.engine.queues[queue]
            assert isinstance(shared, SharedQueue)
            assert shared.requeue_to_tail(got[0].id, 100.0).name == "OK"
        await until(lambda: all(len(got) == 2 for _, got in consumers), "the requeued copy in each queue")
        again = [got[1] for _, got in consumers]
        assert [message.attempts for message in again] == [2, 2]
        # Each came by its queue's tail (its TTL new), not given back to where it was.
        assert all(message.expires_at is not None and message.expires_at > a.engine.clock.now() + 90
                   for message in again)


async def test_a_requeue_to_the_tail_comes_after_the_others_with_its_attempts_and_new_ttl(
        nats_cluster: NatsCluster) -> None:
    """PHPMQ's 005: the message again at the tail of this queue only, its attempts kept, its TTL new."""
    topic, queue, other = name("tail"), name("Foo"), name("other")
    async with node(nats_cluster) as a:
        consumer, got = a.consumer(queue, topic)
        _, others = a.consumer(other, topic)
        await attached(a, queue)
        await attached(a, other)
        for body in (b"a", b"b"):
            _, stored = a.publish(topic, body)
            await stored.wait()
        await until(lambda: len(got) == 2 and len(others) == 2, "both messages in both queues")
        shared = a.engine.queues[queue]
        assert isinstance(shared, SharedQueue)
        assert shared.requeue_to_tail(got[0].id, 100.0).name == "OK"
        consumer.finish(got[1].id)
        await until(lambda: len(got) == 3, "the requeued message again")
        again = got[2]
        assert (again.id, again.body, again.attempts) == (got[0].id, b"a", 2)
        assert again.expires_at is not None and again.expires_at > a.engine.clock.now() + 90
        consumer.finish(again.id)
        assert len(others) == 2  # the other queue of the topic got no copy of it


async def test_two_stored_copies_of_one_message_are_delivered_once(nats_cluster: NatsCluster) -> None:
    """A node that put a delivery back at the queue's tail and ended before it acknowledged that delivery
    leaves two stored copies of one message; a node that fetches both delivers one and discards the other."""
    topic, queue = name("twins"), name("twins")
    async with node(nats_cluster) as a:
        consumer, got = a.consumer(queue, topic, credit=0)
        await attached(a, queue)
        message_id, stored = a.publish(topic, b"one job")
        await stored.wait()
        shared = a.engine.queues[queue]
        assert isinstance(shared, SharedQueue)
        # The copy at the tail, as the node that held the delivery stored it; that delivery's ack never sent.
        a.link.requeue_to_tail(shared, Message(message_id, b"one job", 0, attempts=1, topic=topic))
        consumer.set_credit(10)
        await until(lambda: shared.fetched_count == 2, "both copies fetched")
        assert [m.body for m in got] == [b"one job"] and shared.twin_count == 1
        consumer.finish(message_id)

        async def left() -> tuple[int, int]:
            info = await api.consumer_info(a.link.connection, topic, api.queue_consumer(queue))
            return int(info["num_pending"]), int(info["num_ack_pending"])

        with trio.fail_after(DEADLINE_S):
            while await left() != (0, 0):
                await trio.sleep(0.05)
        assert len(got) == 1



async def _consumer_state(at: Node, topic: str, queue: str) -> tuple[str | None, int]:
    """The server leading the queue's consumer, and the pull requests waiting there."""
    info = await api.consumer_info(at.link.connection, topic, api.queue_consumer(queue))
    return info.get("cluster", {}).get("leader"), int(info.get("num_waiting", 0))


async def test_a_queue_whose_consumer_elects_a_leader_asks_again_at_a_pace(nats_cluster: NatsCluster) -> None:
    """A SIGKILL of the server a node is connected to, which also leads a queue's consumer: the node
    reconnects and asks for messages while the consumer has no leader, and JetStream answers each request
    at once with 503. The node asks again every PULL_RETRY_S, not in a loop as fast as the link, and the
    queue goes on once a leader is elected."""
    topic, queue = name("electing"), name("electing")
    async with node(nats_cluster) as a, node(nats_cluster) as b:
        consumer, got = b.consumer(queue, topic)
        await attached(b, queue)
        target = nats_cluster.server_at(b.link.connection.connected_url).name
        stepdown = f"CONSUMER.LEADER.STEPDOWN.{api.topic_stream(topic)}.{api.queue_consumer(queue)}"
        with trio.fail_after(DEADLINE_S):  # the consumer led by the server b talks to, b's pulls waiting there
            while (state := await _consumer_state(b, topic, queue))[0] != target or state[1] == 0:
                if state[0] not in (target, None):
                    with contextlib.suppress(api.JetStreamError):  # the preferred server not caught up yet
                        await api.api(b.link.connection, stepdown, {"placement": {"preferred": target}})
                await trio.sleep(0.05)
        [puller] = b.link.pullers[queue]
        leader = next(server for server in nats_cluster.servers if server.name == target)
        requests_before, killed_at = puller.counter, trio.current_time()
        leader.kill()
        try:
            message_id, stored = a.publish(topic, b"while a leader is elected")
            await stored.wait()
            assert stored.errors == [None]
            await until(lambda: [m.id for m in got] == [message_id], "the message published after the kill")
            consumer.finish(message_id)
            asked = puller.counter - requests_before
            paced = (trio.current_time() - killed_at) / PULL_RETRY_S
            assert asked <= paced + 10, f"{asked} pull requests in {paced:.0f} retry periods"
        finally:
            leader.start()
            await trio.to_thread.run_sync(nats_cluster.wait_ready)


async def test_a_pull_request_that_never_hears_its_end_is_let_go_and_asked_again(nats_cluster: NatsCluster) -> None:
    """A pull request holds its share of the consumers' credit until JetStream says it ended; one lost on the
    way (a link that died unseen, a server that forgot it) hears nothing: past its lifetime the node asks
    again, and the queue delivers."""
    topic, queue = name("lost-pull"), name("waits")
    async with node(nats_cluster) as a:
        connection = a.link.connection
        publish = connection.publish
        lose = [True]

        def losing(subject: str, payload: bytes, **kwargs: object) -> None:
            if lose[0] and subject.startswith("$JS.API.CONSUMER.MSG.NEXT."):
                return  # sent, as far as the node knows, and lost
            publish(subject, payload, **kwargs)  # type: ignore[arg-type]

        connection.publish = losing  # type: ignore[method-assign]
        _, got = a.consumer(queue, topic, credit=1)
        await attached(a, queue)
        [puller] = a.link.pullers[queue]
        assert puller.outstanding == 1  # the node's whole credit, in a request JetStream never had
        lose[0] = False
        _, stored = a.publish(topic, b"after the loss")
        await stored.wait()
        await until(lambda: len(got) == 1, "the delivery once the lost request was let go")
        assert got[0].body == b"after the loss" and a.link.lost_pulls >= 1
