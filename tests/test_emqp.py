"""The eMQP broker against a real gateway with pyzmq peers as EventMQ's connect (DEALERs with
their own identity): INFORM/ACK, READY slots, REQUEST forwarding and the "dispatched" REPLY,
weights and round robin, buffering in FIFO order, worker REPLY, jobs of a gone worker handed to
another, heartbeats, the admin socket, and what the original gets wrong (docs/protocols/emqp.md)."""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from polymq.codecs import emqp

from support.emqp_wire import Client, Peer, Worker, admin, admin_json
from support.gateway import GatewayProcess, running_gateway

JOB = b'["run", {"path": "jobs", "callable": "work", "args": [], "kwargs": {}}]'


@pytest.fixture
def gateway(tmp_path: Path) -> Iterator[GatewayProcess]:
    with running_gateway(data_dir=tmp_path) as process:
        yield process


def backend(gateway: GatewayProcess) -> str:
    return gateway.addresses["emqp-backend"]


def frontend(gateway: GatewayProcess) -> str:
    return gateway.addresses["emqp-frontend"]


def wait_until(check: object, what: str, timeout: float = 5.0) -> None:
    """Poll the broker's own answers (admin socket) until `check()` holds."""
    deadline = time.monotonic() + timeout
    while not check():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout} s: {what}")
        time.sleep(0.01)


def workers(context: zmq.Context, gateway: GatewayProcess) -> dict[str, dict[str, object]]:
    shown = admin_json(context, gateway.addresses["emqp-admin"], emqp.ROUTER_SHOW_WORKERS)
    return shown["connected_workers"]  # type: ignore[return-value]


def slots(context: zmq.Context, gateway: GatewayProcess, worker: Peer) -> int:
    return int(workers(context, gateway)[worker.identity.decode()]["available_slots"])  # type: ignore[call-overload]


def test_inform_is_acked_then_heartbeated_and_a_request_is_forwarded_and_dispatched(
        gateway: GatewayProcess, context: zmq.Context) -> None:
    with Worker(context, backend(gateway)) as worker, Client(context, frontend(gateway)) as client:
        sent = worker.send(emqp.INFORM, b'[[10, "email"]]', emqp.WORKER)
        ack = worker.receive(skip_heartbeats=False)
        assert ack[:3] == [b"", b"eMQP/1.0", b"ACK"] and ack[4:] == [sent] and len(ack) == 5
        heartbeat = worker.receive(skip_heartbeats=False)  # at once: the jobmanager starts its processes
        assert heartbeat[2] == emqp.HEARTBEAT and abs(float(heartbeat[4]) - time.time()) < 5
        worker.ready()
        wait_until(lambda: slots(context, gateway, worker) == 1, "one slot")
        client_msgid = client.request("email", JOB, b"reply-requested,timeout:30")
        job = worker.job()
        assert job == [b"", b"eMQP/1.0", b"REQUEST", client_msgid, b"email", b"reply-requested,timeout:30", JOB]
        dispatched = client.receive()
        assert dispatched[:3] == [b"", b"eMQP/1.0", b"REPLY"] and dispatched[4:] == [client_msgid]
        assert dispatched[3] not in (client_msgid, b"") and len(dispatched) == 5


def test_buffered_requests_go_out_in_order_on_ready_without_a_dispatched_reply(
        gateway: GatewayProcess, context: zmq.Context) -> None:
    with Worker(context, backend(gateway)) as worker, Client(context, frontend(gateway)) as client:
        worker.inform([(10, "jobs")])
        sent = [client.request("jobs", b"[%d]" % index) for index in range(3)]
        wait_until(lambda: admin_json(context, gateway.addresses["emqp-admin"], emqp.STATUS)[
            "waiting_messages_by_queue"] == {"jobs": 3}, "three waiting")
        worker.ready(3)
        got = [worker.job() for _ in range(3)]
        assert [job[3] for job in got] == sent and [job[6] for job in got] == [b"[0]", b"[1]", b"[2]"]
        assert client.nothing_within(200), "the original never says 'dispatched' for a buffered request"


def test_highest_weight_first_and_equal_weights_in_turn(gateway: GatewayProcess, context: zmq.Context) -> None:
    with Worker(context, backend(gateway)) as heavy, Worker(context, backend(gateway)) as light, \
            Client(context, frontend(gateway)) as client:
        heavy.inform([(10, "w")])
        light.inform([(5, "w")])
        heavy.ready(2)
        light.ready(2)
        wait_until(lambda: slots(context, gateway, heavy) == 2 and slots(context, gateway, light) == 2, "slots")
        sent = [client.request("w", b"[%d]" % index) for index in range(3)]
        assert [heavy.job()[3], heavy.job()[3]] == sent[:2]
        assert light.job()[3] == sent[2]
    with Worker(context, backend(gateway)) as first, Worker(context, backend(gateway)) as second, \
            Client(context, frontend(gateway)) as client:
        first.inform([(7, "even")])
        second.inform([(7, "even")])
        # One after the other: ZeroMQ fair-queues the two peers, so READYs sent together may be
        # read in either order; the slot that waited longest is served first.
        first.ready(2)
        wait_until(lambda: slots(context, gateway, first) == 2, "first's slots")
        second.ready(2)
        wait_until(lambda: slots(context, gateway, second) == 2, "second's slots")
        sent = [client.request("even", b"[%d]" % index) for index in range(4)]
        assert [first.job()[3], first.job()[3]] == [sent[0], sent[2]]
        assert [second.job()[3], second.job()[3]] == [sent[1], sent[3]]


def test_ready_serves_the_worker_s_queues_in_the_order_it_listed_them(gateway: GatewayProcess,
                                                                      context: zmq.Context) -> None:
    with Worker(context, backend(gateway)) as worker, Client(context, frontend(gateway)) as client:
        worker.inform([(1, "urgent"), (50, "bulk")])
        client.request("bulk", b"[1]")
        client.request("urgent", b"[2]")
        wait_until(lambda: admin_json(context, gateway.addresses["emqp-admin"], emqp.STATUS)[
            "waiting_messages_by_queue"] == {"bulk": 1, "urgent": 1}, "both waiting")
        worker.ready()
        assert worker.job()[4:] == [b"urgent", b"", b"[2]"]
        worker.ready()
        assert worker.job()[4:] == [b"bulk", b"", b"[1]"]


def test_a_reply_and_its_ready_end_that_job_only(gateway: GatewayProcess, context: zmq.Context) -> None:
    with Worker(context, backend(gateway)) as worker, Worker(context, backend(gateway)) as other, \
            Client(context, frontend(gateway)) as client:
        worker.inform([(10, "q")])
        worker.ready(2)
        wait_until(lambda: slots(context, gateway, worker) == 2, "slots")
        first, second = client.request("q", b"[1]"), client.request("q", b"[2]", b"reply-requested")
        jobs = [worker.job(), worker.job()]
        worker.reply(jobs[1])
        worker.ready()
        wait_until(lambda: slots(context, gateway, worker) == 1, "the READY")
        status = admin_json(context, gateway.addresses["emqp-admin"], emqp.STATUS)
        assert status["inflight_messages_by_queue"] == {"q": 1}
        other.inform([(10, "q")])
        other.ready()
        worker.send(emqp.KBYE)  # the job it still holds is the first: it goes to the other worker
        again = other.job()
        assert again[3:] == [first, b"q", b"", b"[1]"] and again[3] != second
        wait_until(lambda: admin_json(context, gateway.addresses["emqp-admin"], emqp.STATUS)["polymq"][
            "redelivered"] == 1, "counted")  # type: ignore[index]


def test_a_silent_worker_is_dropped_and_its_job_goes_to_a_live_one(tmp_path: Path, context: zmq.Context) -> None:
    # The silent worker must hold its job before the timeout drops it: 2 s, far beyond a loaded
    # machine's delays; the live one answers heartbeats ten times as often.
    with running_gateway("--emqp-heartbeat-interval", "200", "--emqp-heartbeat-timeout", "2000",
                         data_dir=tmp_path) as gateway, \
            Worker(context, backend(gateway)) as silent, Worker(context, backend(gateway)) as live, \
            Client(context, frontend(gateway)) as client:
        silent.inform([(10, "q")])
        silent.ready()
        wait_until(lambda: slots(context, gateway, silent) == 1, "slot")
        sent = client.request("q", b"[1]")
        assert silent.job()[3] == sent
        live.inform([(10, "q")])
        live.ready()
        heartbeats = 0
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:  # the live worker answers each heartbeat, the silent one never
            frames = live.receive(skip_heartbeats=False)
            if frames[2] == emqp.HEARTBEAT:
                heartbeats += 1
                live.send(emqp.HEARTBEAT, str(time.time()).encode())
                continue
            assert frames[2:5] == [emqp.REQUEST, sent, b"q"]
            break
        else:
            raise AssertionError("the silent worker's job never reached the live one")
        assert heartbeats >= 3
        assert list(workers(context, gateway)) == [live.identity.decode()]
        line = gateway.wait_for_log(lambda line: "(silent for 2 s): 1 jobs back to their queues" in line)
        assert silent.identity.decode() in line


def test_bad_inform_is_answered_and_unknown_peers_and_disconnects_stop_nothing(
        gateway: GatewayProcess, context: zmq.Context) -> None:
    with Peer(context, backend(gateway)) as bad:
        bad.send(emqp.INFORM, b"[[10, 'single quotes']]", emqp.WORKER)
        answer = bad.receive()
        assert answer[2] == emqp.DISCONNECT and answer[4].startswith(b"INFORM queues are not a JSON list")
    with Peer(context, backend(gateway)) as stranger:
        stranger.send(emqp.READY)
        stranger.send(emqp.DISCONNECT)
        assert stranger.nothing_within(100)
    with Worker(context, backend(gateway)) as worker, Client(context, frontend(gateway)) as client:
        worker.inform([(10, "q")])
        worker.send(emqp.DISCONNECT)  # the original crashes
        client.send(emqp.DISCONNECT)  # the original stops
        worker.ready()
        wait_until(lambda: slots(context, gateway, worker) == 1, "still serving")
        sent = client.request("q", b"[1]")
        assert worker.job()[3] == sent
    counters = admin_json(context, gateway.addresses["emqp-admin"], emqp.STATUS)["polymq"]
    assert counters["unknown_peer"] == 2 and counters["ignored_disconnects"] == 2  # type: ignore[index]
    assert counters["invalid"] == 1  # type: ignore[index]
    refused = admin(context, gateway.addresses["emqp-admin"], emqp.DISCONNECT)
    assert refused[2] == emqp.REPLY and refused[5].startswith(b"ERROR: DISCONNECT is turned off")
    assert gateway.process.poll() is None


def test_admin_disconnect_when_enabled_stops_the_gateway_cleanly(tmp_path: Path, context: zmq.Context) -> None:
    with running_gateway("--emqp-admin-disconnect", data_dir=tmp_path) as gateway, \
            Worker(context, backend(gateway)) as worker:
        worker.inform([(10, "q")])
        answer = admin(context, gateway.addresses["emqp-admin"], emqp.DISCONNECT)
        assert answer[2] == emqp.ACK and answer[4].startswith(b"admin:")
        assert worker.receive()[2] == emqp.KBYE
        assert gateway.process.wait(10) == 0


def test_binary_identities_and_frames_work(gateway: GatewayProcess, context: zmq.Context) -> None:
    with Worker(context, backend(gateway), identity=b"\x00\xff\xfeW") as worker, \
            Client(context, frontend(gateway), identity=b"\x80\x81C") as client:
        worker.inform([(10, "bin")])
        worker.ready()
        wait_until(lambda: workers(context, gateway)["\x00\\xff\\xfeW"]["available_slots"] == 1, "slot")
        client_msgid = b"\xff\x00msgid"
        client.request("bin", b"\x00\x01\xff payload", b"\xfeheader", message_id=client_msgid)
        assert worker.job()[3:] == [client_msgid, b"bin", b"\xfeheader", b"\x00\x01\xff payload"]
        assert client.receive()[4:] == [client_msgid]


def test_malformed_messages_are_counted_and_the_broker_carries_on(gateway: GatewayProcess,
                                                                   context: zmq.Context) -> None:
    with Worker(context, backend(gateway)) as worker, Client(context, frontend(gateway)) as client:
        worker.inform([(10, "q")])
        client.sock.send_multipart([b"", b"eMQP/1.0", b"REQUEST"])  # no msgid
        client.sock.send_multipart([b"x", b"eMQP/1.0", b"REQUEST", b"m", b"q", b"", b"[]"])  # no delimiter
        client.sock.send_multipart([b"", b"eMQP/9", b"REQUEST", b"m", b"q", b"", b"[]"])  # another version
        short = client.send(emqp.REQUEST, b"q")  # no headers, no message
        refused = client.receive()
        assert refused[2] == emqp.REPLY and refused[4:] == [short, b"ERROR: REQUEST with 1 body frames "
                                                                   b"(queue, headers, message)"]
        bad_name = client.send(emqp.REQUEST, b"\xff", b"", b"[]")
        assert client.receive()[4:] == [bad_name, b"ERROR: a queue name that is not UTF-8"]
        client.send(b"FROBNICATE")
        worker.ready()
        wait_until(lambda: slots(context, gateway, worker) == 1, "slot")
        sent = client.request("q", b"[1]")
        assert worker.job()[3] == sent
    counters = admin_json(context, gateway.addresses["emqp-admin"], emqp.STATUS)["polymq"]
    assert counters == {"invalid": 5, "unknown_peer": 0, "refused": 2, "redelivered": 0,  # type: ignore[comparison-overlap]
                        "ignored_disconnects": 0, "schedules": {}, "handed_out_by_queue": {"q": 1}}


def test_a_depth_limit_refuses_with_a_reply_instead_of_dropping(tmp_path: Path, context: zmq.Context) -> None:
    with running_gateway("--emqp-max-depth", "2", data_dir=tmp_path) as gateway, \
            Client(context, frontend(gateway)) as client, Worker(context, backend(gateway)) as worker:
        kept = [client.request("full", b"[%d]" % index) for index in range(2)]
        third = client.request("full", b"[2]")
        assert client.receive()[4:] == [third, b"ERROR: queue full holds 2 requests (the limit)"]
        worker.inform([(10, "full")])
        worker.ready(3)
        assert [worker.job()[3], worker.job()[3]] == kept
        assert worker.nothing_within(100)


def test_requests_for_a_queue_without_workers_wait_in_it_unless_rerouting_is_asked(
        tmp_path: Path, context: zmq.Context) -> None:
    with running_gateway(data_dir=tmp_path / "a") as gateway, Client(context, frontend(gateway)) as client, \
            Worker(context, backend(gateway)) as default:
        default.inform(None)  # '' = [[10, "default"]]
        default.ready()
        wait_until(lambda: slots(context, gateway, default) == 1, "slot")
        sent = client.request("reports", b"[1]")
        assert default.nothing_within(150)
        with Worker(context, backend(gateway)) as reports:
            reports.inform([(10, "reports")])
            reports.ready()
            assert reports.job()[3:5] == [sent, b"reports"]
    with running_gateway("--emqp-reroute-unknown", data_dir=tmp_path / "b") as gateway, \
            Client(context, frontend(gateway)) as client, Worker(context, backend(gateway)) as default:
        default.inform(None)
        default.ready()
        wait_until(lambda: slots(context, gateway, default) == 1, "slot")
        sent = client.request("reports", b"[1]")
        assert default.job()[3:5] == [sent, b"default"]


def test_waiting_requests_survive_a_restart(tmp_path: Path, context: zmq.Context) -> None:
    with running_gateway(data_dir=tmp_path) as gateway, Client(context, frontend(gateway)) as client:
        sent = [client.request("durable", b"[%d]" % index, b"reply-requested") for index in range(3)]
        wait_until(lambda: admin_json(context, gateway.addresses["emqp-admin"], emqp.STATUS)[
            "waiting_messages_by_queue"] == {"durable": 3}, "stored")
    with running_gateway(data_dir=tmp_path) as gateway, Worker(context, backend(gateway)) as worker:
        worker.inform([(10, "durable")])
        worker.ready(3)
        got = [worker.job() for _ in range(3)]
        assert [job[3] for job in got] == sent
        assert {job[5] for job in got} == {b"reply-requested"}


def test_admin_status_workers_and_schedulers(gateway: GatewayProcess, context: zmq.Context) -> None:
    address = gateway.addresses["emqp-admin"]
    with Worker(context, backend(gateway)) as worker, Client(context, frontend(gateway)) as client, \
            Peer(context, frontend(gateway)) as scheduler:
        worker.inform([(30, "a"), (5, "b")])
        worker.ready(2)
        wait_until(lambda: slots(context, gateway, worker) == 2, "slots")
        client.request("a", b"[1]")
        worker.job()
        scheduler.send(emqp.INFORM, b"", emqp.SCHEDULER)
        assert scheduler.receive()[2] == emqp.ACK
        status = admin_json(context, address, emqp.STATUS)
        assert status["inflight_messages_by_queue"] == {"a": 1}
        assert status["processed_messages_by_queue"] == {"a": 1}
        assert status["processed_messages_by_worker"] == {worker.identity.decode(): 1}
        assert set(status) >= {"latency_messages_by_queue", "max_latency_messages_by_queue",
                               "waiting_messages_by_queue"}
        assert 0 <= status["max_latency_messages_by_queue"]["a"] < 5000  # type: ignore[index]
        shown = admin_json(context, address, emqp.ROUTER_SHOW_WORKERS)
        me = worker.identity.decode()
        assert shown["connected_workers"][me]["queues"] == [[30, "a"], [5, "b"]]  # type: ignore[index]
        assert shown["connected_workers"][me]["available_slots"] == 1  # type: ignore[index]
        assert shown["connected_queues"] == {"a": [[30, me]], "b": [[5, me]]}
        schedulers = admin_json(context, address, emqp.ROUTER_SHOW_SCHEDULERS)
        assert list(schedulers["connected_schedulers"]) == [scheduler.identity.decode()]  # type: ignore[call-overload]
        with Peer(context, address, identity=b"cli") as cli:
            cli.send(b"HELLO")  # emq-cli's greeting: no answer, so its next read is the next answer
            cli.send(emqp.STATUS)
            assert json.loads(cli.receive()[4])["processed_messages_by_queue"] == {"a": 1}


def test_status_counts_as_processed_only_a_request_handed_over_as_it_arrived(gateway: GatewayProcess,
                                                                           context: zmq.Context) -> None:
    """The original's rule; every job handed out is in polymq's own `handed_out_by_queue`."""
    address = gateway.addresses["emqp-admin"]
    with Worker(context, backend(gateway)) as worker, Client(context, frontend(gateway)) as client:
        worker.inform([(10, "counted")])
        client.request("counted", b"[1]")  # no free slot yet: it waits in its queue
        wait_until(lambda: admin_json(context, address, emqp.STATUS)["waiting_messages_by_queue"].get("counted"),
                   "the request waiting")
        worker.ready(1)
        worker.job()
        worker.ready(1)  # ends that job and offers a slot
        wait_until(lambda: slots(context, gateway, worker) == 1, "a free slot")
        client.request("counted", b"[2]")  # handed over as it arrives
        worker.job()
        status = admin_json(context, address, emqp.STATUS)
        assert status["processed_messages_by_queue"].get("counted") == 1
        assert status["processed_messages_by_worker"].get(worker.identity.decode()) == 1
        assert status["polymq"]["handed_out_by_queue"]["counted"] == 2


def test_a_job_whose_workers_keep_going_is_dead_lettered_after_the_max_attempts(tmp_path: Path,
                                                                                 context: zmq.Context) -> None:
    with running_gateway("--emqp-max-attempts", "2", data_dir=tmp_path) as gateway, \
            Client(context, frontend(gateway)) as client:
        sent = client.request("poison", b"not a job")
        for _ in range(2):
            with Worker(context, backend(gateway)) as worker:
                worker.inform([(10, "poison")])
                worker.ready()
                assert worker.job()[3] == sent
                worker.send(emqp.KBYE)  # as a jobmanager that crashed on it and came back as another
                wait_until(lambda worker=worker: worker.identity.decode() not in workers(context, gateway), "gone")
        with Worker(context, backend(gateway)) as worker:
            worker.inform([(10, "poison"), (1, "poison.dead")])
            worker.ready(2)
            assert worker.job()[3:5] == [sent, b"poison.dead"]
            assert worker.nothing_within(100)


def test_a_ready_ends_the_oldest_job_that_expects_no_reply(tmp_path: Path, context: zmq.Context) -> None:
    with running_gateway("--emqp-worker-processes", "2", data_dir=tmp_path) as gateway, \
            Worker(context, backend(gateway)) as worker, Worker(context, backend(gateway)) as other, \
            Client(context, frontend(gateway)) as client:
        worker.inform([(10, "mixed")])
        worker.ready(2)  # its two processes start
        wait_until(lambda: slots(context, gateway, worker) == 2, "slots")
        replying = client.request("mixed", b"[1]", b"reply-requested")
        plain = client.request("mixed", b"[2]")
        assert [worker.job()[3], worker.job()[3]] == [replying, plain]
        worker.ready()  # the plain job is done (its READY comes with no REPLY)
        wait_until(lambda: slots(context, gateway, worker) == 1, "the READY")
        other.inform([(10, "mixed")])
        other.ready(2)
        worker.send(emqp.KBYE)
        assert other.job()[3] == replying  # still running when its worker went: handed on
        assert other.nothing_within(150)


def test_the_pub_sub_device_fans_out_by_prefix_and_to_the_topic_s_queues(gateway: GatewayProcess,
                                                                         context: zmq.Context) -> None:
    subscriber = context.socket(zmq.SUB)
    other = context.socket(zmq.SUB)
    try:
        for sock, prefix in ((subscriber, b"upd"), (other, b"zzz")):
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RCVTIMEO, 3000)
            sock.setsockopt(zmq.SUBSCRIBE, prefix)
            sock.connect(f"tcp://{gateway.addresses['emqp-pubsub-out']}")
        with Peer(context, gateway.addresses["emqp-pubsub-in"]) as publisher, \
                Worker(context, backend(gateway)) as worker:
            # A SUB's subscription reaches the PUB a moment after it connects: publish until it shows.
            poller = zmq.Poller()
            poller.register(subscriber, zmq.POLLIN)
            while True:
                publisher.send(emqp.PUBLISH, b"upd-warmup", b"w")
                if poller.poll(20):
                    break
            publisher.send(emqp.PUBLISH, b"upd-warmup", b"end")  # the warm-ups before it, then it
            while subscriber.recv_multipart() != [b"upd-warmup", b"end"]:
                pass
            worker.inform([(10, "updates")])
            worker.ready()
            wait_until(lambda: slots(context, gateway, worker) == 1, "slot")
            publisher.send(emqp.PUBLISH, b"updates", b'["update", "1"]')
            assert subscriber.recv_multipart() == [b"updates", b'["update", "1"]']
            job = worker.job()  # the topic's queue got its copy
            assert job[4:] == [b"updates", b"", b'["update", "1"]']
            publisher.send(emqp.REQUEST, b"updates", b"", b"[]")  # not for this device: ignored
            publisher.send(emqp.PUBLISH, b"updates")  # no body frame
            publisher.send(emqp.PUBLISH, b"upd2", b"last")
            assert subscriber.recv_multipart() == [b"upd2", b"last"]
            other.setsockopt(zmq.RCVTIMEO, 100)
            with pytest.raises(zmq.Again):
                other.recv_multipart()
    finally:
        subscriber.close(linger=0)
        other.close(linger=0)


def job_payload(tag: str) -> bytes:
    return json.dumps(["run", {"path": "jobs", "callable": "record", "args": [tag], "kwargs": {},
                               "class_args": [], "class_kwargs": {}}]).encode()


def gateway_schedules(context: zmq.Context, gateway: GatewayProcess) -> dict[str, dict[str, object]]:
    status = admin_json(context, gateway.addresses["emqp-admin"], emqp.STATUS)
    return status["polymq"]["schedules"]  # type: ignore[index, no-any-return]


def test_the_gateway_runs_a_schedule_itself_each_firing_a_request(gateway: GatewayProcess,
                                                                   context: zmq.Context) -> None:
    with Worker(context, backend(gateway)) as worker, Client(context, frontend(gateway)) as client:
        worker.inform([(10, "cronq")])
        worker.ready(5)
        wait_until(lambda: slots(context, gateway, worker) == 5, "slots")
        payload = job_payload("tick")
        started = time.monotonic()  # before the gateway can have the schedule, however late its jobs are read
        client.send(emqp.SCHEDULE, b"cronq", b"guarantee,run_count:2", b"1", payload, b"")
        first = worker.job()  # at once (no nohaste)
        assert first[4:] == [b"cronq", b"reply-requested", payload]
        second = worker.job()
        assert 0.8 < time.monotonic() - started < 3.0
        assert second[4:] == first[4:] and second[3] != first[3]  # one request per firing
        wait_until(lambda: gateway_schedules(context, gateway) == {}, "run_count:2 reached")
        assert worker.nothing_within(1200)


def test_nohaste_waits_and_unschedule_removes_the_job_of_that_identity(gateway: GatewayProcess,
                                                                       context: zmq.Context) -> None:
    with Worker(context, backend(gateway)) as worker, Client(context, frontend(gateway)) as client:
        worker.inform([(10, "later")])
        worker.ready()
        client.send(emqp.SCHEDULE, b"later", b"nohaste", b"3600", job_payload("hourly"), b"")
        client.send(emqp.SCHEDULE, b"later", b"nohaste", b"-1", job_payload("cron"), b"0 4 * * *")
        wait_until(lambda: len(gateway_schedules(context, gateway)) == 2, "both kept")
        shown = gateway_schedules(context, gateway)
        hourly = shown[emqp.schedule_key(job_payload("hourly"))]  # type: ignore[index]
        assert hourly["queue"] == "later" and hourly["interval"] == 3600 and hourly["runs_left"] == -1
        assert 3590 < float(hourly["next"]) - time.time() <= 3600  # type: ignore[arg-type]
        assert shown[emqp.schedule_key(job_payload("cron"))]["cron"] == "0 4 * * *"  # type: ignore[index]
        # UNSCHEDULE names the job (its queue is ignored, as the original's); headers and times do not count.
        client.send(emqp.UNSCHEDULE, b"elsewhere", b"", b"5", job_payload("hourly"), b"")
        wait_until(lambda: list(gateway_schedules(context, gateway)) == [emqp.schedule_key(job_payload("cron"))],
                   "hourly gone")
        bad = client.send(emqp.SCHEDULE, b"later", b"", b"-1", job_payload("x"), b"every tuesday")
        assert client.receive()[4:] == [bad, b"ERROR: 'every tuesday' is not a cron expression"]
        assert worker.nothing_within(100)


def test_schedules_survive_a_restart(tmp_path: Path, context: zmq.Context) -> None:
    with running_gateway(data_dir=tmp_path) as gateway, Client(context, frontend(gateway)) as client:
        client.send(emqp.SCHEDULE, b"nightly", b"nohaste,run_count:7", b"-1", job_payload("n"), b"30 2 * * *")
        wait_until(lambda: len(gateway_schedules(context, gateway)) == 1, "kept")
        before = gateway_schedules(context, gateway)
    with running_gateway(data_dir=tmp_path) as gateway:
        assert gateway_schedules(context, gateway) == before


def test_with_an_emq_scheduler_connected_schedules_go_to_it_as_in_the_original(gateway: GatewayProcess,
                                                                               context: zmq.Context) -> None:
    with Peer(context, frontend(gateway)) as older, Peer(context, frontend(gateway)) as newest, \
            Client(context, frontend(gateway)) as client:
        for scheduler in (older, newest):
            scheduler.send(emqp.INFORM, b"", emqp.SCHEDULER)
            assert scheduler.receive()[2] == emqp.ACK
        body = [b"q", b"", b"60", job_payload("s"), b""]
        msgid = client.send(emqp.SCHEDULE, *body)
        assert newest.receive() == [b"", b"eMQP/1.0", emqp.SCHEDULE, msgid, *body]
        assert older.nothing_within(100)
        msgid = client.send(emqp.UNSCHEDULE, *body)
        assert newest.receive()[2:4] == [emqp.UNSCHEDULE, msgid]
        assert older.receive()[2:4] == [emqp.UNSCHEDULE, msgid]
        assert gateway_schedules(context, gateway) == {}


def _queue_names(gateway: GatewayProcess) -> set[str]:
    with urllib.request.urlopen(f"http://{gateway.http}/api/state", timeout=5) as response:
        return {queue["name"] for queue in json.loads(response.read())["queues"]}


def test_an_emptied_queue_no_worker_serves_is_forgotten_one_that_holds_jobs_is_kept(
        tmp_path: Path, context: zmq.Context) -> None:
    with running_gateway("--emqp-forget-empty", "0", data_dir=tmp_path) as gateway, \
            Client(context, frontend(gateway)) as client:
        with Worker(context, backend(gateway)) as worker:
            worker.inform([(10, "emptied"), (5, "kept")])
            worker.ready()
            wait_until(lambda: slots(context, gateway, worker) == 1, "the READY")
            client.request("emptied", JOB)
            worker.reply(worker.job())  # and no READY: the next request waits
            client.request("kept", JOB)
            wait_until(lambda: admin_json(context, gateway.addresses["emqp-admin"], emqp.STATUS)[
                "waiting_messages_by_queue"] == {"kept": 1}, "the waiting request")
            worker.send(emqp.KBYE)
            wait_until(lambda: not workers(context, gateway), "the KBYE")
        wait_until(lambda: "emptied" not in _queue_names(gateway), "the emptied queue forgotten")
        assert "kept" in _queue_names(gateway)


def test_forget_empty_minus_one_keeps_every_queue(tmp_path: Path, context: zmq.Context) -> None:
    with running_gateway("--emqp-forget-empty", "-1", data_dir=tmp_path) as gateway:
        with Worker(context, backend(gateway)) as worker:
            worker.inform([(10, "stays")])
            worker.send(emqp.KBYE)
            wait_until(lambda: not workers(context, gateway), "the KBYE")
        assert "stays" in _queue_names(gateway)
