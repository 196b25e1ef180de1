"""The NATS client codec (codecs/nats.py): exact bytes of every encoder, every server operation decoded,
byte-boundary splits, limits refused before allocation, and hypothesis properties over MSG/HMSG streams
and garbage."""

from __future__ import annotations

import json
import tracemalloc

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from polymq.codecs import nats
from polymq.codecs.nats import Err, Info, Msg, Ok, Ping, Pong, ProtocolError

# --- a server-side encoder, written for the tests from the protocol text --------------------------------


def server_msg(subject: str, sid: int, reply: str | None, payload: bytes) -> bytes:
    args = [subject, str(sid)] + ([reply] if reply is not None else []) + [str(len(payload))]
    return ("MSG " + " ".join(args) + "\r\n").encode("utf-8", "surrogateescape") + payload + b"\r\n"


def server_header_block(headers: dict[str, str], status: int | None, description: str) -> bytes:
    first = "NATS/1.0"
    if status is not None:
        first += f" {status}" + (f" {description}" if description else "")
    lines = [first] + [f"{name}: {value}" for name, value in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("utf-8", "surrogateescape")


def server_hmsg(subject: str, sid: int, reply: str | None, headers: dict[str, str], payload: bytes,
                status: int | None = None, description: str = "") -> bytes:
    block = server_header_block(headers, status, description)
    args = [subject, str(sid)] + ([reply] if reply is not None else []) + [str(len(block)),
                                                                           str(len(block) + len(payload))]
    return ("HMSG " + " ".join(args) + "\r\n").encode("utf-8", "surrogateescape") + block + payload + b"\r\n"


def encode_event(message: Msg) -> bytes:
    if message.headers is None:
        return server_msg(message.subject, message.sid, message.reply, message.payload)
    return server_hmsg(message.subject, message.sid, message.reply, message.headers, message.payload,
                       message.status, message.description)


def decode(*chunks: bytes, connection: nats.ClientConnection | None = None) -> list[nats.Event]:
    connection = connection or nats.ClientConnection()
    events: list[nats.Event] = []
    for chunk in chunks:
        connection.receive_data(chunk)
        events += connection.next_events()
    return events


# --- encoders -------------------------------------------------------------------------------------------


def test_connect_is_compact_json_on_one_line() -> None:
    line = nats.connect({"verbose": False, "name": "a\r\nPUB x 1", "protocol": 1})
    assert line == b'CONNECT {"verbose":false,"name":"a\\r\\nPUB x 1","protocol":1}\r\n'


def test_pub_bytes() -> None:
    assert nats.pub("orders.new", b"hello") == b"PUB orders.new 5\r\nhello\r\n"
    assert nats.pub("orders.new", b"", reply="_INBOX.x.1") == b"PUB orders.new _INBOX.x.1 0\r\n\r\n"
    assert nats.pub("a", b"x\r\ny") == b"PUB a 4\r\nx\r\ny\r\n"
    assert nats.pub("caf\u00e9", b"") == b"PUB caf\xc3\xa9 0\r\n\r\n"


def test_hpub_bytes() -> None:
    block = b"NATS/1.0\r\nNats-Msg-Id: 42\r\nX: a b\r\n\r\n"
    assert nats.encode_headers({"Nats-Msg-Id": "42", "X": "a b"}) == block
    assert nats.hpub("s", {"Nats-Msg-Id": "42", "X": "a b"}, b"body") == (
        b"HPUB s %d %d\r\n" % (len(block), len(block) + 4) + block + b"body\r\n")
    assert nats.hpub("s", {}, b"", reply="r") == b"HPUB s r 12 12\r\nNATS/1.0\r\n\r\n\r\n"
    assert nats.encode_headers({}) == b"NATS/1.0\r\n\r\n"


def test_sub_unsub_ping_pong_bytes() -> None:
    assert nats.sub("a.*", 7) == b"SUB a.* 7\r\n"
    assert nats.sub("a.>", 8, queue="workers") == b"SUB a.> workers 8\r\n"
    assert nats.unsub(7) == b"UNSUB 7\r\n"
    assert nats.unsub(7, max_msgs=3) == b"UNSUB 7 3\r\n"
    assert nats.PING == b"PING\r\n"
    assert nats.PONG == b"PONG\r\n"


@pytest.mark.parametrize("subject", ["", "a b", "a\tb", "a\r\nPUB x 1", "a\n", " a", "a\x00b", "a\x7f", "a\u00a0b"])
def test_bad_subjects_are_refused(subject: str) -> None:
    with pytest.raises(ValueError):
        nats.pub(subject, b"")
    with pytest.raises(ValueError):
        nats.hpub(subject, {}, b"")
    with pytest.raises(ValueError):
        nats.sub(subject, 1)
    with pytest.raises(ValueError):
        nats.pub("ok", b"", reply=subject)
    with pytest.raises(ValueError):
        nats.sub("ok", 1, queue=subject)


@pytest.mark.parametrize("headers", [{"A\r\nB": "x"}, {"A\n": "x"}, {"A": "x\r\nB: y"}, {"A": "x\n"}, {"A": "\r"},
                                     {"": "x"}, {"A:B": "x"}, {"A B": "x"}])
def test_bad_headers_are_refused(headers: dict[str, str]) -> None:
    with pytest.raises(ValueError):
        nats.encode_headers(headers)
    with pytest.raises(ValueError):
        nats.hpub("s", headers, b"")


def test_bad_sids_are_refused() -> None:
    with pytest.raises(ValueError):
        nats.sub("a", -1)
    with pytest.raises(ValueError):
        nats.unsub(-1)
    with pytest.raises(ValueError):
        nats.unsub(1, max_msgs=-1)


@given(st.text(max_size=12))
def test_a_subject_is_refused_or_stays_one_token(subject: str) -> None:
    try:
        encoded = nats.pub(subject, b"p", reply="r")
    except ValueError:
        return
    line, rest = encoded.split(b"\r\n", 1)
    assert line.split(b" ") == [b"PUB", subject.encode("utf-8", "surrogateescape"), b"r", b"1"]
    assert rest == b"p\r\n"


@given(st.dictionaries(st.text(max_size=8), st.text(max_size=8), max_size=4))
def test_headers_are_refused_or_decode_back(headers: dict[str, str]) -> None:
    try:
        block = nats.encode_headers(headers)
    except ValueError:
        return
    assert nats.parse_headers(block) == (None, "", {name: value.strip(" \t") for name, value in headers.items()})


# --- decoding every server operation --------------------------------------------------------------------


def test_every_server_operation() -> None:
    events = decode(
        b'INFO {"server_id":"N1","max_payload":2048,"headers":true}\r\n'
        b"MSG a.b 1 5\r\nhello\r\n"
        b"MSG a.b 1 _INBOX.x 0\r\n\r\n"
        b"HMSG a.c 2 21 24\r\nNATS/1.0\r\nK:  v \t\r\n\r\nabc\r\n"
        b"HMSG _INBOX.y.1 3 16 16\r\nNATS/1.0 503\r\n\r\n\r\n"
        b"HMSG in 4 r 45 47\r\nNATS/1.0 404 No Messages\r\nNats-Pending: 1\r\n\r\nxy\r\n"
        b"PING\r\nPONG\r\n+OK\r\n-ERR 'Authorization Violation'\r\n"
        b"-ERR 'Permissions Violation for Publish to \"x\"'\r\n"
    )
    assert events == [
        Info({"server_id": "N1", "max_payload": 2048, "headers": True}),
        Msg("a.b", 1, None, b"hello"),
        Msg("a.b", 1, "_INBOX.x", b""),
        Msg("a.c", 2, None, b"abc", {"K": "v"}, None, ""),
        Msg("_INBOX.y.1", 3, None, b"", {}, 503, ""),
        Msg("in", 4, "r", b"xy", {"Nats-Pending": "1"}, 404, "No Messages"),
        Ping(), Pong(), Ok(), Err("Authorization Violation"), Err('Permissions Violation for Publish to "x"'),
    ]


def test_info_updates_max_payload() -> None:
    connection = nats.ClientConnection()
    assert connection.max_payload == nats.DEFAULT_MAX_PAYLOAD
    decode(b'INFO {"max_payload":8388608}\r\n', connection=connection)
    assert connection.max_payload == 8 * 1024 * 1024
    decode(b'INFO {"max_payload":true}\r\nINFO {"max_payload":-1}\r\nINFO {"max_payload":"x"}\r\n',
           connection=connection)
    assert connection.max_payload == 8 * 1024 * 1024


def test_operations_are_case_insensitive() -> None:
    events = decode(b"ping\r\nPoNg\r\n+ok\r\n-err 'x'\r\ninfo {}\r\n"
                    b"msg s 1 1\r\nA\r\nhmsg s 2 12 12\r\nNATS/1.0\r\n\r\n\r\n")
    assert events == [Ping(), Pong(), Ok(), Err("x"), Info({}), Msg("s", 1, None, b"A"), Msg("s", 2, None, b"", {})]


def test_tabs_and_repeated_spaces_separate_arguments() -> None:
    assert decode(b"MSG\ts  1\t r \t2\r\nab\r\n") == [Msg("s", 1, "r", b"ab")]


def test_nothing_until_complete() -> None:
    connection = nats.ClientConnection()
    assert decode(b"MSG a 1 5\r\nhel", connection=connection) == []
    assert decode(b"lo\r", connection=connection) == []
    assert decode(b"\nPI", connection=connection) == [Msg("a", 1, None, b"hello")]
    assert decode(b"NG\r\n", connection=connection) == [Ping()]


STREAM = (
    b'INFO {"server_id":"N","max_payload":1048576,"connect_urls":["127.0.0.1:4222"]}\r\n'
    b"+OK\r\nPING\r\n"
    + server_msg("a.b", 1, None, b"first\r\nwith CRLF inside")
    + server_hmsg("a.c", 2, "reply.to", {"Nats-Msg-Id": "7", "X": "y"}, b"second")
    + server_hmsg("_INBOX.z.9", 3, None, {}, b"", 503)
    + server_hmsg("p", 4, None, {"Nats-Pending-Messages": "1"}, b"", 408, "Request Timeout")
    + b"PONG\r\n-ERR 'Stale Connection'\r\n"
    + server_msg("caf\u00e9.\udcff", 5, None, b"")
)


def test_split_at_every_byte_boundary_gives_the_same_events() -> None:
    whole = decode(STREAM)
    assert len(whole) == 10
    for cut in range(len(STREAM) + 1):
        assert decode(STREAM[:cut], STREAM[cut:]) == whole, cut
    assert decode(*(STREAM[i : i + 1] for i in range(len(STREAM)))) == whole


def test_buffer_is_compacted_once_consumed() -> None:
    connection = nats.ClientConnection()
    decode(STREAM * 50 + b"MSG a 1 3\r\nab", connection=connection)
    assert bytes(connection._buffer) == b"ab"


# --- parse_headers ----------------------------------------------------------------------------------------


def test_parse_headers() -> None:
    assert nats.parse_headers(b"NATS/1.0\r\n\r\n") == (None, "", {})
    assert nats.parse_headers(b"NATS/1.0 503\r\n\r\n") == (503, "", {})
    assert nats.parse_headers(b"NATS/1.0 100 Idle Heartbeat\r\nNats-Last-Consumer: 0\r\n\r\n") == (
        100, "Idle Heartbeat", {"Nats-Last-Consumer": "0"})
    # A name given twice keeps its last value; values lose surrounding spaces and tabs.
    assert nats.parse_headers(b"NATS/1.0\r\nA: 1\r\nB:\t2 \r\nA: 3\r\n\r\n") == (None, "", {"A": "3", "B": "2"})
    assert nats.parse_headers(b"NATS/1.0\r\nA: x: y\r\nE:\r\n\r\n") == (None, "", {"A": "x: y", "E": ""})


@pytest.mark.parametrize("block", [
    b"", b"\r\n\r\n", b"NATS/1.0\r\n", b"HTTP/1.1 200\r\n\r\n", b"NATS/1.0 5x3\r\n\r\n", b"NATS/1.0 5030\r\n\r\n",
    b"NATS/1.0\r\nno colon\r\n\r\n", b"NATS/1.0\r\n: v\r\n\r\n", b"NATS/1.0\r\n\r\nA: b\r\n\r\n",
])
def test_parse_headers_refuses_malformed_blocks(block: bytes) -> None:
    with pytest.raises(ProtocolError):
        nats.parse_headers(block)


# --- malformed lines and limits ---------------------------------------------------------------------------


@pytest.mark.parametrize("data", [
    b"\r\n", b"HELLO\r\n", b"PING x\r\n", b"+OK more\r\n",
    b"MSG\r\n", b"MSG a 1\r\n", b"MSG a 1 r x 5\r\n", b"MSG a x 1\r\n", b"MSG a -1 1\r\n", b"MSG a 1 -1\r\n",
    b"MSG a 1 +1\r\n", b"MSG a 1 1_0\r\n", b"MSG a 1 \xd9\xa1\r\n", b"MSG a 1 99999999999999999999999\r\n",
    b"HMSG a 1 5\r\n", b"HMSG a 1 13 12\r\n", b"HMSG a 1 0 0\r\n\r\n", b"HMSG a 1 4 4\r\nNATS\r\n",
    b"HMSG a 1 14 14\r\nNATS/1.0 5x3\r\n\r\n\r\n",
    b"MSG a 1 2\r\nabc\r\n", b"MSG a 1 2\r\nab\n\r",
    b"INFO\r\n", b"INFO {\r\n", b"INFO []\r\n", b"INFO 1\r\n", b"INFO " + b"[" * 4000 + b"\r\n", b"INFO \xff\xfe\r\n",
])
def test_malformed_input_raises_protocol_error(data: bytes) -> None:
    with pytest.raises(ProtocolError):
        decode(data)


def test_control_line_limit() -> None:
    text = b"x" * (nats.MAX_CONTROL_LINE_SIZE - len(b"-ERR "))
    assert decode(b"-ERR " + text + b"\r\n") == [Err(text.decode())]
    with pytest.raises(ProtocolError):
        decode(b"-ERR x" + text + b"\r\n")
    # Without its end: refused as soon as the line cannot fit any more, not when a newline comes.
    connection = nats.ClientConnection()
    assert decode(b"-ERR " + text + b"\r", connection=connection) == []
    with pytest.raises(ProtocolError):
        decode(b"x", connection=connection)


def test_declared_size_over_the_limit_is_refused_before_the_payload() -> None:
    limit = nats.DEFAULT_MAX_PAYLOAD + nats.PAYLOAD_HEADROOM
    assert decode(b"MSG a 1 %d\r\n" % limit) == []  # accepted: waiting for the payload
    with pytest.raises(ProtocolError):
        decode(b"MSG a 1 %d\r\n" % (limit + 1))
    with pytest.raises(ProtocolError):
        decode(b"HMSG a 1 12 %d\r\n" % (limit + 1))
    connection = nats.ClientConnection()
    decode(b'INFO {"max_payload":100}\r\n', connection=connection)
    with pytest.raises(ProtocolError):
        decode(b"MSG a 1 %d\r\n" % (100 + nats.PAYLOAD_HEADROOM + 1), connection=connection)


def test_limits_allocate_nothing_large() -> None:
    tracemalloc.start()
    try:
        for data in (b"MSG a 1 %d\r\n" % 2**40, b"HMSG a 1 12 %d\r\n" % 2**40, b"MSG a 1 " + b"9" * 4000 + b"\r\n",
                     b"INFO " + b"x" * 100_000):
            with pytest.raises(ProtocolError):
                decode(data)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1024 * 1024


# --- properties -------------------------------------------------------------------------------------------

tokens = st.text(st.characters(codec="utf-8", exclude_categories=("Cc", "Cs", "Zs", "Zl", "Zp")), min_size=1,
                 max_size=12).filter(lambda text: not any(ch.isspace() for ch in text))
header_names = st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E, exclude_characters=":"), min_size=1,
                       max_size=10)
header_values = st.text(st.characters(codec="utf-8", exclude_characters="\r\n"), max_size=12).map(
    lambda text: text.strip(" \t"))
descriptions = st.text(st.characters(codec="utf-8", exclude_characters="\r\n"), max_size=12).map(
    lambda text: text.strip(" \t"))
plain_messages = st.builds(Msg, tokens, st.integers(0, 2**40), st.none() | tokens, st.binary(max_size=40))
header_messages = st.builds(
    lambda subject, sid, reply, payload, headers, status, description: Msg(
        subject, sid, reply, payload, headers, status, description if status is not None else ""),
    tokens, st.integers(0, 2**40), st.none() | tokens, st.binary(max_size=40),
    st.dictionaries(header_names, header_values, max_size=4), st.none() | st.integers(100, 999), descriptions)
messages = st.lists(plain_messages | header_messages | st.sampled_from([Ping(), Pong(), Ok()]), max_size=12)


def encode_any(event: nats.Event) -> bytes:
    if isinstance(event, Msg):
        return encode_event(event)
    return {Ping: b"PING\r\n", Pong: b"PONG\r\n", Ok: b"+OK\r\n"}[type(event)]


def chunked(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({min(cut, len(data)) for cut in cuts})
    return [data[start:end] for start, end in zip([0, *points], [*points, len(data)], strict=True)]


@settings(max_examples=300, deadline=None)
@given(messages, st.lists(st.integers(0, 2000), max_size=20))
def test_message_sequences_in_random_chunks_decode_to_the_same_events(events: list[nats.Event],
                                                                      cuts: list[int]) -> None:
    stream = b"".join(encode_any(event) for event in events)
    assert decode(*chunked(stream, cuts)) == events


pieces = st.sampled_from([b"MSG ", b"HMSG ", b"INFO ", b"PING", b"PONG", b"+OK", b"-ERR ", b"\r\n", b"\r", b"\n",
                          b" ", b"\t", b"1", b"12", b"0", b"a.b", b"NATS/1.0", b"NATS/1.0 503", b": ", b"{}", b"[",
                          b'{"max_payload":1}', b"999999"]) | st.binary(max_size=8)


@settings(max_examples=500, deadline=None)
@given(st.lists(pieces, max_size=40), st.lists(st.integers(0, 400), max_size=10))
def test_garbage_raises_only_protocol_error(parts: list[bytes], cuts: list[int]) -> None:
    connection = nats.ClientConnection()
    try:
        for chunk in chunked(b"".join(parts), cuts):
            connection.receive_data(chunk)
            for event in connection.next_events():
                assert isinstance(event, Info | Msg | Ping | Pong | Ok | Err)
    except ProtocolError:
        pass


def test_info_is_json_of_any_shape() -> None:
    data = {"connect_urls": ["127.0.0.1:1", "127.0.0.1:2"], "nested": {"a": [1, 2.5, None]}, "tls_required": False}
    assert decode(b"INFO " + json.dumps(data).encode() + b"\r\n") == [Info(data)]
