"""Properties of the PHPMQ codec under hypothesis: any chunking reads the same messages, what the
writers write reads back, and no input whatever makes the reader raise."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from polymq.codecs import phpmq
from polymq.codecs.phpmq import NEED_DATA, ClientConnection, ProtocolError, ServerConnection

queue_names = st.text(min_size=1, max_size=40).filter(lambda name: len(name.encode()) <= phpmq.MAX_QUEUE_NAME)
contents = st.binary(max_size=300)
message_ids = st.integers(min_value=0, max_value=2**64 - 1).map(phpmq.format_message_id)
ttls = st.integers(min_value=1, max_value=10**9)

requests = st.one_of(
    st.builds(phpmq.Send, queue_names, contents, st.none() | ttls),
    st.builds(phpmq.Consume, queue_names, st.integers(min_value=0, max_value=10**6)),
    st.builds(phpmq.Ack, queue_names, message_ids),
    st.builds(phpmq.Requeue, queue_names, message_ids, ttls),
    st.builds(phpmq.DeadLetter, queue_names, message_ids),
)


def encode(request: object) -> bytes:
    if isinstance(request, phpmq.Send):
        return phpmq.send(request.queue.encode(), request.content, request.ttl)
    if isinstance(request, phpmq.Consume):
        return phpmq.consume(request.queue.encode(), request.count)
    if isinstance(request, phpmq.Ack):
        return phpmq.ack(request.queue.encode(), request.message_id)
    if isinstance(request, phpmq.Requeue):
        assert request.ttl is not None
        return phpmq.requeue(request.queue.encode(), request.message_id, request.ttl)
    assert isinstance(request, phpmq.DeadLetter)
    return phpmq.dead_letter(request.queue.encode(), request.message_id)


def chunked(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({cut % (len(data) + 1) for cut in cuts})
    return [data[start:end] for start, end in zip([0, *points], [*points, len(data)], strict=True)]


def read_all(connection: ServerConnection | ClientConnection, pieces: list[bytes]) -> list[object]:
    out: list[object] = []
    for piece in pieces:
        connection.receive_data(piece)
        while (event := connection.next_event()) is not NEED_DATA:
            out.append(event)
            if isinstance(event, ProtocolError):
                return out
    return out


@settings(max_examples=300)
@given(st.lists(requests, max_size=8), st.lists(st.integers(min_value=0), max_size=12))
def test_any_chunking_reads_back_what_was_written(written: list[object], cuts: list[int]) -> None:
    data = b"".join(map(encode, written))
    assert read_all(ServerConnection(), chunked(data, cuts)) == written


@settings(max_examples=200)
@given(st.lists(st.tuples(queue_names, contents, message_ids, st.none() | st.integers(min_value=0, max_value=10**9)),
                max_size=6), st.lists(st.integers(min_value=0), max_size=8))
def test_deliveries_of_both_generations_read_back(written: list[tuple[str, bytes, bytes, int | None]],
                                                   cuts: list[int]) -> None:
    data = b"".join(phpmq.delivery(queue.encode(), content, message_id, ttl)
                    for queue, content, message_id, ttl in written)
    got = read_all(ClientConnection(), chunked(data, cuts))
    assert got == [phpmq.Delivery(*item) for item in written]


@settings(max_examples=500)
@given(st.binary(max_size=400), st.lists(st.integers(min_value=0), max_size=6))
def test_garbage_never_raises_and_an_error_is_final(garbage: bytes, cuts: list[int]) -> None:
    connection = ServerConnection(max_content=64)
    got = read_all(connection, chunked(garbage, cuts))
    if got and isinstance(got[-1], ProtocolError):
        error = got[-1]
        connection.receive_data(phpmq.send(b"Q", b"after"))
        assert connection.next_event() is error


@settings(max_examples=200)
@given(st.lists(requests, min_size=1, max_size=4), st.binary(min_size=1, max_size=40))
def test_garbage_after_good_messages_keeps_the_good_ones(written: list[object], garbage: bytes) -> None:
    data = b"".join(map(encode, written)) + garbage
    got = read_all(ServerConnection(), [data])
    assert got[: len(written)] == written
