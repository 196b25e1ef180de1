"""PHPMQ against a real gateway: the original's window, ack and disconnect semantics, both protocol
generations, TTL, requeue, dead letters, bad input and restarts (docs/protocols/phpmq.md)."""

from __future__ import annotations

import json
import signal
import time
import urllib.request
import uuid
from pathlib import Path

import pytest

from polymq.codecs import phpmq

from support.gateway import GatewayProcess, running_gateway
from support.phpmq_wire import PHPMQWire, queue_stats, wait_until_handed_back


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def wire(gateway: GatewayProcess) -> PHPMQWire:
    return PHPMQWire(gateway.host_port("phpmq"))


def test_a_window_of_n_holds_n_and_each_ack_lets_the_next_flow(module_gateway: GatewayProcess) -> None:
    queue = unique("win")
    with wire(module_gateway) as producer, wire(module_gateway) as consumer:
        for body in (b"one", b"two", b"three"):
            producer.publish(queue, body)
        producer.barrier()
        consumer.consume(queue, 2)
        first, second = consumer.deliveries(2)
        assert [first.content, second.content] == [b"one", b"two"]
        consumer.barrier()
        stats = queue_stats(module_gateway.nsq_http, queue)
        assert (stats["in_flight_count"], stats["depth"]) == (2, 1)
        assert consumer.nothing_more()
        consumer.ack(queue, first.message_id)
        [third] = consumer.deliveries(1)
        assert third.content == b"three"
        # The exact bytes of a delivery to a client that never showed the current generation.
        assert bytes(consumer.raw).startswith(phpmq.delivery(queue.encode(), b"one", first.message_id, None))
        assert len(first.message_id) == 32 and phpmq.parse_message_id(first.message_id) is not None


def test_a_new_consume_replaces_the_window_and_gives_back_what_it_held(module_gateway: GatewayProcess) -> None:
    queue, other = unique("repl"), unique("repl-other")
    with wire(module_gateway) as producer, wire(module_gateway) as consumer, wire(module_gateway) as rival:
        producer.publish(queue, b"a")
        producer.publish(queue, b"b")
        producer.barrier()
        consumer.consume(queue, 2)
        a, b = consumer.deliveries(2)
        consumer.consume(other, 1)  # another queue: a and b are released, ahead of newer messages
        consumer.barrier()
        producer.publish(queue, b"c")
        producer.barrier()
        rival.consume(queue, 3)
        got = rival.deliveries(3)
        assert [(d.content, d.message_id) for d in got] == [(b"a", a.message_id), (b"b", b.message_id),
                                                           (b"c", got[2].message_id)]
        producer.publish(other, b"for the replacement window")
        assert [d.content for d in consumer.deliveries(1)] == [b"for the replacement window"]


def test_a_disconnect_returns_unacknowledged_messages_to_their_place(module_gateway: GatewayProcess) -> None:
    queue = unique("disc")
    with wire(module_gateway) as producer:
        producer.publish(queue, b"first")
        producer.publish(queue, b"second")
        producer.barrier()
        with wire(module_gateway) as leaving:
            leaving.consume(queue, 2)
            held = leaving.deliveries(2)
        wait_until_handed_back(module_gateway.nsq_http, queue)
        producer.publish(queue, b"newer")
        producer.barrier()
        with wire(module_gateway) as next_one:
            next_one.consume(queue, 5)
            got = next_one.deliveries(3)
    assert [(d.content, d.message_id) for d in got[:2]] == [(d.content, d.message_id) for d in held]
    assert got[2].content == b"newer"


def test_an_ack_from_another_connection_finishes_it_and_frees_the_holder_s_slot(
        module_gateway: GatewayProcess) -> None:
    queue = unique("ackany")
    with wire(module_gateway) as producer, wire(module_gateway) as consumer:
        producer.publish(queue, b"x")
        producer.publish(queue, b"y")
        consumer.consume(queue, 1)
        [x] = consumer.deliveries(1)
        producer.ack(queue, x.message_id)  # not the holder
        [y] = consumer.deliveries(1)  # the holder's one slot came back
        assert y.content == b"y"
        producer.ack(queue, y.message_id)
        producer.ack(queue, b"0" * 32)  # unknown: nothing happens, as in the original
        producer.ack(unique("no-such-queue"), y.message_id)
        producer.barrier()
        stats = queue_stats(module_gateway.nsq_http, queue)
        assert (stats["in_flight_count"], stats["depth"]) == (0, 0)


def test_the_current_generation_gets_the_remaining_ttl_in_each_delivery(module_gateway: GatewayProcess) -> None:
    queue = unique("ttl")
    with wire(module_gateway) as client:
        client.publish(queue, b"with ttl", ttl=3600)  # a TTL packet: this connection is current-generation
        client.publish(queue, b"no ttl")
        client.consume(queue, 2)
        with_ttl, without = client.deliveries(2)
        assert (with_ttl.ttl, without.ttl) == (3600, 0)
        assert bytes(client.raw) == (phpmq.delivery(queue.encode(), b"with ttl", with_ttl.message_id, 3600)
                                     + phpmq.delivery(queue.encode(), b"no ttl", without.message_id, 0))


def test_a_pinned_consumer_gets_three_packets_whatever_the_producer_sent(module_gateway: GatewayProcess) -> None:
    queue = unique("pinned")
    with wire(module_gateway) as producer, wire(module_gateway) as consumer:
        producer.publish(queue, b"ttl set by a current producer", ttl=60)
        consumer.consume(queue, 1)
        [delivery] = consumer.deliveries(1)
        assert delivery.ttl is None and bytes(consumer.raw)[:8] == b"H0100303"


def test_requeue_puts_it_at_the_tail_with_its_new_ttl(module_gateway: GatewayProcess) -> None:
    queue = unique("req")
    with wire(module_gateway) as client:
        client.publish(queue, b"a", ttl=30)
        client.publish(queue, b"b")
        client.consume(queue, 1)
        [a] = client.deliveries(1)
        client.requeue(queue, a.message_id, 900)
        [b] = client.deliveries(1)
        assert b.content == b"b"
        client.ack(queue, b.message_id)
        [again] = client.deliveries(1)
        assert (again.content, again.message_id, again.ttl) == (b"a", a.message_id, 900)


def test_a_dead_letter_goes_to_the_dead_queue_any_protocol_can_read(module_gateway: GatewayProcess) -> None:
    queue = unique("dl")
    with wire(module_gateway) as client, wire(module_gateway) as reader:
        client.publish(queue, b"poison", ttl=60)
        client.publish(queue, b"fine")
        client.consume(queue, 1)
        [poison] = client.deliveries(1)
        client.dead_letter(queue, poison.message_id)
        [fine] = client.deliveries(1)
        assert fine.content == b"fine"
        reader.consume(queue + ".dead", 5)
        [letter] = reader.deliveries(1)
        assert (letter.content, letter.message_id, letter.queue) == (b"poison", poison.message_id, queue + ".dead")
        reader.barrier()
        assert queue_stats(module_gateway.nsq_http, queue)["dead_letter_count"] == 1


def test_a_ttl_that_ran_out_is_never_delivered_and_is_counted(module_gateway: GatewayProcess) -> None:
    queue = unique("expire")
    with wire(module_gateway) as client:
        client.publish(queue, b"too late", ttl=1)  # PHPMQ TTLs are whole seconds
        client.publish(queue, b"in time", ttl=600)
        client.barrier()
        time.sleep(1.05)
        client.consume(queue, 5)
        [delivery] = client.deliveries(1)
        assert delivery.content == b"in time"
        client.barrier()
        stats = queue_stats(module_gateway.nsq_http, queue)
        assert (stats["expired_count"], stats["in_flight_count"], stats["depth"]) == (1, 1, 0)


def test_one_byte_at_a_time(module_gateway: GatewayProcess) -> None:
    queue = unique("bytes")
    with wire(module_gateway) as client:
        for byte in phpmq.send(queue.encode(), b"slow") + phpmq.consume(queue.encode(), 1):
            client.send(bytes([byte]))
        [delivery] = client.deliveries(1)
        assert delivery.content == b"slow"


BAD_INPUT = {
    "not-a-message-header": b"X0100102",
    "not-a-packet-header": b"H0100102Q0100000000000000000000000000003Foo",
    "non-digit-length": b"H0100102P010000000000000000000000000000xFoo",
    "unknown-type": b"H0100902",
    "client-sent-003": phpmq.delivery(b"Foo", b"x", b"0" * 32, None),
    "wrong-packet-count": b"H0100105",
    "missing-packet": phpmq.message(1, [(1, b"Foo"), (5, b"60")]),
    "over-the-limit": b"H0100102P0100000000000000000000000000003FooP02" + b"9" * 29,
}


@pytest.mark.parametrize("data", BAD_INPUT.values(), ids=BAD_INPUT.keys())
def test_bad_input_closes_that_connection_only(module_gateway: GatewayProcess, data: bytes) -> None:
    queue = unique("bad")
    with wire(module_gateway) as bystander, wire(module_gateway) as culprit:
        bystander.consume(queue, 5)
        bystander.publish(queue, b"before")
        [before] = bystander.deliveries(1)
        culprit.send(data)
        assert culprit.closed_by_server()
        bystander.publish(queue, b"after")
        [after] = bystander.deliveries(1)
        assert (before.content, after.content) == (b"before", b"after")
    reason = {"over-the-limit": "over the limit", "client-sent-003": "003 is not sent by this side"}
    expected = reason.get(next(k for k, v in BAD_INPUT.items() if v == data), "closing the connection")
    module_gateway.wait_for_log(lambda line: "closing the connection" in line and expected in line)


def test_a_message_cut_by_the_end_of_the_connection_is_logged_and_dropped(module_gateway: GatewayProcess) -> None:
    queue = unique("cut")
    with wire(module_gateway) as client:
        client.send(phpmq.send(queue.encode(), b"whole") + phpmq.send(queue.encode(), b"cut off")[:30])
    with wire(module_gateway) as reader:
        reader.consume(queue, 5)
        [whole] = reader.deliveries(1)
        reader.barrier()
        assert whole.content == b"whole" and queue_stats(module_gateway.nsq_http, queue)["depth"] == 0


def test_max_attempts_dead_letters_a_message_that_keeps_coming_back(tmp_path: Path) -> None:
    with running_gateway("--phpmq-max-attempts", "2", data_dir=tmp_path) as gateway:
        with wire(gateway) as producer:
            producer.publish("jobs", b"crashes its consumer")
        for _ in range(2):
            with wire(gateway) as consumer:  # takes it and goes away without an ack
                consumer.consume("jobs", 1)
                consumer.deliveries(1)
        with wire(gateway) as consumer, wire(gateway) as reader:
            consumer.consume("jobs", 1)
            reader.consume("jobs.dead", 1)
            [letter] = reader.deliveries(1)
            assert letter.content == b"crashes its consumer"
            consumer.barrier()
            assert consumer.nothing_more()
            assert queue_stats(gateway.nsq_http, "jobs")["dead_letter_count"] == 1


def test_the_ack_timeout_returns_a_delivery_when_configured(tmp_path: Path) -> None:
    with running_gateway("--phpmq-ack-timeout", "200", data_dir=tmp_path) as gateway, wire(gateway) as client:
        client.publish("slow", b"x")
        client.consume("slow", 1)
        [first] = client.deliveries(1)
        [again] = client.deliveries(1, timeout=3)  # not acked within 200 ms: delivered again
        assert again.message_id == first.message_id


def test_current_generation_by_config_gives_every_consumer_the_ttl_packet(tmp_path: Path) -> None:
    with running_gateway("--phpmq-generation", "current", data_dir=tmp_path) as gateway, wire(gateway) as client:
        client.publish("g", b"x")  # a pinned-style send
        client.consume("g", 1)
        [delivery] = client.deliveries(1)
        assert delivery.ttl == 0 and bytes(client.raw)[:8] == b"H0100304"


def test_unacknowledged_messages_ttls_and_dead_letters_survive_kill_9(tmp_path: Path) -> None:
    with running_gateway(data_dir=tmp_path) as gateway, wire(gateway) as client:
        client.publish("orders", b"held", ttl=3600)
        client.publish("orders", b"poison")
        client.publish("orders", b"waiting")
        client.consume("orders", 2)
        held, poison = client.deliveries(2)
        client.dead_letter("orders", poison.message_id)
        client.deliveries(1)
        client.barrier()
        gateway.stop(signal.SIGKILL)
    with running_gateway(data_dir=tmp_path) as gateway, wire(gateway) as client, wire(gateway) as reader:
        client.publish("orders", b"after", ttl=5)  # shows this connection as current: TTLs in its 003s
        client.consume("orders", 5)
        got = client.deliveries(3)
        assert [d.content for d in got] == [b"held", b"waiting", b"after"] and got[0].message_id == held.message_id
        assert got[0].ttl is not None and 3500 < got[0].ttl <= 3600
        reader.consume("orders.dead", 1)
        [letter] = reader.deliveries(1)
        assert (letter.content, letter.message_id) == (b"poison", poison.message_id)


def _topics(http: str) -> set[str]:
    with urllib.request.urlopen(f"http://{http}/stats?format=json", timeout=5) as reply:
        return {topic["topic_name"] for topic in json.load(reply)["topics"]}


def _wait_gone(http: str, queue: str) -> None:
    deadline = time.monotonic() + 5
    while queue in _topics(http):
        assert time.monotonic() < deadline, f"{queue} still there"
        time.sleep(0.01)


def test_an_emptied_queue_nobody_consumes_is_forgotten_one_that_holds_messages_is_kept(tmp_path: Path) -> None:
    kept, emptied = unique("kept"), unique("emptied")
    with running_gateway("--phpmq-forget-empty", "0", data_dir=tmp_path) as gateway:
        with wire(gateway) as producer, wire(gateway) as consumer:
            producer.publish(kept, b"waits")
            producer.publish(emptied, b"one")
            producer.publish(emptied, b"two")
            producer.barrier()
            consumer.consume(kept, 1)
            consumer.deliveries(1)  # not acked: it goes back when the window moves on
            consumer.consume(emptied, 10)
            for delivery in consumer.deliveries(2):
                consumer.ack(emptied, delivery.message_id)
            consumer.barrier()
        _wait_gone(gateway.nsq_http, emptied)
        assert queue_stats(gateway.nsq_http, kept)["depth"] == 1
    with running_gateway("--phpmq-forget-empty", "0", data_dir=tmp_path) as gateway:
        assert emptied not in _topics(gateway.nsq_http)  # gone from the store too
        with wire(gateway) as consumer:
            consumer.consume(kept, 1)
            [delivery] = consumer.deliveries(1)
            assert delivery.content == b"waits"
            consumer.ack(kept, delivery.message_id)
            consumer.barrier()
        _wait_gone(gateway.nsq_http, kept)
