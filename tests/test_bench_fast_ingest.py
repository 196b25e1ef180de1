"""The bench's fast-ingest publisher on a real nats-server: every message stored once, in order, with the
publisher never more than its two flow acks' worth ahead of the server; a stream that does not allow fast
batches refuses the first message, and the publisher says so instead of waiting."""

from __future__ import annotations

import pytest
import trio

from polymq.bench import fast_ingest
from polymq.jetstream import api
from polymq.jetstream.nats_connection import NatsConnection, NatsOptions

from support.nats_cluster import NatsServer

FLOW = 100
MESSAGES = 1_150  # eleven flow acks and a part
STREAM = api.topic_stream("fast")


async def _connected(server: NatsServer, nursery: trio.Nursery, *, allow: bool) -> NatsConnection:
    connection = await NatsConnection.connect(NatsOptions([server.url], name="fast-ingest-test"), nursery)
    await api.ensure_stream(connection, "fast", api.StreamSettings(replicas=1))
    # A topic's stream keeps what a consumer has yet to take: one that takes nothing keeps everything.
    await api.ensure_consumer(connection, "fast", "keeper", api.consumer_config(
        "keeper", topic="fast", ack_wait_s=60.0, start_seq=0))
    if allow:
        await fast_ingest.allow(connection, "fast")
    return connection


async def _body_at(connection: NatsConnection, seq: int) -> bytes:
    reply = await connection.request(f"$JS.API.DIRECT.GET.{STREAM}", b'{"seq": %d}' % seq)
    return reply.payload


async def test_a_fast_batch_stores_every_message_in_order_keeping_within_its_window(nats_server: NatsServer) -> None:
    async with trio.open_nursery() as nursery:
        connection = await _connected(nats_server, nursery, allow=True)
        batch = fast_ingest.FastBatch(connection, api.topic_subject("fast"), flow=FLOW)
        ahead = []
        for number in range(MESSAGES - 1):
            await batch.add(b"message %d" % number)
            ahead.append(batch.sent - batch.stored)
        assert await batch.commit(b"message %d" % (MESSAGES - 1)) == MESSAGES
        assert batch.every == FLOW  # alone on its stream, the batch gets the flow it asked for
        assert max(ahead) <= fast_ingest.OUTSTANDING * FLOW
        assert max(ahead) > FLOW  # it did not wait for every ack: the next group went while one was stored
        state = (await api.api(connection, f"STREAM.INFO.{STREAM}"))["state"]
        assert (state["messages"], state["first_seq"], state["last_seq"]) == (MESSAGES, 1, MESSAGES)
        for seq in (1, FLOW, FLOW + 1, MESSAGES):
            assert await _body_at(connection, seq) == b"message %d" % (seq - 1)
        await connection.close()
        nursery.cancel_scope.cancel()


async def test_a_stream_without_fast_batches_refuses_the_first_message(nats_server: NatsServer) -> None:
    async with trio.open_nursery() as nursery:
        connection = await _connected(nats_server, nursery, allow=False)
        batch = fast_ingest.FastBatch(connection, api.topic_subject("fast"))
        with pytest.raises(fast_ingest.FastIngestError, match="batch publish is disabled"):
            await batch.add(b"first")
        state = (await api.api(connection, f"STREAM.INFO.{STREAM}"))["state"]
        assert state["messages"] == 0
        await connection.close()
        nursery.cancel_scope.cancel()
