"""Hypothesis property tests of the MQKS codec: framing, the reversible body encoding, request/response round trips
between the client and server codecs, and `--remove-mask` against an independent reference matcher."""

from __future__ import annotations

import base64
import functools
import itertools
import re

from hypothesis import assume, given
from hypothesis import strategies as st

from polymq.codecs import mqks
from polymq.codecs import mqks_client as client

# What `bytes.rstrip()` strips: a name must not end the line with one of these.
ASCII_WHITESPACE = " \t\n\r\x0b\x0c"

# Ids, queues and events: no space, TAB, newline (the protocol's own rule), valid UTF-8, no leading `--` (a flag).
names = st.text(
    alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters=ASCII_WHITESPACE),
    min_size=1,
    max_size=12,
).filter(lambda name: not name.startswith("--"))
# Events in delivery props: also no `,` (it separates props; the original has the same limit).
prop_events = names.filter(lambda name: "," not in name)
when_unused = st.one_of(
    st.none(), st.just(True), st.floats(min_value=0, max_value=1e9, allow_nan=False, allow_infinity=False)
)

# Lines of every kind, valid or not, to build streams from.
LINE_PIECES = [
    b"m1 publish e1 hello world",
    b"pg1 ping x",
    b"pg4 ping --confirm x",
    b"c1 consume q1 e1 --add e2 --delete-queue-when-unused=5 --manual-ack",
    b"rb1 rebind q1 --remove e1 --remove-mask e5.*.a1 --add e8",
    b"a1 ack c1 --all",
    b"a2 ack c1 m1",  # plain acks: a run of them is one `Acks`
    b"a3 ack c2 m 2",
    b"a4 ack --confirm c1 m1",
    b"dq9 delete_queue",
    b"x2  publish e1 d",
    b"pg1 ping a\tb",
    b"\xff\xfe ping x",
    b"m1 publish e1 polymq:base64:!!",
    b"",
    b" ",
    b"\r",
    b"\t",
    b"x" * 40,
    b"id " + b"y" * 700,
]
stream_parts = st.one_of(st.sampled_from(LINE_PIECES), st.sampled_from([b"\n", b"\r\n", b" "]), st.binary(max_size=40))
streams = st.lists(stream_parts, max_size=20).map(b"".join)
limits = st.sampled_from([1, 8, 32, 600, mqks.MAX_LINE_LENGTH])


def split_at(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({min(cut, len(data)) for cut in cuts})
    return [data[start:end] for start, end in zip([0, *points], [*points, len(data)], strict=True)]


def each_line(events: list[mqks.Request]) -> list[mqks.Request]:
    """The events one per line: a run of acks (`Acks`) as its `Ack`s, which depend on how a read splits the run."""
    return [one for event in events for one in (event.each() if isinstance(event, mqks.Acks) else [event])]


def events_at_once(data: bytes, limit: int) -> list[mqks.Request]:
    conn = mqks.ServerConnection(limit)
    conn.receive_data(data)
    conn.receive_data(b"")
    return each_line(conn.next_events())


# ---------------------------------------------------------------------------------------------
# Framing


@given(
    data=streams,
    cuts=st.lists(st.integers(min_value=0, max_value=2000), max_size=12),
    limit=limits,
    take=st.lists(st.booleans(), min_size=13, max_size=13),
)
def test_any_chunking_gives_the_same_events_as_feeding_at_once(
    data: bytes, cuts: list[int], limit: int, take: list[bool]
) -> None:
    conn = mqks.ServerConnection(limit)
    events: list[mqks.Request] = []
    for chunk, take_now in zip(split_at(data, cuts), take, strict=False):
        conn.receive_data(chunk)
        if take_now:  # a reader may take the events after any chunk, or only later
            events += conn.next_events()
    conn.receive_data(b"")
    events += conn.next_events()
    assert each_line(events) == events_at_once(data, limit)


@given(data=st.binary(max_size=2000), cuts=st.lists(st.integers(min_value=0, max_value=2000), max_size=8), limit=limits)
def test_arbitrary_bytes_never_raise(data: bytes, cuts: list[int], limit: int) -> None:
    conn = mqks.ServerConnection(limit)
    events: list[mqks.Request] = []
    for chunk in split_at(data, cuts):
        conn.receive_data(chunk)
        events += conn.next_events()
    conn.receive_data(b"")
    events += conn.next_events()
    assert all(isinstance(event, mqks.Request) for event in events)
    assert conn.next_events() == []


@given(
    lines=st.lists(st.binary(max_size=60).filter(lambda line: b"\n" not in line), max_size=15),
    last=st.binary(max_size=60).filter(lambda line: b"\n" not in line),
    limit=limits,
)
def test_every_complete_line_gives_exactly_one_event(lines: list[bytes], last: bytes, limit: int) -> None:
    conn = mqks.ServerConnection(limit)
    conn.receive_data(b"".join(line + b"\n" for line in lines) + last)
    complete = conn.next_events()
    too_long_last = len(last) > limit  # answered as soon as it is known to be too long
    assert len(each_line(complete)) == len(lines) + too_long_last
    conn.receive_data(b"")
    # At EOF the last line without `\n` counts too, once.
    assert len(conn.next_events()) == (1 if last and not too_long_last else 0)


@given(lines=st.lists(st.binary(max_size=60).filter(lambda line: b"\n" not in line), max_size=15))
def test_each_line_is_parsed_on_its_own(lines: list[bytes]) -> None:
    events = events_at_once(b"".join(line + b"\n" for line in lines), mqks.MAX_LINE_LENGTH)
    assert events == [mqks.parse_line(line) for line in lines]


ack_fields = st.one_of(names.map(str.encode), st.sampled_from([b"", b"--all", b"--confirm", b"m 1", b"m1 ", b"\xff",
                                                                b"a\tb", b"m\r"]))


@given(request_id=ack_fields, action=st.sampled_from([b"ack", b"reject", b"ack "]), consumer_id=ack_fields,
       msg_id=ack_fields)
def test_a_plain_ack_is_the_ack_parse_line_makes(request_id: bytes, action: bytes, consumer_id: bytes,
                                                msg_id: bytes) -> None:
    line = b" ".join([request_id, action, consumer_id, msg_id])
    fields = mqks.plain_ack(line)
    if fields is not None:
        assert mqks.parse_line(line) == mqks.Ack(*fields, False)
    else:  # only an ack with a confirm, `--all` or trailing whitespace (rstripped) is left to `parse_line`
        parsed = mqks.parse_line(line)
        assert not isinstance(parsed, mqks.Ack) or parsed.confirm or parsed.msg_id is None or line != line.rstrip()


@given(lines=st.lists(st.sampled_from([b"a1 ack c1 m1", b"a2 ack c2 m2", b"a3 ack c1 --all", b"p1 ping x"]),
                      max_size=15))
def test_runs_of_plain_acks_are_one_event(lines: list[bytes]) -> None:
    conn = mqks.ServerConnection()
    conn.receive_data(b"".join(line + b"\n" for line in lines))
    events = conn.next_events()
    assert each_line(events) == [mqks.parse_line(line) for line in lines]
    # No two events in a row are acks a run would have joined.
    plain = [isinstance(event, mqks.Acks) or (isinstance(event, mqks.Ack) and not event.confirm
                                              and event.msg_id is not None) for event in events]
    assert not any(first and second for first, second in itertools.pairwise(plain))


# ---------------------------------------------------------------------------------------------
# Reversible body encoding

bodies = st.one_of(
    st.binary(max_size=200),
    st.text(max_size=100).map(str.encode),
    st.sampled_from(
        [b"", b" ", b"x ", b"\t", b"polymq:base64:", b"polymq:base64:aGk=", b"\xc2\x85", b"a\xe2\x80\xa8b"]
    ),
)
UNSAFE = re.compile(rb"[\x00-\x1f\x7f]")


@given(body=bodies)
def test_encode_body_round_trips(body: bytes) -> None:
    encoded = mqks.encode_body(body)
    assert client.decode_body(encoded) == body
    assert mqks.decode_data(encoded) == body


@given(body=bodies)
def test_encoded_body_survives_an_mqks_line(body: bytes) -> None:
    encoded = mqks.encode_body(body)
    assert encoded  # publish and ping need data
    assert UNSAFE.search(encoded) is None  # no \n, \r, \t or other control character
    assert not encoded.endswith(b" ")
    assert encoded == encoded.rstrip()
    text = encoded.decode()  # always UTF-8, and one line for any line splitter
    assert text.splitlines() == [text]
    # Through the server: publish parses back to the body.
    assert mqks.parse_line(b"m1 publish e1 " + encoded) == mqks.Publish("m1", "e1", body, False)


safe_text = st.text(
    alphabet=st.characters(blacklist_categories=("Cc", "Cs"), blacklist_characters="\u2028\u2029"), min_size=1
).filter(lambda text: not text.endswith(" ") and not text.startswith("polymq:base64:"))


@given(text=safe_text)
def test_safe_text_is_sent_verbatim(text: str) -> None:
    assert mqks.encode_body(text.encode()) == text.encode()
    assert client.publish_data(text.encode()) == text.encode()


@given(body=st.binary(min_size=1, max_size=100))
def test_encoded_form_is_the_prefix_and_base64(body: bytes) -> None:
    encoded = mqks.encode_body(body)
    if encoded != body:
        assert encoded == mqks.ENCODED_PREFIX + base64.b64encode(body)


# ---------------------------------------------------------------------------------------------
# Client request -> server request


@given(request_id=names, event=names, body=bodies, confirm=st.booleans())
def test_publish_round_trip(request_id: str, event: str, body: bytes, confirm: bool) -> None:
    line = client.request(request_id, "publish", event.encode() + b" " + client.publish_data(body), confirm=confirm)
    assert mqks.parse_line(line.rstrip(b"\n")) == mqks.Publish(request_id, event, body, confirm)


@given(
    request_id=names,
    queue=names,
    replace=st.lists(names, max_size=4),
    add=st.lists(names, max_size=4),
    delete_when_unused=when_unused,
    manual_ack=st.booleans(),
    confirm=st.booleans(),
)
def test_consume_round_trip(
    request_id: str,
    queue: str,
    replace: list[str],
    add: list[str],
    delete_when_unused: bool | float | None,
    manual_ack: bool,
    confirm: bool,
) -> None:
    parts = [queue, *replace]
    if add:
        parts += ["--add", *add]
    if delete_when_unused is True:
        parts.append("--delete-queue-when-unused")
    elif delete_when_unused is not None:
        parts.append(f"--delete-queue-when-unused={delete_when_unused!r}")
    if manual_ack:
        parts.append("--manual-ack")
    event = mqks.parse_line(client.request(request_id, "consume", " ".join(parts), confirm=confirm)[:-1])
    assert event == mqks.Consume(request_id, queue, tuple(replace), tuple(add), delete_when_unused, manual_ack, confirm)
    assert isinstance(event, mqks.Consume)
    assert type(event.delete_when_unused) is type(delete_when_unused)


@given(
    request_id=names,
    queue=names,
    sections=st.fixed_dictionaries(
        {
            "": st.lists(names, max_size=3),
            "--remove": st.lists(names, max_size=3),
            "--remove-mask": st.lists(names, max_size=3),
            "--add": st.lists(names, max_size=3),
        }
    ),
    order=st.permutations(["--remove", "--remove-mask", "--add"]),
    confirm=st.booleans(),
)
def test_rebind_round_trip(
    request_id: str, queue: str, sections: dict[str, list[str]], order: list[str], confirm: bool
) -> None:
    parts = [queue, *sections[""]]
    for flag in order:
        if sections[flag]:
            parts += [flag, *sections[flag]]
    assume(len(parts) > 1)  # `rebind q1` alone is an error
    event = mqks.parse_line(client.request(request_id, "rebind", " ".join(parts), confirm=confirm)[:-1])
    assert event == mqks.Rebind(
        request_id,
        queue,
        tuple(sections[""]),
        tuple(sections["--remove"]),
        tuple(sections["--remove-mask"]),
        tuple(sections["--add"]),
        confirm,
    )


@given(
    request_id=names, consumer_id=names, msg_id=st.one_of(st.none(), names), confirm=st.booleans(), reject=st.booleans()
)
def test_ack_and_reject_round_trip(
    request_id: str, consumer_id: str, msg_id: str | None, confirm: bool, reject: bool
) -> None:
    action, cls = ("reject", mqks.Reject) if reject else ("ack", mqks.Ack)
    line = client.request(request_id, action, f"{consumer_id} {msg_id or '--all'}", confirm=confirm)
    assert mqks.parse_line(line[:-1]) == cls(request_id, consumer_id, msg_id, confirm)


@given(request_id=names, name=names, confirm=st.booleans())
def test_delete_round_trip(request_id: str, name: str, confirm: bool) -> None:
    line = client.request(request_id, "delete_queue", name, confirm=confirm)
    assert mqks.parse_line(line[:-1]) == mqks.DeleteQueue(request_id, name, confirm)
    line = client.request(request_id, "delete_consumer", name, confirm=confirm)
    assert mqks.parse_line(line[:-1]) == mqks.DeleteConsumer(request_id, name, confirm)


ping_data = st.binary(min_size=1, max_size=60).filter(
    lambda data: (
        b"\n" not in data and b"\t" not in data and data == data.rstrip() and not data.startswith(b"--confirm ")
    )
)


@given(request_id=names, data=ping_data, confirm=st.booleans())
def test_ping_round_trip(request_id: str, data: bytes, confirm: bool) -> None:
    line = client.request(request_id, "ping", data, confirm=confirm)
    assert mqks.parse_line(line[:-1]) == mqks.Ping(request_id, data)
    # And the answer echoes it back.
    answer = client.parse_response(mqks.ok_line(request_id, data)[:-1])
    assert answer == client.Response(request_id, True, data)


@given(request_id=names, error=st.from_regex(r"\d{20}[0-9A-Za-z]{4}", fullmatch=True))
def test_error_line_round_trip(request_id: str, error: str) -> None:
    assert client.parse_response(mqks.error_line(request_id, error)[:-1]) == client.Response(
        request_id, False, error.encode()
    )


# ---------------------------------------------------------------------------------------------
# Server responses -> client


@given(
    consumer_id=names,
    msg_id=names,
    event=prop_events,
    retry=st.integers(min_value=0, max_value=10**9),
    body=bodies,
    cuts=st.lists(st.integers(min_value=0, max_value=400), max_size=5),
)
def test_delivery_round_trip(
    consumer_id: str, msg_id: str, event: str, retry: int, body: bytes, cuts: list[int]
) -> None:
    line = mqks.delivery_line(consumer_id.encode(), msg_id.encode(), event.encode(), retry, body)
    reader = client.LineReader()
    lines = [got for chunk in split_at(line, cuts) for got in reader.feed(chunk)]
    assert len(lines) == 1
    response = client.parse_response(lines[0])
    assert (response.request_id, response.ok) == (consumer_id, True)
    assert not client.is_update(response.data)
    delivery = client.parse_delivery(response.data)
    assert (delivery.msg_id, delivery.event, delivery.retry, delivery.body) == (msg_id, event, retry, body)
    assert delivery.props == ({"event": event, "retry": str(retry)} if retry else {"event": event})


@given(
    consumer_id=names,
    queue=names,
    events=st.lists(names, max_size=5),
    delete_when_unused=when_unused,
    manual_ack=st.booleans(),
)
def test_update_round_trip(
    consumer_id: str, queue: str, events: list[str], delete_when_unused: bool | float | None, manual_ack: bool
) -> None:
    line = mqks.update_line(consumer_id, queue, events, delete_when_unused, manual_ack)
    assert line.count(b"\n") == 1
    assert line.endswith(b"\n")
    response = client.parse_response(line[:-1])
    assert (response.request_id, response.ok) == (consumer_id, True)
    assert client.is_update(response.data)
    update = client.parse_update(response.data)
    assert (update.queue, update.events, update.manual_ack) == (queue, tuple(sorted(events)), manual_ack)
    assert update.delete_when_unused == delete_when_unused
    assert type(update.delete_when_unused) is type(delete_when_unused)
    # The line the client re-sends on reconnect consumes the same thing.
    resent = mqks.parse_line(client.request("c2", "consume", update.line)[:-1])
    assert resent == mqks.Consume("c2", queue, tuple(sorted(events)), (), delete_when_unused, manual_ack, False)


# ---------------------------------------------------------------------------------------------
# --remove-mask against a reference matcher


def reference_match(mask: str, event: str) -> bool:
    """docs/protocols/mqks.md without regular expressions: pieces literal, `*` = zero or more non-dot characters."""
    if "." not in event:
        return False
    pieces = mask.split("*")

    @functools.cache
    def match(index: int, pos: int) -> bool:
        piece = pieces[index]
        if not event.startswith(piece, pos):
            return False
        pos += len(piece)
        if index == len(pieces) - 1:
            return pos == len(event)  # anchored at the end
        while True:  # let this `*` take 0, 1, 2, … non-dot characters
            if match(index + 1, pos):
                return True
            if pos == len(event) or event[pos] == ".":
                return False
            pos += 1

    return match(0, 0)


mask_text = st.text(alphabet="ab.*+?[\\", max_size=8)
event_text = st.text(alphabet="ab.+?[\\", max_size=8)


@given(events=st.sets(event_text, max_size=8), masks=st.lists(mask_text, max_size=3))
def test_mask_agrees_with_reference(events: set[str], masks: list[str]) -> None:
    expected = {event for event in events if any(reference_match(mask, event) for mask in masks)}
    assert mqks.masked(events, masks) == expected


@given(event=event_text, mask=mask_text)
def test_mask_single_agrees_with_reference(event: str, mask: str) -> None:
    assert (event in mqks.masked({event}, [mask])) == reference_match(mask, event)


def test_reference_matcher_examples() -> None:
    # The reference itself against docs/protocols/mqks.md, so a wrong reference cannot make the properties vacuous.
    assert reference_match("e4.*.y", "e4.x.y")
    assert reference_match("e4.*.y", "e4..y")
    assert not reference_match("e3.*", "e3.123.c")
    assert reference_match("*.updated", "user.updated")
    assert not reference_match("*", "abc")
    assert reference_match("*.*.deleted", "category.subcategory.deleted")
    assert not reference_match("*.*.deleted", "a.b.c.deleted")
