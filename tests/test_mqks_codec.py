"""Unit tests of the MQKS codec: request parsing and framing, response lines, error ids and `--remove-mask`.

Each test pins one rule of docs/protocols/mqks.md (wire behaviour of MQKS v0.4.3) or one of the
deviations polymq makes on purpose (a TAB is answered instead of dropping the connection, over-long lines).
"""

from __future__ import annotations

import base64
import datetime
import random
import re

import pytest

from polymq.codecs import mqks
from polymq.codecs import mqks_client as client
from polymq.codecs.mqks import (
    Ack,
    BadRequest,
    Consume,
    DeleteConsumer,
    DeleteQueue,
    Eval,
    Ping,
    Publish,
    Rebind,
    Reject,
)

ERROR_ID = "20261122021533219864RrHK"  # the example of docs/protocols/mqks.md


def feed(*chunks: bytes, eof: bool = False, max_line_length: int = mqks.MAX_LINE_LENGTH) -> list[mqks.Request]:
    """Every request of `chunks`, taking the events after each chunk as a socket loop does."""
    conn = mqks.ServerConnection(max_line_length)
    events: list[mqks.Request] = []
    for chunk in chunks:
        conn.receive_data(chunk)
        events += conn.next_events()
    if eof:
        conn.receive_data(b"")
        events += conn.next_events()
    return events


def bad(request_id: str, line: bytes) -> None:
    """`line` is answered `{request_id} error …` (and nothing else)."""
    event = mqks.parse_line(line)
    assert isinstance(event, BadRequest), event
    assert event.request_id == request_id
    assert event.reason  # goes to the log


# ---------------------------------------------------------------------------------------------
# field split, rstrip, --confirm


def test_split_on_first_two_single_spaces_data_keeps_its_spaces() -> None:
    assert mqks.parse_line(b"m1 publish e1 hello  big world") == Publish("m1", "e1", b"hello  big world", False)
    assert mqks.parse_line(b"pg1 ping a b  c") == Ping("pg1", b"a b  c")
    # Only the first two spaces separate fields: a leading space of data stays in the data.
    assert mqks.parse_line(b"pg1 ping  x") == Ping("pg1", b" x")


@pytest.mark.parametrize(
    ("line", "data"),
    [
        (b"pg1 ping x\r", b"x"),  # CRLF works
        (b"pg1 ping x   ", b"x"),  # trailing spaces of data are lost
        (b"pg1 ping x \r", b"x"),
        (b"pg1 ping x\x0b\x0c", b"x"),  # Python's rstrip: all ASCII whitespace
        (b"pg1 ping  a b ", b" a b"),
    ],
)
def test_line_is_rstripped(line: bytes, data: bytes) -> None:
    assert mqks.parse_line(line) == Ping("pg1", data)


def test_publish_data_loses_trailing_spaces() -> None:
    assert mqks.parse_line(b"m1 publish e1 d1  \r") == Publish("m1", "e1", b"d1", False)


@pytest.mark.parametrize(
    "line", [b"pg3 ping", b"", b"dq9 delete_queue", b"x", b"   ", b"pg3 ping   ", b"\r", b"pg3 ping \r"]
)
def test_fewer_than_three_fields_is_none_error(line: bytes) -> None:
    bad(mqks.NO_ID, line)


def test_none_error_line_bytes() -> None:
    (event,) = feed(b"pg3 ping\n")
    assert isinstance(event, BadRequest)
    assert mqks.error_line(event.request_id, ERROR_ID) == b"None error " + ERROR_ID.encode() + b"\n"


def test_double_space_makes_action_empty_and_answers_with_the_id() -> None:
    bad("x2", b"x2  publish e1 d")
    bad("pg3", b"pg3  ping")  # three fields: 'pg3', '' and 'ping'


@pytest.mark.parametrize(
    ("request_id", "line"),
    [("x1", b"x1 blabla 123"), ("x1", b"x1 PING a"), ("x1", b"x1 \xff\xfe a"), ("x1", b"x1 subscribe q1 e1")],
)
def test_unknown_action(request_id: str, line: bytes) -> None:
    bad(request_id, line)


@pytest.mark.parametrize(
    ("request_id", "line"),
    [
        ("a1", b"a1 ack c1"),
        ("r1", b"r1 reject c1"),
        ("a1", b"a1 ack --confirm c1"),
        ("m1", b"m1 publish e1"),
        ("m1", b"m1 publish --confirm e1"),
        ("m1", b"m1 publish e1 "),  # the space is stripped first
        ("rb1", b"rb1 rebind q1"),
        ("rb1", b"rb1 rebind --confirm q1"),
        ("c1", b"c1 consume --manual-ack"),  # no queue
        ("ev1", b"ev1 _eval --worker=0"),
        ("ev1", b"ev1 _eval --worker=x len(state.queues)"),
    ],
)
def test_missing_or_extra_sub_arguments_answer_with_the_id(request_id: str, line: bytes) -> None:
    bad(request_id, line)


def test_the_rest_of_the_line_is_the_name_as_in_the_original() -> None:
    # `split(' ', 1)` in the original: a name with a space is looked up (and found missing), not refused.
    assert mqks.parse_line(b"dq1 delete_queue --confirm q1 q2") == mqks.DeleteQueue("dq1", "q1 q2", True)
    assert mqks.parse_line(b"dc1 delete_consumer c1 c2") == mqks.DeleteConsumer("dc1", "c1 c2", False)
    assert mqks.parse_line(b"a1 ack c1 m1 x") == mqks.Ack("a1", "c1", "m1 x", False)


def test_publish_to_the_empty_event_parses_as_the_original_does() -> None:
    assert mqks.parse_line(b"m1 publish  e1 d") == mqks.Publish("m1", "", b"e1 d", False)


def test_delete_queue_without_queue_is_none_error() -> None:
    bad(mqks.NO_ID, b"dq9 delete_queue")


def test_confirm_only_as_first_token_of_data_and_stripped() -> None:
    assert mqks.parse_line(b"m1 publish --confirm e1 d1") == Publish("m1", "e1", b"d1", True)
    assert mqks.parse_line(b"m1 publish e1 --confirm d1") == Publish("m1", "e1", b"--confirm d1", False)
    assert mqks.parse_line(b"dq1 delete_queue --confirm q1") == DeleteQueue("dq1", "q1", True)
    assert mqks.parse_line(b"dc1 delete_consumer --confirm c1") == DeleteConsumer("dc1", "c1", True)
    assert mqks.parse_line(b"dc1 delete_consumer c1") == DeleteConsumer("dc1", "c1", False)
    # Stripped once: the second one is data.
    assert mqks.parse_line(b"pg1 ping --confirm --confirm x") == Ping("pg1", b"--confirm x")
    # `--confirm` needs its space: as the whole data it is the data.
    assert mqks.parse_line(b"pg1 ping --confirm") == Ping("pg1", b"--confirm")
    assert mqks.parse_line(b"pg1 ping --confirm ") == Ping("pg1", b"--confirm")


def test_ping_with_confirm_answers_once_with_the_rest() -> None:
    assert mqks.parse_line(b"pg4 ping --confirm x") == Ping("pg4", b"x")
    assert mqks.parse_line(b"pg1 ping service1") == Ping("pg1", b"service1")


# ---------------------------------------------------------------------------------------------
# actions


def test_publish_body_with_the_reversible_encoding_is_decoded() -> None:
    body = b"line1\nline2\t\x00 "
    line = b"m1 publish e1 " + mqks.ENCODED_PREFIX + base64.b64encode(body)
    assert mqks.parse_line(line) == Publish("m1", "e1", body, False)
    assert mqks.parse_line(b"m1 publish e1 " + mqks.ENCODED_PREFIX) == Publish("m1", "e1", b"", False)
    bad("m1", b"m1 publish e1 " + mqks.ENCODED_PREFIX + b"not base64!")


def test_publish_keeps_non_utf8_data_as_bytes() -> None:
    assert mqks.parse_line(b"m1 publish e1 \xff\xfe") == Publish("m1", "e1", b"\xff\xfe", False)


def test_consume_events_replace() -> None:
    assert mqks.parse_line(b"c1 consume q1 e1 e2") == Consume("c1", "q1", ("e1", "e2"), (), None, False, False)


def test_consume_without_events_keeps_bindings() -> None:
    assert mqks.parse_line(b"c1 consume q1") == Consume("c1", "q1", (), (), None, False, False)


def test_consume_add() -> None:
    assert mqks.parse_line(b"c1 consume q1 e1 --add e2 e3") == Consume(
        "c1", "q1", ("e1",), ("e2", "e3"), None, False, False
    )
    assert mqks.parse_line(b"c1 consume q1 --add e2") == Consume("c1", "q1", (), ("e2",), None, False, False)


def test_consume_spec_example() -> None:
    event = mqks.parse_line(b"c1 consume --confirm q1 e1 e2 --delete-queue-when-unused=5 --manual-ack")
    assert event == Consume("c1", "q1", ("e1", "e2"), (), 5.0, True, True)
    assert isinstance(event, Consume)
    assert type(event.delete_when_unused) is float


def test_consume_delete_queue_when_unused_without_value_is_true() -> None:
    event = mqks.parse_line(b"c1 consume q1 e1 --delete-queue-when-unused")
    assert isinstance(event, Consume)
    assert event.delete_when_unused is True
    assert event.manual_ack is False


@pytest.mark.parametrize(("flag", "value"), [(b"=0.5", 0.5), (b"=0", 0.0), (b"=10", 10.0), (b"=1e1", 10.0)])
def test_consume_delete_queue_when_unused_seconds(flag: bytes, value: float) -> None:
    event = mqks.parse_line(b"c1 consume q1 --delete-queue-when-unused" + flag)
    assert isinstance(event, Consume)
    assert event.delete_when_unused == value
    assert type(event.delete_when_unused) is float


@pytest.mark.parametrize(
    "line",
    [
        b"c1 consume q1 e1 --bogus",
        b"c1 consume q1 --remove e1",  # a rebind flag
        b"c1 consume q1 e1 --confirm",  # --confirm only as the first token
        b"c1 consume q1 --delete-queue-when-unused=abc",  # float() of the original raises
        b"c1 consume q1 --delete-queue-when-unused=",
        b"c1 consume q1 --delete-queue-when-unused=nan",  # no timer can wait that long
        b"c1 consume q1 --delete-queue-when-unused=inf",
        b"c1 consume q1 --manual-ack=1",
        b"c1 consume q1 --",
    ],
)
def test_consume_unknown_or_bad_flag_is_an_error(line: bytes) -> None:
    bad("c1", line)


def test_rebind_spec_examples() -> None:
    assert mqks.parse_line(b"rb1 rebind q1 e3 e4 e5.id1.a1 e5.id2.a2") == Rebind(
        "rb1", "q1", ("e3", "e4", "e5.id1.a1", "e5.id2.a2"), (), (), (), False
    )
    assert mqks.parse_line(b"rb2 rebind q1 --remove e3 --add e6 e7") == Rebind(
        "rb2", "q1", (), ("e3",), (), ("e6", "e7"), False
    )
    assert mqks.parse_line(b"rb3 rebind q1 --remove-mask e5.*.a1 e5.*.a2 --add e8") == Rebind(
        "rb3", "q1", (), (), ("e5.*.a1", "e5.*.a2"), ("e8",), False
    )


def test_rebind_sections_in_order_and_repeated() -> None:
    assert mqks.parse_line(b"rb4 rebind --confirm q1 e1 --remove e2 --remove-mask e3.* --add e4") == Rebind(
        "rb4", "q1", ("e1",), ("e2",), ("e3.*",), ("e4",), True
    )
    # A section flag switches where the following names go, whatever the order in the line.
    assert mqks.parse_line(b"rb5 rebind q1 --add a --remove b --add c --remove-mask d.* e") == Rebind(
        "rb5", "q1", (), ("b",), ("d.*", "e"), ("a", "c"), False
    )
    # Only flags: valid, nothing to change.
    assert mqks.parse_line(b"rb6 rebind q1 --remove") == Rebind("rb6", "q1", (), (), (), (), False)


def test_rebind_replace_section_flag() -> None:
    # The original looks the section up by the flag's name, so `--replace` names the default section.
    assert mqks.parse_line(b"rb7 rebind q1 --add a --replace b c") == Rebind(
        "rb7", "q1", ("b", "c"), (), (), ("a",), False
    )


@pytest.mark.parametrize("line", [b"rb1 rebind q1 --bogus e1", b"rb1 rebind q1 e1 --", b"rb1 rebind q1 --manual-ack"])
def test_rebind_unknown_flag_is_an_error(line: bytes) -> None:
    bad("rb1", line)


@pytest.mark.parametrize(("action", "cls"), [(b"ack", Ack), (b"reject", Reject)])
def test_ack_and_reject(action: bytes, cls: type[Ack] | type[Reject]) -> None:
    assert mqks.parse_line(b"a1 " + action + b" c1 m1") == cls("a1", "c1", "m1", False)
    assert mqks.parse_line(b"a1 " + action + b" --confirm c1 m1") == cls("a1", "c1", "m1", True)
    assert mqks.parse_line(b"a1 " + action + b" c1 --all") == cls("a1", "c1", None, False)
    assert mqks.parse_line(b"a1 " + action + b" --confirm c1 --all") == cls("a1", "c1", None, True)


def test_eval() -> None:
    assert mqks.parse_line(b"ev1 _eval --worker=0 len(state.queues)") == Eval("ev1", 0, "len(state.queues)", False)
    assert mqks.parse_line(b"ev2 _eval state.published") == Eval("ev2", None, "state.published", False)
    assert mqks.parse_line(b"ev3 _eval --confirm len(state.queues)") == Eval("ev3", None, "len(state.queues)", True)


# ---------------------------------------------------------------------------------------------
# TAB, non-UTF-8


@pytest.mark.parametrize(
    ("request_id", "line"),
    [
        ("m1", b"m1 publish e1 a\tb"),
        ("pg1", b"pg1 ping \tx"),
        ("pg1", b"pg1 ping x\t"),  # a trailing TAB too: the original asserts before its rstrip
        ("pg1", b"pg1 ping x \t\r"),
        ("c1", b"c1 consume q1\te1"),
        ("x1", b"x1 pi\tng x"),
        (mqks.NO_ID, b"a\tb ping x"),  # the id itself is not one
        (mqks.NO_ID, b"pg1 ping\t"),  # fewer than three fields anyway
    ],
)
def test_tab_anywhere_is_an_error_with_the_id(request_id: str, line: bytes) -> None:
    bad(request_id, line)


def test_tab_answers_and_the_connection_goes_on() -> None:
    events = feed(b"pg1 ping a\tb\npg2 ping ok\n")
    assert len(events) == 2
    assert isinstance(events[0], BadRequest)
    assert events[0].request_id == "pg1"
    assert events[1] == Ping("pg2", b"ok")


def test_non_utf8_request_id_is_none_error() -> None:
    bad(mqks.NO_ID, b"\xff\xfe ping x")
    bad(mqks.NO_ID, b"m\xc3 publish e1 d1")


def test_non_utf8_names_are_errors_with_the_id() -> None:
    bad("m1", b"m1 publish e\xff d1")
    bad("c1", b"c1 consume q\xff e1")
    bad("c1", b"c1 consume q1 e\xff")
    bad("a1", b"a1 ack c\xff m1")
    bad("dq1", b"dq1 delete_queue q\xff")


def test_non_utf8_ping_data_is_echoed_as_bytes() -> None:
    assert mqks.parse_line(b"pg1 ping \xff\xfe") == Ping("pg1", b"\xff\xfe")


def test_utf8_names() -> None:
    assert mqks.parse_line("м1 publish событие данные".encode()) == Publish("м1", "событие", "данные".encode(), False)


# ---------------------------------------------------------------------------------------------
# Framing: EOF, chunks, line length


def test_last_line_without_newline_at_eof_is_processed() -> None:
    assert feed(b"pg1 ping x") == []
    assert feed(b"pg1 ping x", eof=True) == [Ping("pg1", b"x")]
    assert feed(b"pg1 ping x\npg2 ping y\r", eof=True) == [Ping("pg1", b"x"), Ping("pg2", b"y")]


def test_eof_after_a_complete_line_adds_no_empty_line() -> None:
    assert feed(b"pg1 ping x\n", eof=True) == [Ping("pg1", b"x")]
    # Also when the events are taken only after the close.
    conn = mqks.ServerConnection()
    conn.receive_data(b"pg1 ping x\n")
    conn.receive_data(b"")
    assert conn.next_events() == [Ping("pg1", b"x")]


def test_eof_twice_processes_the_last_line_once() -> None:
    conn = mqks.ServerConnection()
    conn.receive_data(b"pg1 ping x")
    conn.receive_data(b"")
    conn.receive_data(b"")
    assert conn.next_events() == [Ping("pg1", b"x")]
    assert conn.next_events() == []


def test_eof_alone_gives_nothing() -> None:
    assert feed(eof=True) == []
    assert feed(b"pg1 ping x\n", b"", b"") == [Ping("pg1", b"x")]


def test_empty_line_in_the_stream_is_none_error() -> None:
    events = feed(b"\npg1 ping x\n")
    assert [type(event) for event in events] == [BadRequest, Ping]
    assert events[0].request_id == mqks.NO_ID


def test_lines_split_across_many_receive_data_calls() -> None:
    stream = b"m1 publish e1 hello world\r\npg1 ping x\nc1 consume q1 e1 --add e2\n"
    conn = mqks.ServerConnection()
    events: list[mqks.Request] = []
    for index in range(len(stream)):
        conn.receive_data(stream[index : index + 1])
        got = conn.next_events()
        # An event appears exactly when its newline arrives.
        assert len(got) == (1 if stream[index] == ord("\n") else 0)
        events += got
    assert events == [
        Publish("m1", "e1", b"hello world", False),
        Ping("pg1", b"x"),
        Consume("c1", "q1", ("e1",), ("e2",), None, False, False),
    ]


def test_several_lines_in_one_chunk() -> None:
    assert feed(b"pg1 ping a\npg2 ping b\npg3 ping c") == [Ping("pg1", b"a"), Ping("pg2", b"b")]


def test_line_of_exactly_the_limit_parses() -> None:
    line = b"pg1 ping " + b"x" * 7  # 16 bytes
    assert feed(line + b"\n", max_line_length=16) == [Ping("pg1", b"x" * 7)]
    assert feed(line, eof=True, max_line_length=16) == [Ping("pg1", b"x" * 7)]


def test_default_limit_accepts_a_one_mib_line() -> None:
    line = b"pg1 ping " + b"x" * (mqks.MAX_LINE_LENGTH - 9)
    assert feed(line + b"\n") == [Ping("pg1", b"x" * (mqks.MAX_LINE_LENGTH - 9))]
    (event,) = feed(line + b"xy\n")
    assert isinstance(event, BadRequest)
    assert event.request_id == "pg1"


def test_over_long_line_is_one_error_then_following_lines_parse() -> None:
    events = feed(b"pg1 ping " + b"x" * 20 + b"\npg2 ping ok\n", max_line_length=16)
    assert len(events) == 2
    assert isinstance(events[0], BadRequest)
    assert events[0].request_id == "pg1"
    assert events[1] == Ping("pg2", b"ok")


def test_over_long_line_in_pieces_is_one_error_then_following_lines_parse() -> None:
    chunks = [b"pg1 ping xxxx", b"x" * 20, b"xxxx", b"x" * 30, b"\npg2 ", b"ping ok\n"]
    events = feed(*chunks, max_line_length=16)
    assert len(events) == 2
    assert isinstance(events[0], BadRequest)
    assert events[0].request_id == "pg1"
    assert events[1] == Ping("pg2", b"ok")


def test_over_long_line_without_id_answers_none() -> None:
    (event,) = feed(b"x" * 40 + b"\n", max_line_length=16)
    assert isinstance(event, BadRequest)
    assert event.request_id == mqks.NO_ID


def test_over_long_line_is_answered_before_its_end_arrives() -> None:
    conn = mqks.ServerConnection(16)
    conn.receive_data(b"pg1 ping " + b"x" * 20)
    (event,) = conn.next_events()
    assert isinstance(event, BadRequest)
    assert event.request_id == "pg1"
    # The buffer does not grow with the rest of the line.
    conn.receive_data(b"y" * 1000)
    assert conn.next_events() == []
    conn.receive_data(b"z\npg2 ping ok\n")
    assert conn.next_events() == [Ping("pg2", b"ok")]


def test_over_long_line_then_a_last_line_at_eof() -> None:
    conn = mqks.ServerConnection(16)
    conn.receive_data(b"pg1 ping " + b"x" * 20)
    assert len(conn.next_events()) == 1
    # The rest of the long line, a last line without `\n`, and the close, before the events are taken.
    conn.receive_data(b"xx\npg2 ping ok")
    conn.receive_data(b"")
    assert conn.next_events() == [Ping("pg2", b"ok")]


def test_over_long_line_answer_does_not_depend_on_chunking() -> None:
    # The id of a long line is found the same way whether the line came whole or in pieces.
    line = b"abcdefghijklmnopqrstuvwxyz ping x\n"
    whole = feed(line, max_line_length=8)
    pieces = feed(line[:10], line[10:], max_line_length=8)
    assert whole == pieces
    assert len(whole) == 1


def test_bad_request_line_is_cut_for_the_log() -> None:
    (event,) = feed(b"x1 blabla " + b"y" * 5000 + b"\n")
    assert isinstance(event, BadRequest)
    assert len(event.line) == mqks.MAX_LOGGED_LINE
    assert event.line.startswith(b"x1 blabla y")


# ---------------------------------------------------------------------------------------------
# response lines


def test_ok_line() -> None:
    assert mqks.ok_line("c1") == b"c1 ok \n"  # a confirm keeps the trailing space
    assert mqks.ok_line(b"c1") == b"c1 ok \n"
    assert mqks.ok_line("pg1", b"service1") == b"pg1 ok service1\n"
    assert mqks.ok_line("pg1", b"a b") == b"pg1 ok a b\n"
    assert mqks.ok_line("ид", b"x") == "ид ok x\n".encode()


def test_error_line() -> None:
    assert mqks.error_line("x1", ERROR_ID) == b"x1 error 20261122021533219864RrHK\n"
    assert mqks.error_line(mqks.NO_ID, ERROR_ID) == b"None error 20261122021533219864RrHK\n"


def test_delivery_line() -> None:
    assert mqks.delivery_line(b"c1", b"m1", b"e1", 0, b"d1") == b"c1 ok m1 event=e1 d1\n"
    assert mqks.delivery_line(b"c1", b"m1", b"e1", 1, b"d1") == b"c1 ok m1 event=e1,retry=1 d1\n"
    assert mqks.delivery_line(b"c1", b"m1", b"e1", 12, b"hello world") == b"c1 ok m1 event=e1,retry=12 hello world\n"
    assert mqks.delivery_line(b"Charlie", b"Dave", b"hello", 0, b"world") == b"Charlie ok Dave event=hello world\n"


def test_delivery_line_encodes_a_body_a_line_cannot_carry() -> None:
    line = mqks.delivery_line(b"c1", b"m1", b"e1", 0, b"a\nb")
    assert line == b"c1 ok m1 event=e1 polymq:base64:" + base64.b64encode(b"a\nb") + b"\n"
    assert line.count(b"\n") == 1
    assert mqks.delivery_line(b"c1", b"m1", b"e1", 0, b"") == b"c1 ok m1 event=e1 polymq:base64:\n"


def test_update_line() -> None:
    assert (
        mqks.update_line("c3", "q1", ["e6", "e2", "e5"], 5.0, False)
        == b"c3 ok --update q1 e2 e5 e6 --delete-queue-when-unused=5.0\n"
    )
    assert (
        mqks.update_line("c1", "q1", {"e2", "e1"}, 5, True)
        == b"c1 ok --update q1 e1 e2 --delete-queue-when-unused=5.0 --manual-ack\n"
    )
    assert mqks.update_line("c1", "q1", ["e1"], True, False) == b"c1 ok --update q1 e1 --delete-queue-when-unused\n"
    assert mqks.update_line("c1", "q1", ["e1"], 0.5, False) == b"c1 ok --update q1 e1 --delete-queue-when-unused=0.5\n"
    assert mqks.update_line("c1", "q1", ["e1"], None, True) == b"c1 ok --update q1 e1 --manual-ack\n"
    assert mqks.update_line("c1", "q1", ["e1"], None, False) == b"c1 ok --update q1 e1\n"


def test_update_line_without_events() -> None:
    # delete_queue: `--update {queue}` with no events, plus the suffixes.
    assert mqks.update_line("c1", "q1", [], None, False) == b"c1 ok --update q1\n"
    assert (
        mqks.update_line("c1", "q1", [], True, True) == b"c1 ok --update q1 --delete-queue-when-unused --manual-ack\n"
    )


def test_format_when_unused() -> None:
    assert mqks.format_when_unused(None) == ""
    assert mqks.format_when_unused(True) == " --delete-queue-when-unused"
    assert mqks.format_when_unused(5) == " --delete-queue-when-unused=5.0"
    assert mqks.format_when_unused(5.0) == " --delete-queue-when-unused=5.0"
    assert mqks.format_when_unused(2.5) == " --delete-queue-when-unused=2.5"
    assert mqks.format_when_unused(0.0) == " --delete-queue-when-unused=0.0"


# ---------------------------------------------------------------------------------------------
# error ids

ERROR_ID_SHAPE = re.compile(r"\d{20}[0-9A-Za-z]{4}")


def test_error_id_shape() -> None:
    utc = datetime.datetime(2026, 11, 22, 2, 15, 33, 219864, tzinfo=datetime.UTC)
    eid = mqks.error_id(utc, random.Random(1))
    assert len(eid) == mqks.ID_LENGTH == 24
    assert ERROR_ID_SHAPE.fullmatch(eid)
    assert eid.startswith("20261122021533219864")


def test_error_id_pads_microseconds_and_fields() -> None:
    eid = mqks.error_id(datetime.datetime(2026, 1, 2, 3, 4, 5, tzinfo=datetime.UTC), random.Random(1))
    assert eid[:20] == "20260102030405000000"
    assert ERROR_ID_SHAPE.fullmatch(eid)


def test_error_id_random_part_is_base62_and_varies() -> None:
    utc = datetime.datetime(2026, 11, 22, tzinfo=datetime.UTC)
    rng = random.Random(7)
    tails = {mqks.error_id(utc, rng)[20:] for _ in range(200)}
    assert len(tails) > 150
    assert all(re.fullmatch(r"[0-9A-Za-z]{4}", tail) for tail in tails)
    # All 62 characters can appear.
    assert set("".join(tails)) == set("0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")
    # Deterministic for a seeded generator.
    assert mqks.error_id(utc, random.Random(3)) == mqks.error_id(utc, random.Random(3))


# ---------------------------------------------------------------------------------------------
# --remove-mask


def test_mask_star_between_dots_may_match_nothing() -> None:
    events = {"e4.x.y", "e4..y", "e4.x.z", "e4.xy", "e4.x.x.y", "e4.x.y.z", "xe4.x.y"}
    assert mqks.masked(events, ["e4.*.y"]) == {"e4.x.y", "e4..y"}


def test_mask_star_never_crosses_a_dot() -> None:
    assert mqks.masked({"e3.123.c", "e3.1", "e3.", "e3"}, ["e3.*"]) == {"e3.1", "e3."}


def test_mask_leading_star() -> None:
    events = {"user.updated", "comment.updated", ".updated", "a.b.updated", "updated", "user.updated.x"}
    assert mqks.masked(events, ["*.updated"]) == {"user.updated", "comment.updated", ".updated"}


def test_mask_two_stars() -> None:
    events = {"post.123.deleted", "category.subcategory.deleted", "x.deleted", "a.b.c.deleted", "a.b.deleted.x"}
    assert mqks.masked(events, ["*.*.deleted"]) == {"post.123.deleted", "category.subcategory.deleted"}


def test_mask_events_without_a_dot_are_never_removed() -> None:
    assert mqks.masked({"abc", "a", "e1"}, ["*"]) == set()
    assert mqks.masked({"abc", "a.b"}, ["abc", "a.b"]) == {"a.b"}
    assert mqks.masked({"user", "user.1"}, ["user*"]) == set()  # `*` never matches the dot


def test_mask_pieces_are_literal() -> None:
    assert mqks.masked({"a+b.x", "aab.x", "a.b", "axb"}, ["a+b.*"]) == {"a+b.x"}
    assert mqks.masked({"e1.x", "e1x.x"}, ["e?.*"]) == set()
    assert mqks.masked({"a.b", "axb.c"}, ["a.b"]) == {"a.b"}  # the dot is a dot


def test_mask_several_masks() -> None:
    events = {"e5.id1.a1", "e5.id2.a2", "e5.id3.a3", "e3", "e4"}
    assert mqks.masked(events, ["e5.*.a1", "e5.*.a2"]) == {"e5.id1.a1", "e5.id2.a2"}


def test_no_masks_remove_nothing() -> None:
    assert mqks.masked({"a.b", "c.d"}, []) == set()


def test_mask_pattern_is_anchored() -> None:
    pattern = mqks.mask_pattern(["e4.*.y"])
    assert pattern.match("e4.x.y")
    assert not pattern.match("e4.x.yz")
    assert not pattern.match("e4.x.y\n")


# ---------------------------------------------------------------------------------------------
# Client side


def test_client_request() -> None:
    assert client.request("m1", "publish", b"e1 d1") == b"m1 publish e1 d1\n"
    assert client.request("m1", "publish", "e1 d1", confirm=True) == b"m1 publish --confirm e1 d1\n"
    assert client.request("pg1", "ping", "mqks.client") == b"pg1 ping mqks.client\n"


def test_client_publish_data() -> None:
    assert client.publish_data(b"hello world") == b"hello world"
    assert client.publish_data(b"x ") == b"polymq:base64:" + base64.b64encode(b"x ")


def test_client_parse_response() -> None:
    assert client.parse_response(b"c1 ok ") == client.Response("c1", True, b"")
    assert client.parse_response(b"pg1 ok mqks.client") == client.Response("pg1", True, b"mqks.client")
    assert client.parse_response(b"x1 error " + ERROR_ID.encode()) == client.Response("x1", False, ERROR_ID.encode())
    for line in (b"c1", b"c1 okay", b"c1 ok", b"c1 nope x"):
        with pytest.raises(client.ResponseError):
            client.parse_response(line)


def test_client_parse_delivery() -> None:
    delivery = client.parse_delivery(b"m1 event=e1 d1")
    assert delivery == client.Delivery("m1", "e1", 0, b"d1", {})
    assert delivery.props == {"event": "e1"}
    delivery = client.parse_delivery(b"m1 event=e1,retry=2 hello world")
    assert (delivery.msg_id, delivery.event, delivery.retry, delivery.body) == ("m1", "e1", 2, b"hello world")
    assert delivery.props == {"event": "e1", "retry": "2"}
    encoded = b"m1 event=e1 polymq:base64:" + base64.b64encode(b"a\nb")
    assert client.parse_delivery(encoded).body == b"a\nb"
    for data in (b"m1 event=e1", b"m1 retry=1 d1"):
        with pytest.raises(client.ResponseError):
            client.parse_delivery(data)


def test_client_parse_update() -> None:
    data = b"--update q1 e2 e5 e6 --delete-queue-when-unused=5.0 --manual-ack"
    assert client.is_update(data)
    update = client.parse_update(data)
    assert update == client.Update(
        "q1", ("e2", "e5", "e6"), 5.0, True, "q1 e2 e5 e6 --delete-queue-when-unused=5.0 --manual-ack"
    )
    update = client.parse_update(b"--update q1 --delete-queue-when-unused")
    assert update.delete_when_unused is True
    assert update.events == ()
    assert client.parse_update(b"--update q1") == client.Update("q1", (), None, False, "q1")
    assert not client.is_update(b"m1 event=e1 d1")


def test_client_update_line_resent_as_consume() -> None:
    # The client re-sends the last `--update`d consume line on reconnect (docs/protocols/mqks.md).
    line = mqks.update_line("c1", "q1", ["e2", "e1"], 5.0, True)
    response = client.parse_response(line.rstrip(b"\n"))
    update = client.parse_update(response.data)
    assert mqks.parse_line(client.request("c2", "consume", update.line)) == Consume(
        "c2", "q1", ("e1", "e2"), (), 5.0, True, False
    )


def test_client_line_reader() -> None:
    reader = client.LineReader(max_line_length=16)
    assert reader.feed(b"c1 ok") == []
    assert reader.feed(b" a\nc1 ok b\nc1") == [b"c1 ok a", b"c1 ok b"]
    assert reader.feed(b" ok \n") == [b"c1 ok "]
    with pytest.raises(client.ResponseError):
        reader.feed(b"x" * 17)


def test_client_line_reader_checks_the_partial_line_after_a_newline() -> None:
    reader = client.LineReader(max_line_length=16)
    with pytest.raises(client.ResponseError):
        reader.feed(b"c1 ok a\n" + b"x" * 17)
