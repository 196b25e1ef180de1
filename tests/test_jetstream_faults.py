"""Faults of a real three-server JetStream cluster under two gateways: publishers on one gateway (NSQ,
MQKS and PZQ, which acknowledge each publish), consumers on the other (NSQ, MQKS, PZQ and PHPMQ, which
reads an NSQ topic); servers killed with SIGKILL, one
rejoining with its store wiped, a gateway killed holding deliveries, a gateway paused past the ack wait
(each protocol's consumer, eMQP's worker on gateways of its own), the whole cluster gone and back.
Nothing a client heard acknowledged may be lost."""

from __future__ import annotations

import json
import os
import re
import signal
import time
import urllib.request
from collections.abc import Callable, Iterator

import pytest
import zmq

from polymq.clients import emqp as emqp_client
from polymq.clients import mqks_blocking, pzq_blocking
from polymq.clients import nsq as nsq_blocking
from polymq.clients import phpmq as phpmq_blocking
from polymq.codecs import emqp, nsq_client

from support.gateway import GatewayProcess, running_gateway
from support.nats_cluster import NatsCluster, NatsServer

# A publish during a leader's election waits for it (5-9 s measured) within the gateway's 10 s.
CLIENT_TIMEOUT_S = 30.0
ROUND = 20  # messages per publisher between two faults
ACK_WAIT_S = "2"  # a dead gateway's deliveries go to the other after 2 s


def _gateway_args(cluster: NatsCluster) -> tuple[str, ...]:
    return ("--jetstream", ",".join(cluster.urls), "--jetstream-ack-wait", ACK_WAIT_S, "--no-emqp")


@pytest.fixture(scope="module")
def gateways(nats_cluster: NatsCluster) -> Iterator[tuple[GatewayProcess, GatewayProcess]]:
    with running_gateway(*_gateway_args(nats_cluster)) as publishing, \
            running_gateway(*_gateway_args(nats_cluster)) as consuming:
        yield publishing, consuming


def _leader(cluster: NatsCluster, stream: str) -> NatsServer:
    for server in cluster.servers:
        if not server.running:
            continue
        status, body = server.monitor("/jsz?streams=true")
        if status != 200:
            continue
        for account in json.loads(body).get("account_details", []):
            for detail in account.get("stream_detail", []):
                leader = detail.get("cluster", {}).get("leader")
                if detail["name"] == stream and leader:
                    return next(s for s in cluster.servers if s.name == leader)
    raise AssertionError(f"no leader of {stream}")


class Publishers:
    """NSQ PUB, MQKS publish --confirm and a PZQ producer on one gateway; what each heard acknowledged."""

    def __init__(self, gateway: GatewayProcess, context: zmq.Context, tag: str) -> None:
        self.gateway = gateway
        self.context = context
        self.tag = tag
        self.acked: dict[str, set[bytes]] = {"nsq": set(), "mqks": set(), "pzq": set(), "phpmq": set()}
        self.count = 0

    def round(self) -> None:
        for _ in range(ROUND):
            self.count += 1
            self._nsq(b"nsq %d" % self.count, "nsq")
            self._nsq(b"for php %d" % self.count, "phpmq")  # NSQ publishes what PHPMQ consumes
            self._mqks(b"mqks-%d" % self.count)
            self._pzq(b"pzq %d" % self.count)

    def _nsq(self, body: bytes, consumer: str) -> None:
        try:
            with nsq_blocking.Connection(self.gateway.nsq_tcp, CLIENT_TIMEOUT_S) as conn:
                conn.send(nsq_client.pub(f"{self.tag}-{consumer}", body))
                frame = conn.next_frame()
        except (OSError, TimeoutError):
            return
        if frame is not None and frame.is_response and frame.data == b"OK":
            self.acked[consumer].add(body)

    def _mqks(self, body: bytes) -> None:
        try:
            with mqks_blocking.Connection(self.gateway.host_port("mqks"), CLIENT_TIMEOUT_S) as conn:
                conn.request("p", "publish", f"{self.tag}-mqks {body.decode()}", confirm=True)
                line = conn.next_line()
        except (OSError, TimeoutError):
            return
        if line == b"p ok ":
            self.acked["mqks"].add(body)

    def _pzq(self, body: bytes) -> None:
        try:
            with pzq_blocking.Producer(self.context, self.gateway.addresses["pzq-receive"], CLIENT_TIMEOUT_S) as peer:
                answer = peer.produce(body)
        except (OSError, TimeoutError, zmq.ZMQError):
            return
        if answer[1] == b"1":
            self.acked["pzq"].add(body)


class Consumers:
    """An NSQ channel, an MQKS queue and a PZQ consumer on the other gateway, made before any publish."""

    def __init__(self, gateway: GatewayProcess, context: zmq.Context, tag: str) -> None:
        self.nsq = nsq_blocking.Connection(gateway.nsq_tcp, CLIENT_TIMEOUT_S)
        self.nsq.send(nsq_client.sub(f"{tag}-nsq", "faults"))
        self.nsq.wait_for_ok("SUB")
        self.mqks = mqks_blocking.Connection(gateway.host_port("mqks"), CLIENT_TIMEOUT_S)
        self.mqks.request("c", "consume", f"{tag}-q {tag}-mqks", confirm=True)
        assert self.mqks.next_line() == b"c ok "
        self.pzq = pzq_blocking.Consumer(context, gateway.addresses["pzq-send"], CLIENT_TIMEOUT_S)
        self.php_queue = f"{tag}-phpmq"
        self.php = phpmq_blocking.Connection(gateway.host_port("phpmq"), CLIENT_TIMEOUT_S)
        self.php.consume(self.php_queue, 100)
        self.php.barrier()

    def read(self, acked: dict[str, set[bytes]], deadline_s: float = 60.0) -> dict[str, set[bytes]]:
        got: dict[str, set[bytes]] = {"nsq": set(), "mqks": set(), "pzq": set(), "phpmq": set()}
        deadline = time.monotonic() + deadline_s
        self.nsq.send(nsq_client.rdy(100))
        while not acked["nsq"] <= got["nsq"] and time.monotonic() < deadline:
            frame = self.nsq.next_frame(5)
            if frame is not None and frame.is_message:
                message = nsq_client.decode_message(frame.data)
                got["nsq"].add(message.body)
                self.nsq.send(nsq_client.fin(message.msg_id))
        while not acked["mqks"] <= got["mqks"] and time.monotonic() < deadline:
            line = self.mqks.next_line(5)
            if line is not None and b" event=" in line:
                got["mqks"].add(line.rsplit(b" ", 1)[1].rstrip(b"\n"))
        while not acked["pzq"] <= got["pzq"] and time.monotonic() < deadline:
            try:
                delivery = self.pzq.receive(5)
            except TimeoutError:
                continue
            self.pzq.ack(delivery)
            got["pzq"].add(delivery[5])
        while not acked["phpmq"] <= got["phpmq"] and time.monotonic() < deadline:
            try:
                [delivery] = self.php.deliveries(1, 5)
            except TimeoutError:
                continue
            self.php.ack(self.php_queue, delivery.message_id)
            got["phpmq"].add(delivery.content)
        return got

    def close(self) -> None:
        self.nsq.close()
        self.mqks.close()
        self.pzq.close()
        self.php.close()


def test_the_backend_is_shown_in_metrics_and_the_admin_state(gateways: tuple[GatewayProcess, GatewayProcess],
                                                              nats_cluster: NatsCluster) -> None:
    publishing, _ = gateways
    with urllib.request.urlopen(f"http://{publishing.http}/metrics", timeout=10) as response:
        metrics = response.read().decode()
    [info] = [line for line in metrics.splitlines() if line.startswith("polymq_backend_info{")]
    assert info.startswith('polymq_backend_info{backend="jetstream",connected="nats://127.0.0.1:')
    assert "polymq_jetstream_publish_ack_seconds_bucket" in metrics
    assert "polymq_jetstream_unreachable 0.0" in metrics
    with urllib.request.urlopen(f"http://{publishing.http}/api/state", timeout=10) as response:
        backend = json.loads(response.read())["backend"]
    assert backend["kind"] == "jetstream" and backend["servers"] == nats_cluster.urls
    assert backend["replicas"] == 3 and backend["failure"] is None


def test_killed_servers_and_a_wiped_store_lose_nothing_acknowledged(
        gateways: tuple[GatewayProcess, GatewayProcess], nats_cluster: NatsCluster, context: zmq.Context) -> None:
    publishing, consuming = gateways
    consumers = Consumers(consuming, context, "servers")
    publishers = Publishers(publishing, context, "servers")
    try:
        publishers.round()
        leader = _leader(nats_cluster, "POLYMQ_T_servers-nsq")
        leader.kill()  # the NSQ topic's stream leader
        publishers.round()
        leader.start()
        nats_cluster.wait_ready()
        other = next(server for server in nats_cluster.servers if server is not leader)
        other.kill()
        publishers.round()
        other.start()
        nats_cluster.wait_ready()
        wiped = next(server for server in nats_cluster.servers if server not in (leader, other))
        wiped.kill()
        wiped.wipe_store()
        wiped.start()
        nats_cluster.wait_ready()
        publishers.round()
        got = consumers.read(publishers.acked)
    finally:
        consumers.close()
    for protocol, acked in publishers.acked.items():
        assert len(acked) >= 2 * ROUND, f"{protocol}: the service did not come back ({len(acked)} acknowledged)"
        assert acked <= got[protocol], f"{protocol}: acknowledged and lost: {sorted(acked - got[protocol])[:5]}"


def _holding(gateway: GatewayProcess, topic: str, count: int) -> tuple[nsq_blocking.Connection,
                                                                        list[nsq_client.Message]]:
    """An NSQ consumer of channel `work` on the gateway holding `count` jobs published there, unfinished."""
    holder = nsq_blocking.Connection(gateway.nsq_tcp, CLIENT_TIMEOUT_S)
    holder.send(nsq_client.sub(topic, "work"))
    holder.wait_for_ok("SUB")
    holder.send(nsq_client.rdy(10))
    with nsq_blocking.Connection(gateway.nsq_tcp, CLIENT_TIMEOUT_S) as producer:
        for index in range(count):
            producer.send(nsq_client.pub(topic, b"job %d" % index))
            frame = producer.next_frame()
            assert frame is not None and frame.data == b"OK"
    held = [nsq_client.decode_message(holder.next_frame().data) for _ in range(count)]  # type: ignore[union-attr]
    return holder, held


def test_a_killed_gateways_deliveries_go_to_the_other_gateway(
        gateways: tuple[GatewayProcess, GatewayProcess], nats_cluster: NatsCluster) -> None:
    _, survivor = gateways
    with running_gateway(*_gateway_args(nats_cluster)) as doomed:
        holder, held = _holding(doomed, "killed-gateway", 5)
        doomed.stop(signal.SIGKILL)
        holder.close()
    with nsq_blocking.Connection(survivor.nsq_tcp, CLIENT_TIMEOUT_S) as taker:
        taker.send(nsq_client.sub("killed-gateway", "work"))
        taker.wait_for_ok("SUB")
        taker.send(nsq_client.rdy(10))
        again = [nsq_client.decode_message(taker.next_frame().data) for _ in range(5)]  # type: ignore[union-attr]
        for message in again:
            taker.send(nsq_client.fin(message.msg_id))
    assert sorted(m.body for m in again) == sorted(m.body for m in held)
    assert sorted(m.msg_id for m in again) == sorted(m.msg_id for m in held)
    assert {m.attempts for m in again} == {2}


def test_a_paused_gateways_deliveries_go_to_the_other_and_its_late_fins_fail_as_nsqd_s_do(
        gateways: tuple[GatewayProcess, GatewayProcess], nats_cluster: NatsCluster) -> None:
    """A gateway SIGSTOPped past the ack wait while its client holds deliveries (a VM stalled, a process
    swapping): the other gateway's consumer gets them again; once it runs again, its client's late FINs are
    answered as nsqd answers a FIN of a message no longer in flight, and what it held, or was brought while
    it stood still, is not handed out again there."""
    _, survivor = gateways
    with running_gateway(*_gateway_args(nats_cluster)) as paused:
        holder, held = _holding(paused, "paused-gateway", 3)
        os.kill(paused.process.pid, signal.SIGSTOP)
        try:
            with nsq_blocking.Connection(survivor.nsq_tcp, CLIENT_TIMEOUT_S) as taker:
                taker.send(nsq_client.sub("paused-gateway", "work"))
                taker.wait_for_ok("SUB")
                taker.send(nsq_client.rdy(10))
                again = [nsq_client.decode_message(taker.next_frame().data)  # type: ignore[union-attr]
                         for _ in range(3)]
                for message in again:
                    taker.send(nsq_client.fin(message.msg_id))
                taker.send(nsq_client.rdy(0))
        finally:
            os.kill(paused.process.pid, signal.SIGCONT)
        assert sorted(m.msg_id for m in again) == sorted(m.msg_id for m in held)
        # The paused gateway's pull requests were still held by the cluster: they may have had them meanwhile.
        assert min(m.attempts for m in again) >= 2
        for message in held:
            holder.send(nsq_client.fin(message.msg_id))
            frame = holder.next_frame()
            assert frame is not None and frame.is_error, frame
            assert frame.data == b"E_FIN_FAILED FIN %s failed ID not in flight" % message.msg_id, frame
        with urllib.request.urlopen(f"http://{paused.http}/api/state", timeout=10) as response:
            backend = json.loads(response.read())["backend"]
        assert backend["lapses"] == 1 and backend["taken_back"] >= 3, backend
        with nsq_blocking.Connection(survivor.nsq_tcp, CLIENT_TIMEOUT_S) as producer:
            producer.send(nsq_client.pub("paused-gateway", b"marker"))
            frame = producer.next_frame()
            assert frame is not None and frame.data == b"OK"
        frame = holder.next_frame()  # the next it gets is new: nothing of before is handed out again
        assert frame is not None and not frame.is_error, frame
        marker = nsq_client.decode_message(frame.data)
        assert marker.body == b"marker", marker
        holder.send(nsq_client.fin(marker.msg_id))
        holder.close()


def _paused_past_the_ack_wait(gateway: GatewayProcess, take_elsewhere: Callable[[], None]) -> None:
    """SIGSTOP `gateway` while `take_elsewhere` (the other gateway's client) waits out the ack wait and takes
    what the paused one's client held; SIGCONT after."""
    os.kill(gateway.process.pid, signal.SIGSTOP)
    try:
        take_elsewhere()
    finally:
        os.kill(gateway.process.pid, signal.SIGCONT)


def _lapsed_once(gateway: GatewayProcess, held: int) -> None:
    with urllib.request.urlopen(f"http://{gateway.http}/api/state", timeout=10) as response:
        backend = json.loads(response.read())["backend"]
    assert backend["lapses"] == 1 and backend["taken_back"] >= held, backend


def _mqks_delivery(line: bytes | None) -> tuple[bytes, bytes, bytes]:
    """`{consumer} ok {msg_id} event={event}[,retry=N] {data}`: its msg_id, event field and data."""
    assert line is not None and b" event=" in line, line
    _, _, msg_id, event, data = line.split(b" ", 4)
    return msg_id, event, data


def test_a_paused_gateways_mqks_consumer_acks_late_as_the_original_answers_an_unknown_id(
        gateways: tuple[GatewayProcess, GatewayProcess], nats_cluster: NatsCluster) -> None:
    """MQKS's manual acks across a pause past the ack wait: the other gateway's consumer of the queue gets the
    held messages again, with `retry`; the paused one's late acks are confirmed (`ok`, as MQKS confirms an ack
    of an id it does not hold) and change nothing there; its next delivery is a new message."""
    _, survivor = gateways
    topic, queue = "paused-mqks", "paused-mqks-q"
    with running_gateway(*_gateway_args(nats_cluster)) as paused, \
            mqks_blocking.Connection(paused.host_port("mqks"), CLIENT_TIMEOUT_S) as holder:
        holder.request("c", "consume", f"{queue} {topic} --manual-ack", confirm=True)
        assert holder.next_line() == b"c ok "
        for index in range(3):
            holder.request(f"p{index}", "publish", f"{topic} job {index}", confirm=True)
        lines = [holder.next_line() for _ in range(6)]  # the 3 confirms and the 3 deliveries, in any order
        assert sorted(line for line in lines if line is not None and b" event=" not in line) == [
            b"p0 ok ", b"p1 ok ", b"p2 ok "], lines
        held = [_mqks_delivery(line) for line in lines if line is not None and b" event=" in line]
        assert sorted(data for _, _, data in held) == [b"job 0", b"job 1", b"job 2"]
        again: list[tuple[bytes, bytes, bytes]] = []

        def take_elsewhere() -> None:
            with mqks_blocking.Connection(survivor.host_port("mqks"), CLIENT_TIMEOUT_S) as taker:
                taker.request("s", "consume", f"{queue} {topic} --manual-ack", confirm=True)
                assert taker.next_line() == b"s ok "
                while len(again) < 3:
                    again.append(_mqks_delivery(taker.next_line()))
                for msg_id, _, _ in again:
                    taker.request("sa", "ack", f"s {msg_id.decode()}", confirm=True)
                    assert taker.next_line() == b"sa ok "
                taker.request("sd", "delete_consumer", "s", confirm=True)
                assert taker.next_line() == b"sd ok "

        _paused_past_the_ack_wait(paused, take_elsewhere)
        assert sorted((msg_id, data) for msg_id, _, data in again) == sorted((m, d) for m, _, d in held)
        # Redeliveries: the paused gateway's pull requests, still held by the cluster, may have had them meanwhile.
        assert all(re.fullmatch(rb"event=paused-mqks,retry=[1-9]", event) for _, event, _ in again), again
        for index, (msg_id, _, _) in enumerate(held):
            holder.request(f"a{index}", "ack", f"c {msg_id.decode()}", confirm=True)
            assert holder.next_line() == f"a{index} ok ".encode()
        _lapsed_once(paused, 3)
        with mqks_blocking.Connection(survivor.host_port("mqks"), CLIENT_TIMEOUT_S) as producer:
            producer.request("pm", "publish", f"{topic} marker", confirm=True)
            assert producer.next_line() == b"pm ok "
        assert _mqks_delivery(holder.next_line()) == (b"pm", b"event=" + topic.encode(), b"marker")
        holder.request("am", "ack", "c pm", confirm=True)
        assert holder.next_line() == b"am ok "


def test_a_paused_gateways_phpmq_consumer_acks_late_as_the_original_answers_an_unknown_id(
        gateways: tuple[GatewayProcess, GatewayProcess], nats_cluster: NatsCluster) -> None:
    """PHPMQ's acks across a pause past the ack wait: the other gateway's consumer of the queue gets the held
    messages again; the paused one's late acks are ignored, silently, as PHPMQ ignores an ack of an id it does
    not hold, and the connection serves on: its next delivery is a new message."""
    _, survivor = gateways
    queue = "paused-phpmq"
    with running_gateway(*_gateway_args(nats_cluster)) as paused, \
            phpmq_blocking.Connection(paused.host_port("phpmq"), CLIENT_TIMEOUT_S) as holder:
        holder.consume(queue, 10)
        holder.barrier()
        with phpmq_blocking.Connection(paused.host_port("phpmq"), CLIENT_TIMEOUT_S) as producer:
            for index in range(3):
                producer.publish(queue, b"job %d" % index)
            producer.barrier()
        held = holder.deliveries(3)
        assert sorted(d.content for d in held) == [b"job 0", b"job 1", b"job 2"]
        again = []

        def take_elsewhere() -> None:
            with phpmq_blocking.Connection(survivor.host_port("phpmq"), CLIENT_TIMEOUT_S) as taker:
                taker.consume(queue, 3)
                again.extend(taker.deliveries(3))
                for delivery in again:
                    taker.ack(queue, delivery.message_id)
                taker.barrier()

        _paused_past_the_ack_wait(paused, take_elsewhere)
        assert sorted((d.message_id, d.content) for d in again) == sorted((d.message_id, d.content) for d in held)
        for delivery in held:
            holder.ack(queue, delivery.message_id)
        holder.barrier()  # the acks handled: PHPMQ answers none
        _lapsed_once(paused, 3)
        with phpmq_blocking.Connection(survivor.host_port("phpmq"), CLIENT_TIMEOUT_S) as producer:
            producer.publish(queue, b"marker")
            producer.barrier()
        [marker] = holder.deliveries(1)
        assert marker.content == b"marker"
        holder.ack(queue, marker.message_id)
        holder.barrier()


def test_a_paused_gateways_pzq_consumer_answers_late_as_the_original_ignores_a_superseded_delivery(
        gateways: tuple[GatewayProcess, GatewayProcess], nats_cluster: NatsCluster) -> None:
    """PZQ's answers across a pause past the ack wait: the other gateway's consumer gets the held messages
    again, under the same keys; the paused one's late `1`s are ignored, as PZQ ignores an answer to a
    delivery that was superseded, and its next delivery is a new message."""
    _, survivor = gateways
    context = zmq.Context()
    try:
        with running_gateway(*_gateway_args(nats_cluster)) as paused, \
                pzq_blocking.Consumer(context, paused.addresses["pzq-send"], CLIENT_TIMEOUT_S) as holder:
            with pzq_blocking.Producer(context, paused.addresses["pzq-receive"], CLIENT_TIMEOUT_S) as producer:
                for index in range(3):
                    assert producer.produce(b"pzq job %d" % index)[1] == b"1"
            held = [holder.receive() for _ in range(3)]
            assert sorted(delivery[5] for delivery in held) == [b"pzq job 0", b"pzq job 1", b"pzq job 2"]
            again: list[list[bytes]] = []

            def take_elsewhere() -> None:
                with pzq_blocking.Consumer(context, survivor.addresses["pzq-send"], CLIENT_TIMEOUT_S) as taker:
                    again.extend(taker.receive() for _ in range(3))
                    for delivery in again:
                        taker.ack(delivery)

            _paused_past_the_ack_wait(paused, take_elsewhere)
            assert sorted((d[1], d[5]) for d in again) == sorted((d[1], d[5]) for d in held)
            for delivery in held:
                holder.ack(delivery)
            with pzq_blocking.Producer(context, survivor.addresses["pzq-receive"], CLIENT_TIMEOUT_S) as producer:
                assert producer.produce(b"pzq marker")[1] == b"1"
            marker = holder.receive()
            assert marker[5] == b"pzq marker", marker
            holder.ack(marker)
            _lapsed_once(paused, 3)
    finally:
        context.term()


def test_a_paused_gateways_emqp_worker_replies_late_as_the_original_ignores_a_reply_to_a_job_it_does_not_hold(
        nats_cluster: NatsCluster) -> None:
    """eMQP's jobs across a pause past the ack wait: a worker on the other gateway gets the held requests
    again, the same msgids and payloads; the paused worker's late REPLYs are ignored there, as the original
    ignores a REPLY for a job it does not hold, its READYs free its slots again, and its next job is a new
    request."""
    args = (*_gateway_args(nats_cluster)[:-1], "--emqp-heartbeat-timeout", "600000")  # eMQP on, nobody reaped
    queue = "paused-emqp"
    context = zmq.Context()
    try:
        with running_gateway(*args) as paused, running_gateway(*args) as survivor, \
                emqp_client.Worker(context, paused.addresses["emqp-backend"], timeout=CLIENT_TIMEOUT_S) as holder, \
                emqp_client.Client(context, paused.addresses["emqp-frontend"], timeout=CLIENT_TIMEOUT_S) as client:
            holder.inform([(10, queue)])
            holder.ready(3)
            sent = {client.request(queue, b"emqp job %d" % index, headers=emqp.REPLY_REQUESTED.encode()):
                    b"emqp job %d" % index for index in range(3)}
            held = [holder.job(CLIENT_TIMEOUT_S) for _ in range(3)]
            assert sorted(job[6] for job in held) == sorted(sent.values())
            again: list[list[bytes]] = []

            def take_elsewhere() -> None:
                with emqp_client.Worker(context, survivor.addresses["emqp-backend"],
                                        timeout=CLIENT_TIMEOUT_S) as taker:
                    taker.inform([(10, queue)])
                    taker.ready(3)
                    again.extend(taker.job(CLIENT_TIMEOUT_S) for _ in range(3))
                    for job in again:
                        taker.reply(job)
                    taker.leave()

            _paused_past_the_ack_wait(paused, take_elsewhere)
            assert sorted((job[3], job[6]) for job in again) == sorted((job[3], job[6]) for job in held)
            for job in held:
                holder.reply(job)
            holder.ready(3)
            client.request(queue, b"emqp marker", headers=emqp.REPLY_REQUESTED.encode())
            marker = holder.job(CLIENT_TIMEOUT_S)
            assert (marker[4], marker[6]) == (queue.encode(), b"emqp marker"), marker
            holder.reply(marker)
            _lapsed_once(paused, 3)
    finally:
        context.term()


def test_a_lost_cluster_fails_publishes_within_the_bound_and_service_resumes(
        gateways: tuple[GatewayProcess, GatewayProcess], nats_cluster: NatsCluster) -> None:
    publishing, consuming = gateways
    with nsq_blocking.Connection(consuming.nsq_tcp, CLIENT_TIMEOUT_S) as consumer:
        consumer.send(nsq_client.sub("lost-cluster", "c"))
        consumer.wait_for_ok("SUB")
        consumer.send(nsq_client.rdy(10))
        for server in nats_cluster.servers:
            server.kill()
        started = time.monotonic()
        with nsq_blocking.Connection(publishing.nsq_tcp, CLIENT_TIMEOUT_S) as producer:
            producer.send(nsq_client.pub("lost-cluster", b"while lost"))
            frame = producer.next_frame()
        assert frame is not None and frame.is_error, frame
        assert frame.data.startswith(b"E_PUB_FAILED PUB failed "), frame
        assert time.monotonic() - started < 15.0  # the gateway's publish bound (10 s), not a hang
        # A channel new to the cluster cannot be made without it: its SUB fails within the API bound (30 s);
        # one the cluster has (`c`) was answered at once above, and delivers once the cluster is back.
        started = time.monotonic()
        with nsq_blocking.Connection(consuming.nsq_tcp, 60.0) as late:
            late.send(nsq_client.sub("lost-cluster", "made-while-lost"))
            frame = late.next_frame()
        assert frame is not None and frame.is_error, frame
        assert frame.data.startswith(b"E_INVALID SUB failed "), frame
        assert time.monotonic() - started < 45.0
        for server in nats_cluster.servers:
            server.start()
        nats_cluster.wait_ready()
        deadline = time.monotonic() + 60
        while True:  # the gateway reconnects by itself: publishes succeed again
            with nsq_blocking.Connection(publishing.nsq_tcp, CLIENT_TIMEOUT_S) as producer:
                producer.send(nsq_client.pub("lost-cluster", b"back"))
                frame = producer.next_frame()
            if frame is not None and frame.data == b"OK":
                break
            assert time.monotonic() < deadline, frame
        while True:
            frame = consumer.next_frame(30)
            assert frame is not None, "the consumer on the other gateway got nothing after the cluster came back"
            if frame.is_message:
                message = nsq_client.decode_message(frame.data)
                consumer.send(nsq_client.fin(message.msg_id))
                if message.body == b"back":
                    break
