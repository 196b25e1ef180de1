"""A full disk, for real: the gateway's data dir on a small tmpfs mounted in a private mount namespace.

Publishes are acknowledged until the tmpfs is full, then refused with each protocol's error (NSQ
`E_MPUB_FAILED`, `E_PUB_FAILED … No space left on device`; MQKS's `error` line; PHPMQ's closed
connection; PZQ's `0` with the error instead of an ACK; eMQP's `ERROR:` REPLY); consumers are served
from what is stored meanwhile; the log says so once; a filler file in the same mount is removed from
outside (`nsenter` into the gateway's namespace) and publishing works again by itself; every
acknowledged message is then delivered. Needs root and a kernel that lets it mount (CI runs as root).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import zmq

from polymq.codecs import emqp, nsq_client
from polymq.codecs.mqks_client import parse_delivery, parse_response
from tests.support.emqp_wire import Client as EMQPClient
from tests.support.emqp_wire import Worker as EMQPWorker
from tests.support.gateway import GatewayProcess, running_gateway
from tests.support.mqks_wire import MQKSWire
from tests.support.nsq_wire import Closed, RawClient
from tests.support.phpmq_wire import PHPMQWire
from tests.support.pzq_wire import Consumer, Producer

TMPFS_SIZE = 16 * 1024 * 1024  # small enough to fill in a second or two
FILLER_SIZE = 4 * 1024 * 1024  # what is freed again
BODY = 1000
BATCH = 100  # 100 kB an MPUB: the tmpfs takes about 120 of them
DEADLINE_S = 60.0
NO_SPACE = "No space left on device"


# A private mount namespace for the test's tmpfs: root has one at once; anyone else gets one in a user
# namespace of their own, where they are root (unprivileged user namespaces, Linux's default).
AS_ROOT = os.geteuid() == 0
NAMESPACE = ("unshare", "--mount", "--propagation", "private",
             *(() if AS_ROOT else ("--user", "--map-root-user")))
ENTER = () if AS_ROOT else ("-U", "--preserve-credentials")  # nsenter's options to join it again


def _cannot_mount() -> str | None:
    """Why this machine cannot run the test, or None."""
    if shutil.which("unshare") is None or shutil.which("nsenter") is None:
        return "needs unshare and nsenter (util-linux)"
    probe = subprocess.run([*NAMESPACE, "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /mnt"], capture_output=True,
                           text=True)
    if probe.returncode != 0:
        return f"cannot mount a tmpfs in a private mount namespace here: {probe.stderr.strip()}"
    return None


@pytest.fixture
def small_disk() -> Iterator[Path]:
    reason = _cannot_mount()
    if reason is not None:  # never a skip: the full-disk behaviour is what this file proves
        pytest.fail(f"the full-disk test cannot run: {reason}")
    mount_point = Path(tempfile.mkdtemp(prefix="polymq-full-"))
    yield mount_point
    shutil.rmtree(mount_point, ignore_errors=True)  # the tmpfs went with the namespace


def full_disk_gateway(mount_point: Path) -> tuple[tuple[str, ...], Path]:
    """The prefix that mounts the tmpfs, writes the filler and execs the gateway (same PID); the data dir."""
    script = (f'mount -t tmpfs -o size={TMPFS_SIZE} tmpfs "$0" && head -c {FILLER_SIZE} /dev/zero > "$0/filler" '
              f'&& exec "$@"')
    prefix = (*NAMESPACE, "sh", "-c", script, str(mount_point))
    return prefix, mount_point / "data"


def publish_until_refused(gateway: GatewayProcess) -> set[bytes]:
    """MPUBs until one is refused; the bodies acknowledged."""
    acknowledged: set[bytes] = set()
    deadline = time.monotonic() + DEADLINE_S
    with RawClient(gateway.nsq_tcp, timeout=10) as producer:
        for batch in range(10_000):
            bodies = [b"%06d-%04d-" % (batch, index) + b"x" * (BODY - 12) for index in range(BATCH)]
            producer.send(nsq_client.mpub("t", bodies))
            frame = producer.read_frame()
            if frame.frame_type == 1:
                assert frame.data.startswith(b"E_MPUB_FAILED MPUB failed "), frame
                assert NO_SPACE.encode() in frame.data, frame
                producer.expect_closed()
                return acknowledged
            assert frame.data == b"OK", frame
            acknowledged.update(bodies)
            assert time.monotonic() < deadline
    raise AssertionError("the tmpfs never filled")


def test_a_full_disk_refuses_publishes_and_recovers_when_space_returns(small_disk: Path) -> None:
    prefix, data_dir = full_disk_gateway(small_disk)
    with running_gateway(data_dir=data_dir, prefix=prefix) as gateway:
        with RawClient(gateway.nsq_tcp) as setup:  # the channel, so that every message is kept for it
            setup.send(nsq_client.sub("t", "c"))
            setup.expect_response(b"OK")
        acknowledged = publish_until_refused(gateway)
        assert len(acknowledged) > 0

        # Every publish is refused while the store fails, with the error of its protocol.
        for _ in range(20):
            with RawClient(gateway.nsq_tcp) as producer:
                producer.send(nsq_client.pub("t", b"refused"))
                producer.expect_error(f"E_PUB_FAILED PUB failed {NO_SPACE}".encode())
                producer.expect_closed()
        gateway.wait_for_log(lambda line: f"storage write failed: {NO_SPACE}" in line)
        failed_lines = [line for line in gateway.log_lines if f"failed: {NO_SPACE}" in line and "storage" in line]
        assert len(failed_lines) == 1, failed_lines

        free_the_filler(gateway, small_disk)
        deadline = time.monotonic() + DEADLINE_S
        while True:
            with RawClient(gateway.nsq_tcp) as producer:
                producer.send(nsq_client.pub("t", b"after"))
                frame = producer.read_frame()
            if frame.frame_type == 0:
                assert frame.data == b"OK"
                acknowledged.add(b"after")
                break
            assert time.monotonic() < deadline, f"publishing did not resume: {frame}"
            time.sleep(0.05)  # the store retries every 200 ms; this only paces the polling
        gateway.wait_for_log(lambda line: "storage writes work again" in line)

        # Every acknowledged message is delivered.
        delivered: set[bytes] = set()
        with RawClient(gateway.nsq_tcp, timeout=10) as reader:
            reader.send(nsq_client.sub("t", "c"))
            reader.expect_response(b"OK")
            reader.send(nsq_client.rdy(2500))
            while not acknowledged <= delivered:
                try:
                    message = reader.read_message()
                except (TimeoutError, Closed) as error:
                    raise AssertionError(f"{len(acknowledged - delivered)} acknowledged messages never came") \
                        from error
                delivered.add(message.body)
                reader.send(nsq_client.fin(message.msg_id))


# -- the other protocols: each refuses with its own error while the store fails, and resumes by itself --


def free_the_filler(gateway: GatewayProcess, mount_point: Path) -> None:
    """Space comes back: the filler goes, from inside the gateway's mount namespace."""
    subprocess.run(["nsenter", "-t", str(gateway.process.pid), "-m", *ENTER, "rm", str(mount_point / "filler")],
                   check=True)


def until_accepted(publish: Callable[[], bool]) -> None:
    """Publish until one is accepted (the store retries its write every 200 ms once space is back)."""
    deadline = time.monotonic() + DEADLINE_S
    while not publish():
        assert time.monotonic() < deadline, "publishing did not resume"
        time.sleep(0.05)  # only paces the retries; the condition is the publish's own answer


def the_failure_is_logged_once(gateway: GatewayProcess) -> None:
    gateway.wait_for_log(lambda line: f"storage write failed: {NO_SPACE}" in line)
    failed_lines = [line for line in gateway.log_lines if f"failed: {NO_SPACE}" in line and "storage" in line]
    assert len(failed_lines) == 1, failed_lines


def test_mqks_refuses_with_its_error_line_and_resumes(small_disk: Path) -> None:
    prefix, data_dir = full_disk_gateway(small_disk)
    with running_gateway(data_dir=data_dir, prefix=prefix) as gateway, \
            MQKSWire(gateway.host_port("mqks")) as client:
        client.send(b"c0 consume --confirm mq me --manual-ack")  # the queue, stored before the disk fills
        assert client.line() == b"c0 ok "
        client.send(b"x0 delete_consumer --confirm c0")
        assert client.line() == b"x0 ok "
        client.send(b"m1 publish --confirm me before")
        assert client.line() == b"m1 ok "
        publish_until_refused(gateway)

        for number in range(5):
            client.send(b"r%d publish --confirm me refused" % number)
            line = client.line()
            assert re.fullmatch(rb"r%d error \S+" % number, line), line  # MQKS's error line, its error id
        the_failure_is_logged_once(gateway)
        client.send(b"c1 consume --confirm mq --manual-ack")  # served from what is stored meanwhile
        assert client.line() == b"c1 ok "
        before = parse_delivery(parse_response(client.line()).data)
        assert before.body == b"before"
        client.send(b"a1 ack --confirm c1 " + before.msg_id.encode())
        assert client.line().startswith(b"a1 ")

        free_the_filler(gateway, small_disk)
        tries = iter(range(10_000))
        deliveries: list[bytes] = []

        def accepted() -> bool:
            request_id = b"m2-%d" % next(tries)
            client.send(request_id + b" publish --confirm me after")
            while not (line := client.line()).startswith(request_id + b" "):
                deliveries.append(line)  # the consumer c1's, on the same connection
            return line == request_id + b" ok "

        until_accepted(accepted)
        gateway.wait_for_log(lambda line: "storage writes work again" in line)
        if not deliveries:
            deliveries.append(client.line())
        assert [parse_delivery(parse_response(line).data).body for line in deliveries] == [b"after"]


def test_phpmq_closes_the_producer_and_resumes(small_disk: Path) -> None:
    prefix, data_dir = full_disk_gateway(small_disk)
    with running_gateway(data_dir=data_dir, prefix=prefix) as gateway:
        address = gateway.host_port("phpmq")
        with PHPMQWire(address) as producer:
            producer.publish("pq", b"before")
            producer.barrier()
        publish_until_refused(gateway)

        for _ in range(5):  # PHPMQ has no error reply: the producer's connection ends instead
            with PHPMQWire(address) as producer:
                producer.publish("pq", b"refused")
                assert producer.closed_by_server()
        the_failure_is_logged_once(gateway)
        with PHPMQWire(address) as consumer:  # served from what is stored meanwhile
            consumer.consume("pq", 10)
            (before,) = consumer.deliveries(1)
            assert before.content == b"before"
            consumer.ack("pq", before.message_id)

        free_the_filler(gateway, small_disk)

        def accepted() -> bool:
            with PHPMQWire(address) as producer:
                producer.publish("pq", b"after")
                # Then a marker it reads back itself: it comes once both were taken, else the connection ends.
                producer.publish("marker", b"m")
                producer.consume("marker", 1)
                try:
                    (marker,) = producer.deliveries(1)
                except Closed:
                    return False
                producer.ack("marker", marker.message_id)
                return True

        until_accepted(accepted)
        with PHPMQWire(address) as consumer:
            consumer.consume("pq", 10)
            assert [delivery.content for delivery in consumer.deliveries(1)] == [b"after"]
            assert consumer.nothing_more()


def test_pzq_answers_0_and_resumes(small_disk: Path, context: zmq.Context) -> None:
    prefix, data_dir = full_disk_gateway(small_disk)
    with running_gateway(data_dir=data_dir, prefix=prefix) as gateway, \
            Producer(context, gateway.addresses["pzq-receive"]) as producer:
        assert producer.produce(b"before", producer_id=b"m1") == [b"m1", b"1", b""]
        publish_until_refused(gateway)

        for number in range(5):  # no ACK: a `0` with the store's error
            producer_id = b"r%d" % number
            assert producer.produce(b"refused", producer_id=producer_id) == [producer_id, b"0", b"", NO_SPACE.encode()]
        the_failure_is_logged_once(gateway)
        with Consumer(context, gateway.addresses["pzq-send"]) as consumer:  # served from what is stored
            before = consumer.receive()
            assert before[-1] == b"before"
            consumer.ack(before)

            free_the_filler(gateway, small_disk)
            until_accepted(lambda: producer.produce(b"after", producer_id=b"m2")[1] == b"1")
            after = consumer.receive()
            assert after[-1] == b"after"
            consumer.ack(after)


def test_emqp_refuses_with_an_error_reply_and_resumes(small_disk: Path, context: zmq.Context) -> None:
    prefix, data_dir = full_disk_gateway(small_disk)
    with running_gateway(data_dir=data_dir, prefix=prefix) as gateway, \
            EMQPClient(context, gateway.addresses["emqp-frontend"]) as client, \
            EMQPWorker(context, gateway.addresses["emqp-backend"]) as worker:
        before = client.request("jobs", b"[0]")  # waits in its queue: no worker yet
        worker.inform([(10, "jobs")])
        worker.ready()
        assert worker.job()[3] == before  # stored and handed out before the disk fills
        publish_until_refused(gateway)

        for number in range(5):
            sent = client.request("jobs", b"[%d]" % (number + 1))
            reply = client.receive()
            assert reply[2] == emqp.REPLY and reply[4] == sent, reply
            assert reply[5] == f"ERROR: the store failed: {NO_SPACE}".encode(), reply
        the_failure_is_logged_once(gateway)

        free_the_filler(gateway, small_disk)
        worker.ready()

        def accepted() -> bool:
            sent = client.request("jobs", b"[after]")
            reply = client.receive()
            assert reply[4] == sent, reply
            return reply[5:] == []  # the "dispatched" REPLY: handed to the worker

        until_accepted(accepted)
        assert worker.job()[6] == b"[after]"
