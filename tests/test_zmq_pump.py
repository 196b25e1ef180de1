"""ZeroMQ inside trio (adapters/zmq_pump.py): the corners of an edge-triggered descriptor, with real
sockets over TCP on 127.0.0.1: messages that were waiting before the pump started, sends that
make the socket readable, a peer gone in the middle of a message, and a peer that reads slowly."""

from __future__ import annotations

import socket
import struct
import time

import pytest
import trio
import zmq
from zmq.utils.monitor import recv_monitor_message

from polymq.adapters.zmq_pump import ZmqPump

DEADLINE_S = 5.0
# After the I/O thread saw a peer go: time for it to end the pipe and for the socket's command
# throttle to pass (well above both).
PIPE_END_S = 0.05


def router(context: zmq.Context) -> tuple[zmq.Socket, str]:
    sock = context.socket(zmq.ROUTER)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    return sock, f"tcp://127.0.0.1:{port}"


def dealer(context: zmq.Context, endpoint: str) -> zmq.Socket:
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    return sock


async def test_messages_waiting_before_the_pump_starts_are_read_without_a_new_edge() -> None:
    with zmq.Context() as context:
        server, endpoint = router(context)
        client = dealer(context, endpoint)
        for number in range(100):
            client.send_multipart([b"m%d" % number])
        # Wait until they are all in: polling EVENTS also consumes the descriptor's edge, so the
        # pump starts with messages waiting and nothing to wake it.
        deadline = time.monotonic() + DEADLINE_S
        while not server.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            assert time.monotonic() < deadline
            time.sleep(0.001)
        time.sleep(0.05)
        got: list[list[bytes]] = []
        pump = ZmqPump(server, got.extend)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(pump.run)
            with trio.fail_after(DEADLINE_S):
                while len(got) < 100:
                    await trio.sleep(0.001)
            nursery.cancel_scope.cancel()
        assert [frames[1] for frames in got] == [b"m%d" % number for number in range(100)]
        client.close()
        pump.close()


async def test_replies_sent_from_the_callback_keep_the_pump_reading() -> None:
    """An echo server: each send may eat the edge that announced the next request."""
    with zmq.Context() as context:
        server, endpoint = router(context)
        pump: ZmqPump

        def echo(messages: list[list[bytes]]) -> None:
            for frames in messages:
                pump.send(frames)

        pump = ZmqPump(server, echo)
        clients = [dealer(context, endpoint) for _ in range(3)]
        async with trio.open_nursery() as nursery:
            nursery.start_soon(pump.run)

            async def ping_pong(client: zmq.Socket, name: bytes) -> None:
                for number in range(300):
                    client.send_multipart([name, b"%d" % number])
                    with trio.fail_after(DEADLINE_S):
                        while not client.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                            await trio.sleep(0)
                    assert client.recv_multipart() == [name, b"%d" % number]

            async with trio.open_nursery() as clients_nursery:
                for index, client in enumerate(clients):
                    clients_nursery.start_soon(ping_pong, client, b"c%d" % index)
            nursery.cancel_scope.cancel()
        assert pump.received == pump.sent == 900
        for client in clients:
            client.close()
        pump.close()


async def test_a_send_from_another_task_wakes_the_waiting_pump_when_a_message_waits() -> None:
    """A message has come while the pump waits, and something else read EVENTS (as a send from
    another task may): the descriptor's edge is gone. The next send from outside the pump's task
    (as a store callback's answer is) must wake the pump, since EVENTS says a message waits."""
    with zmq.Context() as context:
        server, endpoint = router(context)
        got: list[list[bytes]] = []
        pump = ZmqPump(server, got.extend)
        client = dealer(context, endpoint)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(pump.run)
            for number in range(20):
                # The pump goes back to waiting for its descriptor (were it not there yet, its own
                # loop would read EVENTS: the test would pass without the wake-up, never fail).
                await trio.sleep(0.001)
                client.send_multipart([b"m%d" % number])
                # Blocking (the pump cannot run meanwhile) until the message is in; polling
                # EVENTS consumes the edge that would have woken the pump.
                deadline = time.monotonic() + DEADLINE_S
                while not server.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                    assert time.monotonic() < deadline
                    time.sleep(0.0005)
                identity = got[0][0] if got else None
                if identity is not None:
                    pump.send([identity, b"ack"])
                else:
                    pump.settle()  # what a send does once it is made, before the identity is known
                with trio.fail_after(DEADLINE_S):
                    while len(got) <= number:
                        await trio.sleep(0.001)
            nursery.cancel_scope.cancel()
        assert [frames[1] for frames in got] == [b"m%d" % number for number in range(20)]
        client.close()
        pump.close()


def _zmtp_greeting() -> bytes:
    """ZMTP 3.0, NULL mechanism, as a client (RFC 23)."""
    return b"\xff" + b"\x00" * 8 + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\x00") + b"\x00" + b"\x00" * 31


def _zmtp_command(name: bytes, body: bytes) -> bytes:
    payload = bytes([len(name)]) + name + body
    return b"\x04" + bytes([len(payload)]) + payload


async def test_a_peer_gone_in_the_middle_of_a_message_costs_nothing_else() -> None:
    with zmq.Context() as context:
        server, endpoint = router(context)
        got: list[list[bytes]] = []
        pump = ZmqPump(server, got.extend)
        host, port = endpoint.removeprefix("tcp://").rsplit(":", 1)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(pump.run)
            # A raw peer: greeting, READY as a DEALER, then one frame with MORE set, and gone.
            raw = socket.create_connection((host, int(port)))
            raw.sendall(_zmtp_greeting())
            socket_type = b"\x0bSocket-Type" + struct.pack(">I", 6) + b"DEALER"
            raw.sendall(_zmtp_command(b"READY", socket_type))
            raw.sendall(b"\x01\x05first")  # MORE: the rest never comes
            raw.close()
            client = dealer(context, endpoint)
            client.send_multipart([b"whole", b"message"])
            with trio.fail_after(DEADLINE_S):
                while not got:
                    await trio.sleep(0.001)
            await trio.sleep(0.05)
            nursery.cancel_scope.cancel()
        assert [frames[1:] for frames in got] == [[b"whole", b"message"]]
        client.close()
        pump.close()


class _PeerLeavesAfterTheFirstFrame(list[bytes]):
    """A message whose peer goes away (and is seen to go) between its first frame and its second."""

    def __init__(self, frames: list[bytes], peer: zmq.Socket, monitor: zmq.Socket) -> None:
        super().__init__(frames)
        self.peer: zmq.Socket | None = peer
        self.monitor = monitor  # the sending socket's disconnections

    def __getitem__(self, index):  # type: ignore[no-untyped-def]
        if index == 1 and self.peer is not None:
            self.peer.close()
            self.peer = None
            # libzmq's I/O thread sees the connection go, then ends its pipe; the sending socket
            # takes that in at a send once its command throttle (about a millisecond) has passed.
            while recv_monitor_message(self.monitor)["event"] != zmq.EVENT_DISCONNECTED:
                pass
            time.sleep(PIPE_END_S)
        return super().__getitem__(index)


async def test_a_receiver_gone_in_the_middle_of_a_sent_message_costs_nothing_else() -> None:
    """A DEALER (PZQ's send socket) whose peer goes between two frames of a message says Again at
    the later frame, having dropped the message (found by `polymq torture`: it ended the gateway)."""
    with zmq.Context() as context:
        server = context.socket(zmq.DEALER)
        server.setsockopt(zmq.LINGER, 0)
        port = server.bind_to_random_port("tcp://127.0.0.1")
        endpoint = f"tcp://127.0.0.1:{port}"
        leaving = context.socket(zmq.ROUTER)
        leaving.setsockopt(zmq.LINGER, 0)
        leaving.connect(endpoint)
        pump = ZmqPump(server, lambda messages: None)
        # The pipe to the peer is up once the server can send.
        deadline = time.monotonic() + DEADLINE_S
        while not pump.sock.getsockopt(zmq.EVENTS) & zmq.POLLOUT:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        monitor = server.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        monitor.setsockopt(zmq.RCVTIMEO, int(DEADLINE_S * 1000))
        pump.send(_PeerLeavesAfterTheFirstFrame([b"key", b"sent-us", b"", b"body"], leaving, monitor))
        server.disable_monitor()
        monitor.close()
        assert (pump.unroutable, list(pump.outgoing)) == (1, [])
        staying = context.socket(zmq.ROUTER)
        staying.setsockopt(zmq.LINGER, 0)
        staying.connect(endpoint)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(pump.run)
            pump.send([b"next", b"message"])
            pump.send([b"and", b"another"])
            got: list[list[bytes]] = []
            with trio.fail_after(DEADLINE_S):
                while len(got) < 2:
                    if staying.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                        got.append(staying.recv_multipart()[1:])
                    else:
                        await trio.sleep(0.001)
            nursery.cancel_scope.cancel()
        assert got == [[b"next", b"message"], [b"and", b"another"]]
        staying.close()
        pump.close()


async def test_a_slow_reader_gets_everything_in_order_once_it_reads() -> None:
    """More than the high-water mark queued for a peer: the pump holds the rest until it can send."""
    with zmq.Context() as context:
        server = context.socket(zmq.DEALER)
        server.setsockopt(zmq.SNDHWM, 10)
        port = server.bind_to_random_port("tcp://127.0.0.1")
        pump = ZmqPump(server, lambda _messages: None)
        reader = context.socket(zmq.DEALER)
        reader.setsockopt(zmq.RCVHWM, 10)
        reader.connect(f"tcp://127.0.0.1:{port}")
        async with trio.open_nursery() as nursery:
            nursery.start_soon(pump.run)
            filler = b"x" * 16384  # enough to fill the kernel's socket buffers too
            for number in range(2000):
                pump.send([b"%d" % number, filler])
            await trio.sleep(0.1)
            assert pump.outgoing, "the peer has not read: most of it waits in the pump"
            got = []
            with trio.fail_after(DEADLINE_S):
                while len(got) < 2000:
                    while reader.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                        got.append(reader.recv_multipart()[0])
                    await trio.sleep(0.001)
            nursery.cancel_scope.cancel()
        assert got == [b"%d" % number for number in range(2000)] and not pump.outgoing
        reader.close(linger=0)
        pump.close()


async def test_close_ends_the_pump() -> None:
    with zmq.Context() as context:
        server, _ = router(context)
        pump = ZmqPump(server, lambda _messages: None)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(pump.run)
            await trio.sleep(0.01)
            with trio.fail_after(DEADLINE_S):
                pump.close()
                # the nursery ends only when `run` returned


async def test_a_delivery_leaves_after_the_barrier_and_everything_in_the_order_queued() -> None:
    """`send_delivery` queues; the next send (`flush`, or the pump's turn) calls the barrier first;
    an answer queued after a delivery waits behind it."""
    with zmq.Context() as context:
        server, endpoint = router(context)
        peer = dealer(context, endpoint)
        peer.send_multipart([b"hello"])  # the ROUTER learns the peer's identity
        with trio.fail_after(DEADLINE_S):
            while not server.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                await trio.sleep(0.001)
        identity = server.recv_multipart()[0]
        pump: ZmqPump
        barrier_saw: list[int] = []  # messages sent when the barrier ran
        pump = ZmqPump(server, lambda _messages: None, barrier=lambda: barrier_saw.append(pump.sent))
        pump.send([identity, b"answer 1"])  # nothing queued: at once, no barrier
        pump.send_delivery([identity, b"delivery 1"])
        pump.send([identity, b"answer 2"])  # behind the delivery
        pump.send_delivery([identity, b"delivery 2"])
        assert (pump.sent, barrier_saw, len(pump.outgoing)) == (1, [], 3)
        pump.flush()
        assert (pump.sent, barrier_saw, len(pump.outgoing)) == (4, [1], 0)
        # Outside a flush the pump's own turn sends it, the barrier first.
        async with trio.open_nursery() as nursery:
            nursery.start_soon(pump.run)
            await trio.sleep(0)
            pump.send_delivery([identity, b"delivery 3"])
            with trio.fail_after(DEADLINE_S):
                while pump.outgoing:
                    await trio.sleep(0.001)
            nursery.cancel_scope.cancel()
        assert barrier_saw == [1, 4]
        got = []
        with trio.fail_after(DEADLINE_S):
            while len(got) < 5:
                while peer.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                    got.append(peer.recv_multipart()[0])
                await trio.sleep(0.001)
        assert got == [b"answer 1", b"delivery 1", b"answer 2", b"delivery 2", b"delivery 3"]
        peer.close()
        pump.close()


def test_a_frame_that_is_not_a_buffer_leaves_the_next_message_whole() -> None:
    """A caller's bug mid-message (the C loops in the compiled run, the Python ones under
    POLYMQ_PURE_PYTHON=1): the frames already given to libzmq are ended by an empty one, so the
    next message is not glued to them."""
    with zmq.Context() as context:
        server, endpoint = router(context)
        server.setsockopt(zmq.LINGER, 0)
        peer = dealer(context, endpoint)
        peer.send(b"hello")
        assert server.poll(int(DEADLINE_S * 1000))
        identity = server.recv_multipart()[0]
        pump = ZmqPump(server, lambda _messages: None)
        with pytest.raises(TypeError):
            pump._send_one([identity, b"started", 5, b"never sent"])  # type: ignore[list-item]
        assert pump._send_one([identity, b"next", b"message"])
        got = []
        for _ in range(2):
            assert peer.poll(int(DEADLINE_S * 1000))
            got.append(peer.recv_multipart())
        assert got == [[b"started", b""], [b"next", b"message"]]
        peer.close()
        server.close()
