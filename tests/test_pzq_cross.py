"""PZQ with NSQ, MQKS and PHPMQ on one engine: each direction, multi-frame bodies in their
reversible one-body form, and PZQ and PHPMQ consumers competing on one queue."""

from __future__ import annotations

import zmq

from polymq.codecs import nsq_client

from support.gateway import GatewayProcess
from support.mqks_wire import MQKSWire
from support.nsq_wire import RawClient, consumer
from support.phpmq_wire import PHPMQWire
from support.pzq_wire import Consumer, Producer


def test_pzq_producers_reach_nsq_channels_and_mqks_queues_of_the_topic(module_gateway: GatewayProcess,
                                                                       context: zmq.Context) -> None:
    with consumer(module_gateway.nsq_tcp, "pzq", "audit", rdy=5) as audit, \
            MQKSWire(module_gateway.host_port("mqks")) as mqks, \
            Producer(context, module_gateway.addresses["pzq-receive"]) as producer:
        mqks.send(b"c1 consume --confirm pzq-copy pzq")
        assert mqks.line() == b"c1 ok "
        assert producer.produce(b"single")[1] == b"1"
        assert producer.produce(b"two", b"frames")[1] == b"1"
        first, second = audit.read_message(), audit.read_message()
        assert (first.body, second.body) == (b"single", b"pzq-frames:3:two,6:frames,")
        for message in (first, second):
            audit.send(nsq_client.fin(message.msg_id))
        assert mqks.line().endswith(b" event=pzq single")
        assert mqks.line().endswith(b" event=pzq pzq-frames:3:two,6:frames,")
        mqks.send(b"d1 delete_queue --confirm pzq-copy")
        assert mqks.lines(2) == [b"c1 ok --update pzq-copy", b"d1 ok "]
    with Consumer(context, module_gateway.addresses["pzq-send"]) as pzq_consumer:
        got = [pzq_consumer.receive() for _ in range(2)]
        for delivery in got:
            pzq_consumer.ack(delivery)
    assert [d[5:] for d in got] == [[b"single"], [b"two", b"frames"]], "frame for frame again"


def test_nsq_mqks_and_phpmq_publishes_reach_pzq_consumers(module_gateway: GatewayProcess, context: zmq.Context) -> None:
    with Consumer(context, module_gateway.addresses["pzq-send"]) as pzq_consumer:
        with RawClient(module_gateway.nsq_tcp) as nsq:
            nsq.send(nsq_client.pub("pzq", b"from nsq"))
            nsq.expect_response(b"OK")
            nsq.send(nsq_client.pub("pzq", b"pzq-frames:1:a,1:b,"))  # the joined form: frames again
            nsq.expect_response(b"OK")
        with PHPMQWire(module_gateway.host_port("phpmq")) as php:
            php.publish("pzq", b"from php")
        with MQKSWire(module_gateway.host_port("mqks")) as mqks:  # the queue pzq is bound: not dropped
            mqks.send(b"p1 publish --confirm pzq from mqks")
            assert mqks.line() == b"p1 ok "
        got = [pzq_consumer.receive() for _ in range(4)]
        for delivery in got:
            pzq_consumer.ack(delivery)
    assert sorted(tuple(d[5:]) for d in got) == [(b"a", b"b"), (b"from mqks",), (b"from nsq",), (b"from php",)]


def test_pzq_and_phpmq_consumers_compete_on_one_queue(module_gateway: GatewayProcess, context: zmq.Context) -> None:
    with Consumer(context, module_gateway.addresses["pzq-send"]) as pzq_consumer, \
            PHPMQWire(module_gateway.host_port("phpmq")) as php, \
            Producer(context, module_gateway.addresses["pzq-receive"]) as producer:
        php.consume("pzq", 100)
        php.barrier()
        bodies = [b"job %d" % number for number in range(40)]
        for body in bodies:
            assert producer.produce(body)[1] == b"1"
        from_pzq: list[bytes] = []
        from_php: list[bytes] = []
        while len(from_pzq) + len(from_php) < len(bodies):
            if pzq_consumer.sock.poll(50):
                delivery = pzq_consumer.receive()
                pzq_consumer.ack(delivery)
                from_pzq.append(delivery[-1])
            try:
                for delivery in php.deliveries(1, timeout=0.05):
                    php.ack("pzq", delivery.message_id)
                    from_php.append(delivery.content)
            except TimeoutError:
                pass
        assert sorted(from_pzq + from_php) == sorted(bodies), "each job once"
        assert from_pzq and from_php, "both kinds of consumer got some"
