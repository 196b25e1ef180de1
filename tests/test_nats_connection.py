"""The NATS client on trio (jetstream/nats_connection.py) against real nats-server processes: publish and
subscribe, headers, request and reply, no responders, timeouts, server PINGs, reconnection in a cluster,
the reconnect buffer, stale links, close, no server at all, and a JetStream stream with its acks."""

from __future__ import annotations

import json
import os
import random
import signal
import ssl
import subprocess
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio

from polymq.clients.link_proxy import LinkProxy
from polymq.clients.ports import free_ports
from polymq.jetstream import api
from polymq.jetstream.nats_connection import (
    RECONNECT_BUF_SIZE,
    ConnectionLost,
    Msg,
    NatsConnection,
    NatsError,
    NatsOptions,
    NoResponders,
    NoServers,
    RequestTimeout,
)

from support.nats_cluster import NatsCluster, NatsServer

# Generous: a loaded 2-core machine runs three servers and the test.
DEADLINE_S = 30.0


@attrs.define(slots=True, eq=False)
class Hooks:
    """What the connection's callbacks reported, in order."""

    calls: list[str] = attrs.field(factory=list)
    disconnected: trio.Event = attrs.field(factory=trio.Event)
    reconnected: trio.Event = attrs.field(factory=trio.Event)

    def on_disconnected(self) -> None:
        self.calls.append("disconnected")
        self.disconnected.set()

    def on_reconnected(self) -> None:
        self.calls.append("reconnected")
        self.reconnected.set()

    def rearm(self) -> None:
        self.disconnected = trio.Event()
        self.reconnected = trio.Event()


@asynccontextmanager
async def connected(urls: list[str], hooks: Hooks | None = None, **options: Any) -> AsyncIterator[NatsConnection]:
    hooks = hooks or Hooks()
    async with trio.open_nursery() as nursery:
        connection = await NatsConnection.connect(NatsOptions(servers=urls, **options), nursery,
                                                  on_disconnected=hooks.on_disconnected,
                                                  on_reconnected=hooks.on_reconnected)
        try:
            yield connection
        finally:
            await connection.close()


async def refusal(urls: list[str], **options: Any) -> str:
    """The text of the NoServers that connecting raises."""
    async with trio.open_nursery() as nursery:
        with pytest.raises(NoServers) as raised:
            await NatsConnection.connect(NatsOptions(servers=urls, **options), nursery)
    return str(raised.value)


class Inbox:
    """A subscription's messages, and a wait for the n-th."""

    def __init__(self) -> None:
        self.messages: list[Msg] = []
        self._changed = trio.Event()

    def __call__(self, msg: Msg) -> None:
        self.messages.append(msg)
        self._changed.set()

    async def wait_for(self, count: int) -> list[Msg]:
        with trio.fail_after(DEADLINE_S):
            while len(self.messages) < count:
                self._changed = trio.Event()
                await self._changed.wait()
        return self.messages


async def test_ten_thousand_messages_round_trip_with_exact_bodies_in_order(nats_server: NatsServer) -> None:
    rng = random.Random(7)
    bodies = [b"%d:" % i + rng.randbytes(i % 300) + (b"\r\nPING\r\n" if i % 11 == 0 else b"") for i in range(10_000)]
    bodies[5] = b""
    async with connected([nats_server.url]) as connection:
        assert connection.connected_url == nats_server.url
        assert connection.server_info["server_name"] == "n1"
        inbox = Inbox()
        sid = connection.subscribe("bulk.one", inbox)
        for body in bodies:
            connection.publish("bulk.one", body)
        received = await inbox.wait_for(len(bodies))
        assert [msg.payload for msg in received] == bodies
        assert {(msg.subject, msg.sid, msg.reply, msg.headers) for msg in received} == {("bulk.one", sid, None, None)}


async def test_headers_and_reply_subject_round_trip(nats_server: NatsServer) -> None:
    headers = {"Nats-Msg-Id": "id-1", "X-Polymq": "a b: c", "Empty": "", "Unicode": "caf\u00e9"}
    async with connected([nats_server.url]) as connection:
        inbox = Inbox()
        connection.subscribe("headers.*", inbox)
        connection.publish("headers.one", b"body\r\n", headers=headers, reply="some.reply")
        connection.publish("headers.two", b"", headers={})
        first, second = await inbox.wait_for(2)
        assert (first.subject, first.reply, first.payload, first.headers, first.status) == (
            "headers.one", "some.reply", b"body\r\n", headers, None)
        assert (second.subject, second.payload, second.headers) == ("headers.two", b"", {})


async def test_bad_names_are_refused_before_anything_is_sent(nats_server: NatsServer) -> None:
    async with connected([nats_server.url]) as connection:
        for subject in ("", "a b", "a\r\nPUB x 1"):
            with pytest.raises(ValueError):
                connection.publish(subject, b"x")
            with pytest.raises(ValueError):
                connection.subscribe(subject, Inbox())
        with pytest.raises(ValueError):
            connection.publish("ok", b"x", headers={"X": "a\r\nY: b"})
        with pytest.raises(NatsError):
            connection.publish("ok", b"x" * (connection.max_payload + 1))
        await connection.flush()  # the link is still up: nothing broke the framing
        assert connection.is_connected


async def test_request_reply_through_a_second_connection(nats_server: NatsServer) -> None:
    async with connected([nats_server.url]) as responder, connected([nats_server.url]) as requester:

        def echo(msg: Msg) -> None:
            assert msg.reply is not None
            responder.publish(msg.reply, b"echo:" + msg.payload, headers={"Seen": msg.subject})

        responder.subscribe("svc.echo", echo, queue="workers")
        await responder.flush()
        reply = await requester.request("svc.echo", b"hello", timeout=DEADLINE_S)
        assert (reply.payload, reply.headers) == (b"echo:hello", {"Seen": "svc.echo"})
        # Many at once through the shared inbox, each answer to its own request.
        answers: dict[int, Msg | NatsError] = {}
        all_answered = trio.Event()

        def keep(index: int) -> Any:
            def on_answer(answer: Msg | NatsError) -> None:
                assert index not in answers, "called twice"
                answers[index] = answer
                if len(answers) == 500:
                    all_answered.set()
            return on_answer

        for index in range(500):
            requester.request_nowait("svc.echo", b"%d" % index, keep(index), timeout=DEADLINE_S)
        with trio.fail_after(DEADLINE_S):
            await all_answered.wait()
        assert {index: answer.payload for index, answer in answers.items() if isinstance(answer, Msg)} == {
            index: b"echo:%d" % index for index in range(500)}


async def test_a_request_nobody_subscribes_to_gets_no_responders(nats_server: NatsServer) -> None:
    async with connected([nats_server.url]) as connection:
        with pytest.raises(NoResponders):
            await connection.request("nobody.here", b"?", timeout=DEADLINE_S)
        answers: list[Msg | NatsError] = []
        answered = trio.Event()
        connection.request_nowait("nobody.here", b"?", lambda answer: (answers.append(answer), answered.set()))
        with trio.fail_after(DEADLINE_S):
            await answered.wait()
        assert len(answers) == 1 and isinstance(answers[0], NoResponders)


async def test_a_request_never_answered_times_out_once(nats_server: NatsServer) -> None:
    async with connected([nats_server.url]) as connection:
        connection.subscribe("silent", lambda msg: None)
        await connection.flush()
        with pytest.raises(RequestTimeout):
            await connection.request("silent", b"?", timeout=0.3)
        answers: list[Msg | NatsError] = []
        three = trio.Event()

        def on_answer(answer: Msg | NatsError) -> None:
            answers.append(answer)
            if len(answers) == 3:
                three.set()

        for _ in range(3):
            connection.request_nowait("silent", b"?", on_answer, timeout=0.2)
        with trio.fail_after(DEADLINE_S):
            await three.wait()
        await connection.flush()  # a late reply or a second callback would land by now
        assert len(answers) == 3 and all(isinstance(answer, RequestTimeout) for answer in answers)


async def test_server_pings_are_answered_and_the_link_stays_up(tmp_path: Path) -> None:
    with NatsCluster(tmp_path / "nats", size=1, jetstream=False, ping_interval_s=1) as cluster:
        hooks = Hooks()
        async with connected(cluster.urls, hooks) as connection:
            with trio.fail_after(DEADLINE_S):
                while connection.server_pings < 3:
                    await trio.sleep(0.05)
            await connection.flush()
            assert connection.connected_url == cluster.urls[0]
            assert hooks.calls == []


async def test_reconnects_to_another_server_of_the_cluster(nats_cluster: NatsCluster) -> None:
    hooks = Hooks()
    async with connected(nats_cluster.urls, hooks, reconnect_wait=0.2) as connection:
        inbox = Inbox()
        connection.subscribe("reconnect.x", inbox)
        connection.subscribe("reconnect.silent", lambda msg: None)
        connection.publish("reconnect.x", b"before")
        await inbox.wait_for(1)
        pending: list[Msg | NatsError] = []
        connection.request_nowait("reconnect.silent", b"?", pending.append, timeout=600)
        await connection.flush()
        killed = nats_cluster.server_at(connection.connected_url)
        killed.kill()
        try:
            with trio.fail_after(DEADLINE_S):
                await hooks.disconnected.wait()
                await hooks.reconnected.wait()
            assert hooks.calls == ["disconnected", "reconnected"]
            assert len(pending) == 1 and isinstance(pending[0], ConnectionLost)
            assert connection.connected_url not in (None, killed.url)
            connection.publish("reconnect.x", b"after")
            assert [msg.payload for msg in await inbox.wait_for(2)] == [b"before", b"after"]
        finally:
            killed.start()
            await trio.to_thread.run_sync(nats_cluster.wait_ready)


async def test_publishes_while_disconnected_are_sent_after_reconnecting(nats_server: NatsServer) -> None:
    hooks = Hooks()
    async with connected([nats_server.url], hooks, reconnect_wait=0.1) as connection:
        inbox = Inbox()
        connection.subscribe("buffered", inbox)
        await connection.flush()
        nats_server.kill()
        with trio.fail_after(DEADLINE_S):
            await hooks.disconnected.wait()
        connection.publish("buffered", b"while down")
        chunk = b"x" * (512 * 1024)
        with pytest.raises(NatsError, match="output buffer full"):
            for _ in range(RECONNECT_BUF_SIZE // len(chunk) + 1):
                connection.publish("nobody", chunk)
        nats_server.start()
        with trio.fail_after(DEADLINE_S):
            await hooks.reconnected.wait()
        assert [msg.payload for msg in await inbox.wait_for(1)] == [b"while down"]


async def test_a_server_that_stops_answering_pings_is_left(nats_server: NatsServer) -> None:
    hooks = Hooks()
    async with connected([nats_server.url], hooks, ping_interval=0.2, max_pings_out=2, connect_timeout=1.0,
                         reconnect_wait=0.1) as connection:
        pid = nats_server.pid
        assert pid is not None
        os.kill(pid, signal.SIGSTOP)
        try:
            with trio.fail_after(DEADLINE_S):
                await hooks.disconnected.wait()
        finally:
            os.kill(pid, signal.SIGCONT)
        with trio.fail_after(DEADLINE_S):
            await hooks.reconnected.wait()
        await connection.flush()


async def test_a_link_stalled_without_a_fin_is_left_after_its_silence_and_made_again_after_the_heal(
        nats_server: NatsServer) -> None:
    """A switch that drops every packet: nothing closes, nothing comes. The link is left once the server has
    said nothing through `max_pings_out` PINGs; after the heal (the stalled connections reset) the
    connection is back with its subscriptions."""
    hooks = Hooks()
    with LinkProxy.to(nats_server.url) as proxy:
        async with connected([proxy.url], hooks, ping_interval=0.2, max_pings_out=2, connect_timeout=0.5,
                             reconnect_wait=0.1) as connection:
            inbox = Inbox()
            connection.subscribe("stalled", inbox)
            connection.publish("stalled", b"before")
            await inbox.wait_for(1)
            proxy.cut()
            cut_at = trio.current_time()
            with trio.fail_after(DEADLINE_S):
                await hooks.disconnected.wait()
            assert trio.current_time() - cut_at >= 0.2 * 2  # not before two PINGs went unanswered
            connection.publish("stalled", b"while cut")  # kept for the next link
            proxy.heal()
            with trio.fail_after(DEADLINE_S):
                await hooks.reconnected.wait()
            assert [msg.payload for msg in await inbox.wait_for(2)] == [b"before", b"while cut"]
    assert proxy.resets >= 1


async def test_close_sends_what_is_buffered_and_fails_what_is_pending(nats_server: NatsServer) -> None:
    async with connected([nats_server.url]) as receiver:
        inbox = Inbox()
        receiver.subscribe("closing", inbox)
        receiver.subscribe("closing.silent", lambda msg: None)
        await receiver.flush()
        pending: list[Msg | NatsError] = []
        async with trio.open_nursery() as nursery:
            sender = await NatsConnection.connect(NatsOptions(servers=[nats_server.url]), nursery)
            for index in range(1000):
                sender.publish("closing", b"%d" % index)
            sender.request_nowait("closing.silent", b"?", pending.append, timeout=600)
            await sender.close()
        assert len(pending) == 1 and isinstance(pending[0], ConnectionLost)
        with pytest.raises(NatsError):
            sender.publish("closing", b"late")
        assert [msg.payload for msg in await inbox.wait_for(1000)] == [b"%d" % index for index in range(1000)]


async def test_no_servers_names_every_address_tried() -> None:
    ports = free_ports(2)
    urls = [f"nats://127.0.0.1:{port}" for port in ports]
    message = await refusal([*urls[:1], f"127.0.0.1:{ports[1]}"])
    for url in urls:
        assert url in message
    assert message.count("Connection refused") == 2, message


async def test_jetstream_stream_and_publish_acks(nats_server: NatsServer) -> None:
    async with connected([nats_server.url]) as connection:
        config = {"name": "ORDERS", "subjects": ["orders.>"], "storage": "file", "num_replicas": 1}
        created = json.loads((await connection.request("$JS.API.STREAM.CREATE.ORDERS", json.dumps(config).encode(),
                                                       timeout=DEADLINE_S)).payload)
        assert "error" not in created, created
        assert created["config"]["name"] == "ORDERS"
        acks = Inbox()
        reply = connection.new_inbox()
        connection.subscribe(reply, acks)
        connection.publish("orders.new", b"first", reply=reply)
        (ack,) = await acks.wait_for(1)
        assert json.loads(ack.payload) == {"stream": "ORDERS", "seq": 1}
        second = await connection.request("orders.new", b"second", headers={"Nats-Msg-Id": "m2"}, timeout=DEADLINE_S)
        assert json.loads(second.payload) == {"stream": "ORDERS", "seq": 2}
        again = await connection.request("orders.new", b"second", headers={"Nats-Msg-Id": "m2"}, timeout=DEADLINE_S)
        assert json.loads(again.payload) == {"stream": "ORDERS", "seq": 2, "duplicate": True}


def _make_certificates(directory: Path) -> tuple[Path, Path, Path]:
    """A throwaway CA, and a certificate for 127.0.0.1 and localhost it signed: (ca, cert, key)."""
    directory.mkdir()

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=directory, check=True, capture_output=True, timeout=30)

    (directory / "ca.ext").write_text("basicConstraints=critical,CA:TRUE\nkeyUsage=critical,keyCertSign,cRLSign\n")
    (directory / "server.ext").write_text("basicConstraints=critical,CA:FALSE\nextendedKeyUsage=serverAuth\n"
                                          "subjectAltName=DNS:localhost,IP:127.0.0.1\n")
    key = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
    openssl("req", "-new", *key, "-keyout", "ca.key", "-out", "ca.csr", "-subj", "/CN=polymq nats test CA")
    openssl("x509", "-req", "-in", "ca.csr", "-signkey", "ca.key", "-days", "2", "-extfile", "ca.ext", "-out", "ca.pem")
    openssl("req", "-new", *key, "-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=localhost")
    openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial", "-days", "2",
            "-extfile", "server.ext", "-out", "server.pem")
    return directory / "ca.pem", directory / "server.pem", directory / "server.key"


async def test_tls_when_the_server_requires_it(tmp_path: Path) -> None:
    ca, cert, key = _make_certificates(tmp_path / "tls")
    tls = f"tls {{ cert_file: {json.dumps(str(cert))}, key_file: {json.dumps(str(key))} }}"
    context = ssl.create_default_context(cafile=str(ca))
    with NatsCluster(tmp_path / "nats", size=1, jetstream=False, extra_config=tls) as cluster:
        server = cluster.servers[0]
        # The server's INFO says tls_required: the link is upgraded after it.
        async with connected([server.url], tls=context) as connection:
            inbox = Inbox()
            connection.subscribe("secure", inbox)
            connection.publish("secure", b"over TLS", headers={"A": "b"})
            (msg,) = await inbox.wait_for(1)
            assert (msg.payload, msg.headers) == (b"over TLS", {"A": "b"})
        async with connected([f"tls://127.0.0.1:{server.port}"], tls=context) as connection:
            assert connection.connected_url == f"tls://127.0.0.1:{server.port}"
            await connection.flush()
        # Without the CA the certificate is refused, and NoServers says why.
        assert "CERTIFICATE_VERIFY_FAILED" in await refusal([server.url])


async def test_user_password_and_token(tmp_path: Path) -> None:
    users = "authorization { user: polymq, password: s3cret }"
    with NatsCluster(tmp_path / "users", size=1, jetstream=False, extra_config=users) as cluster:
        server = cluster.servers[0]
        async with connected([f"nats://polymq:s3cret@127.0.0.1:{server.port}"]) as connection:
            await connection.flush()
        async with connected([server.url], user="polymq", password="s3cret") as connection:
            await connection.flush()
        assert f"{server.url}: server error 'Authorization Violation'" in await refusal(
            [server.url], user="polymq", password="wrong")
    tokens = "authorization { token: t0ken }"
    with NatsCluster(tmp_path / "token", size=1, jetstream=False, extra_config=tokens) as cluster:
        server = cluster.servers[0]
        async with connected([f"nats://t0ken@127.0.0.1:{server.port}"]) as connection:
            await connection.flush()
        async with connected([server.url], token="t0ken") as connection:
            await connection.flush()
        assert "'Authorization Violation'" in await refusal([server.url])


async def test_a_permissions_violation_is_logged_and_the_link_stays(tmp_path: Path,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    users = ('authorization { users: [ { user: polymq, password: s3cret, '
             'permissions: { publish: { deny: ["forbidden.>"] } } } ] }')
    with NatsCluster(tmp_path / "nats", size=1, jetstream=False, extra_config=users) as cluster:
        hooks = Hooks()
        async with connected(cluster.urls, hooks, user="polymq", password="s3cret") as connection:
            inbox = Inbox()
            connection.subscribe("allowed", inbox)
            connection.publish("forbidden.x", b"no")
            connection.publish("allowed", b"yes")
            assert [msg.payload for msg in await inbox.wait_for(1)] == [b"yes"]
            await connection.flush()
            assert hooks.calls == []
    assert "server error 'Permissions Violation for Publish to \"forbidden.x\"'" in caplog.text


@pytest.mark.parametrize("err_code", [api.ERR_JETSTREAM_UNAVAILABLE, api.ERR_NO_SUITABLE_PEERS])
async def test_a_passing_refusal_of_the_jetstream_api_is_asked_again(tmp_path: Path, err_code: int) -> None:
    """A cluster that just lost a server has no meta leader for a moment ("JetStream system temporarily
    unavailable"): a gateway starting then asks again instead of giving up. The server here has no
    JetStream; a subscriber answers its API subject, refusing the first request."""
    with NatsCluster(tmp_path / "nats", size=1, jetstream=False) as cluster:
        async with connected(cluster.urls) as connection:
            asked: list[Msg] = []

            def answer(msg: Msg) -> None:
                asked.append(msg)
                body: dict[str, Any] = {"type": "io.nats.jetstream.api.v1.account_info_response", "streams": 0}
                if len(asked) == 1:
                    body = {"error": {"code": 503, "err_code": err_code, "description": "passing"}}
                assert msg.reply is not None
                connection.publish(msg.reply, json.dumps(body).encode())

            connection.subscribe("$JS.API.INFO", answer)
            await connection.flush()
            with trio.fail_after(DEADLINE_S):
                info = await api.api(connection, "INFO")
            assert (info["streams"], len(asked)) == (0, 2)


async def test_any_other_refusal_of_the_jetstream_api_is_raised_at_once(tmp_path: Path) -> None:
    with NatsCluster(tmp_path / "nats", size=1, jetstream=False) as cluster:
        async with connected(cluster.urls) as connection:
            asked: list[Msg] = []

            def refuse(msg: Msg) -> None:
                asked.append(msg)
                assert msg.reply is not None
                connection.publish(msg.reply, json.dumps(
                    {"error": {"code": 404, "err_code": api.ERR_STREAM_NOT_FOUND, "description": "stream not found"}})
                    .encode())

            connection.subscribe("$JS.API.STREAM.INFO.X", refuse)
            await connection.flush()
            with trio.fail_after(DEADLINE_S), pytest.raises(api.JetStreamError) as refused:
                await api.api(connection, "STREAM.INFO.X")
            assert (refused.value.err_code, len(asked)) == (api.ERR_STREAM_NOT_FOUND, 1)
