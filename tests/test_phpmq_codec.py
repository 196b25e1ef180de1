"""The PHPMQ codec: exact bytes of both protocol generations, and a clear error for every framing fault."""

from __future__ import annotations

import pytest

from polymq.codecs import phpmq
from polymq.codecs.phpmq import (
    NEED_DATA,
    Ack,
    ClientConnection,
    Consume,
    DeadLetter,
    Delivery,
    ProtocolError,
    Requeue,
    Send,
    ServerConnection,
)

# The protocol library's own encodings (its unit tests; docs/protocols/phpmq.md).
SEND_PINNED = b"H0100102P0100000000000000000000000000003FooP0200000000000000000000000000011Hello World"
CONSUME = b"H0100202P0100000000000000000000000000003FooP04000000000000000000000000000015"
DELIVERY_PINNED = (b"H0100303P0100000000000000000000000000003FooP0200000000000000000000000000011Hello World"
                   b"P0300000000000000000000000000032d7e7f68761d34838494b233148b5486c")
ACK = b"H0100402P0100000000000000000000000000003FooP0300000000000000000000000000032d7e7f68761d34838494b233148b5486c"
SEND_WITH_TTL = (b"H0100103P0100000000000000000000000000003FooP0200000000000000000000000000011Hello World"
                 b"P05000000000000000000000000000043600")
REQUEUE = (b"H0100503P0100000000000000000000000000003Foo"
           b"P0300000000000000000000000000032d7e7f68761d34838494b233148b5486c"
           b"P05000000000000000000000000000043600")
DEAD_LETTER = (b"H0100602P0100000000000000000000000000003Foo"
               b"P0300000000000000000000000000032d7e7f68761d34838494b233148b5486c")
MESSAGE_ID = b"d7e7f68761d34838494b233148b5486c"


def events(data: bytes, connection: ServerConnection | None = None) -> list[object]:
    connection = connection or ServerConnection()
    connection.receive_data(data)
    out = []
    while (event := connection.next_event()) is not NEED_DATA:
        out.append(event)
        if isinstance(event, ProtocolError):
            break
    return out


def error_of(data: bytes, **limits: int) -> str:
    found = events(data, ServerConnection(**limits))
    assert found and isinstance(found[-1], ProtocolError), found
    return found[-1].reason


def test_the_client_messages_of_both_generations() -> None:
    assert events(SEND_PINNED + CONSUME + ACK) == [
        Send("Foo", b"Hello World", None), Consume("Foo", 5), Ack("Foo", MESSAGE_ID)]
    assert events(SEND_WITH_TTL + REQUEUE + DEAD_LETTER) == [
        Send("Foo", b"Hello World", 3600), Requeue("Foo", MESSAGE_ID, 3600), DeadLetter("Foo", MESSAGE_ID)]


@pytest.mark.parametrize(("data", "current"), [(SEND_PINNED + CONSUME + ACK, False), (SEND_WITH_TTL, True),
                                               (REQUEUE, True), (DEAD_LETTER, True)])
def test_a_connection_shows_its_generation_by_what_it_sends(data: bytes, current: bool) -> None:
    connection = ServerConnection()
    events(data, connection)
    assert connection.current_generation is current


def test_the_writers_produce_the_library_s_bytes() -> None:
    assert phpmq.send(b"Foo", b"Hello World") == SEND_PINNED
    assert phpmq.send(b"Foo", b"Hello World", 3600) == SEND_WITH_TTL
    assert phpmq.consume(b"Foo", 5) == CONSUME
    assert phpmq.ack(b"Foo", MESSAGE_ID) == ACK
    assert phpmq.requeue(b"Foo", MESSAGE_ID, 3600) == REQUEUE
    assert phpmq.dead_letter(b"Foo", MESSAGE_ID) == DEAD_LETTER
    assert phpmq.delivery(b"Foo", b"Hello World", MESSAGE_ID, None) == DELIVERY_PINNED
    assert phpmq.delivery(b"Foo", b"Hello World", MESSAGE_ID, 3300) == (
        b"H0100304" + DELIVERY_PINNED[8:] + b"P05000000000000000000000000000043300")


def test_a_client_reads_deliveries_of_both_generations() -> None:
    client = ClientConnection()
    client.receive_data(DELIVERY_PINNED + phpmq.delivery(b"Foo", b"x", MESSAGE_ID, 0))
    assert client.next_event() == Delivery("Foo", b"Hello World", MESSAGE_ID, None)
    assert client.next_event() == Delivery("Foo", b"x", MESSAGE_ID, 0)
    assert client.next_event() is NEED_DATA


def test_contents_are_raw_bytes_of_any_length_and_packets_are_keyed_by_type() -> None:
    body = bytes(range(256)) * 300 + b"H0100102P01"  # framing look-alikes inside a content are content
    out_of_order = phpmq.message(1, [(phpmq.PacketType.CONTENT, body), (phpmq.PacketType.QUEUE, b"Q")])
    assert events(out_of_order) == [Send("Q", body, None)]
    twice = phpmq.message(2, [(1, b"A"), (1, b"B")])  # a repeated type replaces (as the original's readers)
    assert error_of(twice) == "message 002 without packet 04"
    assert events(phpmq.message(1, [(1, b"Q"), (2, b"")])) == [Send("Q", b"", None)]


def test_one_byte_at_a_time() -> None:
    connection = ServerConnection()
    got = []
    for byte in SEND_WITH_TTL + CONSUME + DEAD_LETTER:
        connection.receive_data(bytes([byte]))
        while (event := connection.next_event()) is not NEED_DATA:
            got.append(event)
    assert got == [Send("Foo", b"Hello World", 3600), Consume("Foo", 5), DeadLetter("Foo", MESSAGE_ID)]
    assert not connection.pending


def test_pending_says_a_message_is_cut() -> None:
    connection = ServerConnection()
    connection.receive_data(SEND_PINNED[:20])
    assert connection.next_event() is NEED_DATA and connection.pending


@pytest.mark.parametrize(("count", "window"), [(b"5", 5), (b"0", 0), (b"-3", -3), (b"abc", 0), (b"12abc", 12),
                                               (b" 7", 7), (b"", 0)])
def test_the_count_is_cast_as_php_casts_it(count: bytes, window: int) -> None:
    assert events(phpmq.message(2, [(1, b"Foo"), (4, count)])) == [Consume("Foo", window)]


@pytest.mark.parametrize(("ttl", "seconds"), [(b"3600", 3600), (b"0", None), (b"-5", None), (b"x", None)])
def test_a_ttl_of_zero_or_less_is_no_ttl(ttl: bytes, seconds: int | None) -> None:
    assert events(phpmq.message(1, [(1, b"Foo"), (2, b"b"), (5, ttl)])) == [Send("Foo", b"b", seconds)]


@pytest.mark.parametrize(("data", "reason"), [
    (b"X0100102", "not a message header: b'X0100102'"),
    (b"H01001a2", "not a message header: b'H01001a2'"),
    (b"H0200102", "unsupported protocol version 02 in b'H0200102'"),
    (b"H0100902", "message type 009 is not a PHPMQ message type"),
    (DELIVERY_PINNED, "message type 003 is not sent by this side"),
    (b"H0100104", "message 001 announces 4 packets (it carries 2 or 3)"),
    (b"H0100101", "message 001 announces 1 packets (it carries 2 or 3)"),
    (b"H0100203", "message 002 announces 3 packets (it carries 2)"),
    (b"H0100102Q0100000000000000000000000000003Foo", "not a packet header: b'Q0100000000000000000000000000003'"),
    (b"H0100102P010000000000000000000000000000xFoo", "not a packet header: b'P010000000000000000000000000000x'"),
    (b"H0100102P0900000000000000000000000000003Foo", "packet type 09 is not a PHPMQ packet type"),
    (phpmq.message(1, [(1, b"Foo"), (5, b"60")]), "message 001 without packet 02"),
    (phpmq.message(4, [(1, b"Foo"), (2, b"x")]), "message 004 without packet 03"),
    (phpmq.message(6, [(1, b"Foo"), (5, b"1")]), "message 006 without packet 03"),
    (phpmq.message(1, [(1, b"Foo"), (2, b"x"), (4, b"1")]), "message 001 with packet 04, which it does not carry"),
    (phpmq.message(1, [(1, b""), (2, b"x")]), "a queue name of 0 bytes (1 to 1024)"),
    (phpmq.message(1, [(1, b"Q" * 1025), (2, b"x")]), "a queue name of 1025 bytes (1 to 1024)"),
    (phpmq.message(1, [(1, b"\xff\xfe"), (2, b"x")]), "a queue name that is not UTF-8: b'\\xff\\xfe'"),
])
def test_every_framing_fault_is_a_clear_error(data: bytes, reason: str) -> None:
    assert error_of(data) == reason


def test_a_length_over_the_limit_is_refused_before_its_content_arrives() -> None:
    connection = ServerConnection(max_content=100)
    # Only the headers: the announced 10^28 bytes are never waited for, let alone allocated.
    connection.receive_data(b"H0100102P02" + b"1" + b"0" * 28)
    event = connection.next_event()
    assert isinstance(event, ProtocolError)
    assert event.reason == f"packet 02 of {10**28} bytes is over the limit of 100 bytes"
    assert events(phpmq.send(b"Q", b"x" * 100), ServerConnection(max_content=100)) == [Send("Q", b"x" * 100, None)]


def test_after_an_error_nothing_more_is_read() -> None:
    connection = ServerConnection()
    connection.receive_data(b"garbage!" + SEND_PINNED)
    first = connection.next_event()
    assert isinstance(first, ProtocolError)
    connection.receive_data(SEND_PINNED)
    assert connection.next_event() is first


def test_message_ids_are_32_lowercase_hex_characters() -> None:
    assert phpmq.format_message_id(0x1A2B) == b"00000000000000000000000000001a2b"
    assert phpmq.parse_message_id(b"00000000000000000000000000001a2b") == 0x1A2B
    for bad in (b"1a2b", b"0000000000000000000000000000" + b"1A2B", b"z" * 32, b"0" * 33):
        assert phpmq.parse_message_id(bad) is None
