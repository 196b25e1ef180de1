"""The fakes of nsq_tail, nsq_to_file, nsq_stat and to_nsq (support/fake_<tool>.py) do what nsq 1.3.0's
programs do: each is run as the real one is, against a polymq node, and the two compared, the
commands they send (read by a recording proxy in front of the node), what they print and write.
The fake of nsqadmin answers its JSON API as nsqadmin does: both read one lookupd and two polymq
nodes, and each page the cluster tests read comes with the same keys and the same values.

Needs the real programs in POLYMQ_NSQ_BIN (default ~/ref/nsq/bin; docs/cluster.md): each test
skips, saying so, without them, as in CI, where test_nsq_cluster_tools.py runs the fakes alone.
Every process is started on 127.0.0.1 and stopped by its PID; every wait is for a state.
"""

from __future__ import annotations

import json
import re
import socket
import struct
import subprocess
import threading
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager, suppress
from pathlib import Path
from typing import Any

import attrs
import pytest

from support.fake_tcp import serving
from support.gateway import GatewayProcess, running_gateway
from support.nsq_cluster import (
    WAIT_TIMEOUT_S,
    NsqTool,
    Program,
    http,
    http_json,
    nsq_fake,
    nsq_program,
    running_lookupd,
    wait_until,
)

# The V2 commands that carry a 4-byte size and a body after their line.
_WITH_BODY = (b"IDENTIFY", b"PUB", b"MPUB", b"DPUB", b"AUTH")
BODIES = [b"first", b"second", b"third"]


@attrs.define
class Recording:
    """What one client sent through the proxy; `done` once it closed its side."""

    data: bytearray = attrs.field(factory=bytearray)
    done: threading.Event = attrs.field(factory=threading.Event)


@contextmanager
def recording_proxy(target: str) -> Iterator[tuple[str, list[Recording]]]:
    """A TCP proxy on 127.0.0.1 to `target` that records every byte its clients send."""
    recordings: list[Recording] = []
    host, port = target.rsplit(":", 1)

    def pump(source: socket.socket, sink: socket.socket, record: bytearray | None) -> None:
        with suppress(OSError):
            while data := source.recv(65536):
                if record is not None:
                    record += data
                sink.sendall(data)
        with suppress(OSError):
            sink.shutdown(socket.SHUT_WR)

    def handle(client: socket.socket, _stop: threading.Event) -> None:
        recording = Recording()
        recordings.append(recording)
        with client, socket.create_connection((host, int(port))) as upstream:
            back = threading.Thread(target=pump, args=(upstream, client, None), daemon=True)
            back.start()
            pump(client, upstream, recording.data)
            recording.done.set()
            back.join(WAIT_TIMEOUT_S)

    with serving(handle) as address:
        yield address, recordings


def commands(recording: Recording, topic: str) -> list[Any]:
    """The V2 commands sent, comparable between two runs: IDENTIFY's JSON as a dict, the topic as
    `<topic>`, message ids left out (each run has its own)."""
    assert recording.done.wait(WAIT_TIMEOUT_S), "the client never closed its connection"
    data = bytes(recording.data)
    assert data.startswith(b"  V2"), data[:16]
    data = data[4:]
    found: list[Any] = []
    while data:
        line, _, data = data.partition(b"\n")
        words = line.replace(topic.encode(), b"<topic>").split(b" ")
        if words[0] in _WITH_BODY:
            (size,) = struct.unpack(">i", data[:4])
            body, data = data[4 : 4 + size], data[4 + size :]
            found.append([*words, json.loads(body) if words[0] == b"IDENTIFY" else body])
        elif words[0] in (b"FIN", b"REQ", b"TOUCH"):
            found.append(words[:1])
        else:
            found.append(words)
    return found


@pytest.fixture(scope="module")
def gateway() -> Iterator[GatewayProcess]:
    for name in COMPARED:  # without the real programs, no gateway is started for tests that skip
        nsq_program(name)
    with running_gateway("--in-memory", "--no-mqks", "--no-phpmq", "--no-pzq", "--no-emqp") as process:
        yield process


# The programs compared with their fakes here.
COMPARED = ("nsq_tail", "nsq_to_file", "to_nsq", "nsq_stat", "nsqadmin")


def real_and_fake(name: str) -> list[tuple[str, NsqTool]]:
    """The real program (a skip, or a failure with POLYMQ_NSQ_BIN set, without it) and the fake."""
    return [("real", NsqTool(name, (str(nsq_program(name)),), fake=False)), ("fake", nsq_fake(name))]


def topic_with_backlog(gateway: GatewayProcess, topic: str) -> None:
    """The topic, its channel `c` and the three bodies waiting in it."""
    assert http(gateway.nsq_http, f"/topic/create?topic={topic}", "POST")[0] == 200
    assert http(gateway.nsq_http, f"/channel/create?topic={topic}&channel=c", "POST")[0] == 200
    assert http(gateway.nsq_http, f"/mpub?topic={topic}", "POST", b"\n".join(BODIES))[0] == 200


def channel_drained(gateway: GatewayProcess, topic: str) -> bool:
    """Every message of channel `c` delivered and finished."""
    (stats,) = http_json(gateway.nsq_http, f"/stats?format=json&topic={topic}")["topics"]
    (channel,) = stats["channels"]
    return bool(channel["depth"] == 0 and channel["in_flight_count"] == 0 and channel["message_count"] == 3)


def run_until_drained(gateway: GatewayProcess, tool: NsqTool, topic: str,
                      *args: str) -> tuple[int, list[str], list[Any]]:
    """The tool on channel `c` of a topic with a backlog, through the proxy, stopped by SIGTERM once
    it has finished every message: its exit status, its lines, its commands."""
    topic_with_backlog(gateway, topic)
    with recording_proxy(gateway.nsq_tcp) as (proxy, recordings):
        program = Program([*tool.argv, f"--nsqd-tcp-address={proxy}", f"--topic={topic}", "--channel=c", *args])
        try:
            wait_until(lambda: channel_drained(gateway, topic), f"{tool.name} finishing every message")
        finally:
            status = program.stop()
        (recording,) = recordings
        return status, program.lines, commands(recording, topic)


def test_nsq_tail_fake_subscribes_prints_and_finishes_as_nsq_tail(gateway: GatewayProcess) -> None:
    runs = {kind: run_until_drained(gateway, tool, f"tail_{kind}") for kind, tool in real_and_fake("nsq_tail")}
    for status, lines, _ in runs.values():
        assert status == 0
        assert [line.encode() for line in lines if line.encode() in BODIES] == BODIES
    real, fake = runs["real"][2], runs["fake"][2]
    assert fake == real
    (_, identify), *rest = fake
    assert identify["user_agent"] == "nsq_tail/1.3.0 go-nsq/1.1.0" and identify["feature_negotiation"] is True
    assert rest == [[b"SUB", b"<topic>", b"c"], [b"RDY", b"200"], [b"FIN"], [b"FIN"], [b"FIN"], [b"CLS"]]


def test_nsq_to_file_fake_writes_syncs_and_finishes_as_nsq_to_file(gateway: GatewayProcess, tmp_path: Path) -> None:
    sent, files = {}, {}
    for kind, tool in real_and_fake("nsq_to_file"):
        output = tmp_path / kind
        status, _, sent[kind] = run_until_drained(gateway, tool, f"file_{kind}", f"--output-dir={output}",
                                                  "--sync-interval=100ms")
        assert status == 0
        files[kind] = {path.name.replace(f"file_{kind}", "<topic>"): path.read_bytes() for path in output.iterdir()}
    assert sent["fake"] == sent["real"]
    assert sent["fake"][1:] == [[b"SUB", b"<topic>", b"c"], [b"RDY", b"200"], [b"FIN"], [b"FIN"], [b"FIN"], [b"CLS"]]
    assert list(files["fake"].values()) == list(files["real"].values()) == [b"".join(b + b"\n" for b in BODIES)]
    # <TOPIC>.<HOST><REV>.<DATETIME>.log, <REV> dropped: the short hostname, the date and hour of now.
    name = re.compile(rf"<topic>\.{re.escape(socket.gethostname().split('.')[0])}\.\d{{4}}-\d\d-\d\d_\d\d\.log")
    assert all(name.fullmatch(each) for kind in files for each in files[kind]), files


def test_to_nsq_fake_publishes_stdin_as_to_nsq(gateway: GatewayProcess) -> None:
    runs = {}
    for kind, tool in real_and_fake("to_nsq"):
        topic = f"tonsq_{kind}"
        with recording_proxy(gateway.nsq_tcp) as (proxy, recordings):
            # to_nsq drops the last byte of a chunk even when no delimiter ends it, and skips empty ones.
            result = subprocess.run([*tool.argv, f"--nsqd-tcp-address={proxy}", f"--topic={topic}"],
                                    input=b"one\n\ntwo\nthree", capture_output=True, timeout=WAIT_TIMEOUT_S)
            assert result.returncode == 0, result.stderr
            (recording,) = recordings
            runs[kind] = commands(recording, topic)
    assert runs["fake"] == runs["real"]
    assert [command for command in runs["fake"] if command[0] == b"PUB"] == [
        [b"PUB", b"<topic>", b"one"], [b"PUB", b"<topic>", b"two"], [b"PUB", b"<topic>", b"thre"]]


def test_nsq_stat_fake_prints_nsq_stats_lines(gateway: GatewayProcess) -> None:
    outputs = {}
    for kind, tool in real_and_fake("nsq_stat"):
        topic = f"stat_{kind}"
        topic_with_backlog(gateway, topic)
        result = subprocess.run([*tool.argv, f"--nsqd-http-address={gateway.nsq_http}", f"--topic={topic}",
                                 "--channel=c", "--count=2", "--interval=100ms"], capture_output=True, text=True,
                                timeout=WAIT_TIMEOUT_S)
        assert result.returncode == 0, result.stderr
        outputs[kind] = result.stdout
    assert outputs["fake"] == outputs["real"]
    assert outputs["fake"].splitlines()[2].split() == ["0", "0", "|", "3", "3", "0", "0", "0", "|", "0", "0", "3", "0"]


# Go's log prefix: "2006/01/02 15:04:05 ".
_LOG_TIME = re.compile(r"^\d{4}/\d\d/\d\d \d\d:\d\d:\d\d ")


@pytest.mark.parametrize("name", ["nsq_tail", "nsq_to_file", "nsq_stat", "to_nsq"])
def test_fakes_answer_a_command_line_as_nsqs_tools(name: str) -> None:
    """--version, a missing flag, an unknown one: the same exit status, output and message."""
    for args in (["--version"], [], ["--topic=x"], ["--topic=x", "--channel=y"], ["--bogus"]):
        results = {kind: subprocess.run([*tool.argv, *args], stdin=subprocess.DEVNULL, capture_output=True, text=True,
                                        timeout=WAIT_TIMEOUT_S) for kind, tool in real_and_fake(name)}
        real, fake = results["real"], results["fake"]
        assert (fake.returncode, fake.stdout) == (real.returncode, real.stdout), (args, fake, real)
        assert fake.returncode != 0 or fake.stdout == f"{name} v1.3.0\n", (args, fake)
        if fake.returncode == 1:  # log.Fatal: the message's line
            assert _LOG_TIME.sub("", fake.stderr.splitlines()[-1]) == _LOG_TIME.sub("", real.stderr.splitlines()[-1])
        elif fake.returncode == 2:  # Go's flag package: its first line, before the usage the fakes leave out
            assert fake.stderr.splitlines()[0] == real.stderr.splitlines()[0], (args, fake, real)


def key_paths(document: Any, at: str = "") -> set[str]:
    """Every key of a JSON document, as a path (`nodes[].topics[].topic`), lists' items merged."""
    if isinstance(document, dict):
        return {path for key, value in document.items() for path in {f"{at}{key}", *key_paths(value, f"{at}{key}.")}}
    if isinstance(document, list):
        return {path for item in document for path in key_paths(item, f"{at[:-1]}[].")}
    return set()


def read_by_tests(path: str, document: dict[str, Any]) -> Any:
    """What test_nsq_cluster_tools.py reads of an nsqadmin page (lists in no order nsqadmin promises, sorted)."""
    if path == "/api/nodes":
        return sorted((n["tcp_port"], n["http_port"], n["version"], n["out_of_date"], json.dumps(n["topics"]))
                      for n in document["nodes"])
    if path.startswith("/api/nodes/"):
        return (document["node"], document["total_messages"], document["total_clients"],
                [(t["topic_name"], t["message_count"], sorted(c["channel_name"] for c in t["channels"]))
                 for t in document["topics"]])
    if path == "/api/topics":
        return document["topics"]
    if path.count("/") == 3:  # a topic
        return (document["node"], document["topic_name"], document["message_count"], document["depth"],
                document["paused"], sorted((n["node"], n["message_count"]) for n in document["nodes"]),
                sorted((c["channel_name"], c["depth"], c["message_count"], c["paused"]) for c in document["channels"]))
    return (document["node"], document["channel_name"], document["depth"], document["in_flight_count"],
            document["message_count"], document["paused"], document["clients"],
            sorted((n["node"], n["depth"], n["message_count"]) for n in document["nodes"]))


ADMIN_NODES = 2


def test_nsqadmin_fake_answers_its_api_as_nsqadmin(gateway: GatewayProcess) -> None:
    """Two polymq nodes (besides `gateway`, which the fixture starts, and which registers nowhere) and
    the test lookupd; the real nsqadmin and the fake beside each other, reading it."""
    with running_lookupd("test lookupd") as lookupd, ExitStack() as stack:
        nodes = [stack.enter_context(running_gateway(
            "--lookupd-tcp-address", lookupd.tcp_address, "--broadcast-address", "127.0.0.1", "--in-memory",
            "--no-mqks", "--no-phpmq", "--no-pzq", "--no-emqp")) for _ in range(ADMIN_NODES)]
        for index, node in enumerate(nodes):
            assert http(node.nsq_http, "/topic/create?topic=cmp", "POST")[0] == 200
            for channel in ("c", "d_real", "d_fake"):
                assert http(node.nsq_http, f"/channel/create?topic=cmp&channel={channel}", "POST")[0] == 200
            assert http(node.nsq_http, "/mpub?topic=cmp", "POST", b"\n".join(BODIES[: index + 1]))[0] == 200
        ports = {node.host_port("nsq-tcp")[1] for node in nodes}
        wait_until(lambda: {p["tcp_port"] for p in lookupd.get("/lookup?topic=cmp")["producers"]} == ports,
                   "topic cmp registered by both nodes")
        admins = {}
        for kind, tool in real_and_fake("nsqadmin"):
            program = stack.enter_context(stopping(Program([*tool.argv, "--http-address=127.0.0.1:0",
                                                            f"--lookupd-http-address={lookupd.http_address}"])))
            admins[kind] = program.listening(1)["HTTP"]
        node_page = f"/api/nodes/127.0.0.1:{nodes[1].host_port('nsq-http')[1]}"
        for path in ("/api/nodes", node_page, "/api/topics", "/api/topics/cmp", "/api/topics/cmp/c"):
            real, fake = (http_json(admins[kind], path) for kind in ("real", "fake"))
            assert key_paths(fake) == key_paths(real), path
            assert read_by_tests(path, fake) == read_by_tests(path, real), path
        for path in ("/api/topics/none", "/api/nodes/127.0.0.1:1", "/api/bogus"):
            assert http(admins["fake"], path)[0] == http(admins["real"], path)[0], path
        assert read_by_tests("/api/topics/cmp", http_json(admins["fake"], "/api/topics/cmp"))[2] == 3
        for kind, admin in admins.items():
            for path, stats_of in (("/api/topics/cmp", topic_of), ("/api/topics/cmp/c", channel_c_of)):
                for action, paused in (("pause", True), ("unpause", False)):
                    status, data = http(admin, path, "POST", json.dumps({"action": action}).encode())
                    assert (status, json.loads(data)) == (200, {"message": ""}), (kind, path, action)
                    assert [stats_of(node)["paused"] for node in nodes] == [paused] * ADMIN_NODES, (kind, path)
            status, data = http(admin, "/api/topics/cmp/c", "POST", b'{"action": "bogus"}')
            assert (status, json.loads(data)) == (400, {"message": "INVALID_ACTION"}), kind
            status, data = http(admin, f"/api/topics/cmp/d_{kind}", "DELETE")
            assert (status, json.loads(data)) == (200, {"message": ""}), kind
            assert all(f"d_{kind}" not in {c["channel_name"] for c in topic_of(node)["channels"]} for node in nodes)
            wait_until(lambda kind=kind: f"d_{kind}" not in lookupd.get("/channels?topic=cmp")["channels"],
                       f"channel d_{kind} gone from lookupd")
        status, data = http(admins["fake"], "/api/topics/cmp/c", "POST", json.dumps({"action": "empty"}).encode())
        assert status == 200 and [channel_c_of(node)["depth"] for node in nodes] == [0, 0]


def topic_of(node: GatewayProcess) -> dict[str, Any]:
    (stats,) = http_json(node.nsq_http, "/stats?format=json&topic=cmp")["topics"]
    return dict(stats)


def channel_c_of(node: GatewayProcess) -> dict[str, Any]:
    return dict(next(c for c in topic_of(node)["channels"] if c["channel_name"] == "c"))


@contextmanager
def stopping(program: Program) -> Iterator[Program]:
    try:
        yield program
    finally:
        program.stop()


def test_nsqadmin_fake_answers_a_command_line_as_nsqadmin() -> None:
    """--version and no lookupd: the same exit status and output, the same fatal message."""
    for args in (["--version"], []):
        results = {kind: subprocess.run([*tool.argv, *args], stdin=subprocess.DEVNULL, capture_output=True, text=True,
                                        timeout=WAIT_TIMEOUT_S) for kind, tool in real_and_fake("nsqadmin")}
        real, fake = results["real"], results["fake"]
        assert (fake.returncode, fake.stdout) == (real.returncode, real.stdout), (args, fake, real)
        strip = re.compile(r"^\[nsqadmin\] \S+ \S+ ")
        assert [strip.sub("", line) for line in fake.stderr.splitlines()] == \
            [strip.sub("", line) for line in real.stderr.splitlines()], (args, fake, real)
