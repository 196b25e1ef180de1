"""Flood: garbage connections hammer the gateway while a well-behaved producer and consumer carry on.

Eight connections at a time send random bytes, mutated valid command streams, oversized lines,
bad sizes and corrupt compressed streams; meanwhile one raw producer publishes N unique bodies
(PUB and MPUB, waiting for each OK) and one consumer FINs everything. Every body must arrive
exactly once, every garbage connection must end with a well-formed error frame and/or a close
(never a hang past its deadline), and the gateway must be alive and healthy afterwards.
Random choices come from fixed seeds, so a failure reproduces.
"""

from __future__ import annotations

import contextlib
import random
import re
import socket
import struct
import threading
import time
from collections.abc import Callable

import attrs
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from polymq.codecs import nsq_client as nc

from support.gateway import GatewayProcess
from support.nsq_wire import Closed, RawClient

TOPIC = "flood_main_topic"  # garbage only ever names 1-3 character topics
N_MESSAGES = 3000
GARBAGE_THREADS = 8
NON_FATAL = (b"E_FIN_FAILED", b"E_REQ_FAILED", b"E_TOUCH_FAILED")
_ERROR_RE = re.compile(rb"^E_[A-Z_]+( .*)?$", re.DOTALL)
_SIZE = struct.Struct(">i")


@attrs.define
class Outcome:
    kind: str
    payload: bytes
    frames: list[nc.Frame] = attrs.Factory(list)
    closed: bool = False
    problem: str | None = None  # set when an invariant is broken


# -- garbage generators ---------------------------------------------------------------------------


def _junk_topic(rng: random.Random) -> str:
    return rng.choice(["j", "jk", "j_k", "x.y", "z-1"])


def _valid_command(rng: random.Random) -> bytes:
    topic = _junk_topic(rng)
    msg_id = b"%016x" % rng.getrandbits(64)
    choices: list[Callable[[], bytes]] = [
        lambda: nc.pub(topic, rng.randbytes(rng.randint(1, 64))),
        lambda: nc.mpub(topic, [rng.randbytes(rng.randint(1, 16)) for _ in range(rng.randint(1, 5))]),
        lambda: nc.dpub(topic, rng.randint(0, 5000), b"d"),
        lambda: nc.sub(topic, rng.choice(["c", "c2", "c#ephemeral"])),
        lambda: nc.rdy(rng.randint(0, 3000)),
        lambda: nc.fin(msg_id),
        lambda: nc.req(msg_id, rng.randint(0, 10)),
        lambda: nc.touch(msg_id),
        lambda: nc.nop(),
        lambda: nc.cls(),
        lambda: nc.identify({"feature_negotiation": rng.random() < 0.5,
                             "heartbeat_interval": rng.choice([0, -1, 999, 1000, 70000]),
                             "output_buffer_size": rng.choice([0, -1, 10, 64, 100000]),
                             "sample_rate": rng.choice([0, 50, 100])}),
        lambda: nc.auth(b"secret"),
    ]
    return rng.choice(choices)()


def _mutate(rng: random.Random, data: bytes) -> bytes:
    buf = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        if not buf:
            buf += rng.randbytes(4)
        op = rng.randrange(6)
        at = rng.randrange(len(buf))
        if op == 0:
            buf[at] = rng.randrange(256)
        elif op == 1:
            buf[at:at] = rng.randbytes(rng.randint(1, 8))
        elif op == 2:
            del buf[at : at + rng.randint(1, 8)]
        elif op == 3:
            buf[at:at] = buf[at : at + rng.randint(1, 16)]
        elif op == 4:
            buf[at : at + 4] = _SIZE.pack(rng.choice([-1, 0, 2**31 - 1, 5 * 2**20 + 1, 1 << 20 | 1]))
        else:
            buf[at:at] = rng.choice([b"\n", b"\r\n", b" ", b"\x00"])
    return bytes(buf)


def _garbage(rng: random.Random) -> tuple[str, bytes, bytes | None]:
    """(kind, payload, expected exact error text or None)."""
    kind = rng.choice(["no_magic", "random", "mutated", "mutated", "mutated", "long_line", "bad_size",
                       "deflate_junk", "snappy_junk", "truncated"])
    magic = nc.magic()
    if kind == "no_magic":
        payload = rng.randbytes(rng.randint(4, 300))
        if payload[:4] == magic:
            payload = b"XXXX" + payload[4:]
        return kind, payload, b"E_BAD_PROTOCOL"
    if kind == "random":
        return kind, magic + rng.randbytes(rng.randint(1, 3000)), None
    if kind == "mutated":
        stream = b"".join(_valid_command(rng) for _ in range(rng.randint(1, 12)))
        return kind, magic + _mutate(rng, stream), None
    if kind == "long_line":
        line = b"PUB " + b"a" * rng.randint(16 * 1024, 40 * 1024)
        return kind, magic + line + rng.choice([b"", b"\n"]), b""  # closed with no error frame
    if kind == "bad_size":
        case = rng.randrange(7)
        if case == 0:
            size = rng.choice([0, -1, -(2**31)])
            return kind, magic + b"PUB j\n" + _SIZE.pack(size), b"E_BAD_MESSAGE PUB invalid message body size %d" % size
        if case == 1:
            return (kind, magic + b"PUB j\n" + _SIZE.pack(1048577),
                    b"E_BAD_MESSAGE PUB message too big 1048577 > 1048576")
        if case == 2:
            return kind, magic + b"MPUB j\n" + _SIZE.pack(5242881), b"E_BAD_BODY MPUB body too big 5242881 > 5242880"
        if case == 3:
            return kind, magic + b"MPUB j\n" + _SIZE.pack(4) + _SIZE.pack(0), b"E_BAD_BODY MPUB invalid message count 0"
        if case == 4:
            body = _SIZE.pack(2) + _SIZE.pack(0)
            return (kind, magic + b"MPUB j\n" + _SIZE.pack(len(body)) + body,
                    b"E_BAD_MESSAGE MPUB invalid message(0) body size 0")
        if case == 5:
            return kind, magic + b"IDENTIFY\n" + _SIZE.pack(0), b"E_BAD_BODY IDENTIFY invalid body size 0"
        return kind, magic + b"DPUB j -1\n" + _SIZE.pack(1) + b"x", b"E_INVALID DPUB could not parse timeout -1"
    if kind == "deflate_junk":
        # IDENTIFY asking for deflate with garbage pipelined right behind it (not valid raw DEFLATE).
        junk = b"\xff" * 8 + rng.randbytes(rng.randint(1, 200))
        return kind, magic + nc.identify({"deflate": True, "feature_negotiation": True}) + junk, None
    if kind == "snappy_junk":
        # One complete chunk: compressed/uncompressed with a wrong CRC, or a reserved unskippable type.
        data = rng.randbytes(rng.randint(5, 200))
        junk = bytes([rng.choice([0x00, 0x01, 0x02, 0x7F])]) + len(data).to_bytes(3, "little") + data
        return kind, magic + nc.identify({"snappy": True, "feature_negotiation": True}) + junk, None
    # truncated: a valid command cut short, then an abrupt reset
    stream = magic + _valid_command(rng)
    return kind, stream[: rng.randint(4, max(4, len(stream) - 1))], None


# How long a connection that must close is given to (it closes at once when all is well).
CLOSE_WAIT_S = 10.0


def _closed_within(sock: socket.socket, deadline: float) -> bool:
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        sock.settimeout(remaining)
        try:
            if not sock.recv(65536):
                return True
        except TimeoutError:
            return False
        except OSError:
            return True


def _read_until_closed(conn: RawClient, kind: str, outcome: Outcome, close_expected: bool) -> None:
    deadline = time.monotonic() + (CLOSE_WAIT_S if close_expected else 1.0)
    if kind in ("deflate_junk", "snappy_junk"):
        # The IDENTIFY reply is plain; what follows is compressed: only wait for the close.
        try:
            outcome.frames.append(conn.read_frame(CLOSE_WAIT_S))
        except Closed:
            outcome.closed = True
            return
        outcome.closed = _closed_within(conn.sock, deadline)
        return
    while True:
        try:
            frame = conn.read_frame(max(0.01, deadline - time.monotonic()), skip_heartbeats=False)
        except Closed:
            outcome.closed = True
            return
        except TimeoutError:
            return  # e.g. waiting for the rest of a body: legitimate, we hang up
        outcome.frames.append(frame)
        if frame.frame_type not in (0, 1, 2):
            outcome.problem = f"bad frame type {frame.frame_type}"
        if frame.is_error and not _ERROR_RE.match(frame.data):
            outcome.problem = f"malformed error frame {frame.data!r}"


def _run_garbage(address: str, rng: random.Random) -> Outcome:
    kind, payload, expected = _garbage(rng)
    outcome = Outcome(kind, payload)
    conn = RawClient(address, magic=False, timeout=2.0)
    try:
        with contextlib.suppress(OSError):  # the gateway may already have closed on an early error
            conn.sock.sendall(payload)
        if kind == "truncated":
            conn.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            return outcome
        _read_until_closed(conn, kind, outcome, expected is not None or kind in ("deflate_junk", "snappy_junk"))
    except AssertionError as exc:  # a bad frame size from the gateway
        outcome.problem = f"unparsable output: {exc}"
    finally:
        conn.close()
    if outcome.problem is None:
        outcome.problem = _check(outcome, expected)
    return outcome


def _check(outcome: Outcome, expected: bytes | None) -> str | None:
    errors = [f.data for f in outcome.frames if f.is_error]
    fatal = [i for i, f in enumerate(outcome.frames) if f.is_error and not f.data.startswith(NON_FATAL)]
    if fatal and not outcome.closed:
        return f"fatal error {outcome.frames[fatal[0]].data!r} without a close"
    if fatal and fatal[0] != len(outcome.frames) - 1:
        return f"frames after the fatal error: {[(f.frame_type, f.data[:40]) for f in outcome.frames]}"
    if expected is not None:
        if not outcome.closed:
            return "expected a close"
        if expected == b"" and errors:
            return f"expected a silent close, got {errors}"
        if expected and errors != [expected]:
            return f"expected {expected!r}, got {errors}"
    if outcome.kind in ("deflate_junk", "snappy_junk") and not outcome.closed:
        return "corrupt compressed stream did not close the connection"
    return None


# -- the well-behaved pair ------------------------------------------------------------------------


@attrs.define
class Flow:
    published: list[bytes] = attrs.Factory(list)
    deliveries: list[nc.Message] = attrs.Factory(list)
    errors: list[str] = attrs.Factory(list)
    producer_done: threading.Event = attrs.Factory(threading.Event)


def _produce(address: str, flow: Flow, rng: random.Random) -> None:
    try:
        with RawClient(address, timeout=10.0) as conn:
            index = 0
            while index < N_MESSAGES:
                if rng.random() < 0.5:
                    body = b"flood-%06d" % index
                    conn.send(nc.pub(TOPIC, body))
                    batch = [body]
                else:
                    count = min(rng.randint(2, 40), N_MESSAGES - index)
                    batch = [b"flood-%06d" % (index + i) for i in range(count)]
                    conn.send(nc.mpub(TOPIC, batch))
                conn.expect_response(b"OK", timeout=10.0)
                flow.published.extend(batch)
                index += len(batch)
    except Exception as exc:
        flow.errors.append(f"producer: {exc!r}")
    finally:
        flow.producer_done.set()


def _consume(conn: RawClient, flow: Flow) -> None:
    try:
        seen: set[bytes] = set()
        deadline = time.monotonic() + 60.0
        while time.monotonic() < deadline:
            # The last message may arrive before the producer has its OK: poll briefly, and once
            # everything published has arrived, wait a little longer for any duplicate.
            everything = flow.producer_done.is_set() and seen >= set(flow.published)
            try:
                message = conn.read_message(timeout=0.3)
            except TimeoutError:
                if everything:
                    return
                continue
            flow.deliveries.append(message)
            seen.add(message.body)
            conn.send(nc.fin(message.msg_id))
        flow.errors.append("consumer: gave up after 60 s")
    except Exception as exc:
        flow.errors.append(f"consumer: {exc!r}")


def _garbage_worker(address: str, seed: int, stop: threading.Event, results: list[Outcome]) -> None:
    rng = random.Random(seed)
    while not stop.is_set() or len([r for r in results if r.kind]) < 20:
        try:
            results.append(_run_garbage(address, rng))
        except OSError as exc:  # connect refused etc.: the gateway is in trouble
            results.append(Outcome("connect", b"", problem=f"cannot connect: {exc!r}"))
            return


def test_flood_keeps_the_gateway_and_good_clients_working(gateway: GatewayProcess) -> None:
    address = gateway.nsq_tcp
    flow = Flow()
    consumer = RawClient(address, timeout=10.0)
    consumer.send(nc.sub(TOPIC, "ch"))
    consumer.expect_response(b"OK")
    consumer.send(nc.rdy(50))

    stop = threading.Event()
    results: list[list[Outcome]] = [[] for _ in range(GARBAGE_THREADS)]
    garbage = [
        threading.Thread(target=_garbage_worker, args=(address, 1000 + i, stop, results[i]), daemon=True)
        for i in range(GARBAGE_THREADS)
    ]
    consuming = threading.Thread(target=_consume, args=(consumer, flow), daemon=True)
    producing = threading.Thread(target=_produce, args=(address, flow, random.Random(7)), daemon=True)
    for thread in [*garbage, consuming, producing]:
        thread.start()
    producing.join(60)
    stop.set()
    for thread in [*garbage, consuming]:
        thread.join(60)
    consumer.close()

    assert not flow.errors, flow.errors
    assert len(flow.published) == N_MESSAGES
    bodies = [m.body for m in flow.deliveries]
    assert sorted(bodies) == sorted(flow.published)  # exactly once: nothing lost, nothing twice
    assert all(m.attempts == 1 for m in flow.deliveries)

    outcomes = [o for per_thread in results for o in per_thread]
    problems = [(o.kind, o.problem, o.payload[:80]) for o in outcomes if o.problem]
    assert not problems, problems[:5]
    assert len(outcomes) >= GARBAGE_THREADS * 20
    kinds = {o.kind for o in outcomes}
    assert {"no_magic", "random", "mutated", "long_line", "bad_size", "deflate_junk", "snappy_junk"} <= kinds
    # Nearly every garbage connection was refused with an error frame and/or closed.
    ended = [o for o in outcomes if o.kind != "truncated" and (o.closed or any(f.is_error for f in o.frames))]
    assert len(ended) >= 0.8 * len([o for o in outcomes if o.kind != "truncated"])

    # The gateway survived, without a session blowing up, and still serves a new client.
    assert gateway.process.poll() is None
    with RawClient(address) as probe:
        probe.send(nc.pub(TOPIC, b"after the flood"))
        probe.expect_response(b"OK")
    failures = [i for i, line in enumerate(gateway.log_lines) if "Traceback" in line or "session failed" in line]
    assert not failures, "\n".join(gateway.log_lines[failures[0] : failures[0] + 60])


# -- single connections, hypothesis-generated -----------------------------------------------------

_commands = st.sampled_from(
    [nc.pub("h", b"x"), nc.mpub("h", [b"a", b"bb"]), nc.dpub("h", 5, b"x"), nc.sub("h", "c"), nc.rdy(3),
     nc.fin(b"0123456789abcdef"), nc.req(b"0123456789abcdef", 1), nc.touch(b"0123456789abcdef"), nc.nop(),
     nc.cls(), nc.identify({"feature_negotiation": True}), nc.auth(b"s")]
)
_streams = st.lists(st.one_of(_commands, st.binary(min_size=1, max_size=40)), min_size=1, max_size=8).map(b"".join)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(stream=_streams)
def test_hypothesis_streams_get_errors_or_answers_never_a_crash(module_gateway: GatewayProcess, stream: bytes) -> None:
    with RawClient(module_gateway.nsq_tcp, timeout=2.0) as conn:
        conn.send(stream)
        frames: list[nc.Frame] = []
        closed = False
        while True:
            # After a fatal error the close must come: waited for as long as a loaded machine needs.
            fatal_seen = any(f.is_error and not f.data.startswith(NON_FATAL) for f in frames)
            try:
                frames.append(conn.read_frame(CLOSE_WAIT_S if fatal_seen else 0.15, skip_heartbeats=False))
            except Closed:
                closed = True
                break
            except TimeoutError:
                break
    for frame in frames:
        assert frame.frame_type in (0, 1, 2)
        if frame.is_error:
            assert _ERROR_RE.match(frame.data), frame
    fatal = [f.data for f in frames if f.is_error and not f.data.startswith(NON_FATAL)]
    if fatal:
        assert closed and frames[-1].data == fatal[0], frames
    assert module_gateway.process.poll() is None
    with RawClient(module_gateway.nsq_tcp) as probe:
        probe.send(nc.pub("h", b"probe"))
        probe.expect_response(b"OK")
