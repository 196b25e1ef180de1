"""eMQP with NSQ, MQKS, PHPMQ and PZQ on one engine: eMQP requests reach the other protocols'
consumers of that name, their publishes reach eMQP workers, and eMQP workers, PHPMQ consumers and
PZQ consumers of one name compete on one queue."""

from __future__ import annotations

import uuid

import zmq

from polymq.codecs import emqp, nsq_client

from support.emqp_wire import Client, Worker, admin_json
from support.gateway import GatewayProcess
from support.mqks_wire import MQKSWire
from support.nsq_wire import RawClient, consumer
from support.phpmq_wire import PHPMQWire
from support.pzq_wire import Consumer, Producer

JOB = b'["run", {"path": "jobs", "callable": "work"}]'


def ready_worker(context: zmq.Context, gateway: GatewayProcess, queues: list[str], slots: int) -> Worker:
    worker = Worker(context, gateway.addresses["emqp-backend"])
    worker.inform([(10, queue) for queue in queues])
    worker.ready(slots)
    address = gateway.addresses["emqp-admin"]
    me = worker.identity.decode()
    for _ in range(500):
        shown = admin_json(context, address, emqp.ROUTER_SHOW_WORKERS)["connected_workers"]
        if shown[me]["available_slots"] == slots:  # type: ignore[index]
            return worker
    raise AssertionError("the worker's READYs never counted")


def test_emqp_requests_reach_nsq_channels_mqks_queues_and_phpmq_consumers(module_gateway: GatewayProcess,
                                                                          context: zmq.Context) -> None:
    with consumer(module_gateway.nsq_tcp, "reports", "audit", rdy=5) as audit, \
            MQKSWire(module_gateway.host_port("mqks")) as mqks, \
            PHPMQWire(module_gateway.host_port("phpmq")) as php, \
            Client(context, module_gateway.addresses["emqp-frontend"]) as client:
        mqks.send(b"c1 consume --confirm reports-copy reports")
        assert mqks.line() == b"c1 ok "
        php.consume("reports", 10)
        php.barrier()
        client.request("reports", JOB, b"reply-requested")
        message = audit.read_message()
        assert message.body == JOB and message.attempts == 1
        audit.send(nsq_client.fin(message.msg_id))
        assert mqks.line().endswith(b" event=reports " + JOB)
        [delivery] = php.deliveries(1)  # the eMQP queue `reports` is PHPMQ's queue `reports`
        assert delivery.content == JOB
        php.ack("reports", delivery.message_id)
        mqks.send(b"d1 delete_queue --confirm reports-copy")
        assert mqks.lines(2) == [b"c1 ok --update reports-copy", b"d1 ok "]


def test_nsq_mqks_phpmq_and_pzq_publishes_reach_emqp_workers(module_gateway: GatewayProcess,
                                                             context: zmq.Context) -> None:
    # The PZQ listener publishes to its configured queue, `pzq`: the eMQP worker serves that one too.
    with ready_worker(context, module_gateway, ["inbound", "pzq"], 4) as worker:
        with RawClient(module_gateway.nsq_tcp) as nsq:
            nsq.send(nsq_client.pub("inbound", b"from nsq"))
            nsq.expect_response(b"OK")
        with PHPMQWire(module_gateway.host_port("phpmq")) as php:
            php.publish("inbound", b"from php")
        with MQKSWire(module_gateway.host_port("mqks")) as mqks:  # the queue is bound: not dropped
            mqks.send(b"p1 publish --confirm inbound from mqks")
            assert mqks.line() == b"p1 ok "
        with Producer(context, module_gateway.addresses["pzq-receive"]) as producer:
            assert producer.produce(b"from pzq")[1] == b"1"
        jobs = [worker.job() for _ in range(4)]
    assert sorted((job[4], job[6]) for job in jobs) == [(b"inbound", b"from mqks"), (b"inbound", b"from nsq"),
                                                        (b"inbound", b"from php"), (b"pzq", b"from pzq")]
    for job in jobs:
        assert job[5] == b"" and uuid.UUID(job[3].decode())  # no client msgid: one made from the message id


def test_emqp_workers_phpmq_and_pzq_consumers_compete_on_one_queue(module_gateway: GatewayProcess,
                                                                   context: zmq.Context) -> None:
    with Consumer(context, module_gateway.addresses["pzq-send"]) as pzq_consumer, \
            Client(context, module_gateway.addresses["emqp-frontend"]) as client:
        # The PZQ consumer is the queue's only one yet: once this reaches it, it is connected.
        client.request("pzq", b"probe")
        probe = pzq_consumer.receive()
        pzq_consumer.ack(probe)
        assert probe[-1] == b"probe"
        with ready_worker(context, module_gateway, ["pzq"], 100) as worker, \
                PHPMQWire(module_gateway.host_port("phpmq")) as php:
            php.consume("pzq", 100)
            php.barrier()
            bodies = [b"job %d" % number for number in range(60)]
            for body in bodies:
                client.request("pzq", body)
            from_emqp: list[bytes] = []
            from_pzq: list[bytes] = []
            from_php: list[bytes] = []
            while len(from_emqp) + len(from_pzq) + len(from_php) < len(bodies):
                if worker.sock.poll(20):
                    frames = worker.receive()
                    if frames[2] == emqp.REQUEST:
                        from_emqp.append(frames[6])
                        worker.ready()
                    continue
                if pzq_consumer.sock.poll(20):
                    delivery = pzq_consumer.receive()
                    pzq_consumer.ack(delivery)
                    from_pzq.append(delivery[-1])
                try:
                    for delivery in php.deliveries(1, timeout=0.02):
                        php.ack("pzq", delivery.message_id)
                        from_php.append(delivery.content)
                except TimeoutError:
                    pass
            assert sorted(from_emqp + from_pzq + from_php) == sorted(bodies), "each job once"
            assert from_emqp and from_pzq and from_php, "every kind of consumer got some"
