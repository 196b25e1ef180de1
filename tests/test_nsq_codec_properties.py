"""Hypothesis property tests of the NSQ V2 codec (server parser, client encoders, frames, MPUB bodies)."""

from __future__ import annotations

import itertools
import struct
from collections.abc import Callable

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from polymq.codecs import nsq
from polymq.codecs import nsq_client as client

# Every code nsqd can send (docs/protocols/nsq.md), plus E_BAD_PROTOCOL at the handshake.
NSQD_CODES = frozenset(
    {
        "E_INVALID",
        "E_BAD_BODY",
        "E_BAD_TOPIC",
        "E_BAD_CHANNEL",
        "E_BAD_MESSAGE",
        "E_PUB_FAILED",
        "E_MPUB_FAILED",
        "E_DPUB_FAILED",
        "E_SUB_FAILED",
        "E_IDENTIFY_FAILED",
        "E_AUTH_DISABLED",
        "E_AUTH_FAILED",
        "E_AUTH_FIRST",
        "E_UNAUTHORIZED",
        "E_AUTH_ERROR",
        "E_BAD_PROTOCOL",
        "E_FIN_FAILED",
        "E_REQ_FAILED",
        "E_TOUCH_FAILED",
    }
)

SMALL_LIMITS = nsq.ServerLimits(max_msg_size=40, max_body_size=120, max_rdy_count=50, max_req_timeout_ms=1000)

# ---------------------------------------------------------------------------------------------
# strategies

names = st.one_of(
    st.from_regex(r"[.a-zA-Z0-9_-]{1,64}", fullmatch=True),
    st.from_regex(r"[.a-zA-Z0-9_-]{1,54}#ephemeral", fullmatch=True),
)
message_ids = st.lists(st.integers(0, 255).filter(lambda b: b not in b" \r\n"), min_size=16, max_size=16).map(bytes)
bodies = st.binary(min_size=1, max_size=40)
identify_data = st.fixed_dictionaries(
    {},
    optional={
        "client_id": st.text(max_size=10),
        "hostname": st.text(max_size=10),
        "user_agent": st.text(max_size=10),
        "feature_negotiation": st.booleans(),
        "heartbeat_interval": st.sampled_from([0, 1000, 30000, 60000]),
        "output_buffer_size": st.sampled_from([-1, 0, 64, 65536]),
        "output_buffer_timeout": st.sampled_from([-1, 0, 25, 30000]),
        "deflate": st.booleans(),
        "deflate_level": st.integers(-1, 9),
        "sample_rate": st.integers(0, 99),
        "msg_timeout": st.sampled_from([0, 1000, 900000]),
        "tls_v1": st.booleans(),
        "short_id": st.text(max_size=5),
    },
)

# A step is (encoded bytes, expected event or a predicate on the event).
Step = tuple[bytes, object]


def _identify_step(data: dict[str, object]) -> Step:
    def check(event: object) -> bool:
        return isinstance(event, nsq.Identify) and event.raw == data

    return client.identify(data), check


publish_steps = st.one_of(
    st.builds(lambda t, b: (client.pub(t, b), nsq.Pub(t, b)), names, bodies),
    st.builds(lambda t, bs: (client.mpub(t, bs), nsq.Mpub(t, bs)), names, st.lists(bodies, min_size=1, max_size=5)),
    st.builds(lambda t, d, b: (client.dpub(t, d, b), nsq.Dpub(t, d, b)), names, st.integers(0, 3_600_000), bodies),
    st.just((client.nop(), nsq.Nop())),
)
init_steps = st.one_of(
    publish_steps,
    identify_data.map(_identify_step),
    st.binary(min_size=1, max_size=20).map(lambda s: (client.auth(s), nsq.Auth(s))),
)
subscribed_steps = st.one_of(
    publish_steps,
    st.integers(0, 2500).map(lambda n: (client.rdy(n), nsq.Rdy(n))),
    st.just((b"RDY\n", nsq.Rdy(1))),
    message_ids.map(lambda i: (client.fin(i), nsq.Fin(i))),
    message_ids.map(lambda i: (client.touch(i), nsq.Touch(i))),
    st.builds(lambda i, t: (client.req(i, t), nsq.Req(i, min(t, 3_600_000))), message_ids, st.integers(0, 10**10)),
)
closing_steps = st.one_of(
    publish_steps,
    st.integers(0, 2500).map(lambda n: (client.rdy(n), nsq.Nop())),  # RDY after CLS is ignored
    message_ids.map(lambda i: (client.fin(i), nsq.Fin(i))),
    message_ids.map(lambda i: (client.touch(i), nsq.Touch(i))),
    st.builds(lambda i, t: (client.req(i, t), nsq.Req(i, t)), message_ids, st.integers(0, 3_600_000)),
)


@st.composite
def command_streams(draw: st.DrawFn) -> list[Step]:
    steps: list[Step] = list(draw(st.lists(init_steps, max_size=6)))
    if draw(st.booleans()):
        topic, channel = draw(names), draw(names)
        steps.append((client.sub(topic, channel), nsq.Sub(topic, channel)))
        steps += draw(st.lists(subscribed_steps, max_size=8))
        if draw(st.booleans()):
            steps.append((client.cls(), nsq.Cls()))
            steps += draw(st.lists(closing_steps, max_size=5))
    return steps


@st.composite
def chunked(draw: st.DrawFn, data: bytes) -> list[bytes]:
    """`data` cut at random places (sometimes into single bytes)."""
    if len(data) < 200 and draw(st.integers(0, 9)) == 0:
        return [data[i : i + 1] for i in range(len(data))]
    cuts = sorted(set(draw(st.lists(st.integers(0, len(data)), max_size=12))))
    points = [0, *cuts, len(data)]
    return [data[a:b] for a, b in itertools.pairwise(points)]


def drive(conn: nsq.ServerConnection, chunks: list[bytes], on_event: Callable[[object], None]) -> None:
    """Feed chunks the way the adapter does, reporting SUB and CLS back to the parser."""
    for chunk in chunks:
        conn.receive_data(chunk)
        for _ in range(100_000):
            event = conn.next_event()
            if event is nsq.NEED_DATA:
                break
            if isinstance(event, nsq.Fins):  # a run of FINs: each as its own FIN would parse
                for msg_id in event.msg_ids:
                    on_event(nsq.Fin(msg_id))
                continue
            on_event(event)
            if isinstance(event, nsq.Sub):
                conn.subscribed()
            elif isinstance(event, nsq.Cls):
                conn.closing()
        else:
            raise AssertionError("the parser never asked for more data")


# ---------------------------------------------------------------------------------------------
# (1) encoder stream -> parser, whatever the chunking


@settings(max_examples=120, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_client_command_stream_parses_back_under_any_chunking(data: st.DataObject) -> None:
    steps = data.draw(command_streams())
    stream = client.magic() + b"".join(encoded for encoded, _ in steps)
    chunks = data.draw(chunked(stream))
    assert b"".join(chunks) == stream
    events: list[object] = []
    conn = nsq.ServerConnection()
    drive(conn, chunks, events.append)
    assert len(events) == len(steps), events
    for event, (_, expected) in zip(events, steps, strict=True):
        if callable(expected):
            assert expected(event), event
        else:
            assert event == expected
    assert conn.buffered == 0
    assert conn.state is not nsq.ClientState.CLOSED


# ---------------------------------------------------------------------------------------------
# (2) garbage never raises; the parser stops after a fatal error; codes are nsqd's


def _check_garbage(conn: nsq.ServerConnection, chunks: list[bytes]) -> None:
    limits = conn.limits
    bound = max(nsq.MAX_LINE_LENGTH, limits.max_body_size + 4)
    stopped = False

    def on_event(event: object) -> None:
        nonlocal stopped
        assert not stopped, f"event {event!r} after the parser stopped"
        assert isinstance(event, (*nsq.Command.__args__, nsq.ProtocolError, nsq.CloseSilently)), event
        if isinstance(event, nsq.ProtocolError):
            assert event.code in NSQD_CODES, event
            assert isinstance(event.description, bytes)
            assert event.fatal == (event.code not in nsq.NON_FATAL_CODES)
            nsq.frame_error(event)
            if event.fatal:
                stopped = True
        elif isinstance(event, nsq.CloseSilently):
            stopped = True
        elif isinstance(event, nsq.Rdy):
            assert 0 <= event.count <= limits.max_rdy_count
        elif isinstance(event, nsq.Req):
            assert 0 <= event.timeout_ms <= limits.max_req_timeout_ms
        elif isinstance(event, (nsq.Pub, nsq.Dpub)):
            assert 0 < len(event.body) <= limits.max_msg_size
            assert nsq.is_valid_name(event.topic.encode())
        elif isinstance(event, nsq.Mpub):
            assert event.bodies and all(0 < len(b) <= limits.max_msg_size for b in event.bodies)
        elif isinstance(event, nsq.Sub):
            assert nsq.is_valid_name(event.topic.encode()) and nsq.is_valid_name(event.channel.encode())
        elif isinstance(event, (nsq.Fin, nsq.Touch)):
            assert len(event.msg_id) == nsq.MSG_ID_LENGTH

    for chunk in chunks:
        drive(conn, [chunk], on_event)
        assert conn.buffered <= bound
        if stopped:
            assert conn.state is nsq.ClientState.CLOSED
            assert conn.buffered == 0
    if stopped:
        conn.receive_data(b"NOP\n" * 100)
        assert conn.next_event() is nsq.NEED_DATA
        assert conn.buffered == 0


limits_choice = st.sampled_from([nsq.ServerLimits(), SMALL_LIMITS, nsq.ServerLimits(tls_required=True)])
state_choice = st.sampled_from(["magic", "init", "subscribed", "closing"])


def _conn(limits: nsq.ServerLimits, state: str) -> nsq.ServerConnection:
    conn = nsq.ServerConnection(limits)
    if state != "magic":
        conn.receive_data(nsq.MAGIC_V2)
        assert conn.next_event() is nsq.NEED_DATA
    if state in ("subscribed", "closing"):
        conn.subscribed()
    if state == "closing":
        conn.closing()
    return conn


@settings(max_examples=300)
@given(limits_choice, state_choice, st.lists(st.binary(max_size=60), max_size=8))
def test_random_bytes_never_raise(limits: nsq.ServerLimits, state: str, chunks: list[bytes]) -> None:
    _check_garbage(_conn(limits, state), chunks)


# Garbage that looks like NSQ: command words, separators, numbers and size prefixes.
_tokens = st.one_of(
    st.sampled_from(
        [
            b"IDENTIFY",
            b"AUTH",
            b"SUB",
            b"PUB",
            b"MPUB",
            b"DPUB",
            b"RDY",
            b"FIN",
            b"REQ",
            b"TOUCH",
            b"CLS",
            b"NOP",
            b" ",
            b"\n",
            b"\r\n",
            b"\r",
            b"t",
            b"c",
            b"#ephemeral",
            b"-1",
            b"0",
            b"2500",
            b"3600001",
            b"{}",
            b"x*",
            b'{"heartbeat_interval":-1}',
            b'{"deflate":true,"snappy":true,"feature_negotiation":true}',
            b"[[[[",
            b"18a3cd6d40a69000",
            b'{"heartbeat_interval":NaN}',
            b'{"msg_timeout":1e999}',
            b"[" * 2000,
            b"9" * 5000,
            b"18446744073709551615",
        ]
    ),
    st.integers(-(2**31), 2**31 - 1).map(lambda n: struct.pack(">i", n)),
    st.integers(0, 200).map(lambda n: struct.pack(">i", n)),
    st.binary(max_size=8),
)


@settings(max_examples=400)
@given(limits_choice, state_choice, st.lists(_tokens, max_size=30), st.data())
def test_token_soup_never_raises(
    limits: nsq.ServerLimits, state: str, tokens: list[bytes], data: st.DataObject
) -> None:
    stream = b"".join(tokens)
    _check_garbage(_conn(limits, state), data.draw(chunked(stream)))


@st.composite
def mutated_streams(draw: st.DrawFn) -> bytes:
    steps = draw(command_streams())
    stream = bytearray(client.magic() + b"".join(encoded for encoded, _ in steps))
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["flip", "insert", "delete", "replace"]))
        position = draw(st.integers(0, len(stream)))
        if kind == "insert":
            stream[position:position] = draw(st.binary(min_size=1, max_size=6))
        elif stream and position < len(stream):
            if kind == "flip":
                stream[position] ^= 1 << draw(st.integers(0, 7))
            elif kind == "delete":
                del stream[position : position + draw(st.integers(1, 6))]
            else:
                stream[position] = draw(st.integers(0, 255))
    return bytes(stream)


@settings(max_examples=150, suppress_health_check=[HealthCheck.too_slow])
@given(limits_choice, mutated_streams(), st.data())
def test_mutated_streams_never_raise(limits: nsq.ServerLimits, stream: bytes, data: st.DataObject) -> None:
    _check_garbage(_conn(limits, "magic"), data.draw(chunked(stream)))


@settings(max_examples=50)
@given(st.binary(min_size=1, max_size=200).filter(lambda b: b"\n" not in b), st.integers(1, 5000))
def test_long_lines_close_silently(filler: bytes, chunk: int) -> None:
    conn = _conn(nsq.ServerLimits(), "init")
    stream = (filler * (nsq.MAX_LINE_LENGTH // len(filler) + 1))[: nsq.MAX_LINE_LENGTH]
    events: list[object] = []
    drive(conn, [stream[i : i + chunk] for i in range(0, len(stream), chunk)], events.append)
    assert len(events) == 1 and isinstance(events[0], nsq.CloseSilently)
    assert conn.buffered == 0


@settings(max_examples=100)
@given(
    st.dictionaries(
        st.text(max_size=25),
        st.recursive(
            st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5),
            lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
            max_leaves=6,
        ),
        max_size=6,
    )
)
def test_identify_with_any_json_object(data: dict[str, object]) -> None:
    import json

    body = json.dumps(data).encode()
    conn = _conn(nsq.ServerLimits(), "init")
    events: list[object] = []
    drive(conn, [b"IDENTIFY\n" + struct.pack(">i", len(body)) + body], events.append)
    assert len(events) == 1
    event = events[0]
    if isinstance(event, nsq.ProtocolError):
        assert event.fatal and event.code in ("E_BAD_BODY", "E_IDENTIFY_FAILED")
    else:
        assert isinstance(event, nsq.Identify)


# ---------------------------------------------------------------------------------------------
# (3) message frames round trip through FrameReader / decode_message

frames_strategy = st.one_of(
    st.builds(
        lambda ts, att, mid, body: (nsq.frame_message(ts, att, mid, body), client.Message(ts, att, mid, body)),
        st.integers(-(2**63), 2**63 - 1),
        st.integers(0, 65535),
        st.binary(min_size=16, max_size=16),
        st.binary(max_size=300),
    ),
    st.binary(max_size=50).map(lambda d: (nsq.frame_response(d), client.Frame(0, d))),
    st.binary(max_size=50).map(lambda d: (nsq.frame(1, d), client.Frame(1, d))),
)


@settings(max_examples=200)
@given(st.lists(frames_strategy, min_size=1, max_size=6), st.data())
def test_frames_round_trip(frames: list[tuple[bytes, object]], data: st.DataObject) -> None:
    stream = b"".join(encoded for encoded, _ in frames)
    reader = client.FrameReader()
    got: list[client.Frame] = []
    for chunk in data.draw(chunked(stream)):
        reader.receive_data(chunk)
        got += reader.frames()
    assert len(got) == len(frames)
    for frame, (encoded, expected) in zip(got, frames, strict=True):
        assert 4 + 4 + len(frame.data) == len(encoded)
        if isinstance(expected, client.Message):
            assert frame.is_message
            assert len(frame.data) == 26 + len(expected.body)
            assert client.decode_message(frame.data) == expected
        else:
            assert frame == expected


@given(st.integers(-(2**63), 2**63 - 1), st.integers(0, 65535), st.binary(min_size=16, max_size=16), st.binary())
def test_message_header_matches_frame(ts: int, attempts: int, msg_id: bytes, body: bytes) -> None:
    framed = nsq.frame_message(ts, attempts, msg_id, body)
    assert nsq.frame_message_header(ts, attempts, msg_id, len(body)) + body == framed
    assert struct.unpack_from(">i", framed)[0] == 30 + len(body)


# ---------------------------------------------------------------------------------------------
# (4) MPUB bodies round trip


@given(st.lists(st.binary(min_size=1, max_size=100), min_size=1, max_size=30))
def test_mpub_body_round_trip(parts: list[bytes]) -> None:
    assert nsq.parse_mpub_body(client.mpub_body(parts), nsq.ServerLimits()) == parts


@given(st.lists(st.binary(max_size=30), min_size=1, max_size=10).filter(lambda ps: b"" in ps))
def test_mpub_empty_part_rejected_with_its_index(parts: list[bytes]) -> None:
    error = nsq.parse_mpub_body(client.mpub_body(parts), nsq.ServerLimits())
    index = parts.index(b"")
    assert error == nsq.fatal("E_BAD_MESSAGE", f"MPUB invalid message({index}) body size 0")


@given(st.lists(st.binary(min_size=1, max_size=60), min_size=1, max_size=10))
def test_mpub_part_limit(parts: list[bytes]) -> None:
    limits = nsq.ServerLimits(max_msg_size=40)
    result = nsq.parse_mpub_body(client.mpub_body(parts), limits)
    too_big = [len(p) for p in parts if len(p) > 40]
    if too_big:
        assert result == nsq.fatal("E_BAD_MESSAGE", f"MPUB message too big {too_big[0]} > 40")
    else:
        assert result == parts


@given(st.binary(max_size=200))
def test_parse_mpub_body_garbage(body: bytes) -> None:
    result = nsq.parse_mpub_body(body, SMALL_LIMITS)
    if isinstance(result, nsq.ProtocolError):
        assert result.fatal and result.code in ("E_BAD_BODY", "E_BAD_MESSAGE")
    else:
        assert client.mpub_body(result) == body


@given(st.lists(st.binary(min_size=1, max_size=20), min_size=1, max_size=5), names, st.data())
def test_mpub_command_round_trip(parts: list[bytes], topic: str, data: st.DataObject) -> None:
    stream = client.magic() + client.mpub(topic, parts)
    events: list[object] = []
    drive(nsq.ServerConnection(), data.draw(chunked(stream)), events.append)
    assert events == [nsq.Mpub(topic, parts)]


# ---------------------------------------------------------------------------------------------
# names and quoting


@given(st.binary(max_size=70))
def test_name_rule_matches_nsqd_regex(name: bytes) -> None:
    import re

    expected = 1 <= len(name) <= 64 and re.fullmatch(rb"[.a-zA-Z0-9_-]+(#ephemeral)?", name) is not None
    assert nsq.is_valid_name(name) == expected


@given(st.binary(max_size=40))
def test_go_quote_is_ascii_safe_and_round_trips_ascii(raw: bytes) -> None:
    quoted = nsq.go_quote(raw)
    assert quoted.startswith('"') and quoted.endswith('"')
    assert "\n" not in quoted and "\r" not in quoted
    if all(32 <= b < 127 for b in raw):
        # printable ASCII: only `"` and `\` are escaped, exactly like a JSON string
        import json

        assert quoted == json.dumps(raw.decode())


@given(st.integers(0, 2**64 - 1), st.integers(0, 2**63 - 1), st.integers(1, 65535), st.integers(0, 2**20))
def test_a_numeric_id_frames_as_its_16_lowercase_hex_digits(message_id: int, timestamp_ns: int, attempts: int,
                                                            body_len: int) -> None:
    assert nsq.frame_message_header_of(timestamp_ns, attempts, message_id, body_len) == \
        nsq.frame_message_header(timestamp_ns, attempts, b"%016x" % message_id, body_len)
    assert nsq.message_id_number(b"%016x" % message_id) == message_id


# Ids as a consumer sends them back: mostly this codec's own (16 lowercase hex digits), some not.
_fin_ids = st.one_of(
    st.integers(0, 2**64 - 1).map(lambda number: b"%016x" % number),
    st.text("0123456789abcdefABCDEFINxyz", min_size=16, max_size=16).map(str.encode),
)


@given(st.lists(_fin_ids, min_size=1, max_size=40), st.binary(max_size=30))
def test_a_run_of_fins_reads_every_id_as_a_fin_of_its_own_would(ids: list[bytes], tail: bytes) -> None:
    """The run's bulk check and bulk read give what one FIN line at a time gives, whatever follows."""
    conn = nsq.ServerConnection(nsq.ServerLimits())
    conn.receive_data(nsq.MAGIC_V2 + client.sub("t", "c") + b"".join(client.fin(msg_id) for msg_id in ids) + tail)
    assert isinstance(conn.next_event(), nsq.Sub)
    conn.subscribed()
    event = conn.next_event()
    got = event.msg_ids if isinstance(event, nsq.Fins) else [event.msg_id] if isinstance(event, nsq.Fin) else []
    assert got[: len(ids)] == ids
    # The tail joins the run only with a plain FIN line of its own.
    assert len(got) == len(ids) or tail.startswith(b"FIN ")
    if isinstance(event, nsq.Fins):
        assert nsq.fin_numbers(event.lines) == [nsq.message_id_number(msg_id) for msg_id in got]
