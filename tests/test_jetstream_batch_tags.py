"""A batch's id tells what its members without headers of their own are (jetstream/api.py `batch_tag`,
`batch_member`): read back exactly for any id, origin and place; anything else is no member."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from polymq.jetstream import api

ids = st.integers(min_value=0, max_value=(1 << 64) - 1)
origins = st.none() | st.sampled_from(["nsq", "mqks", "phpmq", "pzq", "emqp", "http", "trace"])
places = st.integers(min_value=1, max_value=1000)  # nats-server's most messages a batch


@given(ids, origins, places, st.text(alphabet="0123456789abcdef", min_size=1, max_size=12),
       st.integers(min_value=1, max_value=10**9))
def test_a_member_is_read_back_with_the_first_id_plus_its_place_and_the_batchs_origin(
        first: int, origin: str | None, place: int, prefix: str, number: int) -> None:
    headers = {api.HEADER_BATCH_ID: f"{prefix}-{number}{api.batch_tag(first, origin)}",
               api.HEADER_BATCH_SEQUENCE: str(place)}
    assert len(headers[api.HEADER_BATCH_ID]) <= 64  # nats-server's longest batch id
    assert api.batch_member(headers) == (first + place - 1, origin)


@given(st.dictionaries(st.sampled_from([api.HEADER_BATCH_ID, api.HEADER_BATCH_SEQUENCE, "Other"]), st.text()))
def test_headers_of_no_tagged_batch_are_no_member(headers: dict[str, str]) -> None:
    member = api.batch_member(headers)
    if member is not None:  # only a tagged id with a number and a place
        assert api.BATCH_FIRST_MARK in headers[api.HEADER_BATCH_ID]
        assert api.is_number(headers[api.HEADER_BATCH_SEQUENCE])


def test_an_untagged_batch_and_a_message_of_none_are_no_member() -> None:
    assert api.batch_member({api.HEADER_BATCH_ID: "0a1b2c-7", api.HEADER_BATCH_SEQUENCE: "2"}) is None
    assert api.batch_member({api.HEADER_MSG_ID: "12"}) is None
    assert api.batch_member({api.HEADER_BATCH_ID: "0a1b2c-7-id12-nsq"}) is None  # no place
    assert api.batch_member({api.HEADER_BATCH_ID: "0a1b2c-7-id²", api.HEADER_BATCH_SEQUENCE: "1"}) is None
