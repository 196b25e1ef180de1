"""The store's record format (`core/records.py`) as a codec: what is encoded decodes back, with and
without a topic, from any entry on; `scan` finds every intact record around damage."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from polymq.core import records

topics = st.none() | st.text(min_size=0, max_size=40)
u64 = st.integers(0, 2**64 - 1)
i64 = st.integers(0, 2**63 - 1)
entries = st.lists(
    st.tuples(u64, u64, st.integers(0, 2**16 - 1), i64, i64,
              st.dictionaries(st.text(max_size=8), st.text(max_size=8), max_size=3).map(records.encode_headers),
              st.binary(max_size=64)),
    min_size=1, max_size=12,
)


def payload_of(record: bytes) -> memoryview:
    [(_offset, record_type, payload)] = list(records.scan(record))
    assert record_type == records.ADD
    return payload


@given(first=st.integers(0, 2**31), entries=entries, topic=topics, data=st.data())
def test_entries_round_trip_with_their_topic(first: int, entries: list[records.AddEntry], topic: str | None,
                                              data: st.DataObject) -> None:
    payload = payload_of(records.encode_add(first, entries, records.topic_part(topic)))
    skip = data.draw(st.integers(0, len(entries)))
    decoded = list(records.decode_add(payload, skip))
    assert [(e.index, e.id, e.timestamp_ns, e.attempts, e.expires_wall_ns, e.due_wall_ns, e.headers, e.body)
            for e in decoded] == [(first + n, *entry) for n, entry in enumerate(entries)][skip:]
    assert {e.topic for e in decoded} <= {topic}
    assert records.add_head(payload)[:2] == (first, len(entries))


@given(first=st.integers(0, 2**31), first_id=u64.map(lambda n: n // 2), timestamp=u64,
       bodies=st.lists(st.binary(max_size=64), min_size=1, max_size=20), topic=topics, data=st.data())
def test_runs_round_trip_with_their_topic(first: int, first_id: int, timestamp: int, bodies: list[bytes],
                                          topic: str | None, data: st.DataObject) -> None:
    payload = payload_of(records.encode_run(first, first_id, timestamp, bodies, records.topic_part(topic)))
    skip = data.draw(st.integers(0, len(bodies)))
    decoded = list(records.decode_add(payload, skip))
    assert [(e.index, e.id, e.timestamp_ns, e.body, e.topic) for e in decoded] == [
        (first + n, first_id + n, timestamp, body, topic) for n, body in enumerate(bodies)][skip:]


def test_a_record_without_a_topic_reads_as_before() -> None:
    # Records written before topics were stored have no ADD_HAS_TOPIC flag: topic None, same entries.
    entry: records.AddEntry = (7, 8, 1, 0, 0, b"", b"body")
    payload = payload_of(records.encode_add(3, [entry]))
    assert records.add_head(payload) == (3, 1, 0)
    assert [(e.index, e.id, e.body, e.topic) for e in records.decode_add(payload)] == [(3, 7, b"body", None)]


@given(bodies=st.lists(st.binary(min_size=1, max_size=40), min_size=2, max_size=8), data=st.data())
def test_scan_keeps_every_intact_record_around_damage(bodies: list[bytes], data: st.DataObject) -> None:
    framed = [records.encode_run(n, n, 0, [body], records.topic_part("t")) for n, body in enumerate(bodies)]
    victim = data.draw(st.integers(0, len(framed) - 1))
    spot = data.draw(st.integers(0, len(framed[victim]) - 1))
    damaged = bytearray(framed[victim])
    damaged[spot] ^= 0xFF
    stream = b"".join(framed[:victim]) + bytes(damaged) + b"".join(framed[victim + 1 :])
    damage: list[records.Damage] = []
    found = [next(records.decode_add(payload)).body for _offset, _type, payload in records.scan(stream, 0, damage)]
    assert found == bodies[:victim] + bodies[victim + 1 :]
    assert damage


json_values = st.recursive(st.none() | st.booleans() | st.integers(-2**53, 2**53) | st.text(max_size=12),
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                                                        max_size=3), max_leaves=8)


@given(headers=st.none() | st.dictionaries(st.text(max_size=10), st.text(max_size=20), max_size=4)
       | st.dictionaries(st.text(max_size=6), json_values, max_size=4))
def test_headers_round_trip(headers: object) -> None:
    # The fast paths (string-valued dicts out, `raw_decode` in) agree with JSON for any headers.
    assert records.decode_headers(records.encode_headers(headers)) == headers


@given(headers=st.dictionaries(st.text(max_size=10), st.text(max_size=20), max_size=4))
def test_headers_read_back_from_a_record_in_place(headers: dict[str, str]) -> None:
    encoded = records.encode_headers(headers)
    payload = memoryview(b"head" + encoded + b"body")
    assert records.decode_headers_at(payload, 4, len(encoded)) == (headers if encoded else None)



@given(headers=st.none() | st.dictionaries(st.text(max_size=10), st.text(max_size=20), max_size=4),
       publisher_id=st.binary(max_size=40))
def test_an_entrys_headers_are_json_or_a_publishers_id_never_mistaken(headers: object, publisher_id: bytes) -> None:
    # JSON never starts with the id's mark, so neither is read as the other.
    assert records.decode_entry_headers(records.encode_headers(headers)) == (headers, None)
    assert records.decode_entry_headers(records.PUBLISHER_ID_PREFIX + publisher_id) == (None, publisher_id)
    assert records.encode_headers(headers)[:1] != records.PUBLISHER_ID_PREFIX

def test_header_bytes_that_are_not_json_are_a_value_error() -> None:
    for damaged in (b"\x00{", b"}", b"{\"a\":"):
        with pytest.raises(ValueError):
            records.decode_headers(damaged)
        with pytest.raises(ValueError):
            records.decode_headers_at(memoryview(b"x" + damaged + b"body"), 1, len(damaged))


def test_the_quoted_header_names_kept_stay_bounded() -> None:
    # Names a client chose (eMQP's, a stream writer's) must not grow the encoder's cache for ever.
    for number in range(records.QUOTED_NAMES_KEPT * 2 + 1):
        headers = {f"name {number}": "value"}
        assert records.decode_headers(records.encode_headers(headers)) == headers
        assert len(records._QUOTED_NAMES) <= records.QUOTED_NAMES_KEPT
