"""MQKS through a real `polymq serve`: what polymq adds to the original and what it must keep.

The original's wire behaviour is checked line for line by the conformance suite
(`test_conformance_mqks.py`); here: durability across restarts and kill -9, the cap on
deliveries per consumer, duplicate msg_ids, confirm ordering, consumer ids taken over, queues
created by `rebind`, and shutdown. Raw sockets, exact lines.
"""

from __future__ import annotations

import signal
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from polymq.codecs import nsq_client
from polymq.codecs.mqks_client import parse_delivery, parse_response

from support.gateway import GatewayProcess, running_gateway
from support.mqks_wire import Closed, MQKSWire
from support.nsq_wire import RawClient


@pytest.fixture
def data_dir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="polymq-mqks-") as folder:
        yield Path(folder)


def wire(gateway: GatewayProcess) -> MQKSWire:
    return MQKSWire(gateway.host_port("mqks"))


def test_confirm_of_consume_comes_before_the_backlog_it_delivers(gateway: GatewayProcess) -> None:
    with wire(gateway) as setup, wire(gateway) as consumer:
        setup.send(b"c0 consume --confirm q1 e1")  # the queue exists from its first consume on
        assert setup.line() == b"c0 ok "
        setup.send(b"x0 delete_consumer --confirm c0")
        assert setup.line() == b"x0 ok "
        setup.send(b"m1 publish e1 one\nm2 publish --confirm e1 two")
        assert setup.line() == b"m2 ok "
        consumer.send(b"c1 consume --confirm q1")
        assert consumer.lines(3) == [b"c1 ok ", b"c1 ok m1 event=e1 one", b"c1 ok m2 event=e1 two"]


def test_a_queue_bound_by_rebind_alone_drops_what_is_published_until_its_first_consume(
        gateway: GatewayProcess) -> None:
    # As the original (its test_add_to_undefined_queue): no queue object until a consume.
    with wire(gateway) as client, RawClient(gateway.nsq_tcp) as nsq:
        client.send(b"r1 rebind --confirm undefined-q e-undef\nr2 rebind --confirm undefined-q --add e-undef2")
        assert client.lines(2) == [b"r1 ok ", b"r2 ok "]
        client.send(b"s1 _eval ' '.join(sorted(state.events_by_queues['undefined-q']))")
        assert client.line() == b"s1 ok e-undef e-undef2"
        client.send(b"m1 publish --confirm e-undef dropped")
        assert client.line() == b"m1 ok "
        nsq.send(nsq_client.pub("e-undef2", b"nsq kept"))
        nsq.expect_response(b"OK")  # NSQ keeps it in its topic (nsqd's rule): no MQKS queue is bound yet
        client.send(b"c1 consume --confirm undefined-q")  # takes the rebind's events over
        assert client.line() == b"c1 ok "
        # m1 was dropped; the topic's backlog goes to its first queue, as an NSQ topic's to its first channel.
        [kept] = client.deliveries(1)
        assert (kept.event, kept.body) == ("e-undef2", b"nsq kept")
        assert client.barrier() == []
        client.send(b"m2 publish e-undef kept")
        assert client.line() == b"c1 ok m2 event=e-undef kept"
        client.send(b"x1 delete_consumer --confirm c1\nm3 publish --confirm e-undef2 also kept")
        assert client.lines(2) == [b"x1 ok ", b"m3 ok "]  # consumed once: a queue now, it keeps messages
        client.send(b"c2 consume undefined-q")
        assert client.line() == b"c2 ok m3 event=e-undef2 also kept"


def test_keep_unconsumed_makes_rebind_create_the_queue() -> None:
    with running_gateway("--mqks-keep-unconsumed") as gateway, wire(gateway) as client:
        client.send(b"r1 rebind --confirm kept e-kept")
        assert client.line() == b"r1 ok "
        client.send(b"m1 publish e-kept hello\nc1 consume kept")
        assert client.line() == b"c1 ok m1 event=e-kept hello"


def test_delete_queue_tells_every_consumer_even_of_a_queue_without_events(gateway: GatewayProcess) -> None:
    with wire(gateway) as first, wire(gateway) as second:
        first.send(b"c1 consume --confirm no-events-q --manual-ack --delete-queue-when-unused=5")
        assert first.line() == b"c1 ok "
        second.send(b"c2 consume --confirm no-events-q --delete-queue-when-unused=5")
        assert second.line() == b"c2 ok "
        second.send(b"d1 delete_queue --confirm no-events-q")
        assert second.lines(2) == [b"c2 ok --update no-events-q --delete-queue-when-unused=5.0", b"d1 ok "]
        assert first.line() == b"c1 ok --update no-events-q --delete-queue-when-unused=5.0 --manual-ack"
        second.send(b"s1 _eval [len(state.queues), len(state.queues_by_consumer_ids)]")
        assert second.line() == b"s1 ok [0, 0]"


def test_delete_queue_forgets_the_events_of_a_queue_bound_by_rebind_alone(gateway: GatewayProcess) -> None:
    with wire(gateway) as client:
        client.send(b"r1 rebind --confirm gone-q e-gone\nd1 delete_queue --confirm gone-q")
        assert client.lines(2) == [b"r1 ok ", b"d1 ok "]
        client.send(b's1 _eval " ".join(sorted(state.events_by_queues["gone-q"]))')
        assert client.line() == b"s1 ok "
        client.send(b"c1 consume --confirm gone-q")
        assert client.line() == b"c1 ok "
        client.send(b"s2 _eval [len(state.events_by_queues), len(state.queues_by_events)]")
        assert client.line() == b"s2 ok [0, 0]"


def test_manual_ack_consumer_holds_at_most_its_window() -> None:
    with running_gateway("--mqks-consumer-window", "3") as gateway, wire(gateway) as client:
        client.send(b"c1 consume --confirm wq we --manual-ack")
        assert client.line() == b"c1 ok "
        client.send(b"\n".join(b"m%d publish we b%d" % (n, n) for n in range(6)))
        assert client.lines(3) == [b"c1 ok m0 event=we b0", b"c1 ok m1 event=we b1", b"c1 ok m2 event=we b2"]
        assert client.barrier() == []
        client.send(b"a1 ack c1 m1")
        assert client.line() == b"c1 ok m3 event=we b3"
        assert client.barrier() == []
        client.send(b"a2 ack c1 --all")
        assert client.lines(2) == [b"c1 ok m4 event=we b4", b"c1 ok m5 event=we b5"]


def test_a_run_of_acks_in_one_write_finishes_each_of_its_consumers_messages() -> None:
    # One read of plain acks is finished in one engine call per consumer (codecs/mqks.py `Acks`): what it
    # acks is gone, what it does not name (another consumer's id, an unknown one, an id twice) is not.
    with running_gateway("--mqks-consumer-window", "4") as gateway, wire(gateway) as client:
        client.send(b"c1 consume --confirm rq1 re1 --manual-ack\nc2 consume --confirm rq2 re2 --manual-ack")
        assert client.lines(2) == [b"c1 ok ", b"c2 ok "]
        client.send(b"\n".join([b"m%d publish re1 b%d" % (n, n) for n in range(6)]
                               + [b"n%d publish re2 d%d" % (n, n) for n in range(6)]))
        first = client.lines(8)
        assert sorted(first) == sorted([b"c1 ok m%d event=re1 b%d" % (n, n) for n in range(4)]
                                       + [b"c2 ok n%d event=re2 d%d" % (n, n) for n in range(4)])
        client.send(b"a1 ack c1 m0\na2 ack c1 m1\na3 ack c2 n0\na4 ack nobody m2\na5 ack c1 m1\na6 ack c2 m3\n"
                    b"a7 ack c2 n1\na8 ack c1 m3")
        # Each consumer has room for exactly what it acked: c1 three (m0, m1, m3), c2 two (n0, n1).
        assert sorted(client.lines(4)) == [b"c1 ok m4 event=re1 b4", b"c1 ok m5 event=re1 b5",
                                           b"c2 ok n4 event=re2 d4", b"c2 ok n5 event=re2 d5"]
        assert client.barrier() == []
        client.send(b"x1 delete_consumer --confirm c1")  # m2, m4, m5 were never acked: back to the queue
        assert client.line() == b"x1 ok "
        client.send(b"c3 consume rq1 --manual-ack")
        assert sorted(client.lines(3)) == [b"c3 ok m2 event=re1,retry=1 b2", b"c3 ok m4 event=re1,retry=1 b4",
                                           b"c3 ok m5 event=re1,retry=1 b5"]


def test_duplicate_msg_ids_can_each_be_rejected(gateway: GatewayProcess) -> None:
    # The original keeps one unacked entry per msg_id, so one copy could never be rejected (docs/protocols/mqks.md).
    with wire(gateway) as client:
        client.send(b"c1 consume --confirm dq de --manual-ack")
        assert client.line() == b"c1 ok "
        client.send(b"same publish de first\nsame publish de second")
        assert client.lines(2) == [b"c1 ok same event=de first", b"c1 ok same event=de second"]
        client.send(b"r1 reject c1 same\nr2 reject c1 same")
        assert sorted(client.lines(2)) == [b"c1 ok same event=de,retry=1 first", b"c1 ok same event=de,retry=1 second"]
        client.send(b"r3 reject c1 same")
        assert client.line() == b"c1 ok same event=de,retry=2 first"


def test_a_consumer_id_used_again_takes_over_and_returns_the_old_unacked(gateway: GatewayProcess) -> None:
    with wire(gateway) as old, wire(gateway) as new:
        old.send(b"c1 consume --confirm tq te --manual-ack")
        assert old.line() == b"c1 ok "
        old.send(b"m1 publish te one")
        assert old.line() == b"c1 ok m1 event=te one"
        new.send(b"c1 consume --confirm tq --manual-ack")
        assert new.lines(2) == [b"c1 ok ", b"c1 ok m1 event=te,retry=1 one"]
        assert old.barrier() == []
        old.send(b"m2 publish te two")  # the old connection's consumer is gone
        assert new.line() == b"c1 ok m2 event=te two"
        assert old.barrier() == []


def test_reject_goes_to_the_tail_behind_queued_messages(gateway: GatewayProcess) -> None:
    with wire(gateway) as client, wire(gateway) as publisher:
        client.send(b"c1 consume --confirm rq re --manual-ack")
        assert client.line() == b"c1 ok "
        client.send(b"c2 consume --confirm other-q other-e")  # same connection, another consumer
        assert client.line() == b"c2 ok "
        publisher.send(b"m1 publish --confirm re one")
        assert publisher.line() == b"m1 ok "
        assert client.line() == b"c1 ok m1 event=re one"
        client.send(b"x1 delete_consumer --confirm c1")
        assert client.line() == b"x1 ok "
        publisher.send(b"m2 publish re two\nm3 publish --confirm re three")
        assert publisher.line() == b"m3 ok "
        client.send(b"c3 consume rq --manual-ack")
        assert [d.body for d in client.deliveries(3)] == [b"one", b"two", b"three"]


def test_restart_brings_back_queues_bindings_options_and_unacked_messages(data_dir: Path) -> None:
    with running_gateway(data_dir=data_dir) as gateway, wire(gateway) as client:
        client.send(b"c1 consume --confirm pq pe1 pe2 --manual-ack --delete-queue-when-unused=30")
        assert client.line() == b"c1 ok "
        client.send(b"m1 publish pe1 one\nm2 publish pe2 two\nm3 publish --confirm pe1 three")
        lines = client.lines(4)
        assert lines[:2] == [b"c1 ok m1 event=pe1 one", b"c1 ok m2 event=pe2 two"]
        assert sorted(lines[2:]) == [b"c1 ok m3 event=pe1 three", b"m3 ok "]
        client.send(b"a1 ack --confirm c1 m2")
        assert client.line() == b"a1 ok "
        assert gateway.stop() == 0
    with running_gateway(data_dir=data_dir) as gateway, wire(gateway) as client, wire(gateway) as other:
        client.send(b"s1 _eval [len(state.queues), len(state.queues_to_delete_when_unused), "
                    b"len(state.events_by_queues)]")
        assert client.line() == b"s1 ok [1, 1, 1]"
        other.send(b"o1 consume --confirm pq --manual-ack --delete-queue-when-unused=30")
        assert other.line() == b"o1 ok "  # the setting was kept: no change, so no --update
        # Returned on shutdown (disconnect = reject): retry counts the delivery before the restart.
        assert other.lines(2) == [b"o1 ok m1 event=pe1,retry=1 one", b"o1 ok m3 event=pe1,retry=1 three"]
        client.send(b"c2 consume --confirm pq --add pe3 --delete-queue-when-unused=30")
        # The bindings survived too: the --update shows them.
        assert client.line() == b"c2 ok --update pq pe1 pe2 pe3 --delete-queue-when-unused=30.0"
        assert other.line() == b"o1 ok --update pq pe1 pe2 pe3 --delete-queue-when-unused=30.0 --manual-ack"
        assert client.line() == b"c2 ok "
        client.send(b"c3 consume --confirm pq")  # without the flag: cleared, as the original does
        assert client.line() == b"c2 ok --update pq pe1 pe2 pe3"
        assert other.line() == b"o1 ok --update pq pe1 pe2 pe3 --manual-ack"
        assert client.line() == b"c3 ok "


def test_confirmed_publishes_survive_kill_9(data_dir: Path) -> None:
    with running_gateway(data_dir=data_dir) as gateway, wire(gateway) as client:
        client.send(b"c0 consume --confirm kq ke\nx0 delete_consumer --confirm c0")  # a queue from now on
        assert client.lines(2) == [b"c0 ok ", b"x0 ok "]
        client.send(b"\n".join(b"m%d publish --confirm ke body %d" % (n, n) for n in range(50)))
        assert sorted(client.lines(50)) == sorted(b"m%d ok " % n for n in range(50))
        assert gateway.stop(signal.SIGKILL) == -signal.SIGKILL
    with running_gateway(data_dir=data_dir) as gateway, wire(gateway) as client:
        client.send(b"c1 consume kq")
        got = [parse_delivery(parse_response(line).data) for line in client.lines(50)]
        assert [(d.msg_id, d.event, d.retry, d.body) for d in got] == [
            (f"m{n}", "ke", 0, b"body %d" % n) for n in range(50)
        ]


def test_auto_ack_delivery_is_done_and_does_not_come_back_after_restart(data_dir: Path) -> None:
    with running_gateway(data_dir=data_dir) as gateway, wire(gateway) as client:
        client.send(b"c1 consume --confirm aq ae")
        assert client.line() == b"c1 ok "
        client.send(b"m1 publish --confirm ae one")
        assert sorted(client.lines(2)) == [b"c1 ok m1 event=ae one", b"m1 ok "]
        assert gateway.stop() == 0
    with running_gateway(data_dir=data_dir) as gateway, wire(gateway) as client:
        client.send(b"c1 consume aq")
        assert client.barrier() == []


def test_sigterm_with_mqks_clients_connected_exits_cleanly(gateway: GatewayProcess) -> None:
    client = wire(gateway)
    client.send(b"c1 consume --confirm sq se --manual-ack")
    assert client.line() == b"c1 ok "
    assert gateway.stop() == 0
    with pytest.raises(Closed):
        client.line()
    client.close()


def test_an_unacked_delivery_seen_before_kill_9_comes_back_with_a_higher_retry(data_dir: Path) -> None:
    # A manual-ack delivery leaves only after the record of its attempt is written (delivery barrier).
    with running_gateway(data_dir=data_dir) as gateway, wire(gateway) as client:
        client.send(b"c1 consume --confirm uq ue --manual-ack")
        assert client.line() == b"c1 ok "
        client.send(b"\n".join(b"m%d publish ue b%d" % (n, n) for n in range(20)))
        assert [d.retry for d in client.deliveries(20)] == [0] * 20
        client.send(b"r1 reject c1 m0")
        assert client.line() == b"c1 ok m0 event=ue,retry=1 b0"
        assert gateway.stop(signal.SIGKILL) == -signal.SIGKILL
    with running_gateway(data_dir=data_dir) as gateway, wire(gateway) as client:
        client.send(b"c1 consume uq --manual-ack")
        got = {d.msg_id: d.retry for d in client.deliveries(20)}
        assert got == {"m0": 2, **{f"m{n}": 1 for n in range(1, 20)}}


def test_messages_from_nsq_keep_their_event_across_a_restart(data_dir: Path) -> None:
    # The store keeps each message's topic, so a queue bound to several events shows the right one.
    with running_gateway(data_dir=data_dir) as gateway, wire(gateway) as client:
        client.send(b"c0 consume --confirm multi ev_a ev_b\nx0 delete_consumer --confirm c0")  # a queue from now on
        assert client.lines(2) == [b"c0 ok ", b"x0 ok "]
        with RawClient(gateway.nsq_tcp) as nsq:
            for topic, body in (("ev_a", b"one"), ("ev_b", b"two"), ("ev_a", b"three")):
                nsq.send(nsq_client.pub(topic, body))
                nsq.expect_response(b"OK")
            nsq.send(nsq_client.mpub("ev_b", [b"four", b"five"]))
            nsq.expect_response(b"OK")
        assert gateway.stop(signal.SIGKILL) == -signal.SIGKILL
    with running_gateway(data_dir=data_dir) as gateway, wire(gateway) as client:
        client.send(b"c1 consume multi")
        assert [(d.event, d.body) for d in client.deliveries(5)] == [
            ("ev_a", b"one"), ("ev_b", b"two"), ("ev_a", b"three"), ("ev_b", b"four"), ("ev_b", b"five")]
