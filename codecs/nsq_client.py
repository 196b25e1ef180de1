"""NSQ V2 wire codec, client side: encode commands, split server frames. Sans-IO.

Used by the NSQ client (`polymq.clients.nsq`), and through it by the conformance suite, the
benchmark and the tests.
"""

from __future__ import annotations

import json
import struct
from typing import Any

import attrs

from polymq.codecs.nsq import (
    FRAME_TYPE_ERROR,
    FRAME_TYPE_MESSAGE,
    FRAME_TYPE_RESPONSE,
    MAGIC_V2,
    MSG_ID_LENGTH,
)

_SIZE = struct.Struct(">i")
_MESSAGE = struct.Struct(">qH")

# A client refuses server frames larger than this (nsqd's max body size plus framing).
MAX_FRAME_SIZE = 5 * 1024 * 1024 + 64


def _with_body(line: bytes, body: bytes) -> bytes:
    return line + _SIZE.pack(len(body)) + body


def magic() -> bytes:
    return MAGIC_V2


def identify(data: dict[str, Any]) -> bytes:
    return _with_body(b"IDENTIFY\n", json.dumps(data).encode())


def auth(secret: bytes) -> bytes:
    return _with_body(b"AUTH\n", secret)


def sub(topic: str, channel: str) -> bytes:
    return f"SUB {topic} {channel}\n".encode()


def pub(topic: str, body: bytes) -> bytes:
    return _with_body(f"PUB {topic}\n".encode(), body)


def dpub(topic: str, defer_ms: int, body: bytes) -> bytes:
    return _with_body(f"DPUB {topic} {defer_ms}\n".encode(), body)


def mpub_body(bodies: list[bytes]) -> bytes:
    parts = [_SIZE.pack(len(bodies))]
    for body in bodies:
        parts.append(_SIZE.pack(len(body)))
        parts.append(body)
    return b"".join(parts)


def mpub(topic: str, bodies: list[bytes]) -> bytes:
    return _with_body(f"MPUB {topic}\n".encode(), mpub_body(bodies))


def rdy(count: int) -> bytes:
    return b"RDY %d\n" % count


def fin(msg_id: bytes) -> bytes:
    return b"FIN " + msg_id + b"\n"


def req(msg_id: bytes, timeout_ms: int) -> bytes:
    return b"REQ " + msg_id + b" %d\n" % timeout_ms


def touch(msg_id: bytes) -> bytes:
    return b"TOUCH " + msg_id + b"\n"


def cls() -> bytes:
    return b"CLS\n"


def nop() -> bytes:
    return b"NOP\n"


@attrs.frozen(slots=True)
class Frame:
    frame_type: int
    data: bytes

    @property
    def is_response(self) -> bool:
        return self.frame_type == FRAME_TYPE_RESPONSE

    @property
    def is_error(self) -> bool:
        return self.frame_type == FRAME_TYPE_ERROR

    @property
    def is_message(self) -> bool:
        return self.frame_type == FRAME_TYPE_MESSAGE


@attrs.frozen(slots=True)
class Message:
    timestamp_ns: int
    attempts: int
    msg_id: bytes
    body: bytes


def decode_message(data: bytes) -> Message:
    timestamp, attempts = _MESSAGE.unpack_from(data)
    return Message(timestamp, attempts, data[10 : 10 + MSG_ID_LENGTH], data[10 + MSG_ID_LENGTH :])


class FrameError(Exception):
    """The server sent something that is not an NSQ frame."""


def frame_at(data: bytes | bytearray, offset: int = 0,
             max_frame_size: int = MAX_FRAME_SIZE) -> tuple[Frame, int] | None:
    """The frame that starts at `offset` and the offset after it; None while it is incomplete."""
    if len(data) - offset < 8:
        return None
    size = _SIZE.unpack_from(data, offset)[0]
    if size < 4 or size > max_frame_size:
        raise FrameError(f"bad frame size {size}")
    end = offset + 4 + size
    if len(data) < end:
        return None
    return Frame(_SIZE.unpack_from(data, offset + 4)[0], bytes(data[offset + 8 : end])), end


class FrameReader:
    """Split a byte stream from an NSQ server into frames."""

    def __init__(self, max_frame_size: int = MAX_FRAME_SIZE) -> None:
        self._buffer = bytearray()
        self._max = max_frame_size

    def receive_data(self, data: bytes) -> None:
        self._buffer += data

    def frames(self) -> list[Frame]:
        out: list[Frame] = []
        buffer = self._buffer
        offset = 0
        while (found := frame_at(buffer, offset, self._max)) is not None:
            frame, offset = found
            out.append(frame)
        if offset:
            del buffer[:offset]
        return out
