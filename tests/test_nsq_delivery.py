"""NSQ delivery over real sockets: output buffering, heartbeats, sampling, redelivery, CLS, FIN/REQ/TOUCH.

One `polymq serve` process per module (distinct topics per test), raw sockets, exact frames and
timings with generous but meaningful bounds (docs/protocols/nsq.md).
"""

from __future__ import annotations

import re
import socket
import struct
import threading
import time
import urllib.error
import urllib.request

import pytest

from polymq.adapters.nsq.tcp import ACK_FAILED_TEXT
from polymq.codecs import nsq_client as nc
from polymq.core.engine import Outcome

from support.gateway import GatewayProcess
from support.nsq_wire import Closed, RawClient, consumer, publish

# -- output buffering -----------------------------------------------------------------------------


def _time_to_first_message(gw: GatewayProcess, topic: str, rdy: int, **identify: object) -> float:
    """Publish one message, then SUB + RDY: seconds from sending RDY to the message frame."""
    publish(gw.nsq_tcp, topic, [b"buffered?"])
    with consumer(gw.nsq_tcp, topic, "ch", **identify) as conn:
        started = time.monotonic()
        conn.send(nc.rdy(rdy))
        message = conn.read_message(timeout=10.0)
        elapsed = time.monotonic() - started
        assert message.body == b"buffered?"
        return elapsed


def test_output_buffer_timeout_delays_a_single_message(module_gateway: GatewayProcess) -> None:
    # RDY 10, one message: in-flight 1 < RDY, so it waits for the 1000 ms output buffer tick.
    elapsed = _time_to_first_message(module_gateway, "obuf_slow", 10, output_buffer_timeout=1000)
    assert 0.9 <= elapsed < 3.0, elapsed


# The flushes at once are told from the timer's by a timer far longer than a loaded machine's delays.
SLOW_FLUSH_MS = 5000


def test_output_buffer_flushed_when_in_flight_reaches_rdy(module_gateway: GatewayProcess) -> None:
    elapsed = _time_to_first_message(module_gateway, "obuf_rdy1", 1, output_buffer_timeout=SLOW_FLUSH_MS)
    assert elapsed < SLOW_FLUSH_MS / 2000, elapsed


def test_output_buffer_flushed_when_rdy_reached_with_several(module_gateway: GatewayProcess) -> None:
    publish(module_gateway.nsq_tcp, "obuf_rdy3", [b"a", b"b", b"c"])
    with consumer(module_gateway.nsq_tcp, "obuf_rdy3", "ch", output_buffer_timeout=SLOW_FLUSH_MS) as conn:
        started = time.monotonic()
        conn.send(nc.rdy(3))
        bodies = [conn.read_message(timeout=10.0).body for _ in range(3)]
        assert time.monotonic() - started < SLOW_FLUSH_MS / 2000
        assert bodies == [b"a", b"b", b"c"]


def test_output_buffer_disabled(module_gateway: GatewayProcess) -> None:
    elapsed = _time_to_first_message(
        module_gateway, "obuf_off", 10, output_buffer_size=-1, output_buffer_timeout=SLOW_FLUSH_MS
    )
    assert elapsed < SLOW_FLUSH_MS / 2000, elapsed


def test_default_output_buffer_timeout(module_gateway: GatewayProcess) -> None:
    # Defaults: 250 ms tick (docs/protocols/nsq.md observed ~200-250 ms with RDY 10).
    elapsed = _time_to_first_message(module_gateway, "obuf_default", 10)
    assert 0.15 <= elapsed < 0.9, elapsed


def test_message_frame_bytes(module_gateway: GatewayProcess) -> None:
    publish(module_gateway.nsq_tcp, "frame_bytes", [b"hello"])
    before_ns = time.time_ns()
    with consumer(module_gateway.nsq_tcp, "frame_bytes", "ch", rdy=1) as conn:
        frame = conn.read_frame()
    assert frame.frame_type == 2
    assert len(frame.data) == 26 + 5  # 4-byte size field = 4 + 26 + len(body) = 30 + len(body)
    timestamp_ns, attempts = struct.unpack_from(">qH", frame.data)
    assert attempts == 1
    assert re.fullmatch(rb"[0-9a-f]{16}", frame.data[10:26])
    assert frame.data[26:] == b"hello"
    assert before_ns - 10 * 10**9 < timestamp_ns <= time.time_ns()


# -- heartbeats -----------------------------------------------------------------------------------


def test_heartbeats_carry_on_while_subscribed_and_busy(module_gateway: GatewayProcess) -> None:
    topic = "hb_busy"
    with consumer(module_gateway.nsq_tcp, topic, "ch", rdy=5, heartbeat_interval=1000) as conn, \
            RawClient(module_gateway.nsq_tcp) as producer:
        received = 0
        heartbeat_frames = 0
        busy_until = time.monotonic() + 2.6
        give_up = time.monotonic() + 20
        sent = 0
        # Busy for 2.6 s at least, and until two heartbeats came (or a loaded machine's 20 s).
        while time.monotonic() < busy_until or (heartbeat_frames < 2 and time.monotonic() < give_up):
            producer.send(nc.pub(topic, b"tick %d" % sent))
            producer.expect_response(b"OK")
            sent += 1
            # Read what arrives for ~200 ms, heartbeats included.
            until = time.monotonic() + 0.2
            while True:
                try:
                    frame = conn.read_frame(max(0.01, until - time.monotonic()), skip_heartbeats=False)
                except TimeoutError:
                    break
                if frame.is_message:
                    received += 1
                    conn.send(nc.fin(nc.decode_message(frame.data).msg_id))
                else:
                    # The heartbeat is exactly a response frame `_heartbeat_`.
                    assert (frame.frame_type, frame.data) == (0, b"_heartbeat_"), frame
                    heartbeat_frames += 1
        assert heartbeat_frames >= 2
        while received < sent:  # the last ones may still be on their way
            frame = conn.read_frame(10.0, skip_heartbeats=True)
            received += 1
            conn.send(nc.fin(nc.decode_message(frame.data).msg_id))
        conn.send(nc.nop())


def _silent_close(gw: GatewayProcess, topic: str) -> tuple[float, int]:
    """IDENTIFY (heartbeat 1000), 0.5 s later SUB, then silence: (seconds from SUB to close, heartbeats)."""
    conn = RawClient(gw.nsq_tcp)
    with conn:
        conn.identify(heartbeat_interval=1000)
        time.sleep(0.5)  # the last client line falls between two heartbeat ticks
        last_line = time.monotonic()  # before the gateway can have read it, however late the OK is read
        conn.send(nc.sub(topic, "ch"))
        conn.expect_response(b"OK")
        conn.expect_closed(timeout=5.0)
        return time.monotonic() - last_line, conn.heartbeats


def test_silent_subscriber_is_closed_exactly_two_intervals_after_its_last_line(module_gateway: GatewayProcess) -> None:
    elapsed, heartbeats = _silent_close(module_gateway, "hb_silent_exact")
    assert 1.95 <= elapsed < 2.5, elapsed  # docs/protocols/nsq.md: interval 1000 → closed at 2.0 s
    assert heartbeats == 2


def test_nop_keeps_a_subscriber_open(module_gateway: GatewayProcess) -> None:
    with consumer(module_gateway.nsq_tcp, "hb_nop", "ch", heartbeat_interval=1000) as conn:
        for _ in range(3):
            frame = conn.read_frame(2.0, skip_heartbeats=False)
            assert frame.data == b"_heartbeat_"
            conn.send(nc.nop())
        publish(module_gateway.nsq_tcp, "hb_nop", [b"still here"])
        conn.send(nc.rdy(1))
        assert conn.read_message().body == b"still here"


# -- sample_rate ----------------------------------------------------------------------------------


def _count_delivered(gw: GatewayProcess, topic: str, channel: str, at_least: int = 0, **identify: object) -> int:
    """Messages delivered: the first `at_least` waited for as long as a loaded machine needs, then
    any more until the channel is quiet for half a second."""
    count = 0
    with consumer(gw.nsq_tcp, topic, channel, rdy=2500, output_buffer_size=-1, **identify) as conn:
        while True:
            try:
                message = conn.read_message(timeout=10.0 if count < at_least else 0.5)
            except TimeoutError:
                return count
            count += 1
            conn.send(nc.fin(message.msg_id))


def test_sample_rate(module_gateway: GatewayProcess) -> None:
    topic = "sampled"
    gw = module_gateway
    # Two channels exist before publishing, so each gets its own copy of all 300.
    for channel in ("all", "sample1"):
        with consumer(gw.nsq_tcp, topic, channel):
            pass
    with RawClient(gw.nsq_tcp) as producer:
        producer.send(nc.mpub(topic, [b"m%03d" % i for i in range(300)]))
        producer.expect_response(b"OK")
    assert _count_delivered(gw, topic, "all", at_least=300) == 300
    sampled = _count_delivered(gw, topic, "sample1", sample_rate=1)
    # Kept with probability 2/100 (nsqd drops when rand(100) > rate): expected 6 of 300.
    assert sampled <= 30, sampled


# -- disconnect with messages in flight -----------------------------------------------------------


@pytest.mark.parametrize("how", ["close", "reset"])
def test_disconnect_redelivers_in_flight_at_once(module_gateway: GatewayProcess, how: str) -> None:
    gw = module_gateway
    topic = f"disconnect_{how}"
    bodies = [b"one", b"two", b"three"]
    first = consumer(gw.nsq_tcp, topic, "ch", rdy=3)
    publish(gw.nsq_tcp, topic, bodies)
    got = [first.read_message() for _ in bodies]
    assert [m.body for m in got] == bodies
    assert [m.attempts for m in got] == [1, 1, 1]
    with consumer(gw.nsq_tcp, topic, "ch", rdy=10, output_buffer_size=-1) as second:
        second.expect_nothing(0.2)
        if how == "reset":
            # RST instead of FIN, with unread data on the gateway's side (was a whole-gateway crash).
            first.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        closed_at = time.monotonic()
        first.close()
        again = [second.read_message(timeout=2.0) for _ in bodies]
        # Not after msg_timeout (60 s): at once (polymq's documented choice, docs/protocols/nsq.md).
        assert time.monotonic() - closed_at < 1.0
        assert sorted(m.body for m in again) == sorted(bodies)
        assert {m.msg_id for m in again} == {m.msg_id for m in got}
        assert [m.attempts for m in again] == [2, 2, 2]
        for message in again:
            second.send(nc.fin(message.msg_id))
        second.expect_nothing(0.2)
    with RawClient(gw.nsq_tcp) as probe:  # the gateway is alive
        probe.send(nc.pub(topic, b"alive"))
        probe.expect_response(b"OK")


# -- CLS ------------------------------------------------------------------------------------------


def test_cls_stops_deliveries_and_keeps_the_socket(module_gateway: GatewayProcess) -> None:
    gw = module_gateway
    topic = "cls_topic"
    with consumer(gw.nsq_tcp, topic, "ch", rdy=10, output_buffer_size=-1) as conn:
        publish(gw.nsq_tcp, topic, [b"before"])
        held = conn.read_message()
        assert held.body == b"before"
        conn.send(nc.cls())
        conn.expect_response(b"CLOSE_WAIT")
        publish(gw.nsq_tcp, topic, [b"after1", b"after2"])
        conn.send(nc.rdy(5))  # ignored after CLS
        conn.expect_nothing(0.5)
        # Still open and still allowed to settle what it holds.
        conn.send(nc.fin(held.msg_id))
        conn.send(nc.fin(b"0" * 16))
        conn.expect_error(b"E_FIN_FAILED FIN 0000000000000000 failed ID not in flight")
        conn.send(nc.sub(topic, "ch"))
        conn.expect_error(b"E_INVALID cannot SUB in current state")
        conn.expect_closed()
    # The messages published after CLS wait for another consumer.
    with consumer(gw.nsq_tcp, topic, "ch", rdy=10) as other:
        assert sorted(other.read_message().body for _ in range(2)) == [b"after1", b"after2"]


# -- FIN / REQ / TOUCH ----------------------------------------------------------------------------


def test_every_failed_outcome_of_the_engine_has_its_nsqd_text() -> None:
    assert set(ACK_FAILED_TEXT) == set(Outcome) - {Outcome.OK}


def test_fin_req_touch_from_another_connection_fail_non_fatally(module_gateway: GatewayProcess) -> None:
    gw = module_gateway
    topic = "not_owner"
    owner = consumer(gw.nsq_tcp, topic, "ch", rdy=1)
    with owner, consumer(gw.nsq_tcp, topic, "ch", rdy=0) as thief:
        publish(gw.nsq_tcp, topic, [b"mine"])
        message = owner.read_message()
        msg_id = message.msg_id
        thief.send(nc.fin(msg_id))
        thief.expect_error(b"E_FIN_FAILED FIN " + msg_id + b" failed client does not own message")
        thief.send(nc.req(msg_id, 0))
        thief.expect_error(b"E_REQ_FAILED REQ " + msg_id + b" failed client does not own message")
        thief.send(nc.touch(msg_id))
        thief.expect_error(b"E_TOUCH_FAILED TOUCH " + msg_id + b" failed client does not own message")
        # Non-fatal: the thief's connection still works.
        thief.send(nc.rdy(1))
        thief.expect_nothing(0.2)
        owner.send(nc.fin(msg_id))
        owner.expect_nothing(0.2)
        owner.send(nc.fin(msg_id))
        owner.expect_error(b"E_FIN_FAILED FIN " + msg_id + b" failed ID not in flight")


def test_req_with_delay_redelivers_after_it(module_gateway: GatewayProcess) -> None:
    gw = module_gateway
    topic = "req_delay"
    with consumer(gw.nsq_tcp, topic, "ch", rdy=1) as conn:
        publish(gw.nsq_tcp, topic, [b"later"])
        first = conn.read_message()
        assert first.attempts == 1
        requeued_at = time.monotonic()
        conn.send(nc.req(first.msg_id, 500))
        again = conn.read_message(timeout=3.0)
        elapsed = time.monotonic() - requeued_at
        assert 0.45 <= elapsed < 1.5, elapsed
        assert (again.msg_id, again.body, again.attempts) == (first.msg_id, b"later", 2)
        assert again.timestamp_ns == first.timestamp_ns  # kept across requeues
        conn.send(nc.req(again.msg_id, 0))
        third = conn.read_message(timeout=1.0)
        assert (third.msg_id, third.attempts) == (first.msg_id, 3)
        conn.send(nc.fin(third.msg_id))
        conn.expect_nothing(0.2)


def test_msg_timeout_redelivers(module_gateway: GatewayProcess) -> None:
    gw = module_gateway
    topic = "timeout_redeliver"
    with consumer(gw.nsq_tcp, topic, "ch", rdy=1, msg_timeout=1000, output_buffer_size=-1) as conn:
        # Timed from before the publish: the delivery follows it, the redelivery comes 1 s after that,
        # however late this process reads either.
        started = time.monotonic()
        publish(gw.nsq_tcp, topic, [b"slow"])
        first = conn.read_message()
        again = conn.read_message(timeout=10.0)  # the 1000 ms asked for in IDENTIFY, not the default 60 s
        elapsed = time.monotonic() - started
        assert elapsed >= 0.9, elapsed
        assert (again.msg_id, again.attempts) == (first.msg_id, 2)
        conn.send(nc.fin(again.msg_id))
        conn.expect_nothing(0.2)


def test_touch_keeps_a_message_in_flight(module_gateway: GatewayProcess) -> None:
    gw = module_gateway
    topic = "touched"
    # A TOUCH every 0.5 s under a 3 s msg_timeout: a loaded machine's stalls stay inside it.
    with consumer(gw.nsq_tcp, topic, "ch", rdy=1, msg_timeout=3000, output_buffer_size=-1) as conn, \
            consumer(gw.nsq_tcp, topic, "ch", rdy=1, output_buffer_size=-1) as other:
        publish(gw.nsq_tcp, topic, [b"long job"])
        message = conn.read_message()
        for _ in range(8):  # 4 s, longer than the msg_timeout
            conn.send(nc.touch(message.msg_id))
            conn.expect_nothing(0.5)  # no redelivery, no TOUCH error
        other.expect_nothing(0.05)
        conn.send(nc.fin(message.msg_id))
        conn.expect_nothing(0.3)  # FIN succeeded
        other.expect_nothing(0.3)  # and nobody gets it again


# -- channel deleted over HTTP --------------------------------------------------------------------


def _http_post(gw: GatewayProcess, target: str, body: bytes = b"") -> tuple[int, bytes]:
    request = urllib.request.Request(f"http://{gw.nsq_http}{target}", data=body, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=3.0) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def test_channel_deleted_over_http_closes_its_consumers(module_gateway: GatewayProcess) -> None:
    gw = module_gateway
    topic = "deleted_channel"
    doomed = [consumer(gw.nsq_tcp, topic, "doomed", rdy=rdy, output_buffer_size=-1) for rdy in (5, 0)]
    with consumer(gw.nsq_tcp, topic, "kept", rdy=5, output_buffer_size=-1) as kept:
        publish(gw.nsq_tcp, topic, [b"before"])
        assert doomed[0].read_message().body == b"before"  # held in flight when the channel goes
        assert kept.read_message().body == b"before"
        assert _http_post(gw, f"/channel/delete?topic={topic}&channel=doomed") == (200, b"")
        for conn in doomed:
            started = time.monotonic()
            conn.expect_closed(timeout=2.0)  # closed by the server, no error frame
            assert time.monotonic() - started < 1.0
            conn.close()
        publish(gw.nsq_tcp, topic, [b"after"])
        assert kept.read_message().body == b"after"
        assert _http_post(gw, f"/channel/delete?topic={topic}&channel=doomed") == (
            404, b'{"message":"CHANNEL_NOT_FOUND"}')


# -- fatal errors end the stream ------------------------------------------------------------------


def test_fatal_error_is_the_last_frame_while_messages_flow(module_gateway: GatewayProcess) -> None:
    """Deliveries racing a fatal error must not follow the error frame (nsqd closes right after it)."""
    gw = module_gateway
    topic = "fatal_while_busy"
    stop = threading.Event()

    def pump() -> None:
        with RawClient(gw.nsq_tcp) as producer:
            while not stop.is_set():
                producer.send(nc.mpub(topic, [b"x" * 100] * 50))
                producer.expect_response(b"OK")

    for _ in range(5):
        conn = consumer(gw.nsq_tcp, topic, "ch", rdy=2500, output_buffer_size=-1)
        stop.clear()
        thread = threading.Thread(target=pump, daemon=True)
        thread.start()
        try:
            time.sleep(0.05)
            conn.send(b"BAD\n")
            frames = []
            with pytest.raises(Closed):
                while True:
                    frames.append(conn.read_frame(2.0))
        finally:
            stop.set()
            thread.join(5)
            conn.close()
        assert frames[-1].data == b"E_INVALID invalid command BAD"
        assert [f for f in frames if f.is_error] == frames[-1:]
