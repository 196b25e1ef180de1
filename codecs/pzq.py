"""PZQ wire codec, sans-IO: ZeroMQ multipart frames in, typed messages out, and the frames back.

PZQ has three sockets (docs/protocols/pzq.md). On the receive socket (a ROUTER) producers send
`[producer_id, <header frames>…, '', body…]` and get `[producer_id, '1', '']` once the message is
stored, or `[producer_id, '0', '', reason]`. On the send socket (a DEALER) consumers get
`[key, sent_us, ack_timeout_us, '', body…]` and answer `[key, status]` (`1` done, anything else:
send it again now). The monitor socket (a ROUTER) answers a request whose last frame is `MONITOR`
with six `key: value` lines.

The frames a ROUTER adds (the peer's routing id, and a REQ's empty envelope) stay with the adapter:
these functions take and give the frames after the routing id.
"""

from __future__ import annotations

import attrs

DELIMITER = b""
ACK_OK = b"1"
ACK_FAILED = b"0"
# The original's refusal texts (its manager.cpp), kept word for word: clients may match them.
MALFORMED = b"Malformed message, no delimiter found or missing message parts"
EMPTY = b"Trying to save empty message"
MONITOR = b"MONITOR"
# The six monitor keys, in the original's order.
MONITOR_KEYS = ("messages", "messages_inflight", "db_size", "inflight_db_size", "syncs", "expired_messages")
# A delivery key names the message, as the original's does: every delivery of it has the same key
# (16 lowercase hex digits of the engine's message id), so consumers may de-duplicate on it.
KEY_DIGITS = 16
_HEX_DIGITS = b"0123456789abcdef"
# How several body frames travel as one body to protocols that carry one (NSQ, MQKS, PHPMQ): this
# prefix, then each frame as a netstring, `<length>:<bytes>,`. Reversible: a body in this form
# reaches a PZQ consumer as its frames again (docs/protocols/pzq.md).
FRAMES_PREFIX = b"pzq-frames:"


@attrs.define(slots=True)
class Produce:
    producer_id: bytes
    bodies: list[bytes]  # the frames after the delimiter, in order


@attrs.define(slots=True)
class ProduceRefused:
    producer_id: bytes
    reason: bytes


@attrs.define(slots=True)
class ConsumerAck:
    key: bytes
    done: bool  # `1`; anything else asks for the message again at once


@attrs.define(slots=True)
class Ignored:
    """Frames that mean nothing (a consumer answer without a status); the adapter logs them."""

    reason: str


def parse_produce(frames: list[bytes]) -> Produce | ProduceRefused | Ignored:
    """A producer's message, without the routing id: `[producer_id, <headers>…, '', body…]`.

    Header frames are dropped, as the original drops them. A message with an id alone is refused
    with the original's malformed text (the original answers nothing, and the producer waits out
    its timeout)."""
    if not frames:
        return Ignored("a producer message without any frame")
    producer_id = frames[0]
    try:
        delimiter = frames.index(DELIMITER, 1)
    except ValueError:
        return ProduceRefused(producer_id, MALFORMED)
    bodies = frames[delimiter + 1 :]
    if not bodies:
        return ProduceRefused(producer_id, EMPTY)
    return Produce(producer_id, bodies)


def producer_ack(producer_id: bytes) -> list[bytes]:
    return [producer_id, ACK_OK, DELIMITER]


def producer_refusal(producer_id: bytes, reason: bytes) -> list[bytes]:
    return [producer_id, ACK_FAILED, DELIMITER, reason]


def delivery(key: bytes, sent_us: int, ack_timeout_us: int, bodies: list[bytes]) -> list[bytes]:
    return [key, b"%d" % sent_us, b"%d" % ack_timeout_us, DELIMITER, *bodies]


def parse_consumer_ack(frames: list[bytes]) -> ConsumerAck | Ignored:
    """A consumer's answer as the send socket (a DEALER) reads it: `[key, status, …]`."""
    if len(frames) < 2:
        return Ignored(f"a consumer answer of {len(frames)} frame(s), without a status")
    return ConsumerAck(frames[0], frames[1] == ACK_OK)


def delivery_key(message_id: int) -> bytes:
    """The key of every delivery of the message."""
    return b"%016x" % message_id


def parse_key(key: bytes) -> int | None:
    """The message id of a key this codec made; None for anything else."""
    if len(key) != KEY_DIGITS or key.strip(_HEX_DIGITS):
        return None
    return int(key, 16)


def is_monitor_request(frames: list[bytes]) -> bool:
    """The original answers any request whose last frame is `MONITOR`."""
    return bool(frames) and frames[-1] == MONITOR


def monitor_text(values: dict[str, int]) -> bytes:
    return b"".join(b"%s: %d\n" % (key.encode(), values[key]) for key in MONITOR_KEYS)


def parse_monitor_text(text: bytes) -> dict[str, int]:
    """What the reference monitor client does: split lines, then `key: value`."""
    out: dict[str, int] = {}
    for line in text.decode().splitlines():
        key, _, value = line.partition(": ")
        out[key] = int(value)
    return out


def join_frames(bodies: list[bytes]) -> bytes:
    """One body for the engine: a single frame as it is, several as `FRAMES_PREFIX` netstrings.

    A single frame that itself starts with the prefix is written in the joined form too, so that
    splitting it again is never ambiguous."""
    if len(bodies) == 1 and not bodies[0].startswith(FRAMES_PREFIX):
        return bodies[0]
    return FRAMES_PREFIX + b"".join(b"%d:%s," % (len(body), body) for body in bodies)


def split_frames(body: bytes) -> list[bytes]:
    """The frames of an engine body: `join_frames` undone; any other body is one frame."""
    if not body.startswith(FRAMES_PREFIX):
        return [body]
    frames: list[bytes] = []
    offset = len(FRAMES_PREFIX)
    while offset < len(body):
        colon = body.find(b":", offset)
        length_text = body[offset:colon]
        if colon < 0 or not length_text.isdigit() or len(length_text) > 20:
            return [body]  # not in the joined form after all: deliver it as it is
        start = colon + 1
        end = start + int(length_text)
        if end >= len(body) or body[end : end + 1] != b",":
            return [body]
        frames.append(body[start:end])
        offset = end + 1
    return frames if frames else [body]
