"""The nsqd → nsqlookupd TCP protocol (V1), the node's side: commands out, responses in.

No sockets, no clock: `identify`, `register`, `unregister` and `ping` make the bytes nsqd 1.3.0
writes (go-nsq's Command.WriteTo: the name, each parameter after one space, a newline, and for
IDENTIFY a 4-byte big-endian size and the JSON body), and `ResponseReader` cuts what nsqlookupd
answers into responses (internal/protocol SendResponse: a 4-byte big-endian size and the data,
no frame type). nsqlookupd answers `OK` to REGISTER, UNREGISTER and PING, its own JSON to IDENTIFY,
and `E_<CODE> <text>` to a command it refuses; after a fatal one (every error it sends) it closes.
"""

from __future__ import annotations

import json
import struct
from typing import Any

import attrs

# What a node writes first on a new connection (go-nsq MagicV1).
MAGIC_V1 = b"  V1"
OK = b"OK"
_SIZE = struct.Struct(">i")
# Go's json.Marshal writes these as \u escapes (HTML-safe); nsqd's IDENTIFY bodies do too.
_GO_ESCAPES = {"<": "\\u003c", ">": "\\u003e", "&": "\\u0026", "\u2028": "\\u2028", "\u2029": "\\u2029"}


class LookupProtocolError(Exception):
    """A response nsqd would refuse to read (larger than its limit, or a negative size)."""


def go_json(value: Any) -> bytes:
    """json.Marshal of a map: keys sorted, no spaces, UTF-8, Go's HTML-safe escapes."""
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    for raw, escaped in _GO_ESCAPES.items():
        text = text.replace(raw, escaped)
    return text.encode()


def command(name: bytes, *params: str) -> bytes:
    return b" ".join((name, *(param.encode() for param in params))) + b"\n"


def identify(broadcast_address: str, tcp_port: int, http_port: int, version: str, hostname: str) -> bytes:
    """IDENTIFY with nsqd's body (lookup.go connectCallback): the five keys nsqlookupd reads."""
    body = go_json({"broadcast_address": broadcast_address, "hostname": hostname, "http_port": http_port,
                    "tcp_port": tcp_port, "version": version})
    return b"IDENTIFY\n" + _SIZE.pack(len(body)) + body


def register(topic: str, channel: str = "") -> bytes:
    """REGISTER topic [channel] (go-nsq Register leaves an empty channel out)."""
    return command(b"REGISTER", topic, channel) if channel else command(b"REGISTER", topic)


def unregister(topic: str, channel: str = "") -> bytes:
    return command(b"UNREGISTER", topic, channel) if channel else command(b"UNREGISTER", topic)


def ping() -> bytes:
    return b"PING\n"


@attrs.define(slots=True)
class ResponseReader:
    """Bytes from nsqlookupd in, whole responses out (nsqd's readResponseBounded)."""

    max_size: int  # nsqd bounds a response by its --max-body-size
    _buffer: bytearray = attrs.field(factory=bytearray)

    def receive_data(self, data: bytes) -> list[bytes]:
        self._buffer += data
        responses: list[bytes] = []
        while len(self._buffer) >= _SIZE.size:
            (size,) = _SIZE.unpack_from(self._buffer)
            if size < 0 or size > self.max_size:
                raise LookupProtocolError(f"response body size ({size}) is greater than limit ({self.max_size})")
            end = _SIZE.size + size
            if len(self._buffer) < end:
                break
            responses.append(bytes(self._buffer[_SIZE.size:end]))
            del self._buffer[:end]
        return responses


def is_error(response: bytes) -> bool:
    """nsqlookupd's refusals start with their code (`E_INVALID`, `E_BAD_TOPIC`, …)."""
    return response.startswith(b"E_")
