"""MQKS and NSQ on one engine (docs/architecture.md): both directions, both drop rules,
bodies MQKS cannot carry verbatim. One gateway for the module; names are unique per test.
"""

from __future__ import annotations

import base64
import re
import urllib.request

from polymq.clients.stream import StreamClient
from polymq.codecs import nsq_client, stream_rows
from polymq.codecs.mqks import ENCODED_PREFIX
from polymq.codecs.mqks_client import parse_delivery, parse_response

from support.gateway import GatewayProcess
from support.mqks_wire import MQKSWire
from support.nsq_wire import RawClient, consumer


def mqks(gateway: GatewayProcess) -> MQKSWire:
    return MQKSWire(gateway.host_port("mqks"))


def nsq_pub(gateway: GatewayProcess, topic: str, *bodies: bytes) -> None:
    with RawClient(gateway.nsq_tcp) as conn:
        for body in bodies:
            conn.send(nsq_client.pub(topic, body))
            conn.expect_response(b"OK")


def test_mqks_publish_reaches_nsq_channels_of_the_same_topic(module_gateway: GatewayProcess) -> None:
    gw = module_gateway
    with consumer(gw.nsq_tcp, "x_orders", "billing", rdy=10) as billing, \
            consumer(gw.nsq_tcp, "x_orders", "audit", rdy=10) as audit, mqks(gw) as client:
        client.send(b"m1 publish --confirm x_orders order 1 with spaces")
        assert client.line() == b"m1 ok "
        for nsq_consumer in (billing, audit):  # each channel is a queue of its own: one copy each
            message = nsq_consumer.read_message()
            assert (message.body, message.attempts) == (b"order 1 with spaces", 1)
            nsq_consumer.send(nsq_client.fin(message.msg_id))


def test_nsq_publish_reaches_mqks_queues_bound_to_that_event(module_gateway: GatewayProcess) -> None:
    gw = module_gateway
    with mqks(gw) as client:
        client.send(b"c1 consume --confirm x-q1 x_events x_other --manual-ack")
        assert client.line() == b"c1 ok "
        nsq_pub(gw, "x_events", b"from nsq")
        reply = parse_response(client.line())
        delivery = parse_delivery(reply.data)
        # No publisher msg_id: the engine id as NSQ shows it (16 hex digits), the topic as the event.
        assert reply.request_id == "c1" and len(delivery.msg_id) == 16 and int(delivery.msg_id, 16) > 0
        assert (delivery.event, delivery.retry, delivery.body) == ("x_events", 0, b"from nsq")
        client.send(f"r1 reject c1 {delivery.msg_id}".encode())
        assert client.line() == f"c1 ok {delivery.msg_id} event=x_events,retry=1 from nsq".encode()
        client.send(f"a1 ack --confirm c1 {delivery.msg_id}".encode())
        assert client.line() == b"a1 ok "
        assert client.barrier() == []


def test_http_pub_and_mpub_reach_mqks(module_gateway: GatewayProcess) -> None:
    gw = module_gateway
    with mqks(gw) as client:
        client.send(b"c1 consume --confirm x-http x_http")
        assert client.line() == b"c1 ok "
        urllib.request.urlopen(f"http://{gw.nsq_http}/pub?topic=x_http", data=b"one", timeout=3).read()
        urllib.request.urlopen(f"http://{gw.nsq_http}/mpub?topic=x_http", data=b"two\nthree", timeout=3).read()
        assert [d.body for d in client.deliveries(3)] == [b"one", b"two", b"three"]


def test_mqks_publish_to_an_unbound_event_is_dropped_but_nsq_keeps_its_own(module_gateway: GatewayProcess) -> None:
    gw = module_gateway
    with mqks(gw) as client:
        client.send(b"m1 publish --confirm x_unbound dropped by the mqks rule")
        assert client.line() == b"m1 ok "
        nsq_pub(gw, "x_unbound", b"kept by the nsqd rule")
        # The first queue bound to the topic receives what NSQ left there, and only that.
        client.send(b"c1 consume x-late x_unbound")
        delivery = parse_delivery(parse_response(client.line()).data)
        assert (delivery.event, delivery.body) == ("x_unbound", b"kept by the nsqd rule")
        assert client.barrier() == []
    with consumer(gw.nsq_tcp, "x_unbound", "late", rdy=10) as late:
        late.expect_nothing(0.2)  # nothing left: the MQKS publish was never kept


def test_mqks_publish_to_a_topic_nsq_created_without_channels_is_dropped(module_gateway: GatewayProcess) -> None:
    gw = module_gateway
    urllib.request.urlopen(urllib.request.Request(f"http://{gw.nsq_http}/topic/create?topic=x_made", method="POST"),
                           timeout=3).read()
    with mqks(gw) as client:
        client.send(b"m1 publish --confirm x_made lost")
        assert client.line() == b"m1 ok "
    with consumer(gw.nsq_tcp, "x_made", "c", rdy=10) as nsq_consumer:
        nsq_consumer.expect_nothing(0.2)


def test_bodies_mqks_cannot_carry_verbatim_are_encoded_reversibly(module_gateway: GatewayProcess) -> None:
    gw = module_gateway
    bodies = [b"line one\nline two", b"tab\there", b"\x00\xff\xfe binary", b"trailing space ", b"cr\r\n",
              ENCODED_PREFIX + b"looks encoded", "plain unicode é ✓".encode()]
    with mqks(gw) as client:
        client.send(b"c1 consume --confirm x-enc x_enc")
        assert client.line() == b"c1 ok "
        nsq_pub(gw, "x_enc", *bodies)
        lines = client.lines(len(bodies))
        for line, body in zip(lines, bodies, strict=True):
            data = line.split(b" ", 4)[4]
            if body == "plain unicode é ✓".encode():
                assert data == body  # safe text goes verbatim
            else:
                assert data == ENCODED_PREFIX + base64.b64encode(body)
            assert parse_delivery(parse_response(line).data).body == body
        assert client.barrier() == []  # no stray line: the framing held


def test_mqks_encoded_publish_reaches_nsq_as_the_original_bytes(module_gateway: GatewayProcess) -> None:
    gw = module_gateway
    body = b"two\nlines and \x00 a NUL"
    with consumer(gw.nsq_tcp, "x_dec", "c", rdy=10) as nsq_consumer, mqks(gw) as client:
        client.send(b"m1 publish --confirm x_dec " + ENCODED_PREFIX + base64.b64encode(body))
        assert client.line() == b"m1 ok "
        assert nsq_consumer.read_message().body == body
        client.send(b"m2 publish x_dec " + ENCODED_PREFIX + b"not base64!")
        assert parse_response(client.line()).ok is False
        nsq_consumer.expect_nothing(0.2)


def test_a_publish_reaches_nsq_and_mqks_queues_of_the_topic_once_each(module_gateway: GatewayProcess) -> None:
    gw = module_gateway
    with consumer(gw.nsq_tcp, "x_both", "ch", rdy=100) as nsq_consumer, mqks(gw) as one, mqks(gw) as two:
        one.send(b"c1 consume --confirm x-both-q x_both")
        two.send(b"c2 consume --confirm x-both-q x_both")
        assert (one.line(), two.line()) == (b"c1 ok ", b"c2 ok ")
        nsq_pub(gw, "x_both", *(b"n%d" % n for n in range(10)))
        with mqks(gw) as publisher:
            publisher.send(b"\n".join(b"m%d publish x_both q%d" % (n, n) for n in range(10)))
            assert publisher.barrier() == []
        got_nsq = {nsq_consumer.read_message().body for _ in range(20)}
        assert got_nsq == {b"n%d" % n for n in range(10)} | {b"q%d" % n for n in range(10)}
        got_mqks = one.barrier() + two.barrier()  # the two consumers compete on the one queue
        bodies = sorted(parse_delivery(parse_response(line).data).body for line in got_mqks)
        assert bodies == sorted(got_nsq)


def test_a_stream_writer_id_a_line_cannot_carry_shows_the_engine_id(module_gateway: GatewayProcess) -> None:
    """A stream writer's row id is shown to MQKS consumers as msg_id, but only as a line carries it:
    one with a space, a newline, another control character or a Unicode line break would break the
    delivery line (a newline made two lines of one), so the engine id is shown instead."""
    ids = ["plain-id", "has space", "new\nline", "cr\rid", "tab\tid", "nul\x00id", "nel\x85id", "ls\u2028id",
           "ünïcode"]
    with mqks(module_gateway) as client, StreamClient(module_gateway.http) as writer:
        client.send(b"c1 consume --confirm x_ids_copy x_ids")
        assert client.line() == b"c1 ok "
        writer.publish([stream_rows.encode_publish_row(b"row %d" % number, message_id=row_id)
                        for number, row_id in enumerate(ids)], "x_ids")
        deliveries = [parse_delivery(parse_response(line).data) for line in client.lines(len(ids))]
        client.send(b"d1 delete_queue --confirm x_ids_copy")
        assert client.lines(2) == [b"c1 ok --update x_ids_copy", b"d1 ok "]
    assert [delivery.body for delivery in deliveries] == [b"row %d" % number for number in range(len(ids))]
    shown = [delivery.msg_id for delivery in deliveries]
    assert [shown[0], shown[-1]] == ["plain-id", "ünïcode"]
    engine_ids = shown[1:-1]
    assert all(re.fullmatch("[0-9a-f]{16}", msg_id) for msg_id in engine_ids), engine_ids
    assert engine_ids == sorted(set(engine_ids))
