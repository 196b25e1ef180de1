"""The bodies the run publishes: a unique id and a checksum, so a corrupted body is told apart.

`tq.<flow>.<seq>.<padding>.<crc32 of everything before it, 8 hex>`: ASCII without spaces, so every
protocol carries it verbatim (an MQKS line, a PHPMQ packet, a ZeroMQ frame, an NSQ frame).
"""

from __future__ import annotations

import random
import zlib

import attrs

PREFIX = b"tq"
SEPARATOR = b"."
# Padding lengths vary so that bodies of many sizes cross the wire (and frame boundaries).
MAX_PADDING = 96
PADDING_ALPHABET = b"abcdefghijklmnopqrstuvwxyz0123456789"


@attrs.frozen(slots=True)
class BodyId:
    flow: int
    seq: int

    @property
    def key(self) -> bytes:
        return b"%d.%d" % (self.flow, self.seq)


def make_body(flow: int, seq: int, rng: random.Random) -> bytes:
    padding = bytes(rng.choices(PADDING_ALPHABET, k=rng.randrange(MAX_PADDING)))
    head = SEPARATOR.join((PREFIX, b"%d" % flow, b"%d" % seq, padding))
    return head + SEPARATOR + b"%08x" % zlib.crc32(head)


def parse_body(body: bytes) -> BodyId | None:
    """The id of a body this run made, or None for anything else (corrupted, cut, foreign)."""
    head, separator, checksum = body.rpartition(SEPARATOR)
    if not separator or checksum != b"%08x" % zlib.crc32(head):
        return None
    parts = head.split(SEPARATOR)
    if len(parts) != 4 or parts[0] != PREFIX or not parts[1].isdigit() or not parts[2].isdigit():
        return None
    return BodyId(int(parts[1]), int(parts[2]))
