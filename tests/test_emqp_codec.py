"""The eMQP codec: the frames EventMQ 0.3.13's router and peers exchange, and bytes of any kind
(the original dies on identities or frames that are not UTF-8)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from polymq.codecs import emqp
from polymq.codecs.emqp import Inform, Invalid, Message, Publish, Request, Schedule, WorkerReply

ID = b"5d6f0e4a-0000-4000-8000-000000000001"  # a peer's uuid4 identity
MSGID = b"8f6a1c2e-0000-4000-8000-000000000002"


def test_a_routed_message_and_its_body() -> None:
    frames = [ID, b"", b"eMQP/1.0", b"REQUEST", MSGID, b"email", b"reply-requested,timeout:30", b'["run", {}]']
    assert emqp.parse(frames) == Message(ID, b"REQUEST", MSGID, [b"email", b"reply-requested,timeout:30",
                                                                 b'["run", {}]'])
    assert emqp.parse([ID, b"", b"eMQP/1.0", b"READY"]) == Invalid(
        "4 frames: an eMQP message has an identity and at least 4 more")
    binary = [b"\x00\xff\x80ab", b"", b"eMQP/1.0", b"READY", b"\xfe\xff"]  # a libzmq-made identity, any msgid
    assert emqp.parse(binary) == Message(b"\x00\xff\x80ab", b"READY", b"\xfe\xff", [])
    assert emqp.parse([ID, b"x", b"eMQP/1.0", b"READY", MSGID]) == Invalid(
        "the frame after the identity is not the empty delimiter")
    assert emqp.parse([ID, b"", b"eMQP/2.0", b"READY", MSGID]) == Invalid(
        "protocol version b'eMQP/2.0'; this broker speaks eMQP/1.0")


@pytest.mark.parametrize(("raw", "name"), [
    (b"email", "email"),
    ("caf\u00e9".encode(), "caf\u00e9"),
    (b"", Invalid("a queue name of 0 bytes (1 to 1024)")),
    (b"q" * 1025, Invalid("a queue name of 1025 bytes (1 to 1024)")),
    (b"\xff\xfe", Invalid("a queue name that is not UTF-8")),
])
def test_queue_name(raw: bytes, name: object) -> None:
    assert emqp.queue_name(raw) == name


@pytest.mark.parametrize(("body", "parsed"), [
    ([b'[[10, "default"], [5, "other"]]', b"worker"], Inform([(10, b"default"), (5, b"other")], b"worker")),
    ([b"", b"worker"], Inform([(10, b"default")], b"worker")),
    ([b"", b"scheduler"], Inform([(10, b"default")], b"scheduler")),
    ([b"[[40, \"email\"]]", b"worker"], Inform([(40, b"email")], b"worker")),
    ([b"not json", b"worker"], Invalid("INFORM queues are not a JSON list of [weight, name]: "
                                        "Expecting value: line 1 column 1 (char 0)")),
    ([b'[["x", "q"]]', b"worker"], Invalid("INFORM queues are not a JSON list of [weight, name]: "
                                           "invalid literal for int() with base 10: 'x'")),
    ([b"[[true, \"q\"]]", b"worker"], Invalid("INFORM queues are not a JSON list of [weight, name]: a boolean")),
    ([b"[]"], Invalid("INFORM with 1 body frames (queues, peer type)")),
])
def test_inform(body: list[bytes], parsed: object) -> None:
    assert emqp.parse_inform(body) == parsed


def test_request_reply_schedule_publish_bodies() -> None:
    assert emqp.parse_request([b"email", b"", b"[]"]) == Request(b"email", b"", b"[]")
    assert isinstance(emqp.parse_request([b"email", b""]), Invalid)
    assert emqp.parse_worker_reply([b'{"value": 42}', MSGID]) == WorkerReply(b'{"value": 42}', MSGID)
    assert isinstance(emqp.parse_worker_reply([MSGID]), Invalid)
    assert emqp.parse_schedule([b"q", b"nohaste", b"60", b"[]", b""]) == Schedule(b"q", b"nohaste", 60, b"[]", b"")
    assert emqp.parse_schedule([b"q", b"", b"-1", b"[]", b"*/5 * * * *"]) == Schedule(b"q", b"", None, b"[]",
                                                                                    b"*/5 * * * *")
    assert emqp.parse_schedule([b"q", b"", b"-1", b"[]", b""]) == Invalid(
        "SCHEDULE without an interval or a cron expression")
    assert isinstance(emqp.parse_schedule([b"q", b"", b"soon", b"[]", b""]), Invalid)
    assert emqp.parse_publish([b"updates", b'["update", "1"]']) == Publish(b"updates", b'["update", "1"]')
    assert emqp.parse_headers(b"reply-requested,guarantee,retry-count:3,timeout:30") == {
        "reply-requested": "", "guarantee": "", "retry-count": "3", "timeout": "30"}
    assert emqp.parse_headers(b"") == {}


def test_the_router_s_frames() -> None:
    assert emqp.ack(ID, b"m1", MSGID) == [ID, b"", b"eMQP/1.0", b"ACK", b"m1", MSGID]
    assert emqp.reply(ID, b"m2", MSGID) == [ID, b"", b"eMQP/1.0", b"REPLY", b"m2", MSGID]
    assert emqp.heartbeat(ID, b"m3", 1795313853.0189893) == [ID, b"", b"eMQP/1.0", b"HEARTBEAT", b"m3",
                                                             b"1795313853.0189893"]
    assert emqp.kbye(ID, b"m4") == [ID, b"", b"eMQP/1.0", b"KBYE", b"m4"]
    request = Message(b"client", b"REQUEST", MSGID, [b"email", b"", b"[]"])
    assert emqp.forward(ID, request) == [ID, b"", b"eMQP/1.0", b"REQUEST", MSGID, b"email", b"", b"[]"]
    assert emqp.published(b"t", b"body") == [b"t", b"body"]
    assert emqp.client_message(b"READY", b"m5") == [b"", b"eMQP/1.0", b"READY", b"m5"]
    assert emqp.refusal(ID, b"m6", MSGID, "queue full") == [ID, b"", b"eMQP/1.0", b"REPLY", b"m6", MSGID,
                                                            b"ERROR: queue full"]
    assert emqp.disconnect(ID, b"m7", "bad INFORM") == [ID, b"", b"eMQP/1.0", b"DISCONNECT", b"m7", b"bad INFORM"]
    assert json.loads(b'[[10, "default"]]') == [[10, "default"]]


@given(st.lists(st.binary(max_size=24), max_size=9))
def test_any_frames_parse_without_raising(frames: list[bytes]) -> None:
    message = emqp.parse(frames)
    if isinstance(message, Message):
        for parse_body in (emqp.parse_inform, emqp.parse_request, emqp.parse_worker_reply, emqp.parse_schedule,
                           emqp.parse_publish):
            parse_body(message.body)
        emqp.parse_headers(frames[-1])
        emqp.queue_name(frames[-1])
    else:
        assert len(frames) < 5 or frames[1] != b"" or frames[2] != b"eMQP/1.0"


@given(st.binary(max_size=24), st.sampled_from([b"READY", b"REQUEST", b"INFORM", b"REPLY"]), st.binary(max_size=24),
       st.lists(st.binary(max_size=24), max_size=6))
def test_what_a_peer_sends_parses_back(identity: bytes, command: bytes, msgid: bytes, body: list[bytes]) -> None:
    assert emqp.parse([identity, *emqp.client_message(command, msgid, *body)]) == Message(identity, command, msgid,
                                                                                          body)
