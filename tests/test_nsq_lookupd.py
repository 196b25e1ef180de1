"""Registration with nsqlookupd, in-process: the engine and its registrar against the test lookupd.

The registrar runs in trio beside an engine the test drives; the lookupd (tests/support/
fake_lookupd.py) runs in threads, so the test waits for it in a worker thread and trio keeps
serving. Every wait is for a state of the lookupd, with a generous deadline.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from functools import partial
from typing import Any

import pytest
import trio

from polymq.adapters.nsq import lookupd as lookupd_module
from polymq.adapters.nsq.lookupd import LookupdRegistrar, NodeIdentity, channel_of, registrations
from polymq.core.engine import Engine
from polymq.gateway.logs import TextFormatter

from support.fake_lookupd import FakeLookupd, running_lookupd

IDENTITY = NodeIdentity("127.0.0.1", 4150, 4151, "1.3.0", "node-1")


def wait(lookupd: FakeLookupd, check: Callable[[], Any]) -> Any:
    return trio.to_thread.run_sync(lookupd.wait_for, check)


def registered(lookupd: FakeLookupd) -> set[tuple[str, str, str]]:
    """The registrations that have a producer now."""
    return {key for key, producers in lookupd.db.items() if producers and key[0] != "client"}


def test_channel_names_and_what_a_snapshot_registers() -> None:
    assert channel_of("t", "t/c") == "c"
    assert channel_of("t", "t/c#ephemeral") == "c#ephemeral"
    assert channel_of("t", "orders") == "orders"  # another protocol's queue keeps its name
    assert channel_of("t", "u/c") is None  # "u/c" is no NSQ channel name
    assert channel_of("t", "with space") is None and channel_of("é", "q") is None
    assert channel_of("t", "x" * 65) is None
    engine = Engine()
    engine.ensure_topic("alone")
    engine.ensure_topic("bad topic")
    for queue, topic in (("t/c", "t"), ("q", "t"), ("u/c", "t"), ("only bad", "b")):
        engine.ensure_queue(queue)
        engine.bind(queue, topic)
    # nsqd's connectCallback: a topic with channels registers its channels, one without alone.
    assert registrations(engine) == [("alone", ""), ("t", "c"), ("t", "q"), ("b", "")]


async def test_a_node_registers_what_it_holds_then_every_change_in_order() -> None:
    engine = Engine()
    engine.ensure_topic("before")
    engine.ensure_queue("before/c")
    engine.bind("before/c", "before")
    with running_lookupd() as lookupd:
        registrar = LookupdRegistrar(engine, IDENTITY, [lookupd.tcp_address], max_response=5 << 20)
        async with trio.open_nursery() as nursery:
            await nursery.start(registrar.run)
            await wait(lookupd, lambda: ("channel", "before", "c") in registered(lookupd))
            engine.ensure_topic("t")
            engine.ensure_queue("t/c")
            engine.bind("t/c", "t")
            engine.ensure_queue("phpmq-queue")
            engine.bind("phpmq-queue", "t")
            engine.ensure_topic("not valid")  # left out: nsqlookupd would close the connection
            engine.ensure_queue("bad name")
            engine.bind("bad name", "t")
            await wait(lookupd, lambda: ("channel", "t", "phpmq-queue") in registered(lookupd))
            engine.unbind("phpmq-queue", "t")
            engine.delete_queue("t/c")
            await wait(lookupd, lambda: registered(lookupd) == {("topic", "before", ""), ("channel", "before", "c"),
                                                                ("topic", "t", "")})
            engine.delete_topic("t")
            await wait(lookupd, lambda: registered(lookupd) == {("topic", "before", ""), ("channel", "before", "c")})
            lines = [line for _, line in lookupd.commands]
            assert lines == ["IDENTIFY", "REGISTER before c", "REGISTER t", "REGISTER t c", "REGISTER t phpmq-queue",
                             "UNREGISTER t phpmq-queue", "UNREGISTER t c", "UNREGISTER t"]
            assert lookupd.connections == 1
            nursery.cancel_scope.cancel()


async def test_identify_tells_the_node_as_nsqd_does() -> None:
    with running_lookupd() as lookupd:
        registrar = LookupdRegistrar(Engine(), IDENTITY, [lookupd.tcp_address], max_response=5 << 20)
        async with trio.open_nursery() as nursery:
            await nursery.start(registrar.run)
            nodes = await wait(lookupd, lookupd.nodes)
            assert [(n.broadcast_address, n.tcp_port, n.http_port, n.version, n.hostname) for n in nodes] == [
                ("127.0.0.1", 4150, 4151, "1.3.0", "node-1")]
            peer = registrar.peers[lookupd.tcp_address]
            while not peer.connected:  # the lookupd lists a node before it answers its IDENTIFY
                await trio.sleep(0.01)
            assert peer.info["version"] == "1.3.0"  # nsqlookupd's own answer
            nursery.cancel_scope.cancel()


async def test_a_node_pings_every_interval(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(lookupd_module, "PING_INTERVAL_S", 0.05)
    with running_lookupd() as lookupd:
        registrar = LookupdRegistrar(Engine(), IDENTITY, [lookupd.tcp_address], max_response=5 << 20)
        async with trio.open_nursery() as nursery:
            await nursery.start(registrar.run)
            await wait(lookupd, lambda: [line for _, line in lookupd.commands].count("PING") >= 3)
            assert lookupd.connections == 1
            nursery.cancel_scope.cancel()


async def test_a_lost_lookupd_is_reconnected_and_told_everything_again(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(lookupd_module, "RECONNECT_FIRST_S", 0.01)
    engine = Engine()
    engine.ensure_topic("t")
    with running_lookupd() as lookupd:
        registrar = LookupdRegistrar(engine, IDENTITY, [lookupd.tcp_address], max_response=5 << 20)
        async with trio.open_nursery() as nursery:
            await nursery.start(registrar.run)
            await wait(lookupd, lambda: ("topic", "t", "") in registered(lookupd))
            await trio.to_thread.run_sync(lookupd.drop_connections)
            await wait(lookupd, lambda: lookupd.connections == 2 and ("topic", "t", "") in registered(lookupd))
            assert [line for _, line in lookupd.commands] == ["IDENTIFY", "REGISTER t", "IDENTIFY", "REGISTER t"]
            nursery.cancel_scope.cancel()


async def test_an_absent_lookupd_is_tried_again_until_it_answers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(lookupd_module, "RECONNECT_FIRST_S", 0.01)
    monkeypatch.setattr(lookupd_module, "RECONNECT_MAX_S", 0.05)
    engine = Engine()
    with trio.socket.socket() as taken:  # a port nobody listens on yet
        await taken.bind(("127.0.0.1", 0))
        port = taken.getsockname()[1]
    registrar = LookupdRegistrar(engine, IDENTITY, [f"127.0.0.1:{port}"], max_response=5 << 20)
    async with trio.open_nursery() as nursery:
        await nursery.start(registrar.run)
        engine.ensure_topic("t")  # while nobody listens: told at the connection, not lost
        lookupd = FakeLookupd(port=port)
        lookupd.start()
        try:
            await wait(lookupd, lambda: ("topic", "t", "") in registered(lookupd))
        finally:
            lookupd.close()
        nursery.cancel_scope.cancel()


async def test_several_lookupds_changed_at_run_time_and_left_at_stop() -> None:
    engine = Engine()
    engine.ensure_topic("t")
    with running_lookupd() as first, running_lookupd() as second:
        registrar = LookupdRegistrar(engine, IDENTITY, [first.tcp_address], max_response=5 << 20)
        async with trio.open_nursery() as nursery:
            await nursery.start(registrar.run)
            await wait(first, lambda: ("topic", "t", "") in registered(first))
            registrar.set_addresses([first.tcp_address, second.tcp_address])
            await wait(second, lambda: ("topic", "t", "") in registered(second))
            engine.ensure_topic("u")  # told to both
            await wait(first, lambda: ("topic", "u", "") in registered(first))
            await wait(second, lambda: ("topic", "u", "") in registered(second))
            registrar.set_addresses([second.tcp_address])  # the first forgets this node
            await wait(first, lambda: not first.nodes() and not registered(first))
            assert first.connections == 1 and second.connections == 1
            await registrar.stop()  # every lookupd forgets it
            await wait(second, lambda: not second.nodes() and not registered(second))
            nursery.cancel_scope.cancel()
    assert engine.on_topic_created == [] and engine.on_bound == []  # the registrar's observers are gone


async def test_a_refused_command_ends_the_connection_and_it_is_made_again(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(lookupd_module, "RECONNECT_FIRST_S", 0.01)
    monkeypatch.setattr(lookupd_module, "_valid", lambda name: True)  # let a bad name through
    engine = Engine()
    with running_lookupd() as lookupd:
        registrar = LookupdRegistrar(engine, IDENTITY, [lookupd.tcp_address], max_response=5 << 20)
        async with trio.open_nursery() as nursery:
            await nursery.start(registrar.run)
            await wait(lookupd, lookupd.nodes)
            engine.ensure_topic("bad name")  # written as "REGISTER bad name": a topic "bad", channel "name"
            engine.ensure_topic("x" * 65)  # nsqlookupd: E_BAD_TOPIC, and it closes
            await wait(lookupd, lambda: lookupd.connections >= 2)
            nursery.cancel_scope.cancel()


def test_the_fake_lookupd_refuses_as_nsqlookupd() -> None:
    """The test lookupd itself: its answers to a bad magic, a command before IDENTIFY, bad names."""
    import socket

    def exchange(data: bytes) -> list[bytes]:
        with socket.create_connection(("127.0.0.1", int(lookupd.tcp_address.rsplit(":", 1)[1])), timeout=10) as s:
            s.sendall(data)
            out = b""
            while chunk := s.recv(65536):
                out += chunk
        answers = []
        while out:
            (size,) = struct.unpack(">i", out[:4])
            answers.append(out[4:4 + size])
            out = out[4 + size:]
        return answers

    body = json.dumps({"broadcast_address": "h", "tcp_port": 1, "http_port": 2, "version": "1.3.0"}).encode()
    identify = b"IDENTIFY\n" + struct.pack(">i", len(body)) + body
    with running_lookupd() as lookupd:
        assert exchange(b"  V2") == [b"E_BAD_PROTOCOL"]
        assert exchange(b"  V1REGISTER t\n") == [b"E_INVALID client must IDENTIFY"]
        assert exchange(b"  V1NOPE\n") == [b"E_INVALID invalid command NOPE"]
        answers = exchange(b"  V1PING\n" + identify + b"REGISTER t c\nREGISTER b@d\n")
        assert answers[0] == b"OK" and json.loads(answers[1])["version"] == "1.3.0" and answers[2] == b"OK"
        assert answers[3] == b"E_BAD_TOPIC REGISTER topic name 'b@d' is not valid"
        missing = json.dumps({"broadcast_address": "h", "tcp_port": 0, "http_port": 2, "version": "1"}).encode()
        assert exchange(b"  V1IDENTIFY\n" + struct.pack(">i", len(missing)) + missing) == [
            b"E_BAD_BODY IDENTIFY missing fields"]
        assert lookupd.registrations() == {("client", "", ""): [], ("channel", "t", "c"): [], ("topic", "t", ""): []}


async def test_what_a_lookupd_sends_is_escaped_in_the_log(monkeypatch: pytest.MonkeyPatch,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    """A hostile lookupd's IDENTIFY answer and refusal reach the log with their control characters escaped."""
    monkeypatch.setattr(lookupd_module, "RECONNECT_FIRST_S", 60.0)  # one connection is enough
    answered = trio.Event()

    async def hostile(stream: trio.SocketStream) -> None:
        info = json.dumps({"version": "1\n2026-11-26 00:00:00.000 INFO    gateway  FORGED",
                           "broadcast_address": "\x1b[31mred\u2028"}).encode()
        refusal = b"E_BAD_TOPIC \x00\nFORGED"
        await stream.receive_some()
        await stream.send_all(struct.pack(">i", len(info)) + info)
        await stream.receive_some()
        await stream.send_all(struct.pack(">i", len(refusal)) + refusal)
        answered.set()
        await trio.sleep_forever()

    engine = Engine()
    engine.ensure_topic("t")
    caplog.set_level("DEBUG", logger="polymq.lookupd")
    async with trio.open_nursery() as nursery:
        (listener,) = await nursery.start(partial(trio.serve_tcp, hostile, 0, host="127.0.0.1"))
        port = listener.socket.getsockname()[1]
        registrar = LookupdRegistrar(engine, IDENTITY, [f"127.0.0.1:{port}"], max_response=5 << 20)
        await nursery.start(registrar.run)
        await answered.wait()
        peer = registrar.peers[f"127.0.0.1:{port}"]
        while not any("refused" in record.getMessage() for record in caplog.records):
            await trio.sleep(0.01)
        assert not peer.connected
        nursery.cancel_scope.cancel()
    lines = [TextFormatter().format(record) for record in caplog.records if record.name == "polymq.lookupd"]
    text = "\n".join(lines)
    assert "FORGED" in text and "\\x0a2026-11-26" in text and "\\x1b[31mred\\u2028" in text and "\\x00" in text
    assert all("\n" not in line and "\x1b" not in line and "\x00" not in line and "\u2028" not in line
               for line in lines)
