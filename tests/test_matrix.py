"""The cross-protocol matrix: for every ordered pair of the seven endpoints (publisher, consumer), one
cell publishes a set of bodies and checks what the consumer receives, exactly, against the mapping of
docs/architecture.md and the encodings of docs/protocols/*.md: bodies, ids, attempts, TTLs and
headers where the consumer's protocol shows them.

What cannot be expressed is data here, with its reason, and the docs' table (docs/matrix.md) is
rendered from it: `test_docs_table_is_the_rendered_matrix` keeps the two equal. With
POLYMQ_MATRIX_RESULTS=FILE the run writes its results to FILE as JSON, which
`tools/matrix_table.py FILE --write docs/matrix.md` renders into the page.
"""

from __future__ import annotations

import base64
import importlib.util
import json
import os
import re
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

from polymq.clients import mqks_blocking
from polymq.clients import nsq as nsq_blocking
from polymq.clients.stream import StreamClient, StreamClientError
from polymq.codecs import nsq_client, stream_rows
from polymq.codecs.mqks import MAX_LINE_LENGTH as MQKS_MAX_LINE

from support.gateway import GatewayProcess, running_gateway
from support.matrix_endpoints import (
    EMQP_HEADERS,
    PHPMQ_TTL_S,
    TIMEOUT_S,
    Cell,
    Received,
    Sent,
    admin,
    endpoints,
    mqks_request_id,
    nsq_http_post,
    state_of,
    wait_until,
)

ROOT = Path(__file__).resolve().parent.parent
DOCS_PAGE = ROOT / "docs" / "matrix.md"
RESULTS_VARIABLE = "POLYMQ_MATRIX_RESULTS"

# The endpoints, in the table's order, with their titles.
ENDPOINTS = {
    "nsq-tcp": "NSQ TCP",
    "nsq-http": "NSQ HTTP",
    "mqks": "MQKS",
    "phpmq": "PHPMQ",
    "pzq": "PZQ",
    "emqp": "eMQP",
    "stream": "Spark stream",
}

# The reversible encodings' prefixes, as docs/protocols/mqks.md and docs/protocols/pzq.md write them.
MQKS_PREFIX = b"polymq:base64:"
PZQ_PREFIX = b"pzq-frames:"

# Endpoints that cannot consume, and why.
NO_CONSUMER = {
    "nsq-http": "nsqd's HTTP API only publishes, it has no way to read a message",
}

# 1 MiB: nsqd's --max-msg-size, the largest message NSQ publishers send (and the stream endpoint's
# --stream-max-row-size); PHPMQ, PZQ and eMQP take up to 16 MiB, so 1 MiB is what every pair carries.
LARGE_BYTES = 1024 * 1024

BODIES: dict[str, bytes] = {
    "ascii": b"hello, matrix",
    "utf-8": "zażółć gęślą jaźń, 日本語, 🐢".encode(),
    "all bytes": bytes(range(256)),
    "empty": b"",
    "newline and tab": b"line one\n\tline two\r\n",
    # What an MQKS line would change: trailing whitespace (the original strips it), Unicode line breaks.
    "trailing space": b"ends in a space ",
    "Unicode line breaks": "one\u2028two\u2029three\u0085four".encode(),
    # Bodies that look like the two reversible encodings: MQKS's, and PZQ's form of several frames.
    "MQKS's prefix": b"polymq:base64:aGVsbG8=",
    "PZQ's prefix": b"pzq-frames:5:hello,3:PZQ,",
    # The last: the NSQ publishers send the last body deferred.
    "1 MiB": (bytes(range(256)) * (LARGE_BYTES // 256 + 1))[:LARGE_BYTES],
}
LARGE = "1 MiB"

# Bodies a publisher's protocol cannot send, and why.
# (`test_not_expressible_bodies_are_refused` sends each and sees the refusal.)
NOT_EXPRESSIBLE_BODIES: dict[tuple[str, str], str] = {
    ("nsq-tcp", "empty"): "nsqd refuses a message of 0 bytes in PUB, MPUB and DPUB (`E_BAD_MESSAGE PUB invalid "
                          "message body size 0`)",
    ("nsq-http", "empty"): "nsqd's `/pub` answers 400 `MSG_EMPTY`, a binary `/mpub` refuses a message of 0 bytes "
                           "(413 `BAD_MESSAGE`) and a text `/mpub` skips empty lines",
    ("stream", "empty"): "the stream publish endpoint refuses a row without body bytes (400 `BAD_ROW`: "
                         "`empty body`)",
}


def mqks_large_body(cell: Cell) -> bytes:
    """The largest body an MQKS publish line of this cell carries: the line (`--mqks-max-line`, 1 MiB,
    its newline not counted) less the head `<id> publish --confirm <event> `; printable ASCII, as the
    line carries it verbatim (any other byte would take base64's 4/3)."""
    head = len(f"{mqks_request_id(cell, list(BODIES).index(LARGE))} publish --confirm {cell.topic} ")
    return (bytes(range(33, 127)) * (MQKS_MAX_LINE // 94 + 1))[: MQKS_MAX_LINE - head]


# Notes on a publisher's bodies, shown as the footnotes of its row.
LARGE_NOTES = {
    "mqks": "the large body is the largest an MQKS request line carries: `--mqks-max-line` (1 MiB) less the "
            "request's head (`<id> publish --confirm <event> `), printable ASCII (a line carries other bytes "
            "only in base64, 4/3 as long)",
}


def bodies_of(cell: Cell) -> dict[str, bytes]:
    bodies = {name: body for name, body in BODIES.items() if (cell.publisher, name) not in NOT_EXPRESSIBLE_BODIES}
    if cell.publisher == "mqks":
        bodies[LARGE] = mqks_large_body(cell)
    return bodies


def row_notes(publisher: str) -> list[str]:
    notes = [f"{name} body not expressible: {reason}" for (who, name), reason in NOT_EXPRESSIBLE_BODIES.items()
             if who == publisher]
    if publisher in LARGE_NOTES:
        notes.append(LARGE_NOTES[publisher])
    return notes


CELLS = [Cell(publisher, consumer) for publisher in ENDPOINTS for consumer in ENDPOINTS]


def results(passed: set[Cell]) -> dict[str, Any]:
    """The matrix as `tools/matrix_table.py` renders it: every cell's outcome, each row's notes."""
    cells: dict[str, dict[str, str]] = {}
    for cell in CELLS:
        if cell.consumer in NO_CONSUMER:
            cells[f"{cell.publisher} {cell.consumer}"] = {"status": "not expressible",
                                                         "reason": NO_CONSUMER[cell.consumer]}
        else:
            cells[f"{cell.publisher} {cell.consumer}"] = {"status": "pass" if cell in passed else "fail"}
    return {"endpoints": ENDPOINTS, "cells": cells, "notes": {who: row_notes(who) for who in ENDPOINTS}}


# -- what each consumer shows -------------------------------------------------------------------------

# The attempts a first delivery shows: NSQ's attempts, MQKS's retry (left out: 0) and a stream row's
# (a stream never delivers); PHPMQ, PZQ and eMQP show none.
FIRST_ATTEMPTS = {"nsq-tcp": 1, "mqks": 0, "stream": 0}
# The protocol a stream row says its message came in by (docs/spark.md).
ORIGINS = {"nsq-tcp": "nsq", "nsq-http": "nsq", "mqks": "mqks", "phpmq": "phpmq", "pzq": "pzq", "emqp": "emqp",
           "stream": "http"}
HEX16 = re.compile(r"[0-9a-f]{16}")
HEX32 = re.compile(r"[0-9a-f]{32}")


def engine_id(cell: Cell, shown: str, sent: Sent) -> int | None:
    """The engine's message id a consumer shows (checking the protocol's form), or None where it shows
    the publisher's own id instead (which must then be the one sent)."""
    consumer = cell.consumer
    if consumer == "mqks" and sent.publisher_id is not None and cell.publisher in ("mqks", "stream"):
        assert shown == sent.publisher_id, "MQKS shows the publisher's id as msg_id"
        return None
    if consumer == "emqp" and cell.publisher == "emqp":
        assert shown == sent.publisher_id, "a worker gets the client's msgid"
        return None
    if consumer == "emqp":
        made = uuid.UUID(shown)
        assert str(made) == shown, "a msgid made from the message's id: uuid text"
        return made.int
    assert (HEX32 if consumer == "phpmq" else HEX16).fullmatch(shown), shown
    return int(shown, 16)


def expected_stream_headers(cell: Cell, sent: Sent) -> dict[str, Any] | None:
    if cell.publisher == "mqks":
        return {"msg_id": sent.publisher_id}
    if cell.publisher == "emqp":
        return {"emqp-msgid": sent.publisher_id, "emqp-headers": EMQP_HEADERS.decode()}
    if cell.publisher == "stream":
        return {"matrix-cell": cell.name, "msg_id": sent.publisher_id}
    return None


# What docs/protocols/mqks.md says an MQKS line cannot carry verbatim: control characters (C0, DEL)
# and the Unicode line breaks NEL, LS and PS.
MQKS_UNSAFE = re.compile("[\x00-\x1f\x7f\x85\u2028\u2029]")


def mqks_wire(body: bytes) -> bytes:
    """The data of an MQKS delivery of `body`, by the rules of docs/protocols/mqks.md: verbatim, or
    `polymq:base64:` and the base64 of the bytes for a body that is empty, not UTF-8, holds an unsafe
    character, ends in whitespace or starts with the prefix."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        text = None
    if text is None or not text or MQKS_UNSAFE.search(text) or text[-1].isspace() \
            or body.startswith(MQKS_PREFIX):
        return MQKS_PREFIX + base64.b64encode(body)
    return body


def pzq_join(frames: list[bytes]) -> bytes:
    """Frames as one body (docs/protocols/pzq.md): the prefix, then each frame as a netstring."""
    return PZQ_PREFIX + b"".join(b"%d:%s," % (len(frame), frame) for frame in frames)


def pzq_frames(body: bytes) -> list[bytes]:
    """The frames a PZQ consumer gets for an engine body: the frames of a body in the joined form (one
    or more netstrings after the prefix, nothing else), else the body as one frame."""
    if not body.startswith(PZQ_PREFIX):
        return [body]
    frames, rest = [], body[len(PZQ_PREFIX):]
    while rest:
        length, colon, tail = rest.partition(b":")
        if not (colon and length.isdigit() and tail[int(length):int(length) + 1] == b","):
            return [body]
        frames.append(tail[: int(length)])
        rest = tail[int(length) + 1 :]
    return frames or [body]


def engine_body(cell: Cell, body: bytes) -> bytes:
    """What the engine holds for `body` as the publisher sent it: a PZQ producer's one frame that
    starts with PZQ's prefix is kept in the joined form (so it is not read as several)."""
    return pzq_join([body]) if cell.publisher == "pzq" and body.startswith(PZQ_PREFIX) else body


def check_body(cell: Cell, sent: Sent, got: Received) -> None:
    """The body, exactly, or the documented reversible form of it, decoded and compared exactly."""
    held = engine_body(cell, sent.body)
    if cell.consumer == "pzq":
        assert got.frames == pzq_frames(held), "a body in PZQ's joined form reaches PZQ consumers as its frames"
        return
    assert got.body == held
    if cell.publisher == "pzq":
        assert pzq_frames(got.body) == [sent.body], "the joined form decodes to the producer's frame"
    if cell.consumer == "mqks":
        assert got.wire == mqks_wire(held), "verbatim, or the documented reversible encoding"


def check_delivery(cell: Cell, sent: Sent, got: Received, ttl_bound: int, published_ns: tuple[int, int]) -> None:
    consumer = cell.consumer
    check_body(cell, sent, got)
    if got.timestamp_ns is not None:
        assert published_ns[0] <= got.timestamp_ns <= published_ns[1], "stamped as it was published"
    expected_attempts = FIRST_ATTEMPTS.get(consumer)
    assert got.attempts == expected_attempts
    if consumer in ("mqks", "emqp", "stream"):
        assert got.topic == cell.topic
    if consumer == "phpmq":
        if cell.publisher == "phpmq":  # whole seconds left, rounded up
            assert got.ttl is not None and ttl_bound <= got.ttl <= PHPMQ_TTL_S
        else:
            assert got.ttl == 0, "0 for a message without a TTL"
    if consumer == "emqp":
        assert got.headers == (EMQP_HEADERS if cell.publisher == "emqp" else b"")
    if consumer == "stream":
        assert got.origin == ORIGINS[cell.publisher]
        assert got.headers == expected_stream_headers(cell, sent)


# -- the matrix ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def matrix_gateway() -> Iterator[GatewayProcess]:
    """One gateway for the whole matrix: PHPMQ deliveries in the current generation (with the TTL
    left), and eMQP workers that need not answer heartbeats while a cell runs."""
    with running_gateway("--phpmq-generation", "current", "--emqp-heartbeat-timeout", "600000") as process:
        yield process


@pytest.fixture(scope="module")
def passed() -> Iterator[set[Cell]]:
    """The cells that passed; written to $POLYMQ_MATRIX_RESULTS at the end when it is set."""
    cells: set[Cell] = set()
    yield cells
    target = os.environ.get(RESULTS_VARIABLE)
    if target:
        Path(target).write_text(json.dumps(results(cells), indent=1, ensure_ascii=False) + "\n", encoding="utf-8")


@pytest.mark.parametrize("cell", [cell for cell in CELLS if cell.consumer not in NO_CONSUMER], ids=lambda c: c.name)
def test_cell(cell: Cell, matrix_gateway: GatewayProcess, context: zmq.Context, passed: set[Cell]) -> None:
    run_cell(cell, list(bodies_of(cell).values()), matrix_gateway, context)
    passed.add(cell)


def run_cell(cell: Cell, bodies: list[bytes], gateway: GatewayProcess, context: zmq.Context,
             publisher_gateway: GatewayProcess | None = None) -> None:
    """Publish `bodies` (on `publisher_gateway`, when another node is given) and check every delivery
    on `gateway`, then that the consumer's queue is left empty."""
    with endpoints(gateway, cell, context, publisher_gateway) as (publisher, consumer):
        started, started_ns = time.monotonic(), time.time_ns()
        sent = publisher.publish(bodies)
        received = consumer.receive(len(sent))
        published_ns = (started_ns, time.time_ns())
        # The TTL left is whole seconds rounded up: at least the TTL less the seconds gone, rounded down.
        ttl_bound = PHPMQ_TTL_S - int(time.monotonic() - started) - 1
        assert len(received) == len(bodies)
        for one, got in zip(sent, received, strict=True):
            check_delivery(cell, one, got, ttl_bound, published_ns)
        ids = [engine_id(cell, got.shown_id, one) for one, got in zip(sent, received, strict=True)]
        shown = [found for found in ids if found is not None]
        assert shown == sorted(set(shown)), "the engine's ids: one per message, increasing in publish order"

        def drained() -> bool:
            state = state_of(gateway, "queues", consumer.queue)
            return state is not None and state["depth"] == 0 and state["in_flight"] == 0

        wait_until(drained, f"queue {consumer.queue} empty, nothing in flight (no copy left over)")


# -- what is not expressible is refused ---------------------------------------------------------------

def _refused_by_nsq_tcp(gateway: GatewayProcess) -> None:
    for command, error in ((nsq_client.pub("matrix-refused", b""), b"PUB invalid message body size 0"),
                           (nsq_client.mpub("matrix-refused", [b"not alone", b""]),
                            b"MPUB invalid message(1) body size 0"),
                           (nsq_client.dpub("matrix-refused", 0, b""), b"DPUB invalid message body size 0")):
        with nsq_blocking.Connection(gateway.nsq_tcp, TIMEOUT_S) as conn:
            conn.send(command)
            frame = conn.next_frame()
            assert frame is not None and frame.is_error
            assert frame.data == b"E_BAD_MESSAGE " + error


def _refused_by_nsq_http(gateway: GatewayProcess) -> None:
    assert nsq_http_post(gateway, "/pub?topic=matrix-refused", b"") == (400, b'{"message":"MSG_EMPTY"}')
    assert nsq_http_post(gateway, "/mpub?topic=matrix-refused&binary=true",
                         nsq_client.mpub_body([b"not alone", b""])) == (413, b'{"message":"BAD_MESSAGE"}')
    assert nsq_http_post(gateway, "/mpub?topic=matrix-refused", b"\n") == (200, b"OK")  # an empty line: nothing


def _refused_by_stream(gateway: GatewayProcess) -> None:
    with StreamClient(gateway.http, timeout=TIMEOUT_S) as client, pytest.raises(StreamClientError) as refusal:
        client.publish([stream_rows.encode_publish_row(b"")], "matrix-refused")
    assert (refusal.value.status, refusal.value.code) == (400, "BAD_ROW")
    assert str(refusal.value).endswith("row 0: empty body")


REFUSALS = {("nsq-tcp", "empty"): _refused_by_nsq_tcp, ("nsq-http", "empty"): _refused_by_nsq_http,
            ("stream", "empty"): _refused_by_stream}


@pytest.mark.parametrize("publisher_body", sorted(NOT_EXPRESSIBLE_BODIES), ids=" ".join)
def test_not_expressible_bodies_are_refused(publisher_body: tuple[str, str], matrix_gateway: GatewayProcess) -> None:
    REFUSALS[publisher_body](matrix_gateway)
    # A topic without a queue keeps what is published to it (nsqd's backlog rule): nothing there.
    made = state_of(matrix_gateway, "topics", "matrix-refused")
    assert made is None or made["depth"] == 0, "nothing was published"
    admin(matrix_gateway, "topic/delete", topic="matrix-refused")


def test_the_mqks_large_body_is_the_largest_a_line_carries(matrix_gateway: GatewayProcess) -> None:
    cell = Cell("mqks", "nsq-tcp")
    largest = mqks_large_body(cell)
    request_id = mqks_request_id(cell, list(BODIES).index(LARGE))  # the cell's own
    event = cell.topic.encode()
    with mqks_blocking.Connection(matrix_gateway.host_port("mqks"), TIMEOUT_S) as conn:
        conn.request("c1", "consume", f"{cell.name} {cell.topic}", confirm=True)
        assert conn.next_line() == b"c1 ok "

        def lines_until(last: Callable[[bytes], bool]) -> list[bytes]:
            """Lines up to the one `last` takes (a confirm and a delivery come in either order)."""
            lines: list[bytes] = []
            while not lines or not last(lines[-1]):
                line = conn.next_line()
                assert line is not None, lines[-3:]
                lines.append(line)
            return lines

        def delivery(msg_id: bytes, data: bytes) -> bytes:
            return b"c1 ok %s event=%s %s" % (msg_id, event, data)

        conn.request(request_id, "publish", event + b" " + largest, confirm=True)
        taken = [conn.next_line() or b"", conn.next_line() or b""]
        assert sorted(taken) == sorted([f"{request_id} ok ".encode(), delivery(request_id.encode(), largest)])
        conn.request(request_id, "publish", event + b" " + largest + b"!", confirm=True)
        refused = lines_until(lambda line: line.startswith(f"{request_id} ".encode()))
        assert refused[-1].startswith(f"{request_id} error ".encode())
        # Deliveries come in publish order: the next one is the marker's, nothing of the refused line.
        conn.request("marker", "publish", event + b" marker", confirm=True)
        after = lines_until(lambda line: line == delivery(b"marker", b"marker"))
        assert [line for line in refused + after if line.startswith(b"c1 ")] == [delivery(b"marker", b"marker")]
    admin(matrix_gateway, "topic/delete", topic=cell.topic)
    admin(matrix_gateway, "queue/delete", queue=cell.name)


# -- the docs' table ----------------------------------------------------------------------------------

def _table_tool() -> Any:
    spec = importlib.util.spec_from_file_location("matrix_table", ROOT / "tools" / "matrix_table.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_docs_table_is_the_rendered_matrix() -> None:
    tool = _table_tool()
    every_cell_passing = results(set(CELLS))
    assert tool.section(DOCS_PAGE.read_text(encoding="utf-8")) == tool.render(every_cell_passing), \
        "docs/matrix.md is out of date: run the command it prints"


def test_every_cell_is_a_test_or_not_expressible() -> None:
    rendered = results(set(CELLS))["cells"]
    assert len(rendered) == len(ENDPOINTS) ** 2 == 49
    assert sum(cell["status"] == "not expressible" for cell in rendered.values()) == len(NO_CONSUMER) * len(ENDPOINTS)


def test_the_printed_command_rewrites_the_table(tmp_path: Path) -> None:
    """`tools/matrix_table.py RESULTS --write PAGE` (docs/matrix.md prints it) puts the table back
    between the markers of a page whose table is stale, and leaves the rest of the page alone."""
    tool = _table_tool()
    page = DOCS_PAGE.read_text(encoding="utf-8")
    stale = tool.replace(page, "| a stale table |\n")
    assert stale != page
    (tmp_path / "matrix.md").write_text(stale, encoding="utf-8")
    (tmp_path / "results.json").write_text(json.dumps(results(set(CELLS))), encoding="utf-8")
    subprocess.run([sys.executable, str(ROOT / "tools" / "matrix_table.py"), str(tmp_path / "results.json"),
                    "--write", str(tmp_path / "matrix.md")], check=True, timeout=60)
    assert (tmp_path / "matrix.md").read_text(encoding="utf-8") == page
