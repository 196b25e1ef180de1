"""PZQ against a real gateway with pyzmq clients: producer answers after storing, deliveries and
consumer answers, timeouts, one key for every delivery of a message and the `0`s of superseded
deliveries, the window, multi-frame bodies, the monitor, pipelined producers, restarts
(docs/protocols/pzq.md)."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from polymq.codecs import pzq

from support.gateway import GatewayProcess, running_gateway
from support.pzq_wire import Consumer, Monitor, Producer, endpoint


def drain(consumer: Consumer, count: int) -> list[list[bytes]]:
    got = []
    for _ in range(count):
        delivery = consumer.receive()
        consumer.ack(delivery)
        got.append(delivery)
    return got


def wait_stats(monitor: Monitor, **expected: int) -> dict[str, int]:
    deadline = time.monotonic() + 5
    while True:
        stats = monitor.stats()
        if all(stats[key] == value for key, value in expected.items()) or time.monotonic() > deadline:
            return stats
        time.sleep(0.01)


@pytest.fixture
def gateway(tmp_path: Path) -> Iterator[GatewayProcess]:
    with running_gateway("--pzq-ack-timeout", "300", "--pzq-window", "5", data_dir=tmp_path) as process:
        yield process


def test_producer_answers_as_the_original(gateway: GatewayProcess, context: zmq.Context) -> None:
    with Producer(context, gateway.addresses["pzq-receive"]) as producer:
        assert producer.produce(b"body", producer_id=b"m1") == [b"m1", b"1", b""]
        producer.sock.send_multipart([b"m2", b"header", b"", b"b1", b"b2"])
        assert producer.sock.recv_multipart() == [b"m2", b"1", b""]
        producer.sock.send_multipart([b"m3", b"no delimiter"])
        assert producer.sock.recv_multipart() == [b"m3", b"0", b"", pzq.MALFORMED]
        producer.sock.send_multipart([b"m4", b""])
        assert producer.sock.recv_multipart() == [b"m4", b"0", b"", pzq.EMPTY]
        producer.sock.send_multipart([b"m5"])  # the original answers nothing; polymq says why
        assert producer.sock.recv_multipart() == [b"m5", b"0", b"", pzq.MALFORMED]
    with Consumer(context, gateway.addresses["pzq-send"]) as consumer:
        first, second = drain(consumer, 2)
        assert first[2:3] != [b""] and first[3:] == [b"300000", b"", b"body"]
        assert second[4:] == [b"", b"b1", b"b2"], "header frames are dropped, body frames kept"
        assert pzq.parse_key(first[1]) is not None and len(first[1]) == 16
        assert abs(int(first[2]) - time.time_ns() // 1000) < 5_000_000


def test_ack_zero_sends_it_again_at_once_and_no_ack_after_the_timeout(gateway: GatewayProcess,
                                                                      context: zmq.Context) -> None:
    with Producer(context, gateway.addresses["pzq-receive"]) as producer, \
            Consumer(context, gateway.addresses["pzq-send"]) as consumer, \
            Monitor(context, gateway.addresses["pzq-monitor"]) as monitor:
        producer.produce(b"a")
        producer.produce(b"b")
        first = consumer.receive()
        second = consumer.receive()
        assert [first[-1], second[-1]] == [b"a", b"b"] and first[1] != second[1]
        consumer.ack(first, b"0")
        again = consumer.receive()
        assert (again[-1], again[1]) == (b"a", first[1]), "the same message, under the same key"
        consumer.ack(again)
        # No answer for b: after the ack timeout (300 ms here) it comes again, under the same key.
        late = consumer.receive()
        assert (late[-1], late[1]) == (b"b", second[1])
        assert int(late[2]) >= int(second[2]) + 300_000, "sent_us is the time of this delivery"
        consumer.ack(late)  # `1` ends it, whichever delivery it answers
        assert wait_stats(monitor, messages=0)["messages"] == 0
        nothing_sent_before((consumer,), int(late[2]) + 300_000)


def receive_either(consumers: tuple[Consumer, Consumer]) -> tuple[Consumer, list[bytes]]:
    """The next delivery to either consumer (ZeroMQ's DEALER picks), and which one got it."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        for consumer in consumers:
            if not consumer.nothing_within(10):
                return consumer, consumer.receive()
    raise AssertionError("no delivery within 10 s")


def nothing_sent_before(consumers: tuple[Consumer, ...], deadline_us: int) -> None:
    """No delivery comes but ones sent at or after `deadline_us` (the last delivery's ACK timeout)."""
    for consumer in consumers:
        while not consumer.nothing_within(500):
            extra = consumer.receive()
            assert int(extra[2]) >= deadline_us, f"sent again at once: {extra!r}"
            consumer.ack(extra)


def test_a_superseded_delivery_s_0_is_ignored_and_the_current_one_s_is_honoured(tmp_path: Path,
                                                                                 context: zmq.Context) -> None:
    """Two consumers: the first lets its delivery time out, the message goes to the other one under the
    same key; the first one's late `0` is ignored, the holder's `0` sends it again at once, once."""
    timeout_us = 3_000_000
    with running_gateway("--pzq-ack-timeout", "3000", data_dir=tmp_path) as gateway, \
            Producer(context, gateway.addresses["pzq-receive"]) as producer, \
            Consumer(context, gateway.addresses["pzq-send"]) as one, \
            Consumer(context, gateway.addresses["pzq-send"]) as two, \
            Monitor(context, gateway.addresses["pzq-monitor"]) as monitor:
        wait_stats(monitor, messages=0)
        producer.produce(b"m")
        late, first = receive_either((one, two))
        holder, again = receive_either((one, two))  # after the ACK timeout
        assert (again[1], again[5:]) == (first[1], [b"m"])
        assert int(again[2]) >= int(first[2]) + timeout_us
        late.ack(first, b"0")  # superseded: ignored
        holder.ack(again, b"0")  # the current delivery's: sent again at once
        receiver, third = receive_either((one, two))
        assert third[1] == first[1]
        assert int(third[2]) < int(again[2]) + timeout_us, "sent on the 0, not after the timeout"
        receiver.ack(third, b"0")  # a 0 per delivery: honoured again
        receiver, fourth = receive_either((one, two))
        assert fourth[1] == first[1]
        receiver.ack(fourth)
        assert wait_stats(monitor, messages=0)["messages"] == 0
        nothing_sent_before((one, two), int(fourth[2]) + timeout_us)


def test_a_superseded_delivery_s_0_sends_nothing_again_with_one_consumer(tmp_path: Path,
                                                                          context: zmq.Context) -> None:
    """One ROUTER gets both deliveries: the first delivery's late `0` is ignored all the same, and the
    holder's `1` ends the message."""
    with running_gateway("--pzq-ack-timeout", "1000", data_dir=tmp_path) as gateway, \
            Producer(context, gateway.addresses["pzq-receive"]) as producer, \
            Consumer(context, gateway.addresses["pzq-send"], timeout_ms=10_000) as consumer, \
            Monitor(context, gateway.addresses["pzq-monitor"]) as monitor:
        producer.produce(b"m")
        first = consumer.receive()
        again = consumer.receive()  # after the ACK timeout
        assert again[1] == first[1]
        consumer.ack(first, b"0")
        consumer.ack(again)
        assert wait_stats(monitor, messages=0)["messages"] == 0
        nothing_sent_before((consumer,), int(again[2]) + 1_000_000)


def test_a_consumer_holds_at_most_its_window(tmp_path: Path, context: zmq.Context) -> None:
    # An ACK timeout far longer than the test: what it holds must not come back while it looks.
    with running_gateway("--pzq-ack-timeout", "60000", "--pzq-window", "5", data_dir=tmp_path) as gateway, \
            Producer(context, gateway.addresses["pzq-receive"]) as producer, \
            Monitor(context, gateway.addresses["pzq-monitor"]) as monitor:
        for number in range(20):
            producer.produce(b"%d" % number)
        with Consumer(context, gateway.addresses["pzq-send"]) as slow:
            held = [slow.receive() for _ in range(5)]
            assert slow.nothing_within(200), "a window of 5"
            stats = wait_stats(monitor, messages_inflight=5)
            assert (stats["messages"], stats["messages_inflight"]) == (20, 5)
            for delivery in held:
                slow.ack(delivery)
            rest = drain(slow, 15)
        assert [d[-1] for d in held + rest] == [b"%d" % n for n in range(20)], "in order"
        stats = wait_stats(monitor, messages=0)
        assert (stats["messages"], stats["messages_inflight"], stats["expired_messages"]) == (0, 0, 0)


def test_the_monitor_answers_real_values_and_says_what_it_does_not_know(gateway: GatewayProcess,
                                                                       context: zmq.Context) -> None:
    with Monitor(context, gateway.addresses["pzq-monitor"]) as monitor, \
            Producer(context, gateway.addresses["pzq-receive"]) as producer:
        before = monitor.stats()
        assert list(before) == list(pzq.MONITOR_KEYS)
        producer.produce(b"x" * 1000)
        after = wait_stats(monitor, messages=before["messages"] + 1)
        assert after["db_size"] > before["db_size"] and after["syncs"] > before["syncs"]
        monitor.sock.send(b"STATUS")
        assert monitor.sock.recv() == b"ERROR: unknown request, send MONITOR"
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.RCVTIMEO, 3000)
    dealer.connect(endpoint(gateway.addresses["pzq-monitor"]))
    dealer.send(pzq.MONITOR)
    reply = dealer.recv_multipart()
    assert reply[0] == b"" and reply[1].startswith(b"messages: ")
    dealer.close(linger=0)


def test_pipelined_producers_get_every_ack(gateway: GatewayProcess, context: zmq.Context) -> None:
    """The original loses a few ACKs with 64 messages in flight; polymq answers every one."""
    with Producer(context, gateway.addresses["pzq-receive"]) as producer, \
            Monitor(context, gateway.addresses["pzq-monitor"]) as monitor:
        sent, answered, in_flight = 0, set(), 64
        total = 3000
        while len(answered) < total:
            while sent < total and sent - len(answered) < in_flight:
                producer.sock.send_multipart([b"%d" % sent, b"", b"payload %d" % sent])
                sent += 1
            frames = producer.sock.recv_multipart()
            assert frames[1:] == [b"1", b""], frames
            answered.add(frames[0])
        assert answered == {b"%d" % n for n in range(total)}
        assert wait_stats(monitor, messages=total)["messages"] == total


def test_stored_messages_survive_kill_9_and_are_all_sent_again(tmp_path: Path, context: zmq.Context) -> None:
    with running_gateway(data_dir=tmp_path) as gateway:
        with Producer(context, gateway.addresses["pzq-receive"]) as producer:
            for body in (b"one", b"two", b"three"):
                assert producer.produce(body)[1] == b"1"
        with Consumer(context, gateway.addresses["pzq-send"]) as consumer:
            first = consumer.receive()
            consumer.ack(first)
            consumer.receive()  # in flight when the gateway dies: sent again after the restart
            with Monitor(context, gateway.addresses["pzq-monitor"]) as monitor:
                wait_stats(monitor, messages=2)
            gateway.stop(signal.SIGKILL)
    with running_gateway(data_dir=tmp_path) as gateway, Consumer(context, gateway.addresses["pzq-send"]) as consumer:
        got = drain(consumer, 2)
        assert [d[-1] for d in got] == [b"two", b"three"]
        assert consumer.nothing_within(300)
