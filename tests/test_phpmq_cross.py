"""PHPMQ, NSQ and MQKS on one engine (docs/architecture.md): each direction, TTLs and dead letters
set over PHPMQ honoured whoever consumes. One gateway for the module; names are unique per test."""

from __future__ import annotations

import time
import uuid

from polymq.codecs import nsq_client

from support.gateway import GatewayProcess
from support.mqks_wire import MQKSWire
from support.nsq_wire import RawClient, consumer
from support.phpmq_wire import PHPMQWire


def unique(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:8]}"


def php(gateway: GatewayProcess) -> PHPMQWire:
    return PHPMQWire(gateway.host_port("phpmq"))


def test_a_phpmq_send_reaches_nsq_channels_and_mqks_queues_of_that_name(module_gateway: GatewayProcess) -> None:
    name = unique("orders")
    with consumer(module_gateway.nsq_tcp, name, "billing", rdy=5) as billing, \
            MQKSWire(module_gateway.host_port("mqks")) as mqks, php(module_gateway) as producer:
        mqks.send(f"c1 consume --confirm {name}-mqks {name}".encode())
        assert mqks.line() == b"c1 ok "
        producer.publish(name, b"from php \x00\xff binary")
        message = billing.read_message()
        assert (message.body, message.attempts) == (b"from php \x00\xff binary", 1)
        billing.send(nsq_client.fin(message.msg_id))
        # Not UTF-8: MQKS gets it in its reversible encoding (docs/protocols/mqks.md).
        line = mqks.line()
        assert line.startswith(b"c1 ok ") and f"event={name} polymq:base64:".encode() in line
        # The PHPMQ queue of that name keeps its own copy for PHPMQ consumers.
        producer.consume(name, 1)
        [delivery] = producer.deliveries(1)
        assert delivery.content == b"from php \x00\xff binary"


def test_nsq_and_mqks_publishes_reach_a_phpmq_consumer(module_gateway: GatewayProcess) -> None:
    name = unique("jobs")
    with php(module_gateway) as worker, MQKSWire(module_gateway.host_port("mqks")) as mqks:
        worker.consume(name, 10)
        worker.barrier()  # the queue exists and is bound: MQKS's drop rule does not apply
        with RawClient(module_gateway.nsq_tcp) as nsq:
            nsq.send(nsq_client.pub(name, b"from nsq"))
            nsq.expect_response(b"OK")
        mqks.send(f"p1 publish --confirm {name} from mqks".encode())
        assert mqks.line() == b"p1 ok "
        got = worker.deliveries(2)
        assert sorted(d.content for d in got) == [b"from mqks", b"from nsq"]
        for delivery in got:
            worker.ack(name, delivery.message_id)


def test_a_ttl_set_over_phpmq_is_honoured_by_an_nsq_consumer(module_gateway: GatewayProcess) -> None:
    name = unique("ttl")
    with consumer(module_gateway.nsq_tcp, name, "late", rdy=0) as late, php(module_gateway) as producer:
        producer.publish(name, b"expires", ttl=1)
        producer.publish(name, b"stays", ttl=600)
        producer.barrier()
        time.sleep(1.05)  # PHPMQ TTLs are whole seconds
        late.send(nsq_client.rdy(5))
        message = late.read_message()
        assert message.body == b"stays"
        late.send(nsq_client.fin(message.msg_id))


def test_a_phpmq_dead_letter_is_read_by_nsq_and_moved_back_by_a_phpmq_client(module_gateway: GatewayProcess) -> None:
    name = unique("mail")
    with php(module_gateway) as client, consumer(module_gateway.nsq_tcp, f"{name}.dead", "ops", rdy=5) as ops:
        client.publish(name, b"undeliverable")
        client.consume(name, 1)
        [delivery] = client.deliveries(1)
        client.dead_letter(name, delivery.message_id)
        letter = ops.read_message()
        assert letter.body == b"undeliverable"
        assert int(letter.msg_id, 16) == int(delivery.message_id, 16), "the same message, the same id"
        ops.send(nsq_client.fin(letter.msg_id))
        # Moving it back is publishing it again to its queue, from any protocol.
        client.publish(name, letter.body)
        [again] = client.deliveries(1)
        assert again.content == b"undeliverable"
