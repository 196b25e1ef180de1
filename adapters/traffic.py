"""What a protocol's clients sent and got, counted where it happens.

Compiled (mypyc): the sessions bump these counters per read, per write and per message, and a
compiled session's bump of a compiled class's field is a store into it, not an attribute lookup.
"""

from __future__ import annotations

from typing import Final

# Error codes counted per protocol: a protocol's vocabulary is a few dozen codes at most, so this only
# guards a mistake (a code made of client input); past it the rest are counted as `OTHER_ERROR`.
MAX_ERROR_CODES: Final = 64
OTHER_ERROR: Final = "_other"


class Traffic:
    """Bytes per read and per write, messages as a plain count (TCP protocols: messages published and
    delivered; ZeroMQ ones: ZeroMQ messages), connections, and errors by the protocol's own code."""

    def __init__(self, *, connections_opened: int = 0, bytes_in: int = 0, bytes_out: int = 0, messages_in: int = 0,
                 messages_out: int = 0, connections_refused: int = 0, slow_disconnected: int = 0) -> None:
        self.connections_opened = connections_opened
        self.bytes_in = bytes_in
        self.bytes_out = bytes_out
        self.messages_in = messages_in
        self.messages_out = messages_out
        self.connections_refused = connections_refused  # past the listener's --…-max-connections
        self.slow_disconnected = slow_disconnected  # clients that left their output unread past --max-client-output
        # Errors answered or closed with, by the protocol's own code (NSQ `E_INVALID`, MQKS `error`, …).
        self.errors: dict[str, int] = {}

    def error(self, code: str) -> None:
        """Count an error of `code`: one of the protocol's fixed codes, never client input."""
        errors = self.errors
        if code not in errors and len(errors) >= MAX_ERROR_CODES:
            code = OTHER_ERROR
        errors[code] = errors.get(code, 0) + 1

    def add(self, other: Traffic) -> None:
        self.connections_opened += other.connections_opened
        self.connections_refused += other.connections_refused
        self.slow_disconnected += other.slow_disconnected
        self.bytes_in += other.bytes_in
        self.bytes_out += other.bytes_out
        self.messages_in += other.messages_in
        self.messages_out += other.messages_out
        for code, count in other.errors.items():
            self.errors[code] = self.errors.get(code, 0) + count
