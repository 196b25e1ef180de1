"""`polymq serve --jetstream …` at start-up: the line that names the backend, and one clear line when
the cluster cannot be used (nothing listening, no JetStream, a contradiction with --in-memory), and what
a node on JetStream refuses of the stream API (snapshots)."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import trio
import trio.testing

from polymq.clients.ports import free_ports
from polymq.clients.stream import StreamClient, StreamClientError
from polymq.codecs import stream_rows
from polymq.gateway.port_holder import Holder, holder_of
from polymq.jetstream import api
from polymq.jetstream.backend import cluster_replicas, node_number
from polymq.jetstream.nats_connection import NatsConnection, NatsOptions

from support.gateway import running_gateway
from support.nats_cluster import NatsCluster, NatsServer
from support.nsq_wire import RawClient

FREE_PORTS = ("--nsq-tcp-port", "0", "--nsq-http-port", "0", "--mqks-port", "0", "--phpmq-port", "0",
              "--phpmq-console-port", "0", "--admin-port", "0", "--no-pzq", "--no-emqp")


def _serve(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "polymq", "serve", *FREE_PORTS, *args], capture_output=True,
                          text=True, timeout=60, env=dict(os.environ))


def _one_error(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 1
    assert "Traceback" not in result.stderr + result.stdout
    errors = [line for line in result.stderr.splitlines() if " ERROR " in line]
    assert len(errors) == 1, result.stderr
    return errors[0].split("gateway  ", 1)[1]


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_nothing_listening_is_one_line_naming_every_server(tmp_path: Path) -> None:
    first, second = _closed_port(), _closed_port()
    servers = f"nats://127.0.0.1:{first},127.0.0.1:{second}"
    line = _one_error(_serve("--data-dir", str(tmp_path / "data"), "--jetstream", servers))
    assert line == (f"cannot use the JetStream cluster at nats://127.0.0.1:{first}, 127.0.0.1:{second}: no NATS "
                    f"server answered: nats://127.0.0.1:{first}: Error connecting to ('127.0.0.1', {first}): "
                    f"Connection refused; nats://127.0.0.1:{second}: Error connecting to ('127.0.0.1', {second}): "
                    "Connection refused; check --jetstream and that the servers run with JetStream on")
    assert not (tmp_path / "data").exists()


def test_a_server_without_jetstream_is_one_line(tmp_path: Path) -> None:
    with NatsCluster(tmp_path / "nats", size=1, jetstream=False) as cluster:
        line = _one_error(_serve("--data-dir", str(tmp_path / "data"), "--jetstream", cluster.urls[0]))
    assert line == (f"cannot use the JetStream cluster at {cluster.urls[0]}: JetStream does not answer at "
                    f"{cluster.urls[0]} (JetStream did not answer $JS.API.INFO within 10 s); check --jetstream and "
                    "that the servers run with JetStream on")


def test_in_memory_and_jetstream_contradict(tmp_path: Path) -> None:
    line = _one_error(_serve("--in-memory", "--jetstream", f"nats://127.0.0.1:{_closed_port()}"))
    assert line == ("--in-memory and --jetstream contradict each other: the JetStream cluster keeps every message; "
                    "give one of them")


def test_the_start_up_line_names_the_backend_servers_and_replicas(nats_server: NatsServer, tmp_path: Path) -> None:
    with running_gateway("--jetstream", nats_server.url, "--jetstream-replicas", "3") as gateway:
        line = gateway.wait_for_log(lambda line: " storage JetStream at " in line)
    # One server: its streams get one replica, whatever was asked.
    assert line.endswith(f"storage JetStream at {nats_server.url} (servers {nats_server.url}), replicas per "
                         f"topic: 1, node {line.rsplit(' ', 1)[1]}")
    assert int(line.rsplit(" ", 1)[1]) >= 0


def test_the_cluster_pages_example_runs_as_printed_twice(nats_server: NatsServer) -> None:
    """docs/cluster.md's two-node example, its addresses put where the two gateways listen."""
    text = (Path(__file__).resolve().parent.parent / "docs" / "cluster.md").read_text()
    [code] = re.findall(r"^\.venv/bin/python - <<'EOF'\n(.*?)^EOF$", text.split("## Shared queues on JetStream")[1],
                        re.MULTILINE | re.DOTALL)
    with running_gateway("--jetstream", nats_server.url) as first, \
            running_gateway("--jetstream", nats_server.url) as second:
        code = code.replace('("127.0.0.2", 25000)', repr(second.host_port("mqks")))
        code = code.replace('("127.0.0.1", 25000)', repr(first.host_port("mqks")))
        for _ in range(2):
            result = subprocess.run([sys.executable, "-"], input=code, capture_output=True, text=True, timeout=60)
            assert result.returncode == 0, result.stderr
            assert result.stdout == (
                "c1 ok \np1 ok \nc1 ok p1 event=greetings hello from node 1\nc1 ok --update shared-demo\nc2 ok \n")


def test_a_node_on_jetstream_takes_row_publishes(nats_server: NatsServer) -> None:
    """The Spark source's writes are publishes like any other; a snapshot of a queue no node knows is refused as
    on the embedded store. (Snapshots of shared queues: test_jetstream_snapshots.py; streams read by position:
    test_jetstream_streams.py.)"""
    with running_gateway("--jetstream", nats_server.url) as gateway, StreamClient(gateway.http) as client, \
            RawClient(gateway.nsq_tcp) as nsq:
        with pytest.raises(StreamClientError) as refused:
            client.snapshot("orders")
        assert refused.value.status == 404 and refused.value.code == "STREAM_ERROR"
        assert str(refused.value).endswith("no stream or queue orders"), refused.value
        nsq.send(b"SUB orders spark-rows\n")
        nsq.expect_response()
        nsq.send(b"RDY 2\n")
        client.publish([stream_rows.encode_publish_row(b"row one"), stream_rows.encode_publish_row(b"row two")],
                       topic="orders")
        assert sorted(nsq.read_message().body for _ in range(2)) == [b"row one", b"row two"]


async def test_a_node_started_while_the_cluster_forms_waits_for_its_servers_to_size_replicas(
        tmp_path: Path) -> None:
    cluster = NatsCluster(tmp_path / "nats", 3)
    first, second, third = cluster.servers
    try:
        first.start()
        second.start()
        await trio.to_thread.run_sync(cluster.wait_ready)  # two of three up: JetStream answers, INFO lists two
        async with trio.open_nursery() as nursery:
            connection = await NatsConnection.connect(NatsOptions(servers=[first.url]), nursery)
            assert len(connection.server_info["connect_urls"]) == 2
            chosen: list[int] = []

            async def size() -> None:
                chosen.append(await cluster_replicas(connection, 3, wait_s=60.0))

            nursery.start_soon(size)
            await trio.testing.wait_all_tasks_blocked()
            assert chosen == []  # waiting for the third server, not sized by the first INFO
            await trio.to_thread.run_sync(third.start)
            with trio.fail_after(60.0):
                while not chosen:
                    await connection.next_info()
                    await trio.testing.wait_all_tasks_blocked()
            assert chosen == [3]
            # A cluster smaller than asked: as many as it has once the wait is over; fewer asked: those.
            assert await cluster_replicas(connection, 5, wait_s=0.05) == 3
            assert await cluster_replicas(connection, 2, wait_s=0.05) == 2
            await connection.close()
    finally:
        cluster.stop()


async def test_a_node_started_while_the_node_numbers_leader_is_silent_waits_for_the_next_leader(
        tmp_path: Path) -> None:
    """A node restarted while the leader of the stream it draws its number from is paused (or cut off, or
    still catching up after a heal) gets no answer to its publish at all, not "no responders": it asks
    again until the other servers elect a leader, rather than failing its start-up at the first silence."""
    with NatsCluster(tmp_path / "nats", 3) as cluster:
        async with trio.open_nursery() as nursery:
            first = await NatsConnection.connect(NatsOptions(servers=cluster.urls), nursery)
            before = await node_number(first, 3)
            info = await api.api(first, f"STREAM.INFO.{api.NODES_STREAM}")
            leader = next(server for server in cluster.servers if server.name == info["cluster"]["leader"])
            others = [server.url for server in cluster.servers if server is not leader]
            os.kill(leader.pid, signal.SIGSTOP)
            try:
                restarted = await NatsConnection.connect(NatsOptions(servers=others), nursery)
                with trio.fail_after(api.API_DEADLINE_S):
                    after = await node_number(restarted, 3)
                info = await api.api(restarted, f"STREAM.INFO.{api.NODES_STREAM}")
            finally:
                os.kill(leader.pid, signal.SIGCONT)
            assert info["cluster"]["leader"] != leader.name
            assert after != before
            await restarted.close()
            await first.close()


async def test_a_standalone_server_gives_one_replica_at_once(nats_server: NatsServer) -> None:
    async with trio.open_nursery() as nursery:
        connection = await NatsConnection.connect(NatsOptions(servers=[nats_server.url]), nursery)
        with trio.fail_after(1.0):  # no waiting: the INFO names no cluster
            assert await cluster_replicas(connection, 3, wait_s=60.0) == 1
        await connection.close()


def test_every_listener_is_bound_before_the_node_connects_to_the_cluster(tmp_path: Path) -> None:
    """A node's own outgoing connections can never take one of its ports: they are all bound first. The NATS
    server here accepts and says nothing, so the node waits on it; its ports listen meanwhile."""
    mqks, nsq_tcp, emqp = free_ports(3)
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        silent.settimeout(60)  # a hang becomes a failure
        args = [sys.executable, "-m", "polymq", "serve", "--data-dir", str(tmp_path / "data"), "--nsq-http-port", "0",
                "--phpmq-port", "0", "--phpmq-console-port", "0", "--admin-port", "0", "--no-pzq",
                "--emqp-frontend-port", "0", "--emqp-admin-port", "0", "--emqp-pubsub-in-port", "0",
                "--emqp-pubsub-out-port", "0", "--mqks-port", str(mqks), "--nsq-tcp-port", str(nsq_tcp),
                "--emqp-backend-port", str(emqp), "--jetstream", f"nats://127.0.0.1:{silent.getsockname()[1]}"]
        process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            connection, _ = silent.accept()  # the node's NATS connection: it waits for the server's INFO
            with connection:
                assert [holder_of(port) for port in (mqks, nsq_tcp, emqp)] == [Holder.LISTENER] * 3
        finally:
            process.kill()
            process.wait()
