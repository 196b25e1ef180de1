"""ZeroMQ's frame loops in C (native/zmq_frames.c) against the pure-Python ones
they replace: the same messages off a real socket, the same outcomes of a send, and a closed
socket refused instead of touched. The pump's behaviour tests (test_zmq_pump.py) run on the C
loops in the compiled run and on the pure ones under POLYMQ_PURE_PYTHON=1."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import pytest
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from polymq.adapters.zmq_pump import ZmqPump
from polymq.native import zmq_loops

DEADLINE_S = 5.0

if not zmq_loops.in_use():
    if os.environ.get("POLYMQ_EXPECT_COMPILED"):
        raise AssertionError("the ZeroMQ frame loops in C are not in use (did `python tools/mypyc_build.py` fail?)")
    pytest.skip("the C frame loops are not in use (not built, or POLYMQ_PURE_PYTHON); "
                "test_zmq_pump.py tests the pure ones", allow_module_level=True)


@pytest.fixture(scope="module")
def pair() -> Iterator[tuple[zmq.Socket, zmq.Socket]]:
    """A ROUTER (the gateway's side) and a DEALER connected to it over TCP."""
    with zmq.Context() as context:
        server = context.socket(zmq.ROUTER)
        server.setsockopt(zmq.LINGER, 0)
        server.setsockopt(zmq.ROUTER_MANDATORY, 1)
        port = server.bind_to_random_port("tcp://127.0.0.1")
        client = context.socket(zmq.DEALER)
        client.setsockopt(zmq.LINGER, 0)
        client.setsockopt(zmq.IDENTITY, b"client-1")
        client.connect(f"tcp://127.0.0.1:{port}")
        client.send(b"hello")
        assert server.poll(int(DEADLINE_S * 1000))
        server.recv_multipart()
        yield server, client
        client.close()
        server.close()


def receive_all(pump: ZmqPump, count: int) -> list[list[bytes]]:
    got: list[list[bytes]] = []
    pump.on_messages = got.extend
    deadline = time.monotonic() + DEADLINE_S
    while len(got) < count:
        assert time.monotonic() < deadline, f"{len(got)} of {count}"
        pump.sock.poll(100)
        pump._receive()
    return got


messages = st.lists(st.lists(st.binary(max_size=300) | st.sampled_from([b"", b"x" * 70_000]), min_size=1,
                             max_size=8), min_size=1, max_size=20)


@settings(max_examples=60, deadline=None)
@given(sent=messages)
def test_what_the_c_loop_receives_is_what_was_sent_frame_by_frame(pair: tuple[zmq.Socket, zmq.Socket],
                                                                  sent: list[list[bytes]]) -> None:
    server, client = pair
    pump = ZmqPump(server, lambda _messages: None)
    assert pump._native_receive is not None
    for frames in sent:
        client.send_multipart(frames)
    assert receive_all(pump, len(sent)) == [[b"client-1", *frames] for frames in sent]


@settings(max_examples=60, deadline=None)
@given(sent=messages)
def test_what_the_c_loop_sends_arrives_whole(pair: tuple[zmq.Socket, zmq.Socket], sent: list[list[bytes]]) -> None:
    server, client = pair
    pump = ZmqPump(server, lambda _messages: None)
    assert pump._native_send is not None
    for frames in sent:
        # Any buffer: bytes, bytearray and memoryview frames, as pyzmq's send takes them.
        pump.send([b"client-1", *(bytearray(frame) if index % 2 else memoryview(frame)
                                   for index, frame in enumerate(frames))])
    got = []
    for _ in sent:
        assert client.poll(int(DEADLINE_S * 1000))
        got.append(client.recv_multipart())
    assert got == sent
    assert pump.sent == len(sent) and not pump.outgoing


def test_a_batch_stops_at_its_limit_and_the_rest_waits() -> None:
    # inproc: a message is in the ROUTER's pipe once the DEALER's send returned.
    with zmq.Context() as context:
        server = context.socket(zmq.ROUTER)
        server.bind("inproc://limit")
        client = context.socket(zmq.DEALER)
        client.connect("inproc://limit")
        for number in range(10):
            client.send_multipart([b"m", b"%d" % number])
        assert zmq_loops._FUNCTIONS is not None
        receive = zmq_loops._FUNCTIONS[0]
        first = receive(server, server.underlying, 3)
        assert [frames[2] for frames in first] == [b"0", b"1", b"2"]
        pump = ZmqPump(server, lambda _messages: None)
        assert [frames[2] for frames in receive_all(pump, 7)] == [b"%d" % number for number in range(3, 10)]
        client.close(linger=0)
        server.close(linger=0)


def test_a_message_for_a_peer_that_is_gone_is_counted_unroutable(pair: tuple[zmq.Socket, zmq.Socket]) -> None:
    server, _client = pair
    pump = ZmqPump(server, lambda _messages: None)
    pump.send([b"nobody", b"body"])  # ROUTER_MANDATORY: EHOSTUNREACH, nobody to tell
    assert (pump.unroutable, pump.sent, list(pump.outgoing)) == (1, 0, [])


def test_a_closed_socket_is_refused_not_touched() -> None:
    with zmq.Context() as context:
        sock = context.socket(zmq.DEALER)
        pump = ZmqPump(sock, lambda _messages: None)
        sock.close()
        with pytest.raises(zmq.ZMQError) as refused:
            pump._receive()
        assert refused.value.errno == zmq.ENOTSOCK
        with pytest.raises(zmq.ZMQError) as refused:
            pump._send_one([b"a", b"b"])
        assert refused.value.errno == zmq.ENOTSOCK


def test_a_frame_that_is_no_buffer_is_a_type_error_and_nothing_is_sent(pair: tuple[zmq.Socket, zmq.Socket]) -> None:
    server, client = pair
    pump = ZmqPump(server, lambda _messages: None)
    with pytest.raises(TypeError):
        pump._send_one(["client-1", b"text"])  # type: ignore[list-item]
    pump.send([b"client-1", b"after"])
    assert client.poll(int(DEADLINE_S * 1000))
    assert client.recv_multipart() == [b"after"]


def test_a_stand_in_socket_gets_the_pure_loops() -> None:
    class StandIn(zmq.Socket):  # type: ignore[type-arg]
        pass

    with zmq.Context() as context:
        sock = StandIn(context, zmq.DEALER)
        pump = ZmqPump(sock, lambda _messages: None)
        assert pump._native_receive is None and pump._native_send is None
        sock.close()
