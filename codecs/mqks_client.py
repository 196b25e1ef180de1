"""MQKS wire codec, client side: request lines out, response lines in. Sans-IO.

Used by polymq's MQKS client (`polymq.clients.mqks`), the conformance suite and the
tests. Shapes follow docs/protocols/mqks.md
"""

from __future__ import annotations

import base64

import attrs

from polymq.codecs.mqks import ENCODED_PREFIX, MAX_LINE_LENGTH, encode_body


def request(request_id: str, action: str, data: str | bytes, *, confirm: bool = False) -> bytes:
    """`{id} {action} [--confirm ]{data}\\n`."""
    raw = data.encode() if isinstance(data, str) else data
    head = f"{request_id} {action} {'--confirm ' if confirm else ''}".encode()
    return head + raw + b"\n"


def publish_data(body: bytes) -> bytes:
    """A body as publish data: verbatim when a line carries it unchanged, else the reversible encoding."""
    return encode_body(body)


@attrs.frozen(slots=True)
class Response:
    request_id: str
    ok: bool
    data: bytes  # for an error: the error id


@attrs.frozen(slots=True)
class Delivery:
    msg_id: str
    event: str
    retry: int
    body: bytes  # decoded from the reversible encoding
    props: dict[str, str] = attrs.field(eq=False)


@attrs.frozen(slots=True)
class Update:
    queue: str
    events: tuple[str, ...]
    delete_when_unused: bool | float | None
    manual_ack: bool
    line: str  # the consume data to re-send on reconnect


class ResponseError(ValueError):
    pass


def parse_response(line: bytes) -> Response:
    """One response line without its `\\n`."""
    request_id, space, rest = line.partition(b" ")
    if not space:
        raise ResponseError(f"not a response: {line[:80]!r}")
    if rest.startswith(b"ok "):
        return Response(request_id.decode(), True, rest[3:])
    if rest.startswith(b"error "):
        return Response(request_id.decode(), False, rest[6:])
    raise ResponseError(f"not a response: {line[:80]!r}")


def decode_body(data: bytes) -> bytes:
    if data.startswith(ENCODED_PREFIX):
        return base64.b64decode(data[len(ENCODED_PREFIX) :])
    return data


def parse_delivery(data: bytes) -> Delivery:
    """The data of a consumer's `ok` line: `{msg_id} {props} {data}`."""
    parts = data.split(b" ", 2)
    if len(parts) != 3:
        raise ResponseError(f"not a delivery: {data[:80]!r}")
    msg_id, props_raw, body = parts
    props = dict(prop.split("=", 1) for prop in props_raw.decode().split(",") if "=" in prop)
    if "event" not in props:
        raise ResponseError(f"delivery without event: {data[:80]!r}")
    return Delivery(msg_id.decode(), props["event"], int(props.get("retry", "0")), decode_body(body), props)


def is_update(data: bytes) -> bool:
    return data.startswith(b"--update ")


def parse_update(data: bytes) -> Update:
    """`--update {queue}[ events][ --delete-queue-when-unused[=f]][ --manual-ack]`."""
    tokens = data.decode().split(" ")[1:]
    if not tokens:
        raise ResponseError(f"not an update: {data[:80]!r}")
    queue, events = tokens[0], []
    delete_when_unused: bool | float | None = None
    manual_ack = False
    for token in tokens[1:]:
        if token == "--delete-queue-when-unused":
            delete_when_unused = True
        elif token.startswith("--delete-queue-when-unused="):
            delete_when_unused = float(token.split("=", 1)[1])
        elif token == "--manual-ack":
            manual_ack = True
        elif token:
            events.append(token)
    return Update(queue, tuple(events), delete_when_unused, manual_ack, " ".join(tokens))


class LineReader:
    """Splits received bytes into lines; a line longer than `max_line_length` is an error."""

    def __init__(self, max_line_length: int = 4 * MAX_LINE_LENGTH) -> None:
        self.max_line_length = max_line_length
        self._buffer = bytearray()

    def feed(self, data: bytes) -> list[bytes]:
        buffer = self._buffer
        buffer += data
        end = buffer.rfind(b"\n")
        lines = bytes(buffer[:end]).split(b"\n") if end >= 0 else []
        del buffer[: end + 1]
        # Also the partial line after the last `\n`: a chunk can end a line and bring a huge one.
        if len(buffer) > self.max_line_length:
            raise ResponseError("response line too long")
        return lines
