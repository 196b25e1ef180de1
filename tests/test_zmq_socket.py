"""The clients' ZeroMQ plumbing (clients/zmq_socket.py) on both of its paths, the frame loops in C
(where built) and the Python ones: what `send` sends arrives whole, what `waiting` takes is what was
sent and in order, at most its limit per call, and a send that finds no room waits as pyzmq's does,
then says Again at its SNDTIMEO."""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator

import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from polymq.clients import zmq_socket
from polymq.native import zmq_loops

DEADLINE_MS = 5000

# Under `make test` the C loops must be there (test_compiled.py says so too): not skipped then.
C_MISSING = not zmq_loops.in_use() and not os.environ.get("POLYMQ_EXPECT_COMPILED")
PATHS = ["python", pytest.param("c", marks=pytest.mark.skipif(C_MISSING, reason="the C loops are not built"))]


@pytest.fixture(params=PATHS)
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "python":
        monkeypatch.setattr(zmq_loops, "native_loops", lambda _sock: None)
    return request.param


@pytest.fixture
def pair() -> Iterator[tuple[zmq.Socket, zmq.Socket]]:
    """A ROUTER and a DEALER (identity `peer`) connected over loopback TCP, the DEALER's hello taken."""
    with zmq.Context() as context:
        router = context.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        port = router.bind_to_random_port("tcp://127.0.0.1")
        dealer = zmq_socket.open_socket(context, zmq.DEALER, f"127.0.0.1:{port}", identity=b"peer")
        dealer.send(b"hello")
        assert router.poll(DEADLINE_MS)
        assert router.recv_multipart() == [b"peer", b"hello"]
        yield router, dealer
        dealer.close()
        router.close()


def take(sock: zmq.Socket, count: int) -> list[list[bytes]]:
    got: list[list[bytes]] = []
    while len(got) < count:
        assert sock.poll(DEADLINE_MS), f"{len(got)} of {count} arrived"
        got.extend(zmq_socket.waiting(sock))
    return got


messages = st.lists(st.lists(st.binary(max_size=200) | st.sampled_from([b"", b"y" * 70_000]), min_size=1,
                             max_size=7), min_size=1, max_size=15)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(sent=messages)
def test_what_send_sends_is_what_waiting_takes(path: str, pair: tuple[zmq.Socket, zmq.Socket],
                                               sent: list[list[bytes]]) -> None:
    router, dealer = pair
    assert (zmq_loops.native_loops(dealer) is not None) == (path == "c")
    for frames in sent:
        zmq_socket.send(dealer, frames)
    assert take(router, len(sent)) == [[b"peer", *frames] for frames in sent]
    for frames in sent:
        zmq_socket.send(router, [b"peer", *frames])
    assert take(dealer, len(sent)) == sent


def test_waiting_takes_at_most_its_limit_and_leaves_the_rest(path: str, pair: tuple[zmq.Socket, zmq.Socket],
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    router, dealer = pair
    monkeypatch.setattr(zmq_socket, "WAITING_LIMIT", 3)
    for number in range(5):
        zmq_socket.send(dealer, [b"m", b"%d" % number])
    assert router.poll(DEADLINE_MS)
    first: list[list[bytes]] = []
    while len(first) < 3:  # the five may arrive in more than one TCP read
        first.extend(zmq_socket.waiting(router))
        assert len(first) <= 3
        assert first or router.poll(DEADLINE_MS)
    assert [frames[2] for frames in first] == [b"0", b"1", b"2"]
    assert [frames[2] for frames in take(router, 2)] == [b"3", b"4"]
    assert zmq_socket.waiting(router) == []


def test_a_send_without_room_waits_for_its_sndtimeo_then_says_again(path: str) -> None:
    with zmq.Context() as context:
        # With IMMEDIATE, a DEALER whose peer never answers has no pipe to put a message in: a send
        # blocks until SNDTIMEO.
        sock = context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IMMEDIATE, 1)
        sock.setsockopt(zmq.SNDTIMEO, 200)
        sock.connect("tcp://127.0.0.1:9")
        try:
            with pytest.raises(zmq.Again):
                zmq_socket.send(sock, [b"a", b"b"])
        finally:
            sock.close()


def test_a_message_for_a_peer_that_is_gone_says_host_unreachable(path: str,
                                                                 pair: tuple[zmq.Socket, zmq.Socket]) -> None:
    router, _dealer = pair
    router.setsockopt(zmq.ROUTER_MANDATORY, 1)
    with pytest.raises(zmq.ZMQError) as raised:
        zmq_socket.send(router, [b"nobody", b"x"])
    assert raised.value.errno == errno.EHOSTUNREACH


def test_a_frame_that_is_not_a_buffer_leaves_the_next_message_whole(path: str,
                                                                    pair: tuple[zmq.Socket, zmq.Socket]) -> None:
    router, dealer = pair
    with pytest.raises(TypeError):
        zmq_socket.send(dealer, [b"started", "not bytes", b"never sent"])  # type: ignore[list-item]
    zmq_socket.send(dealer, [b"next", b"message"])
    # The broken one ends with an empty frame where it broke; the next arrives as it was sent.
    assert take(router, 2) == [[b"peer", b"started", b""], [b"peer", b"next", b"message"]]
