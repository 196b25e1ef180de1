"""NSQ V2 codec, exact bytes and exact error texts (docs/protocols/nsq.md).

Sans-IO: no gateway is started. The parser is driven the way the adapter drives it: bytes in,
events out, `subscribed()` / `closing()` reported after a successful SUB / CLS.
"""

from __future__ import annotations

import json
import struct

import attrs
import pytest

from polymq.codecs import nsq
from polymq.codecs import nsq_client as client

MAX_MSG = 1048576
MAX_BODY = 5242880
MSG_ID = b"18a3cd6d40a69000"


# ---------------------------------------------------------------------------------------------
# helpers


def connect(limits: nsq.ServerLimits | None = None, *, state: str = "init") -> nsq.ServerConnection:
    """A connection past the magic, in `state` (init, subscribed or closing)."""
    conn = nsq.ServerConnection(limits)
    conn.receive_data(nsq.MAGIC_V2)
    assert conn.next_event() is nsq.NEED_DATA
    assert conn.state is nsq.ClientState.INIT
    if state in ("subscribed", "closing"):
        conn.subscribed()
    if state == "closing":
        conn.closing()
    return conn


def pull(conn: nsq.ServerConnection, data: bytes = b"") -> list[nsq.Event]:
    """Feed `data`, then take events until NEED_DATA (reporting SUB/CLS like the adapter)."""
    if data:
        conn.receive_data(data)
    out: list[nsq.Event] = []
    for _ in range(10_000):
        event = conn.next_event()
        if event is nsq.NEED_DATA:
            return out
        out.append(event)
        if isinstance(event, nsq.Sub):
            conn.subscribed()
        elif isinstance(event, nsq.Cls):
            conn.closing()
    raise AssertionError("parser never asked for more data")


def one(data: bytes, limits: nsq.ServerLimits | None = None, *, state: str = "init") -> nsq.Event:
    events = pull(connect(limits, state=state), data)
    assert len(events) == 1, events
    return events[0]


def assert_stopped(conn: nsq.ServerConnection) -> None:
    """After a fatal error the parser yields nothing more, whatever arrives."""
    assert conn.state is nsq.ClientState.CLOSED
    assert conn.next_event() is nsq.NEED_DATA
    conn.receive_data(b"NOP\nPUB t\n\x00\x00\x00\x01x" * 10)
    assert conn.next_event() is nsq.NEED_DATA
    assert conn.buffered == 0


def assert_fatal(
    data: bytes,
    code: str,
    text: str | bytes,
    limits: nsq.ServerLimits | None = None,
    *,
    state: str = "init",
    before: bytes = b"",
) -> None:
    conn = connect(limits, state=state)
    if before:
        pull(conn, before)
    # Trailing commands must not be parsed after the fatal error.
    events = pull(conn, data + b"NOP\n" + client.pub("t", b"x"))
    assert len(events) == 1, events
    error = events[0]
    assert isinstance(error, nsq.ProtocolError), error
    expected = text.encode() if isinstance(text, str) else text
    assert (error.code, error.description, error.fatal) == (code, expected, True)
    assert nsq.frame_error(error) == _frame(1, code.encode() + b" " + expected)
    assert_stopped(conn)


def _frame(frame_type: int, data: bytes) -> bytes:
    return struct.pack(">ii", len(data) + 4, frame_type) + data


def sized(line: bytes, size: int, body: bytes = b"") -> bytes:
    return line + struct.pack(">i", size) + body


# ---------------------------------------------------------------------------------------------
# server frames, exact bytes


def test_ok_frame_bytes() -> None:
    assert bytes.fromhex("00000006 00000000 4f4b") == nsq.FRAME_OK
    assert nsq.frame_response(b"OK") == nsq.FRAME_OK


def test_heartbeat_frame_bytes() -> None:
    assert bytes.fromhex("0000000f 00000000") + b"_heartbeat_" == nsq.FRAME_HEARTBEAT
    assert len(nsq.FRAME_HEARTBEAT) == 4 + 15


def test_close_wait_frame_bytes() -> None:
    assert bytes.fromhex("0000000e 00000000") + b"CLOSE_WAIT" == nsq.FRAME_CLOSE_WAIT


def test_error_frame_bytes() -> None:
    bad_protocol = nsq.ProtocolError("E_BAD_PROTOCOL", b"")
    assert bad_protocol.frame_text == b"E_BAD_PROTOCOL"
    assert nsq.frame_error(bad_protocol) == bytes.fromhex("00000012 00000001") + b"E_BAD_PROTOCOL"
    error = nsq.fatal("E_INVALID", "invalid command pub")
    assert nsq.frame_error(error) == bytes.fromhex("00000021 00000001") + b"E_INVALID invalid command pub"
    non_fatal = nsq.non_fatal("E_FIN_FAILED", b"FIN 18a3cd6d40a69000 failed ID not in flight")
    assert non_fatal.fatal is False
    assert nsq.frame_error(non_fatal) == _frame(1, b"E_FIN_FAILED FIN 18a3cd6d40a69000 failed ID not in flight")


def test_frame_types() -> None:
    assert (nsq.FRAME_TYPE_RESPONSE, nsq.FRAME_TYPE_ERROR, nsq.FRAME_TYPE_MESSAGE) == (0, 1, 2)
    assert nsq.frame(2, b"abc") == bytes.fromhex("00000007 00000002") + b"abc"


@pytest.mark.parametrize("body", [b"", b"x", b"hello world", bytes(range(256)) * 10])
def test_message_frame_layout(body: bytes) -> None:
    timestamp = 1_700_000_000_123_456_789
    data = nsq.frame_message(timestamp, 3, MSG_ID, body)
    size, frame_type, ts, attempts = struct.unpack_from(">iiqH", data)
    assert size == 30 + len(body)
    assert len(data) == 4 + size
    assert frame_type == 2
    assert ts == timestamp
    assert attempts == 3
    assert data[18:34] == MSG_ID
    assert data[34:] == body
    assert nsq.frame_message_header(timestamp, 3, MSG_ID, len(body)) + body == data
    assert nsq.MESSAGE_OVERHEAD == 26


def test_message_frame_extremes() -> None:
    data = nsq.frame_message(-1, 65535, b"f" * 16, b"b")
    assert data[8:16] == b"\xff" * 8
    assert data[16:18] == b"\xff\xff"


# ---------------------------------------------------------------------------------------------
# magic


def test_bad_magic() -> None:
    conn = nsq.ServerConnection()
    events = pull(conn, b"  V1NOP\n")
    assert events == [nsq.ProtocolError("E_BAD_PROTOCOL", b"", True)]
    assert nsq.frame_error(events[0]) == bytes.fromhex("00000012 00000001") + b"E_BAD_PROTOCOL"
    assert_stopped(conn)


@pytest.mark.parametrize("magic", [b"GET ", b"  v2", b"\x00\x00\x00\x00", b"V2  ", b"  V3"])
def test_bad_magic_variants(magic: bytes) -> None:
    conn = nsq.ServerConnection()
    events = pull(conn, magic)
    assert [(e.code, e.description) for e in events] == [("E_BAD_PROTOCOL", b"")]


def test_magic_in_pieces() -> None:
    conn = nsq.ServerConnection()
    assert conn.state is nsq.ClientState.MAGIC
    for piece in (b" ", b" V", b"2"):
        assert pull(conn, piece) == []
    assert conn.state is nsq.ClientState.INIT
    assert pull(conn, b"NOP\n") == [nsq.Nop()]


def test_magic_and_commands_in_one_chunk() -> None:
    conn = nsq.ServerConnection()
    assert pull(conn, b"  V2NOP\n" + client.pub("t", b"x")) == [nsq.Nop(), nsq.Pub("t", b"x")]


# ---------------------------------------------------------------------------------------------
# line framing


def test_crlf_stripped() -> None:
    assert one(b"NOP\r\n") == nsq.Nop()
    assert one(b"SUB t c\r\n") == nsq.Sub("t", "c")
    assert one(b"PUB t\r\n\x00\x00\x00\x01x") == nsq.Pub("t", b"x")


def test_only_one_cr_stripped() -> None:
    assert_fatal(b"SUB t c\r\r\n", "E_BAD_CHANNEL", 'SUB channel name "c\\r" is not valid')


def test_params_split_on_single_spaces() -> None:
    # "SUB  t c" splits into SUB, "", t, c: the empty topic is not valid.
    assert_fatal(b"SUB  t c\n", "E_BAD_TOPIC", 'SUB topic name "" is not valid')


def test_extra_params_ignored() -> None:
    assert one(b"PUB a b\n\x00\x00\x00\x01x") == nsq.Pub("a", b"x")
    assert one(b"SUB t c extra more\n") == nsq.Sub("t", "c")
    assert one(b"NOP extra\n") == nsq.Nop()
    assert one(b"DPUB t 5 extra\n\x00\x00\x00\x01x") == nsq.Dpub("t", 5, b"x")
    assert one(b"FIN " + MSG_ID + b" extra\n", state="subscribed") == nsq.Fin(MSG_ID)
    assert one(b"RDY 5 extra\n", state="subscribed") == nsq.Rdy(5)


@pytest.mark.parametrize("name", [b"pub", b"Pub", b"nop", b"sub", b"FOO", b"IDENTIFY2", b"\xffX"])
def test_invalid_command(name: bytes) -> None:
    assert_fatal(name + b" t\n", "E_INVALID", b"invalid command " + name)


def test_empty_line_is_invalid_command() -> None:
    assert_fatal(b"\n", "E_INVALID", b"invalid command ")


def test_line_limit_exact() -> None:
    limit = nsq.MAX_LINE_LENGTH
    assert limit == 16 * 1024
    # the 16 KiB buffer holds the line and its '\n'
    longest = b"NOP" + b" " * (limit - 4) + b"\n"
    assert len(longest) == limit
    assert one(longest) == nsq.Nop()
    conn = connect()
    events = pull(conn, b"NOP" + b" " * (limit - 3) + b"\n")
    assert len(events) == 1 and isinstance(events[0], nsq.CloseSilently)
    assert_stopped(conn)


def test_line_limit_without_newline() -> None:
    conn = connect()
    chunk = b"x" * 1000
    events: list[nsq.Event] = []
    for _ in range(16):
        events += pull(conn, chunk)
    assert events == []
    assert conn.buffered == 16000
    events = pull(conn, b"x" * 384)
    assert len(events) == 1 and isinstance(events[0], nsq.CloseSilently)
    assert_stopped(conn)


def test_line_limit_applies_per_line() -> None:
    line = b"NOP" + b" " * 10_000 + b"\n"
    assert pull(connect(), line * 4) == [nsq.Nop()] * 4


def test_incremental_bytes() -> None:
    stream = client.pub("t", b"body") + b"NOP\n" + client.mpub("t", [b"a", b"bc"])
    conn = connect()
    events: list[nsq.Event] = []
    for i in range(len(stream)):
        events += pull(conn, stream[i : i + 1])
    assert events == [nsq.Pub("t", b"body"), nsq.Nop(), nsq.Mpub("t", [b"a", b"bc"])]
    assert conn.buffered == 0


# ---------------------------------------------------------------------------------------------
# commands, success


def test_nop() -> None:
    assert one(client.nop()) == nsq.Nop()
    assert one(client.nop(), state="subscribed") == nsq.Nop()
    assert one(client.nop(), state="closing") == nsq.Nop()


@pytest.mark.parametrize("state", ["init", "subscribed", "closing"])
def test_publish_in_any_state(state: str) -> None:
    assert one(client.pub("t", b"x"), state=state) == nsq.Pub("t", b"x")
    assert one(client.mpub("t", [b"x", b"yz"]), state=state) == nsq.Mpub("t", [b"x", b"yz"])
    assert one(client.dpub("t", 10, b"x"), state=state) == nsq.Dpub("t", 10, b"x")


def test_pub_max_size_accepted() -> None:
    body = b"m" * MAX_MSG
    assert one(client.pub("t", body)) == nsq.Pub("t", body)


def test_dpub_bounds() -> None:
    assert one(client.dpub("t", 0, b"x")) == nsq.Dpub("t", 0, b"x")
    assert one(client.dpub("t", 3_600_000, b"x")) == nsq.Dpub("t", 3_600_000, b"x")
    assert one(b"DPUB t 007\n\x00\x00\x00\x01x") == nsq.Dpub("t", 7, b"x")


def test_sub_then_cls() -> None:
    conn = connect()
    assert pull(conn, client.sub("t", "c")) == [nsq.Sub("t", "c")]
    assert conn.state is nsq.ClientState.SUBSCRIBED
    assert pull(conn, client.rdy(10) + client.cls()) == [nsq.Rdy(10), nsq.Cls()]
    assert conn.state is nsq.ClientState.CLOSING


def test_rdy() -> None:
    assert one(b"RDY\n", state="subscribed") == nsq.Rdy(1)
    assert one(b"RDY 0\n", state="subscribed") == nsq.Rdy(0)
    assert one(b"RDY 2500\n", state="subscribed") == nsq.Rdy(2500)
    # nsqd's ByteToBase10: the empty parameter is 0
    assert one(b"RDY \n", state="subscribed") == nsq.Rdy(0)


@pytest.mark.parametrize("data", [b"RDY 5\n", b"RDY\n", b"RDY 99999\n", b"RDY x\n", b"RDY -1\n"])
def test_rdy_ignored_after_cls(data: bytes) -> None:
    conn = connect(state="closing")
    events = pull(conn, data + b"NOP\n")
    assert len(events) == 2
    assert not isinstance(events[0], (nsq.Rdy, nsq.ProtocolError))
    assert events[1] == nsq.Nop()
    assert conn.state is nsq.ClientState.CLOSING


@pytest.mark.parametrize("state", ["subscribed", "closing"])
def test_fin_req_touch(state: str) -> None:
    assert one(client.fin(MSG_ID), state=state) == nsq.Fin(MSG_ID)
    assert one(client.touch(MSG_ID), state=state) == nsq.Touch(MSG_ID)
    assert one(client.req(MSG_ID, 0), state=state) == nsq.Req(MSG_ID, 0)
    assert one(client.req(MSG_ID, 100), state=state) == nsq.Req(MSG_ID, 100)


def fin_run(ids: list[bytes]) -> nsq.Fins:
    return nsq.Fins(b"".join(client.fin(msg_id) for msg_id in ids))


def test_a_run_of_fins_is_one_event_and_anything_unusual_ends_it() -> None:
    ids = [b"%016x" % number for number in range(5)]
    odd = b"\x00\x01\xff" + b"z" * 13
    conn = connect(state="subscribed")
    stream = b"".join(client.fin(i) for i in ids[:3]) + b"FIN " + ids[3] + b"\r\n" + client.fin(ids[4]) \
        + b"FIN " + odd + b"\n" + client.fin(ids[0]) + client.fin(ids[1]) + client.nop()
    assert pull(conn, stream) == [fin_run(ids[:3]), nsq.Fin(ids[3]), nsq.Fin(ids[4]), nsq.Fin(odd),
                                  fin_run(ids[:2]), nsq.Nop()]
    assert fin_run(ids[:3]).msg_ids == ids[:3]
    assert conn.buffered == 0
    conn = connect(state="subscribed")
    assert pull(conn, client.fin(ids[0]) + client.fin(ids[1])[:-3]) == [nsq.Fin(ids[0])]  # the rest: not yet
    assert pull(conn, client.fin(ids[1])[-3:]) == [nsq.Fin(ids[1])]


def test_a_run_of_fins_before_sub_is_the_general_error() -> None:
    conn = connect(state="init")
    events = pull(conn, client.fin(MSG_ID) + client.fin(MSG_ID))
    assert events == [nsq.fatal("E_INVALID", "cannot FIN in current state")]
    assert_stopped(conn)


def test_message_ids_as_numbers_and_back() -> None:
    assert [nsq.message_id_number(raw) for raw in [b"000000000000002a", b"ffffffffffffffff", b"000000000000002A",
                                                   b"2a", b"+00000000000002a", b"0x0000000000002a",
                                                   b" 00000000000002a"]] == [42, 2**64 - 1, -1, -1, -1, -1, -1]
    assert nsq.frame_message_header_of(7, 3, 42, 5) == nsq.frame_message_header(7, 3, b"000000000000002a", 5)


@pytest.mark.parametrize("ids, numbers", [
    ([b"000000000000002a", b"ffffffffffffffff", b"0123456789abcdef"], [42, 2**64 - 1, 0x0123456789ABCDEF]),
    # One id this codec never wrote: -1 for it alone, the others read as before.
    ([b"000000000000002a", b"000000000000002A", b"zzzzzzzzzzzzzzzz", b"00000000000000ff"], [42, -1, -1, 255]),
    ([b"FIN00000000000ff", b"00000000000000ff"], [-1, 255]),
])
def test_a_run_of_fins_ids_read_in_bulk(ids: list[bytes], numbers: list[int]) -> None:
    assert nsq.fin_numbers(fin_run(ids).lines) == numbers


def test_message_id_is_opaque_16_bytes() -> None:
    odd = b"\x00\x01\xff" + b"z" * 13
    assert one(b"FIN " + odd + b"\n", state="subscribed") == nsq.Fin(odd)


@pytest.mark.parametrize(
    ("timeout", "expected"),
    [(b"3600000", 3_600_000), (b"3600001", 3_600_000), (b"99999999999", 3_600_000), (b"", 0), (b"00", 0)],
)
def test_req_timeout_clamped(timeout: bytes, expected: int) -> None:
    assert one(b"REQ " + MSG_ID + b" " + timeout + b"\n", state="subscribed") == nsq.Req(MSG_ID, expected)


def test_req_clamp_uses_limits() -> None:
    limits = nsq.ServerLimits(max_req_timeout_ms=5000)
    assert one(client.req(MSG_ID, 6000), limits, state="subscribed") == nsq.Req(MSG_ID, 5000)


def test_auth() -> None:
    assert one(client.auth(b"secret")) == nsq.Auth(b"secret")


def test_identify_repeated_before_sub() -> None:
    conn = connect()
    events = pull(conn, client.identify({"client_id": "a"}) + client.identify({"client_id": "b"}))
    assert [e.client_id for e in events if isinstance(e, nsq.Identify)] == ["a", "b"]


# ---------------------------------------------------------------------------------------------
# error table, rows the codec decides


@pytest.mark.parametrize("state", ["subscribed", "closing"])
def test_identify_wrong_state(state: str) -> None:
    assert_fatal(client.identify({}), "E_INVALID", "cannot IDENTIFY in current state", state=state)


@pytest.mark.parametrize(
    ("size", "text"),
    [
        (0, "IDENTIFY invalid body size 0"),
        (-1, "IDENTIFY invalid body size -1"),
        (-(2**31), f"IDENTIFY invalid body size {-(2**31)}"),
        (MAX_BODY + 1, f"IDENTIFY body too big {MAX_BODY + 1} > {MAX_BODY}"),
        (2**31 - 1, f"IDENTIFY body too big {2**31 - 1} > {MAX_BODY}"),
    ],
)
def test_identify_size(size: int, text: str) -> None:
    assert_fatal(sized(b"IDENTIFY\n", size), "E_BAD_BODY", text)


@pytest.mark.parametrize(
    "body",
    [b"{", b"not json", b"[]", b"[1, 2]", b'"text"', b"42", b"\xff\xfe", b"{}}", b"[" * 100_000],
)
def test_identify_bad_json(body: bytes) -> None:
    assert_fatal(sized(b"IDENTIFY\n", len(body), body), "E_BAD_BODY", "IDENTIFY failed to decode JSON body")


@pytest.mark.parametrize(
    "data",
    [
        {"heartbeat_interval": 1000.5},
        {"heartbeat_interval": "1000"},
        {"heartbeat_interval": True},
        {"msg_timeout": 1e3},
        {"sample_rate": 2**31},
        {"output_buffer_size": 2**63},
        {"feature_negotiation": "true"},
        {"deflate": 1},
        {"client_id": 5},
        {"hostname": ["h"]},
    ],
)
def test_identify_wrong_json_types(data: dict[str, object]) -> None:
    # Go's json.Unmarshal into nsqd's identifyDataV2 fails on a type mismatch or an overflow.
    assert_fatal(client.identify(data), "E_BAD_BODY", "IDENTIFY failed to decode JSON body")


@pytest.mark.parametrize("literal", [b"NaN", b"Infinity", b"-Infinity", b"1e400"])
def test_identify_non_finite_numbers(literal: bytes) -> None:
    body = b'{"heartbeat_interval": ' + literal + b"}"
    assert_fatal(sized(b"IDENTIFY\n", len(body), body), "E_BAD_BODY", "IDENTIFY failed to decode JSON body")


def test_identify_null_values_are_defaults() -> None:
    # Go's json leaves a field alone for null.
    keys = [
        "client_id",
        "heartbeat_interval",
        "output_buffer_size",
        "output_buffer_timeout",
        "deflate",
        "deflate_level",
        "snappy",
        "sample_rate",
        "msg_timeout",
        "feature_negotiation",
        "tls_v1",
    ]
    event = one(client.identify(dict.fromkeys(keys)))
    assert isinstance(event, nsq.Identify)
    assert event.heartbeat_interval_ms == 30_000
    assert event.msg_timeout_ms == 60_000


def test_identify_unknown_keys_ignored() -> None:
    event = one(client.identify({"short_id": "x", "long_id": "y", "topology_zone": "z", "whatever": [1]}))
    assert isinstance(event, nsq.Identify)


@pytest.mark.parametrize(
    ("data", "text"),
    [
        ({"heartbeat_interval": 500}, "IDENTIFY heartbeat interval (500) is invalid"),
        ({"heartbeat_interval": 999}, "IDENTIFY heartbeat interval (999) is invalid"),
        ({"heartbeat_interval": 60001}, "IDENTIFY heartbeat interval (60001) is invalid"),
        ({"heartbeat_interval": -2}, "IDENTIFY heartbeat interval (-2) is invalid"),
        ({"output_buffer_timeout": 24}, "IDENTIFY output buffer timeout (24) is invalid"),
        ({"output_buffer_timeout": 30001}, "IDENTIFY output buffer timeout (30001) is invalid"),
        ({"output_buffer_timeout": -2}, "IDENTIFY output buffer timeout (-2) is invalid"),
        ({"output_buffer_size": 63}, "IDENTIFY output buffer size (63) is invalid"),
        ({"output_buffer_size": 65537}, "IDENTIFY output buffer size (65537) is invalid"),
        ({"output_buffer_size": -2}, "IDENTIFY output buffer size (-2) is invalid"),
        ({"sample_rate": 100}, "IDENTIFY sample rate (100) is invalid"),
        ({"sample_rate": -1}, "IDENTIFY sample rate (-1) is invalid"),
        ({"msg_timeout": 999}, "IDENTIFY msg timeout (999) is invalid"),
        ({"msg_timeout": 900001}, "IDENTIFY msg timeout (900001) is invalid"),
        ({"msg_timeout": -1}, "IDENTIFY msg timeout (-1) is invalid"),
        # nsqd checks heartbeat, output buffer (timeout, then size), sample rate, msg timeout in that order
        ({"msg_timeout": 1, "heartbeat_interval": 2}, "IDENTIFY heartbeat interval (2) is invalid"),
        ({"output_buffer_size": 1, "output_buffer_timeout": 1}, "IDENTIFY output buffer timeout (1) is invalid"),
        ({"msg_timeout": 1, "sample_rate": 100}, "IDENTIFY sample rate (100) is invalid"),
    ],
)
def test_identify_bad_field(data: dict[str, int], text: str) -> None:
    assert_fatal(client.identify(data), "E_BAD_BODY", text)


def test_identify_deflate_and_snappy() -> None:
    data = {"feature_negotiation": True, "deflate": True, "snappy": True}
    assert_fatal(client.identify(data), "E_IDENTIFY_FAILED", "cannot enable both deflate and snappy compression")


def test_identify_deflate_and_snappy_one_disabled_on_server() -> None:
    data = {"feature_negotiation": True, "deflate": True, "snappy": True}
    event = one(client.identify(data), nsq.ServerLimits(snappy_enabled=False))
    assert isinstance(event, nsq.Identify)
    assert (event.deflate, event.snappy) == (True, False)
    event = one(client.identify(data), nsq.ServerLimits(deflate_enabled=False))
    assert isinstance(event, nsq.Identify)
    assert (event.deflate, event.snappy) == (False, True)


def test_identify_without_negotiation_never_compresses() -> None:
    # nsqd answers plain OK and upgrades nothing when feature_negotiation is false.
    event = one(client.identify({"deflate": True, "snappy": True}))
    assert isinstance(event, nsq.Identify)
    assert (event.feature_negotiation, event.deflate, event.snappy) == (False, False, False)


@pytest.mark.parametrize("state", ["subscribed", "closing"])
def test_sub_wrong_state(state: str) -> None:
    assert_fatal(client.sub("t", "c"), "E_INVALID", "cannot SUB in current state", state=state)


def test_sub_twice() -> None:
    assert_fatal(client.sub("t", "c2"), "E_INVALID", "cannot SUB in current state", before=client.sub("t", "c"))


def test_sub_heartbeats_disabled() -> None:
    assert_fatal(
        client.sub("t", "c"),
        "E_INVALID",
        "cannot SUB with heartbeats disabled",
        before=client.identify({"heartbeat_interval": -1}),
    )


def test_sub_heartbeats_disabled_checked_before_params() -> None:
    before = client.identify({"heartbeat_interval": -1})
    assert_fatal(b"SUB\n", "E_INVALID", "cannot SUB with heartbeats disabled", before=before)


@pytest.mark.parametrize("data", [b"SUB\n", b"SUB t\n", b"SUB t\r\n"])
def test_sub_insufficient_params(data: bytes) -> None:
    assert_fatal(data, "E_INVALID", "SUB insufficient number of parameters")


NAME_64 = "n" * 64
EPHEMERAL_64 = "e" * 54 + "#ephemeral"


@pytest.mark.parametrize("name", ["t", NAME_64, EPHEMERAL_64, "a.b-c_D9", "x#ephemeral", "...", "-", "_"])
def test_valid_names(name: str) -> None:
    assert nsq.is_valid_name(name.encode())
    assert one(client.sub(name, name)) == nsq.Sub(name, name)
    assert one(client.pub(name, b"x")) == nsq.Pub(name, b"x")
    assert one(client.dpub(name, 1, b"x")) == nsq.Dpub(name, 1, b"x")
    assert one(client.mpub(name, [b"x"])) == nsq.Mpub(name, [b"x"])


@pytest.mark.parametrize(
    ("name", "quoted"),
    [
        (b"x*", '"x*"'),
        (b"n" * 65, '"' + "n" * 65 + '"'),
        (b"e" * 55 + b"#ephemeral", '"' + "e" * 55 + '#ephemeral"'),
        (b"#ephemeral", '"#ephemeral"'),
        (b"a#ephemeralx", '"a#ephemeralx"'),
        (b"a#b", '"a#b"'),
        (b"a/b", '"a/b"'),
        (b'q"uote', '"q\\"uote"'),
        (b"back\\slash", '"back\\\\slash"'),
        (b"tab\there", '"tab\\there"'),
        (b"nul\x00", '"nul\\x00"'),
        (b"del\x7f", '"del\\x7f"'),
        (b"bell\x07\x08\x0c\x0b", '"bell\\a\\b\\f\\v"'),
        (b"bad\xff\xfe", '"bad\\xff\\xfe"'),
        ("caf\u00e9".encode(), '"caf\u00e9"'),
        ("c1\u0085".encode(), '"c1\\u0085"'),
        ("zw\u200b".encode(), '"zw\\u200b"'),
        ("nbsp\u00a0".encode(), '"nbsp\\u00a0"'),
        ("smile\U0001f600".encode(), '"smile\U0001f600"'),
        ("tag\U000e0001".encode(), '"tag\\U000e0001"'),
        (b"surrogate\xed\xa0\x80", '"surrogate\\xed\\xa0\\x80"'),
        (b"short\xe2\x82", '"short\\xe2\\x82"'),
    ],
)
def test_invalid_names(name: bytes, quoted: str) -> None:
    assert not nsq.is_valid_name(name)
    assert nsq.go_quote(name) == quoted
    assert_fatal(b"SUB " + name + b" c\n", "E_BAD_TOPIC", f"SUB topic name {quoted} is not valid")
    assert_fatal(b"SUB t " + name + b"\n", "E_BAD_CHANNEL", f"SUB channel name {quoted} is not valid")
    assert_fatal(b"PUB " + name + b"\n", "E_BAD_TOPIC", f"PUB topic name {quoted} is not valid")
    assert_fatal(b"DPUB " + name + b" 0\n", "E_BAD_TOPIC", f"DPUB topic name {quoted} is not valid")


def test_name_with_trailing_newline_is_invalid() -> None:
    # Go's `$` (no multi-line flag) matches only at the very end; Python's `$` also before a final '\n'.
    assert not nsq.is_valid_name(b"topic\n")
    assert not nsq.is_valid_name(b"topic#ephemeral\n")


def test_mpub_bad_topic() -> None:
    conn = connect()
    events = pull(conn, b"MPUB x*\n")
    assert len(events) == 1
    error = events[0]
    assert isinstance(error, nsq.ProtocolError) and error.fatal
    assert error.code == "E_BAD_TOPIC"
    # nsqd doubles the code in this one text (quirk); either form is compatible .
    assert error.description in (b'MPUB topic name "x*" is not valid', b'E_BAD_TOPIC MPUB topic name "x*" is not valid')
    assert_stopped(conn)


@pytest.mark.parametrize(("command", "line"), [("PUB", b"PUB\n"), ("MPUB", b"MPUB\n"), ("DPUB", b"DPUB t\n")])
def test_publish_insufficient_params(command: str, line: bytes) -> None:
    assert_fatal(line, "E_INVALID", f"{command} insufficient number of parameters")


def test_bad_topic_checked_before_size() -> None:
    assert_fatal(sized(b"PUB x*\n", 0), "E_BAD_TOPIC", 'PUB topic name "x*" is not valid')


@pytest.mark.parametrize("command", ["PUB", "DPUB"])
@pytest.mark.parametrize(
    ("size", "text"),
    [
        (0, "{} invalid message body size 0"),
        (-5, "{} invalid message body size -5"),
        (MAX_MSG + 1, f"{{}} message too big {MAX_MSG + 1} > {MAX_MSG}"),
        (2**31 - 1, f"{{}} message too big {2**31 - 1} > {MAX_MSG}"),
    ],
)
def test_pub_dpub_size(command: str, size: int, text: str) -> None:
    line = b"PUB t\n" if command == "PUB" else b"DPUB t 0\n"
    assert_fatal(sized(line, size), "E_BAD_MESSAGE", text.format(command))


def test_pub_size_uses_limits() -> None:
    limits = nsq.ServerLimits(max_msg_size=10)
    assert one(client.pub("t", b"x" * 10), limits) == nsq.Pub("t", b"x" * 10)
    assert_fatal(client.pub("t", b"x" * 11), "E_BAD_MESSAGE", "PUB message too big 11 > 10", limits)


@pytest.mark.parametrize(
    ("defer", "text"),
    [
        (b"-1", "DPUB could not parse timeout -1"),
        (b"abc", "DPUB could not parse timeout abc"),
        (b"1.5", "DPUB could not parse timeout 1.5"),
        (b"+5", "DPUB could not parse timeout +5"),
        (b"3600001", "DPUB timeout 3600001 out of range 0-3600000"),
    ],
)
def test_dpub_timeout(defer: bytes, text: str) -> None:
    assert_fatal(b"DPUB t " + defer + b"\n", "E_INVALID", text)


def test_dpub_timeout_checked_before_body_size() -> None:
    assert_fatal(sized(b"DPUB t x\n", 0), "E_INVALID", "DPUB could not parse timeout x")


@pytest.mark.parametrize(
    ("size", "text"),
    [
        (0, "MPUB invalid body size 0"),
        (-1, "MPUB invalid body size -1"),
        (MAX_BODY + 1, f"MPUB body too big {MAX_BODY + 1} > {MAX_BODY}"),
    ],
)
def test_mpub_body_size(size: int, text: str) -> None:
    assert_fatal(sized(b"MPUB t\n", size), "E_BAD_BODY", text)


@pytest.mark.parametrize("count", [0, -1, -(2**31), (MAX_BODY - 4) // 5 + 1, 2**31 - 1])
def test_mpub_count(count: int) -> None:
    body = struct.pack(">i", count) + struct.pack(">i", 1) + b"x"
    assert_fatal(sized(b"MPUB t\n", len(body), body), "E_BAD_BODY", f"MPUB invalid message count {count}")


def test_mpub_count_limit() -> None:
    assert (MAX_BODY - 4) // 5 == 1048575
    limits = nsq.ServerLimits(max_body_size=104)  # (104 - 4) // 5 = 20 messages at most
    assert nsq.parse_mpub_body(client.mpub_body([b"x"] * 20), limits) == [b"x"] * 20
    error = nsq.parse_mpub_body(client.mpub_body([b"x"] * 21), limits)
    assert error == nsq.fatal("E_BAD_BODY", "MPUB invalid message count 21")


@pytest.mark.parametrize(
    ("bodies", "text"),
    [
        ([b"", b"x"], "MPUB invalid message(0) body size 0"),
        ([b"x", b"y", b""], "MPUB invalid message(2) body size 0"),
    ],
)
def test_mpub_part_empty(bodies: list[bytes], text: str) -> None:
    assert_fatal(client.mpub("t", bodies), "E_BAD_MESSAGE", text)


def test_mpub_part_negative_and_too_big() -> None:
    body = struct.pack(">ii", 2, 1) + b"x" + struct.pack(">i", -3) + b"pad"
    assert_fatal(sized(b"MPUB t\n", len(body), body), "E_BAD_MESSAGE", "MPUB invalid message(1) body size -3")
    body = struct.pack(">ii", 1, MAX_MSG + 1) + b"x"
    assert_fatal(
        sized(b"MPUB t\n", len(body), body), "E_BAD_MESSAGE", f"MPUB message too big {MAX_MSG + 1} > {MAX_MSG}"
    )


def test_mpub_part_max_size_accepted() -> None:
    bodies = [b"a" * MAX_MSG, b"b"]
    assert one(client.mpub("t", bodies)) == nsq.Mpub("t", bodies)


def test_mpub_truncated_parts_are_fatal() -> None:
    for body in (b"\x00\x00", struct.pack(">i", 2) + struct.pack(">i", 1) + b"x", struct.pack(">ii", 1, 5) + b"ab"):
        events = pull(connect(), sized(b"MPUB t\n", len(body), body))
        assert len(events) == 1
        error = events[0]
        assert isinstance(error, nsq.ProtocolError) and error.fatal
        assert error.code in ("E_BAD_BODY", "E_BAD_MESSAGE")


@pytest.mark.parametrize("state", ["init"])
def test_rdy_wrong_state(state: str) -> None:
    assert_fatal(b"RDY 1\n", "E_INVALID", "cannot RDY in current state", state=state)


@pytest.mark.parametrize(
    ("arg", "text"),
    [
        (b"x", "RDY could not parse count x"),
        (b"-1", "RDY could not parse count -1"),
        (b"1.0", "RDY could not parse count 1.0"),
        (b"2501", "RDY count 2501 out of range 0-2500"),
        (b"99999", "RDY count 99999 out of range 0-2500"),
        # ByteToBase10 accumulates in a uint64 and RDY converts it to int64, as Go wraps
        (b"18446744073709551615", "RDY count -1 out of range 0-2500"),
        (b"18446744073709551616", None),
        (b"1" * 5000, None),
    ],
)
def test_rdy_value(arg: bytes, text: str | None) -> None:
    conn = connect(state="subscribed")
    events = pull(conn, b"RDY " + arg + b"\n")
    if text is None:  # a wrapped value: any RDY event in range, or an E_INVALID, never an exception
        assert len(events) == 1
        event = events[0]
        assert (isinstance(event, nsq.Rdy) and 0 <= event.count <= 2500) or (
            isinstance(event, nsq.ProtocolError) and event.code == "E_INVALID"
        )
        return
    assert_fatal(b"RDY " + arg + b"\n", "E_INVALID", text, state="subscribed")


def test_rdy_range_uses_limits() -> None:
    limits = nsq.ServerLimits(max_rdy_count=10)
    assert one(b"RDY 10\n", limits, state="subscribed") == nsq.Rdy(10)
    assert_fatal(b"RDY 11\n", "E_INVALID", "RDY count 11 out of range 0-10", limits, state="subscribed")


@pytest.mark.parametrize("command", ["FIN", "REQ", "TOUCH"])
def test_fin_req_touch_wrong_state(command: str) -> None:
    assert_fatal(f"{command} {MSG_ID.decode()} 0\n".encode(), "E_INVALID", f"cannot {command} in current state")


@pytest.mark.parametrize("command", ["FIN", "REQ", "TOUCH"])
@pytest.mark.parametrize("msg_id", [b"", b"abc", b"18a3cd6d40a6900", b"18a3cd6d40a690001"])
def test_invalid_message_id(command: str, msg_id: bytes) -> None:
    line = command.encode() + b" " + msg_id + b" 0\n"
    assert_fatal(line, "E_INVALID", "invalid message ID", state="subscribed")


@pytest.mark.parametrize(
    ("line", "text"), [(b"FIN\n", "FIN"), (b"TOUCH\n", "TOUCH"), (b"REQ " + MSG_ID + b"\n", "REQ")]
)
def test_fin_req_touch_insufficient_params(line: bytes, text: str) -> None:
    assert_fatal(line, "E_INVALID", f"{text} insufficient number of params", state="subscribed")


@pytest.mark.parametrize("timeout", [b"-5", b"x", b"1.5", b"+1", b"1e3"])
def test_req_timeout_parse(timeout: bytes) -> None:
    line = b"REQ " + MSG_ID + b" " + timeout + b"\n"
    assert_fatal(line, "E_INVALID", b"REQ could not parse timeout " + timeout, state="subscribed")


@pytest.mark.parametrize("state", ["init", "closing"])
def test_cls_wrong_state(state: str) -> None:
    assert_fatal(b"CLS\n", "E_INVALID", "cannot CLS in current state", state=state)


@pytest.mark.parametrize("state", ["subscribed", "closing"])
def test_auth_wrong_state(state: str) -> None:
    assert_fatal(client.auth(b"s"), "E_INVALID", "cannot AUTH in current state", state=state)


def test_auth_params_and_size() -> None:
    assert_fatal(b"AUTH x\n", "E_INVALID", "AUTH invalid number of parameters")
    assert_fatal(sized(b"AUTH\n", 0), "E_BAD_BODY", "AUTH invalid body size 0")
    assert_fatal(sized(b"AUTH\n", MAX_BODY + 1), "E_BAD_BODY", f"AUTH body too big {MAX_BODY + 1} > {MAX_BODY}")


# TLS required : anything but IDENTIFY before TLS is refused


@pytest.mark.parametrize(
    ("data", "name"),
    [
        (client.pub("t", b"x"), b"PUB"),
        (b"NOP\n", b"NOP"),
        (client.sub("t", "c"), b"SUB"),
        (client.auth(b"s"), b"AUTH"),
        (b"pub t\n", b"pub"),
        (b"\xffZ\n", b"\xffZ"),
    ],
)
def test_tls_required(data: bytes, name: bytes) -> None:
    limits = nsq.ServerLimits(tls_available=True, tls_required=True)
    assert_fatal(data, "E_INVALID", b"cannot " + name + b" in current state (TLS required)", limits)


def test_tls_required_allows_identify_then_everything_after_tls() -> None:
    limits = nsq.ServerLimits(tls_available=True, tls_required=True)
    conn = connect(limits)
    events = pull(conn, client.identify({"tls_v1": True, "feature_negotiation": True}))
    assert len(events) == 1 and isinstance(events[0], nsq.Identify) and events[0].tls_v1
    conn.tls_active = True
    assert pull(conn, client.pub("t", b"x")) == [nsq.Pub("t", b"x")]


# ---------------------------------------------------------------------------------------------
# IDENTIFY negotiation


def negotiate(data: dict[str, object], limits: nsq.ServerLimits | None = None) -> nsq.Identify:
    result = nsq.negotiate_identify(data, limits or nsq.ServerLimits())
    assert isinstance(result, nsq.Identify), result
    return result


def test_identify_defaults() -> None:
    identify = negotiate({})
    assert identify.heartbeat_interval_ms == 30_000
    assert identify.output_buffer_size == 16384
    assert identify.output_buffer_timeout_ms == 250
    assert identify.msg_timeout_ms == 60_000
    assert identify.sample_rate == 0
    assert (identify.deflate, identify.snappy, identify.tls_v1, identify.feature_negotiation) == (
        False,
        False,
        False,
        False,
    )
    assert identify.deflate_level == 6
    assert (identify.client_id, identify.hostname, identify.user_agent) == ("", "", "")


def test_identify_strings() -> None:
    identify = negotiate({"client_id": "c", "hostname": "h", "user_agent": "pynsq/0.9.1"})
    assert (identify.client_id, identify.hostname, identify.user_agent) == ("c", "h", "pynsq/0.9.1")


def test_identify_zero_means_default() -> None:
    zeros = {
        "heartbeat_interval": 0,
        "output_buffer_size": 0,
        "output_buffer_timeout": 0,
        "msg_timeout": 0,
        "sample_rate": 0,
        "deflate_level": 0,
    }
    got = attrs.asdict(negotiate(zeros), recurse=False)
    default = attrs.asdict(negotiate({}), recurse=False)
    del got["raw"], default["raw"]
    assert got == default


def test_heartbeat_rules() -> None:
    assert negotiate({"heartbeat_interval": -1}).heartbeat_interval_ms == -1
    assert negotiate({"heartbeat_interval": 1000}).heartbeat_interval_ms == 1000
    assert negotiate({"heartbeat_interval": 60000}).heartbeat_interval_ms == 60000
    limits = nsq.ServerLimits(heartbeat_interval_ms=5000, max_heartbeat_interval_ms=10_000)
    assert negotiate({}, limits).heartbeat_interval_ms == 5000
    assert negotiate({"heartbeat_interval": 10_000}, limits).heartbeat_interval_ms == 10_000
    assert isinstance(nsq.negotiate_identify({"heartbeat_interval": 10_001}, limits), nsq.ProtocolError)


def test_heartbeat_disabled_refuses_sub_enabled_allows() -> None:
    conn = connect()
    events = pull(conn, client.identify({"heartbeat_interval": 1000}) + client.sub("t", "c"))
    assert isinstance(events[0], nsq.Identify) and events[1] == nsq.Sub("t", "c")


def test_output_buffer_timeout_rules() -> None:
    assert negotiate({"output_buffer_timeout": -1}).output_buffer_timeout_ms == 0
    assert negotiate({"output_buffer_timeout": 25}).output_buffer_timeout_ms == 25
    assert negotiate({"output_buffer_timeout": 30000}).output_buffer_timeout_ms == 30000
    assert negotiate({"output_buffer_timeout": -1}).output_buffer_size == 16384


def test_output_buffer_size_rules() -> None:
    identify = negotiate({"output_buffer_size": -1})
    assert (identify.output_buffer_size, identify.output_buffer_timeout_ms) == (1, 0)
    identify = negotiate({"output_buffer_size": -1, "output_buffer_timeout": 100})
    assert (identify.output_buffer_size, identify.output_buffer_timeout_ms) == (1, 0)
    assert negotiate({"output_buffer_size": 64}).output_buffer_size == 64
    assert negotiate({"output_buffer_size": 65536}).output_buffer_size == 65536
    identify = negotiate({"output_buffer_size": 100, "output_buffer_timeout": 100})
    assert (identify.output_buffer_size, identify.output_buffer_timeout_ms) == (100, 100)


def test_msg_timeout_and_sample_rate() -> None:
    assert negotiate({"msg_timeout": 1000}).msg_timeout_ms == 1000
    assert negotiate({"msg_timeout": 900_000}).msg_timeout_ms == 900_000
    assert negotiate({"sample_rate": 99}).sample_rate == 99
    assert negotiate({"sample_rate": 1}).sample_rate == 1


@pytest.mark.parametrize(("asked", "got"), [(9, 6), (6, 6), (1, 1), (3, 3), (0, 6), (-1, 6)])
def test_deflate_level_clamped(asked: int, got: int) -> None:
    identify = negotiate({"feature_negotiation": True, "deflate": True, "deflate_level": asked})
    assert identify.deflate and identify.deflate_level == got


def test_deflate_level_max_from_limits() -> None:
    limits = nsq.ServerLimits(max_deflate_level=3)
    identify = negotiate({"feature_negotiation": True, "deflate": True, "deflate_level": 9}, limits)
    assert identify.deflate_level == 3
    identify = negotiate({"feature_negotiation": True, "deflate": True}, limits)
    assert identify.deflate_level == 3


def test_deflate_level_without_deflate_is_default() -> None:
    # nsqd: deflateLevel := 6; only `deflate && level > 0` takes the client's level.
    identify = negotiate({"feature_negotiation": True, "deflate_level": 2})
    assert (identify.deflate, identify.deflate_level) == (False, 6)


def test_compression_disabled_on_server() -> None:
    limits = nsq.ServerLimits(deflate_enabled=False, snappy_enabled=False)
    identify = negotiate({"feature_negotiation": True, "deflate": True}, limits)
    assert identify.deflate is False
    identify = negotiate({"feature_negotiation": True, "snappy": True}, limits)
    assert identify.snappy is False


NEGOTIATION_KEYS = [
    "max_rdy_count",
    "version",
    "max_msg_timeout",
    "msg_timeout",
    "tls_v1",
    "deflate",
    "deflate_level",
    "max_deflate_level",
    "snappy",
    "sample_rate",
    "auth_required",
    "output_buffer_size",
    "output_buffer_timeout",
]


def test_identify_response_default_exact() -> None:
    identify = negotiate({"feature_negotiation": True})
    expected = (
        b'{"max_rdy_count":2500,"version":"1.3.0","max_msg_timeout":900000,"msg_timeout":60000,"tls_v1":false,'
        b'"deflate":false,"deflate_level":6,"max_deflate_level":6,"snappy":false,"sample_rate":0,'
        b'"auth_required":false,"output_buffer_size":16384,"output_buffer_timeout":250}'
    )
    assert nsq.identify_response(identify, nsq.ServerLimits(), tls=False) == expected


def test_identify_response_echoes_effective_values() -> None:
    identify = negotiate(
        {
            "feature_negotiation": True,
            "deflate": True,
            "deflate_level": 9,
            "msg_timeout": 5000,
            "sample_rate": 10,
            "output_buffer_size": -1,
            "tls_v1": True,
        }
    )
    limits = nsq.ServerLimits(auth_enabled=True, tls_available=True, max_rdy_count=100)
    raw = nsq.identify_response(identify, limits, tls=True)
    pairs = json.loads(raw, object_pairs_hook=list)
    assert [key for key, _ in pairs] == NEGOTIATION_KEYS
    assert dict(pairs) == {
        "max_rdy_count": 100,
        "version": "1.3.0",
        "max_msg_timeout": 900000,
        "msg_timeout": 5000,
        "tls_v1": True,
        "deflate": True,
        "deflate_level": 6,
        "max_deflate_level": 6,
        "snappy": False,
        "sample_rate": 10,
        "auth_required": True,
        "output_buffer_size": 1,
        "output_buffer_timeout": 0,
    }
    assert b" " not in raw


def test_identify_response_snappy() -> None:
    identify = negotiate({"feature_negotiation": True, "snappy": True})
    body = json.loads(nsq.identify_response(identify, nsq.ServerLimits(), tls=False))
    assert (body["snappy"], body["deflate"], body["tls_v1"]) == (True, False, False)


def test_identify_event_through_parser() -> None:
    data = {"client_id": "c", "feature_negotiation": True, "heartbeat_interval": 5000, "output_buffer_timeout": -1}
    event = one(client.identify(data))
    assert isinstance(event, nsq.Identify)
    assert event.raw == data
    assert (event.heartbeat_interval_ms, event.output_buffer_timeout_ms, event.feature_negotiation) == (5000, 0, True)


# ---------------------------------------------------------------------------------------------
# client side codec


def test_client_encoders_exact() -> None:
    assert client.magic() == b"  V2"
    assert client.sub("t", "c") == b"SUB t c\n"
    assert client.pub("t", b"ab") == b"PUB t\n\x00\x00\x00\x02ab"
    assert client.dpub("t", 5, b"ab") == b"DPUB t 5\n\x00\x00\x00\x02ab"
    assert (
        client.mpub("t", [b"a", b"bc"])
        == b"MPUB t\n\x00\x00\x00\x0f\x00\x00\x00\x02\x00\x00\x00\x01a\x00\x00\x00\x02bc"
    )
    assert client.rdy(7) == b"RDY 7\n"
    assert client.fin(MSG_ID) == b"FIN " + MSG_ID + b"\n"
    assert client.req(MSG_ID, 9) == b"REQ " + MSG_ID + b" 9\n"
    assert client.touch(MSG_ID) == b"TOUCH " + MSG_ID + b"\n"
    assert client.cls() == b"CLS\n"
    assert client.nop() == b"NOP\n"
    assert client.auth(b"s") == b"AUTH\n\x00\x00\x00\x01s"


def test_frame_reader_splits_frames() -> None:
    reader = client.FrameReader()
    stream = (
        nsq.FRAME_OK
        + nsq.FRAME_HEARTBEAT
        + nsq.frame_error(nsq.fatal("E_INVALID", "x"))
        + nsq.frame_message(1, 1, MSG_ID, b"body")
    )
    reader.receive_data(stream[:5])
    assert reader.frames() == []
    reader.receive_data(stream[5:])
    frames = reader.frames()
    assert [f.frame_type for f in frames] == [0, 0, 1, 2]
    assert frames[0].is_response and frames[0].data == b"OK"
    assert frames[1].data == b"_heartbeat_"
    assert frames[2].is_error and frames[2].data == b"E_INVALID x"
    assert frames[3].is_message
    message = client.decode_message(frames[3].data)
    assert message == client.Message(1, 1, MSG_ID, b"body")


@pytest.mark.parametrize("size", [0, 3, -1, client.MAX_FRAME_SIZE + 1])
def test_frame_reader_bad_size(size: int) -> None:
    reader = client.FrameReader()
    reader.receive_data(struct.pack(">ii", size, 0))
    with pytest.raises(client.FrameError):
        reader.frames()
