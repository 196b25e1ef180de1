"""The PZQ codec: the original's producer answers frame for frame, deliveries, consumer answers,
delivery keys, the monitor text, and the reversible joining of body frames (with hypothesis)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from polymq.codecs import pzq
from polymq.codecs.pzq import ConsumerAck, Ignored, Produce, ProduceRefused


@pytest.mark.parametrize(("frames", "parsed"), [
    ([b"id", b"", b"b1"], Produce(b"id", [b"b1"])),
    ([b"id", b"h1", b"h2", b"", b"b1", b"b2"], Produce(b"id", [b"b1", b"b2"])),  # headers dropped
    ([b"", b"", b"b1"], Produce(b"", [b"b1"])),  # an empty id is an id
    ([b"id", b"", b"b1", b"", b"b3"], Produce(b"id", [b"b1", b"", b"b3"])),  # later empty frames are body
    ([b"id", b"data"], ProduceRefused(b"id", b"Malformed message, no delimiter found or missing message parts")),
    ([b"id"], ProduceRefused(b"id", b"Malformed message, no delimiter found or missing message parts")),
    ([b"id", b""], ProduceRefused(b"id", b"Trying to save empty message")),
    ([], Ignored("a producer message without any frame")),
])
def test_a_producer_message_as_the_original_reads_it(frames: list[bytes], parsed: object) -> None:
    assert pzq.parse_produce(frames) == parsed


def test_producer_answers_and_deliveries_frame_for_frame() -> None:
    assert pzq.producer_ack(b"id") == [b"id", b"1", b""]
    assert pzq.producer_refusal(b"id", pzq.EMPTY) == [b"id", b"0", b"", b"Trying to save empty message"]
    key = pzq.delivery_key(0x1A2B)
    assert key == b"0000000000001a2b" and pzq.parse_key(key) == 0x1A2B
    assert pzq.delivery(key, 1795313967964098, 5_000_000, [b"b1", b"b2"]) == [
        key, b"1795313967964098", b"5000000", b"", b"b1", b"b2"]


@pytest.mark.parametrize(("frames", "answer"), [
    ([b"k", b"1"], ConsumerAck(b"k", True)),
    ([b"k", b"0"], ConsumerAck(b"k", False)),
    ([b"k", b"no"], ConsumerAck(b"k", False)),  # anything but 1 asks for it again
    ([b"k", b"1", b"extra"], ConsumerAck(b"k", True)),
    ([b"k"], Ignored("a consumer answer of 1 frame(s), without a status")),
])
def test_a_consumer_answer(frames: list[bytes], answer: object) -> None:
    assert pzq.parse_consumer_ack(frames) == answer


@pytest.mark.parametrize("key", [b"1795313967964098|f3717dc8-0000", b"0000000000001a2b|1", b"0000000000001A2B",
                                 b"000000000001a2b", b"00000000000001a2b", b"0000000000001a2g", b"", b"|1"])
def test_keys_of_nobody_s_making_name_no_message(key: bytes) -> None:
    assert pzq.parse_key(key) is None


def test_the_monitor_text_has_the_six_keys_in_order() -> None:
    values = {"messages": 3, "messages_inflight": 1, "db_size": 4096, "inflight_db_size": 100, "syncs": 7,
              "expired_messages": 2}
    text = pzq.monitor_text(values)
    assert text == (b"messages: 3\nmessages_inflight: 1\ndb_size: 4096\ninflight_db_size: 100\nsyncs: 7\n"
                    b"expired_messages: 2\n")
    assert pzq.parse_monitor_text(text) == values
    assert pzq.is_monitor_request([b"", b"MONITOR"]) and pzq.is_monitor_request([b"MONITOR"])
    assert not pzq.is_monitor_request([b"MONITOR", b"x"]) and not pzq.is_monitor_request([])


def test_frames_are_joined_into_one_body_only_when_there_are_several() -> None:
    assert pzq.join_frames([b"plain"]) == b"plain"
    assert pzq.join_frames([b"a", b"", b"bc"]) == b"pzq-frames:1:a,0:,2:bc,"
    assert pzq.join_frames([b"pzq-frames:x"]) == b"pzq-frames:12:pzq-frames:x,"  # a look-alike is escaped
    assert pzq.split_frames(b"pzq-frames:1:a,0:,2:bc,") == [b"a", b"", b"bc"]
    for not_joined in (b"plain", b"pzq-frames:", b"pzq-frames:2:a,", b"pzq-frames:x:a,", b"pzq-frames:1:ab"):
        assert pzq.split_frames(not_joined) == [not_joined]


@given(st.lists(st.binary(max_size=40), min_size=1, max_size=8))
def test_splitting_a_joined_body_gives_the_frames_back(frames: list[bytes]) -> None:
    assert pzq.split_frames(pzq.join_frames(frames)) == frames


@given(st.binary(max_size=200))
def test_any_body_splits_without_raising(body: bytes) -> None:
    frames = pzq.split_frames(body)
    assert frames and (frames == [body] or body.startswith(pzq.FRAMES_PREFIX))


@given(st.lists(st.binary(max_size=30), max_size=8))
def test_any_producer_frames_parse_without_raising(frames: list[bytes]) -> None:
    parsed = pzq.parse_produce(frames)
    if isinstance(parsed, Produce):
        assert parsed.producer_id == frames[0] and parsed.bodies and b"" in frames[1:]
    elif isinstance(parsed, ProduceRefused):
        assert parsed.reason in (pzq.MALFORMED, pzq.EMPTY) and parsed.producer_id == frames[0]
    else:
        assert frames == []


@given(st.lists(st.binary(max_size=30), max_size=5))
def test_any_consumer_answer_parses_without_raising(frames: list[bytes]) -> None:
    answer = pzq.parse_consumer_ack(frames)
    assert isinstance(answer, ConsumerAck) == (len(frames) >= 2)
    if isinstance(answer, ConsumerAck):
        assert answer.done == (frames[1] == b"1")
        pzq.parse_key(answer.key)  # any key: a delivery of ours or None, never an exception
