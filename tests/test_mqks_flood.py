"""MQKS bad input and floods against a real `polymq serve`: exact answers, the connection and the gateway survive.

Over 127.0.0.1 raw sockets: over-long lines (whole, in pieces, never ending), TABs, control characters and
bytes that are not UTF-8, unknown actions and consumers, malformed arguments, `_eval` attacks (docs/protocols/mqks.md:
answered with `error`, never executed) and its whitelisted counters; then floods: hundreds of garbage
connections hanging up mid-line while a manual-ack pair exchanges thousands of messages, a client that never
reads, and a manual-ack consumer that leaves with thousands unacknowledged. Absence is proven with ping
round trips (`MQKSWire.barrier`), never with sleeps. Random choices come from fixed seeds.
"""

from __future__ import annotations

import base64
import contextlib
import random
import re
import socket
import struct
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import attrs
import pytest

from polymq.codecs.mqks import ENCODED_PREFIX
from polymq.codecs.mqks_client import Delivery, parse_delivery, parse_response

from support.gateway import GatewayProcess, running_gateway
from support.mqks_wire import Closed, MQKSWire

SHORT_LIMIT = 1024  # --mqks-max-line of the `short_gateway`
ERROR_RE = re.compile(rb"([^ \n]*) error (\d{20}[0-9A-Za-z]{4})")
# Any response line: `{id} ok {data}` (data may be empty) or `{id} error {error_id}`.
RESPONSE_RE = re.compile(rb"[^ \n]* (ok .*|error \d{20}[0-9A-Za-z]{4})", re.DOTALL)
MB = 1024 * 1024
RSS_GROWTH_LIMIT_KB = 200 * 1024
EVAL_REFUSED = "_eval answers stats expressions only"


@pytest.fixture(scope="module")
def short_gateway() -> Iterator[GatewayProcess]:
    """A gateway whose MQKS lines may be at most 1024 bytes."""
    with running_gateway("--mqks-max-line", str(SHORT_LIMIT)) as process:
        yield process


def wire(gateway: GatewayProcess, timeout: float = 10.0) -> MQKSWire:
    client = MQKSWire(gateway.host_port("mqks"), timeout=timeout)
    client.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return client


def one_error(lines: list[bytes], request_id: str) -> str:
    """The error id of the only line, which must be `{request_id} error {24-char id}`."""
    assert len(lines) == 1, lines
    match = ERROR_RE.fullmatch(lines[0])
    assert match is not None, lines
    assert match[1] == request_id.encode(), lines
    return match[2].decode()


def ask(client: MQKSWire, line: bytes) -> list[bytes]:
    """Send one raw line (`\\n` added) and return every line answered before a ping round trip."""
    client.sock.sendall(line + b"\n")
    return client.barrier()


def logged(gateway: GatewayProcess, error_id: str, reason: str, timeout: float = 5.0) -> str:
    """The gateway's log line for `error_id`; it must state `reason`. (The log pipe is read by a thread.)"""
    deadline = time.monotonic() + timeout
    while True:
        for line in list(gateway.log_lines):
            if f"error {error_id}:" in line:
                assert reason in line, line
                return line
        assert time.monotonic() < deadline, f"error {error_id} not in the gateway log"
        time.sleep(0.01)


def no_tracebacks(gateway: GatewayProcess) -> None:
    lines = list(gateway.log_lines)
    failures = [i for i, line in enumerate(lines) if "Traceback" in line or "session failed" in line]
    assert not failures, "\n".join(lines[failures[0] : failures[0] + 40])


def memory_kb(gateway: GatewayProcess) -> dict[str, int]:
    """VmRSS and VmHWM (peak RSS) of the gateway process, in kB."""
    fields = {}
    for line in Path(f"/proc/{gateway.process.pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmRSS", "VmHWM"):
            fields[name] = int(value.split()[0])
    return fields


def delivery(line: bytes, consumer_id: str) -> Delivery:
    response = parse_response(line)
    assert response.ok and response.request_id == consumer_id, line
    return parse_delivery(response.data)


def eval_ok(client: MQKSWire, code: str) -> bytes:
    lines = ask(client, b"ev _eval " + code.encode())
    assert len(lines) == 1 and lines[0].startswith(b"ev ok "), (code, lines)
    return lines[0][len(b"ev ok ") :]


def assert_alive(gateway: GatewayProcess) -> None:
    assert gateway.process.poll() is None
    with wire(gateway) as probe:
        assert ask(probe, b"alive ping still here") == [b"alive ok still here"]


# -- over-long lines ----------------------------------------------------------------------------------


def long_line(request_id: bytes, size: int = 5000) -> bytes:
    """A publish line of exactly `size` bytes, without its newline."""
    head = request_id + b" publish long_ev "
    return head + b"x" * (size - len(head))


def test_a_long_line_gets_one_error_and_the_connection_goes_on(short_gateway: GatewayProcess) -> None:
    gw = short_gateway
    with wire(gw) as consumer, wire(gw) as client:
        assert ask(consumer, b"lc consume --confirm long_q long_ev") == [b"lc ok "]

        error_id = one_error(ask(client, long_line(b"L1")), "L1")
        logged(gw, error_id, f"line longer than {SHORT_LIMIT} bytes")
        assert ask(client, b"n1 ping after") == [b"n1 ok after"]

        # Good lines around it in the same write are answered, in order.
        client.sock.sendall(b"a ping 1\n" + long_line(b"L2") + b"\nb ping 2\n")
        lines = client.barrier()
        assert lines[0] == b"a ok 1" and lines[2] == b"b ok 2", lines
        one_error(lines[1:2], "L2")

        # No id to read: no space before the limit, not UTF-8, a TAB in it.
        one_error(ask(client, b"x" * 5000), "None")
        one_error(ask(client, b"y" * 2000 + b" ping " + b"z" * 3000), "None")
        one_error(ask(client, b"\xff\xfe" + long_line(b"")), "None")
        one_error(ask(client, long_line(b"t\tab")), "None")

        # The limit is the line without its newline; a CR before the newline counts.
        exact = b"P ping " + b"y" * (SHORT_LIMIT - 7)
        assert ask(client, exact) == [b"P ok " + b"y" * (SHORT_LIMIT - 7)]
        assert ask(client, exact[:-1] + b"\r") == [b"P ok " + b"y" * (SHORT_LIMIT - 8)]
        one_error(ask(client, b"Q ping " + b"y" * (SHORT_LIMIT - 6)), "Q")

        # Nothing of the long publishes reached the queue.
        client.send(b"s1 publish long_ev sentinel")
        assert consumer.line() == b"lc ok s1 event=long_ev sentinel"
        assert consumer.barrier() == []


@pytest.mark.parametrize("piece", [1, 7, 100, 1023, 1024, 1025, 4096, 0])
def test_a_long_line_in_small_pieces_gets_exactly_one_error(short_gateway: GatewayProcess, piece: int) -> None:
    data = long_line(b"P%d" % piece) + b"\nq ping after\n"
    rng = random.Random(piece)
    with wire(short_gateway) as client:
        at = 0
        while at < len(data):
            size = piece or rng.randint(1, 300)  # 0: random sizes
            client.sock.sendall(data[at : at + size])
            at += size
        lines = client.barrier()
        assert lines[1:] == [b"q ok after"], lines
        one_error(lines[:1], f"P{piece}")


def test_a_line_without_newline_for_a_while_is_answered_early_and_skipped(short_gateway: GatewayProcess) -> None:
    gw = short_gateway
    with wire(gw) as client, wire(gw) as other:
        client.sock.sendall(b"N1 publish long_ev " + b"z" * 2000)
        error_id = one_error([client.line()], "N1")  # before any newline was sent
        logged(gw, error_id, f"line longer than {SHORT_LIMIT} bytes")
        assert ask(other, b"o1 ping meanwhile") == [b"o1 ok meanwhile"]
        # The rest of the line is dropped, whatever it holds: TABs, newline-less lines, bytes that are not UTF-8.
        for n in range(200):
            client.sock.sendall(b"z" * 997 + b"\t\xff" + (b"k ping x" if n % 7 == 0 else b"z"))
        client.sock.sendall(b"\n")
        assert client.barrier() == []
        assert ask(client, b"k1 ping fine") == [b"k1 ok fine"]


@pytest.mark.slow
@pytest.mark.parametrize("max_line", [SHORT_LIMIT, None], ids=["max-line-1024", "default-max-line"])
def test_a_never_ending_line_does_not_grow_memory(max_line: int | None) -> None:
    args = ("--mqks-max-line", str(max_line)) if max_line else ()
    with running_gateway(*args) as gw, wire(gw, timeout=30.0) as client:
        assert ask(client, b"w ping warm") == [b"w ok warm"]
        before = memory_kb(gw)["VmRSS"]
        chunk = b"m" * MB
        client.sock.sendall(b"E1 ping " + chunk[8:])
        for _ in range(49):
            client.sock.sendall(chunk)
        client.sock.sendall(b"\n")
        lines = client.barrier()
        error_id = one_error(lines, "E1")
        logged(gw, error_id, "line longer than")
        peak = memory_kb(gw)["VmHWM"]
        assert peak - before < RSS_GROWTH_LIMIT_KB, (before, peak)
        assert ask(client, b"E2 ping done") == [b"E2 ok done"]


# -- TABs, control characters, bytes that are not UTF-8 ------------------------------------------------


TAB_LINES = [
    (b"\tT1 ping x", "None"),
    (b"T\t2 ping x", "None"),
    (b"T3\tping x y", "None"),
    (b"T4 pi\tng x", "T4"),
    (b"T5 ping x\ty", "T5"),
    (b"T6 ping x\t", "T6"),  # trailing: the original asserts before its rstrip
    (b"T7 ping x\t\r", "T7"),
    (b"T8 publish tab_ev \tbody", "T8"),
    (b"T9 publish tab_ev body\t", "T9"),
    (b"T10 publish --confirm tab_ev a\tb", "T10"),
    (b"T11 publish tab_ev\tx body", "T11"),
    (b"T12 ack cA m1\t", "T12"),
    (b"T13 reject --confirm cA\tm1", "T13"),
    (b"T14 delete_consumer --confirm cA\t", "T14"),
    (b"T15 delete_queue --confirm tab_qa\t", "T15"),
    (b"T16 rebind --confirm tab_qb --remove tab_ev\t", "T16"),
    (b"cX consume --confirm tab_qa tab_ev\t--manual-ack", "cX"),
    (b"T17 _eval WORKERS\t", "T17"),
    (b"T18 _eval\tWORKERS", "None"),
    (b"\t", "None"),
]


def test_a_tab_anywhere_is_an_error_and_nothing_else_changes(module_gateway: GatewayProcess) -> None:
    gw = module_gateway
    with wire(gw) as a, wire(gw) as b, wire(gw) as publisher:
        assert ask(a, b"cA consume --confirm tab_qa tab_ev --manual-ack") == [b"cA ok "]
        assert ask(b, b"cB consume --confirm tab_qb tab_ev") == [b"cB ok "]
        publisher.send(b"m1 publish tab_ev before")
        assert a.line() == b"cA ok m1 event=tab_ev before"  # unacked by cA
        assert b.line() == b"cB ok m1 event=tab_ev before"

        for line, request_id in TAB_LINES:
            error_id = one_error(ask(a, line), request_id)
            if request_id != "None":
                logged(gw, error_id, "TAB in request")
        # All at once: one error each, in order.
        a.sock.sendall(b"".join(line + b"\n" for line, _ in TAB_LINES))
        lines = a.barrier()
        assert len(lines) == len(TAB_LINES), lines
        for line, (_, request_id) in zip(lines, TAB_LINES, strict=True):
            one_error([line], request_id)

        # m1 is still unacked by cA (the TAB ack/reject/delete_consumer did nothing): a reject returns it.
        assert sorted(ask(a, b"R1 reject --confirm cA m1")) == [b"R1 ok ", b"cA ok m1 event=tab_ev,retry=1 before"]
        # No TAB publish went out, no consumer cX was made, both queues are still bound.
        publisher.send(b"m2 publish tab_ev after")
        assert a.line() == b"cA ok m2 event=tab_ev after"
        assert b.line() == b"cB ok m2 event=tab_ev after"
        assert a.barrier() == [] and b.barrier() == [] and publisher.barrier() == []


CARRIED_BODIES = [
    (b"a\x00b\x1bc\rd", True),
    (b"\x00", True),
    (b"\x1b[31mred\x1b[0m", True),
    (b"mid\rdle", True),
    (b"\x7f", True),
    (b"\xff\xfe\x80abc", True),
    (b"\xc3\x28 broken utf-8", True),
    (b"nel \xc2\x85 line", True),
    ("café € ✓".encode(), False),
    (b"plain text with  two spaces", False),
]


def test_control_characters_and_non_utf8_data_arrive_exactly(module_gateway: GatewayProcess) -> None:
    gw = module_gateway
    with wire(gw) as consumer, wire(gw) as publisher:
        assert ask(consumer, b"cc consume --confirm ctl_q ctl_ev") == [b"cc ok "]
        publisher.sock.sendall(b"".join(b"k%d publish ctl_ev %s\n" % (n, body)
                                        for n, (body, _) in enumerate(CARRIED_BODIES)))
        for n, (body, encoded) in enumerate(CARRIED_BODIES):
            line = consumer.line()
            head = b"cc ok k%d event=ctl_ev " % n
            assert line.startswith(head), line
            data = line[len(head) :]
            if encoded:
                assert data == ENCODED_PREFIX + base64.b64encode(body)
            else:
                assert data == body
            assert delivery(line, "cc").body == body

        # Data in the reversible encoding is decoded on publish and re-encoded only when needed.
        awkward = b"\n\t trailing \x00 "
        publisher.send(b"e1 publish ctl_ev " + ENCODED_PREFIX + base64.b64encode(awkward))
        publisher.send(b"e2 publish ctl_ev " + ENCODED_PREFIX + base64.b64encode(b"plain"))
        assert consumer.line() == b"cc ok e1 event=ctl_ev " + ENCODED_PREFIX + base64.b64encode(awkward)
        assert consumer.line() == b"cc ok e2 event=ctl_ev plain"

        # Ids that are not UTF-8 cannot be answered by name; bad base64 and a non-UTF-8 event are errors.
        for line in (b"\xffid publish ctl_ev x", b"\xc3\x28 publish ctl_ev x", b"ok\xe9 publish --confirm ctl_ev x",
                     b"\xff ping x"):
            one_error(ask(publisher, line), "None")
        one_error(ask(publisher, b"b64 publish ctl_ev " + ENCODED_PREFIX + b"@@@"), "b64")
        one_error(ask(publisher, b"ev1 publish \xff x"), "ev1")
        publisher.send(b"end publish ctl_ev end")
        assert consumer.line() == b"cc ok end event=ctl_ev end"  # none of the bad publishes went out
        assert consumer.barrier() == []


# -- unknown actions and consumers, malformed arguments -----------------------------------------------

# (line, answer): a request id = exactly one `{id} error …`; None = no answer at all; bytes = that line.
MALFORMED: list[tuple[bytes, str | bytes | None]] = [
    (b"u1 blabla 123", "u1"),
    (b"u2 PING x", "u2"),
    (b"u3 publish_ e x", "u3"),
    (b"u4 _EVAL WORKERS", "u4"),
    (b"x2  publish e1 d", "x2"),
    (b"", "None"),
    (b"   ", "None"),
    (b"\r", "None"),
    (b"pg3 ping", "None"),
    (b"dq9 delete_queue", "None"),
    (b"m1 publish unk_ev", "m1"),
    (b"m3 publish --confirm unk_ev", "m3"),
    (b"a4 ack cZ", "a4"),
    (b"a6 reject", "None"),
    (b"a7 reject --confirm cZ", "a7"),
    (b"a8 ack --confirm nosuch m1", None),
    (b"a9 ack nosuch --all", None),
    (b"a10 reject --confirm nosuch --all", None),
    (b"a11 reject --confirm nosuch m1", None),
    (b"a12 delete_consumer --confirm nosuch", None),
    (b"a13 delete_consumer nosuch", None),
    (b"a14 ack --confirm nosuch m1 with spaces", None),
    (b"r1 rebind unk_q", "r1"),
    (b"r2 rebind --confirm unk_q --bogus x", "r2"),
    (b"c1 consume unk_q --bogus", "c1"),
    (b"c2 consume --confirm unk_q2 --delete-queue-when-unused=abc", "c2"),
    (b"c3 consume --confirm unk_q2 --delete-queue-when-unused=nan", "c3"),
    (b"c4 consume --confirm unk_q2 --delete-queue-when-unused=inf", "c4"),
    (b"c5 consume --confirm", "c5"),
    (b"c6 consume  ", "None"),
    (b"d1 delete_queue", "None"),
    (b"d2 delete_consumer", "None"),
    (b"e1 _eval --worker=x WORKERS", "e1"),
    (b"e2 _eval --worker=3 WORKERS", "e2"),
    (b"e3 _eval --worker=0", "e3"),
    (b"e4 _eval --worker=0 WORKERS", b"e4 ok 1"),
    (b"p1 ping --confirm x", b"p1 ok x"),
]


def _expected(answer: str | bytes | None) -> Callable[[list[bytes]], None]:
    def check(lines: list[bytes]) -> None:
        if answer is None:
            assert lines == []
        elif isinstance(answer, bytes):
            assert lines == [answer]
        else:
            one_error(lines, answer)

    return check


def test_unknown_actions_unknown_consumers_and_bad_arguments(module_gateway: GatewayProcess) -> None:
    gw = module_gateway
    with wire(gw) as client:
        for line, answer in MALFORMED:
            lines = ask(client, line)
            try:
                _expected(answer)(lines)
            except AssertionError as error:
                raise AssertionError(f"{line!r}: {lines}") from error
        error_id = one_error(ask(client, b"u1 blabla 123"), "u1")
        logged(gw, error_id, "unknown action 'blabla'")
        # All in one write: the same answers, in order, and nothing for the unknown consumers.
        client.sock.sendall(b"".join(line + b"\n" for line, _ in MALFORMED))
        lines = client.barrier()
        expected = [answer for _, answer in MALFORMED if answer is not None]
        assert len(lines) == len(expected), lines
        for line, answer in zip(lines, expected, strict=True):
            _expected(answer)([line])
        assert ask(client, b"z ping survived") == [b"z ok survived"]
    no_tracebacks(gw)


# -- _eval ----------------------------------------------------------------------------------------------


def _attacks(marker: Path) -> list[str]:
    touch = f"__import__('os').system('touch {marker}')"
    return [
        touch,
        f"{touch} or WORKERS",
        f"[WORKERS, {touch}]",
        f"WORKERS if {touch} else WORKERS",
        f"f'{{{touch}}}'",
        f"open('{marker}', 'w').write('x')",
        "open('/etc/passwd').read()",
        "state.__class__",
        "state.__class__.__mro__",
        "state",
        "config",
        "globals()",
        "exec('1')",
        "getattr(state, 'published')",
        "state.published.__class__",
        "().__class__.__base__.__subclasses__()",
        "1+1",
        "'WORKERS'",
        "lambda: 0",
        f"(lambda: {touch})()",
        "[x for x in (WORKERS,)]",
        "len(state.queues) + 1",
        "(" * 100_000,
        "[" * 4000 + "]" * 4000,
        "-" * 8000 + "1",
        "not " * 2040 + "1",
        "a" + "[0]" * 2700,
        "a" + ".b" * 4000,
        "lambda: " * 1000 + "1",
        f"[{touch}]" + " + [WORKERS]" * 83_300,  # ~1 MB of code, a line under the 1 MiB default
    ]


def test_eval_never_runs_code(module_gateway: GatewayProcess) -> None:
    gw = module_gateway
    marker = Path(tempfile.gettempdir()) / f"polymq-eval-{uuid.uuid4().hex}"
    attacks = _attacks(marker)
    assert 990_000 < len(attacks[-1]) < 1_000_000
    with wire(gw) as client:
        for n, code in enumerate(attacks):
            for prefix in (b"", b"--confirm ", b"--worker=0 ") if n < 2 else (b"",):
                request_id = f"E{n}"
                try:
                    error_id = one_error(ask(client, f"{request_id} _eval ".encode() + prefix + code.encode()),
                                         request_id)
                except AssertionError as error:
                    raise AssertionError(f"_eval {code[:80]!r}") from error
                logged(gw, error_id, EVAL_REFUSED)
        assert not marker.exists()
        assert eval_ok(client, "WORKERS") == b"1"
        assert ask(client, b"z ping survived") == [b"z ok survived"]
    no_tracebacks(gw)
    assert not marker.exists()


def test_eval_stats_count_what_happened(gateway: GatewayProcess) -> None:
    with wire(gateway) as one, wire(gateway) as two, wire(gateway) as three, wire(gateway) as client:
        assert eval_ok(client, "len(state.queues)") == b"0"
        assert eval_ok(client, "[state.published, state.queued, state.consumed]") == b"[0, 0, 0]"
        assert ask(one, b"c1 consume --confirm sq1 sev1") == [b"c1 ok "]
        assert ask(two, b"c2 consume --confirm sq2 sev1") == [b"c2 ok "]
        assert ask(three, b"c3 consume --confirm sq3 sev2 --manual-ack") == [b"c3 ok "]
        client.sock.sendall(b"".join(b"p%d publish sev1 one %d\n" % (n, n) for n in range(30)))
        client.sock.sendall(b"".join(b"q%d publish sev2 two %d\n" % (n, n) for n in range(20)))
        client.sock.sendall(b"".join(b"r%d publish sev_unbound none %d\n" % (n, n) for n in range(10)))
        assert client.barrier() == []
        assert [delivery(one.line(), "c1").msg_id for _ in range(30)] == [f"p{n}" for n in range(30)]
        assert [delivery(two.line(), "c2").msg_id for _ in range(30)] == [f"p{n}" for n in range(30)]
        assert [delivery(three.line(), "c3").msg_id for _ in range(20)] == [f"q{n}" for n in range(20)]

        assert eval_ok(client, "state.published") == b"60"
        assert eval_ok(client, "state.queued") == b"80"  # 30 x 2 queues + 20; the unbound 10 were dropped
        assert eval_ok(client, "state.consumed") == b"80"
        assert eval_ok(client, "[state.published, state.queued]") == b"[60, 80]"
        assert eval_ok(client, "[ state.published ,state.queued ]") == b"[60, 80]"
        assert eval_ok(client, "(state.published, state.consumed)") == b"(60, 80)"
        assert eval_ok(client, "len(state.queues)") == b"3"
        assert eval_ok(client, "len( state.queues )") == b"3"
        assert eval_ok(client, "WORKERS") == b"1"
        assert ask(client, b"w _eval --worker=0 len(state.queues)") == [b"w ok 3"]
        unacked = "sum(len(ms) for ms in state.messages_by_consumer_ids.itervalues())"
        assert eval_ok(client, unacked) == b"20"
        assert ask(three, b"a1 ack --confirm c3 --all") == [b"a1 ok "]
        assert eval_ok(client, unacked.replace("itervalues", "values")) == b"0"


# -- floods ---------------------------------------------------------------------------------------------

FLOOD_MESSAGES = 5000
GARBAGE_CONNECTIONS = 200
GARBAGE_THREADS = 12
FLOOD_CONSUMER = "FLOODCONSUMER00000000001"
_JUNK_EVENTS = [b"j", b"jk", b"j.k", b"z-1"]
_JUNK_QUEUES = [b"jq", b"jq2", b"j.q"]
_JUNK_IDS = [b"g1", b"g2", b"gc", b"x"]


def _junk_line(rng: random.Random) -> bytes:
    event, queue, cid = rng.choice(_JUNK_EVENTS), rng.choice(_JUNK_QUEUES), rng.choice(_JUNK_IDS)
    mid = b"jm%d" % rng.randrange(100)
    choices: list[Callable[[], bytes]] = [
        lambda: b"%s publish %s %s" % (mid, event, rng.randbytes(rng.randint(1, 60)).replace(b"\n", b"")),
        lambda: b"%s publish --confirm %s body" % (mid, event),
        lambda: b"%s consume %s %s%s" % (cid, queue, event, rng.choice(
            [b"", b" --manual-ack", b" --add j", b" --delete-queue-when-unused", b" --delete-queue-when-unused=0.01",
             b" --bogus", b" --confirm"])),
        lambda: b"rb rebind %s --remove-mask j.* --add %s" % (queue, event),
        lambda: b"a ack %s %s" % (cid, rng.choice([b"--all", mid])),
        lambda: b"r reject --confirm %s --all" % cid,
        lambda: b"d delete_consumer --confirm %s" % cid,
        lambda: b"dq delete_queue %s" % queue,
        lambda: b"p ping %s" % rng.randbytes(rng.randint(1, 20)).replace(b"\n", b""),
        lambda: b"e _eval %s" % rng.choice([b"WORKERS", b"len(state.queues)", b"__import__('os')", b"(" * 5000]),
        lambda: b"t\tab ping x",
        lambda: b"x blabla y",
        lambda: rng.randbytes(rng.randint(1, 200)),
    ]
    line = rng.choice(choices)()
    for _ in range(rng.choice([0, 0, 1, 2])):  # mutate
        at = rng.randrange(len(line) + 1)
        line = line[:at] + rng.choice([b"\n", b"\t", b"\r", b"\x00", b" ", b"\xff", rng.randbytes(1)]) + line[at:]
    return line


@attrs.define
class GarbageOutcome:
    lines: int = 0  # response lines read (half-closed connections only)
    problems: list[str] = attrs.Factory(list)


def _garbage_connection(address: tuple[str, int], rng: random.Random, outcome: GarbageOutcome) -> None:
    lines = [_junk_line(rng) for _ in range(rng.randint(1, 40))]
    if rng.random() < 0.05:
        lines.append(b"L publish j " + b"l" * (MB + rng.randint(1, 100_000)))  # over the default limit
    burst = b"\n".join(lines) + b"\n" + _junk_line(rng)[: rng.randint(1, 30)]  # ends mid-line
    how = rng.choice(["reset", "close", "half-close"])
    sock = socket.create_connection(address, timeout=10.0)
    try:
        with contextlib.suppress(OSError):  # the gateway may see our reset first
            sock.sendall(burst)
        if how == "reset":
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        elif how == "half-close":
            # EOF: the last partial line is processed, everything is answered, then the gateway closes.
            sock.shutdown(socket.SHUT_WR)
            received = bytearray()
            while chunk := sock.recv(1 << 20):
                received += chunk
            if received and not received.endswith(b"\n"):
                outcome.problems.append(f"cut response {bytes(received[-80:])!r}")
            for line in bytes(received).split(b"\n")[:-1]:
                outcome.lines += 1
                if not RESPONSE_RE.fullmatch(line):
                    outcome.problems.append(f"malformed response {line[:80]!r}")
    except TimeoutError:
        outcome.problems.append(f"no close after EOF ({how})")
    except OSError as error:
        outcome.problems.append(f"{how}: {error!r}")
    finally:
        sock.close()


@attrs.define
class Flow:
    published: dict[str, bytes] = attrs.Factory(dict)
    deliveries: list[Delivery] = attrs.Factory(list)
    errors: list[str] = attrs.Factory(list)
    producer_done: threading.Event = attrs.Factory(threading.Event)


def _flood_body(n: int) -> bytes:
    if n % 10 == 0:
        return b"ctl\x00\x1b\r-%d" % n  # delivered in the reversible encoding
    if n % 10 == 1:
        return b"\xff\xfe-%d" % n
    return b"flood body %06d " % n + b"x" * (n % 50) + b"."


def _produce(gateway: GatewayProcess, flow: Flow) -> None:
    try:
        with wire(gateway) as producer:
            for start in range(0, FLOOD_MESSAGES, 250):
                batch = {f"fm{n:05d}": _flood_body(n) for n in range(start, min(start + 250, FLOOD_MESSAGES))}
                producer.sock.sendall(b"".join(b"%s publish flood_ev %s\n" % (mid.encode(), body)
                                               for mid, body in batch.items()))
                if answered := producer.barrier():
                    flow.errors.append(f"producer got {answered[:3]}")
                flow.published.update(batch)
    except Exception as error:
        flow.errors.append(f"producer: {error!r}")
    finally:
        flow.producer_done.set()


def _consume(consumer: MQKSWire, flow: Flow) -> None:
    try:
        seen: set[str] = set()
        deadline = time.monotonic() + 60.0
        acks = 0
        while time.monotonic() < deadline:
            if flow.producer_done.is_set() and len(seen) >= len(flow.published):
                return
            try:
                line = consumer.line(timeout=1.0)
            except TimeoutError:
                continue
            message = delivery(line, FLOOD_CONSUMER)
            flow.deliveries.append(message)
            seen.add(message.msg_id)
            acks += 1
            consumer.sock.sendall(b"a%d ack %s %s\n" % (acks, FLOOD_CONSUMER.encode(), message.msg_id.encode()))
        flow.errors.append("consumer: gave up after 60 s")
    except Exception as error:
        flow.errors.append(f"consumer: {error!r}")


@pytest.mark.slow
def test_garbage_connections_do_not_disturb_a_manual_ack_exchange(gateway: GatewayProcess) -> None:
    address = gateway.host_port("mqks")
    flow = Flow()
    consumer = wire(gateway)
    assert ask(consumer, f"{FLOOD_CONSUMER} consume --confirm flood_q flood_ev --manual-ack".encode()) == [
        FLOOD_CONSUMER.encode() + b" ok "]

    outcomes: list[GarbageOutcome] = []
    started = 0
    lock = threading.Lock()

    def garbage(seed: int) -> None:
        nonlocal started
        rng = random.Random(seed)
        while True:
            with lock:
                if started >= GARBAGE_CONNECTIONS and flow.producer_done.is_set():
                    return
                started += 1
            outcome = GarbageOutcome()
            outcomes.append(outcome)
            _garbage_connection(address, rng, outcome)

    threads = [threading.Thread(target=garbage, args=(1000 + i,), daemon=True) for i in range(GARBAGE_THREADS)]
    consuming = threading.Thread(target=_consume, args=(consumer, flow), daemon=True)
    producing = threading.Thread(target=_produce, args=(gateway, flow), daemon=True)
    for thread in [*threads, consuming, producing]:
        thread.start()
    for thread in [producing, consuming, *threads]:
        thread.join(90)
        assert not thread.is_alive()

    assert not flow.errors, flow.errors
    assert len(flow.published) == FLOOD_MESSAGES
    # Exactly once, with the right body, never redelivered.
    assert sorted(d.msg_id for d in flow.deliveries) == sorted(flow.published)
    assert all(d.body == flow.published[d.msg_id] and d.retry == 0 and d.event == "flood_ev"
               for d in flow.deliveries)
    assert consumer.barrier() == []  # no late duplicate
    consumer.close()

    assert len(outcomes) >= GARBAGE_CONNECTIONS
    problems = [problem for outcome in outcomes for problem in outcome.problems]
    assert not problems, problems[:5]
    assert sum(outcome.lines for outcome in outcomes) > 0
    assert_alive(gateway)
    no_tracebacks(gateway)


def _never_reading_socket(address: tuple[str, int]) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.settimeout(10.0)
    sock.connect(address)
    return sock


@pytest.mark.slow
def test_a_client_that_never_reads_blocks_nobody() -> None:
    count, body = 20_000, b"b" * 1000
    with running_gateway("--mqks-consumer-window", "2000") as gw, wire(gw) as good, wire(gw) as producer:
        address = gw.host_port("mqks")
        before = memory_kb(gw)["VmRSS"]
        # A consumer of the same event that stops reading after its confirm.
        stuck = _never_reading_socket(address)
        stuck.sendall(b"S1 consume --confirm stuck_q big_ev\n")
        received = b""
        while not received.endswith(b"\n"):
            received += stuck.recv(1)
        assert received == b"S1 ok \n"
        assert ask(good, b"G1 consume --confirm good_q big_ev") == [b"G1 ok "]

        # A client sending pings, never reading the pongs: the gateway must stop reading it, not buffer it all.
        flooder = _never_reading_socket(address)
        flooder.settimeout(1.0)
        flood_total = 64 * MB
        flood_sent = 0
        flood_stalled = threading.Event()

        def flood() -> None:
            nonlocal flood_sent
            line = b"f ping " + b"p" * 1017 + b"\n"
            chunk = line * 256
            try:
                while flood_sent < flood_total:
                    flood_sent += flooder.send(chunk)
            except TimeoutError:
                flood_stalled.set()
            except OSError:
                pass

        flooding = threading.Thread(target=flood, daemon=True)
        flooding.start()

        got: list[str] = []

        def read_good() -> None:
            with contextlib.suppress(TimeoutError, Closed):
                while len(got) < count:
                    got.append(delivery(good.line(timeout=20.0), "G1").msg_id)

        reading = threading.Thread(target=read_good, daemon=True)
        reading.start()
        for start in range(0, count, 1000):
            producer.sock.sendall(b"".join(b"m%d publish big_ev %s\n" % (n, body) for n in range(start, start + 1000)))
            assert producer.barrier() == []
        reading.join(30)
        assert got == [f"m{n}" for n in range(count)]  # all, in order
        assert good.barrier() == []
        # The stuck consumer really is stuck: most of its copies still wait in its queue.
        waiting = int(eval_ok(producer, "sum(q.qsize() for q in state.queues.values())"))
        assert waiting > count // 2, waiting

        # Still responsive for a new client while both misbehaving clients are connected.
        started = time.monotonic()
        assert_alive(gw)
        assert time.monotonic() - started < 2.0
        flooding.join(30)
        assert flood_stalled.is_set() and flood_sent < flood_total, flood_sent
        peak = memory_kb(gw)["VmHWM"]
        assert peak - before < RSS_GROWTH_LIMIT_KB, (before, peak)
        stuck.close()
        flooder.close()
        assert_alive(gw)
        no_tracebacks(gw)


@pytest.mark.slow
def test_a_manual_ack_consumer_leaving_with_thousands_unacked_returns_each_once(gateway: GatewayProcess) -> None:
    count = 3000
    bodies = {f"u{n}": (b"returned %d \x00" % n if n % 3 == 0 else b"returned %d" % n) for n in range(count)}
    with wire(gateway) as leaver, wire(gateway) as heir, wire(gateway) as producer:
        assert ask(leaver, b"cA consume --confirm ret_q ret_ev --manual-ack") == [b"cA ok "]
        producer.sock.sendall(b"".join(b"%s publish ret_ev %s\n" % (mid.encode(), body)
                                       for mid, body in bodies.items()))
        assert producer.barrier() == []
        first = [delivery(leaver.line(), "cA") for _ in range(count)]
        assert {(d.msg_id, d.body, d.retry) for d in first} == {(mid, body, 0) for mid, body in bodies.items()}

        assert ask(heir, b"cB consume --confirm ret_q --manual-ack") == [b"cB ok "]  # all are with cA
        unacked = "sum(len(ms) for ms in state.messages_by_consumer_ids.values())"
        assert eval_ok(producer, unacked) == str(count).encode()
        leaver.close()

        returned = [delivery(heir.line(), "cB") for _ in range(count)]
        assert sorted(d.msg_id for d in returned) == sorted(bodies)
        assert all(d.retry == 1 and d.props["event"] == "ret_ev" and d.body == bodies[d.msg_id] for d in returned)
        assert heir.barrier() == []
        assert eval_ok(producer, unacked) == str(count).encode()
        assert ask(heir, b"a1 ack --confirm cB --all") == [b"a1 ok "]
        assert eval_ok(producer, unacked) == b"0"
