"""64-bit message ids: increasing, never reused.

The counter starts from the wall clock in milliseconds shifted left by 20 bits, so a restart
without stored state still starts above every id of the previous run unless that run issued
more than about a million ids per millisecond on average. Durable storage also records the last
id and the source resumes above it (`advance_past`).
"""

from __future__ import annotations

from typing import Final

ID_BITS: Final = 64
_MASK: Final = (1 << ID_BITS) - 1
_COUNTER_BITS: Final = 20


# Ids of an engine shared by several nodes (core/shared.py): the node's number in the top bits, so
# two nodes never make the same id; below them the milliseconds and a counter as above, narrower.
NODE_BITS: Final = 12
_NODE_SHIFT: Final = ID_BITS - NODE_BITS
_NODE_COUNTER_BITS: Final = 11  # 2,048 ids a millisecond on average before the counter runs into the clock's bits


def node_of(message_id: int) -> int:
    """The number of the node that made an id of a shared engine (`IdSource(..., node)`)."""
    return message_id >> _NODE_SHIFT


class IdSource:
    def __init__(self, wall_ns: int, node: int | None = None) -> None:
        """Ids from the wall clock; with `node` (0 to 4,095), ids no other node numbered otherwise makes."""
        if node is None:
            self._next = ((wall_ns // 1_000_000) << _COUNTER_BITS) & _MASK
        else:
            if not 0 <= node < 1 << NODE_BITS:
                raise ValueError(f"node number {node} is outside 0..{(1 << NODE_BITS) - 1}")
            below = ((wall_ns // 1_000_000) << _NODE_COUNTER_BITS) & ((1 << _NODE_SHIFT) - 1)
            self._next = (node << _NODE_SHIFT) | below

    def next(self) -> int:
        value = self._next
        self._next = (value + 1) & _MASK
        return value

    def reserve(self, count: int) -> int:
        """Reserve `count` consecutive ids; returns the first."""
        first = self._next
        self._next = (first + count) & _MASK
        return first

    def advance_past(self, last_used: int) -> None:
        if last_used >= self._next:
            self._next = (last_used + 1) & _MASK

    @property
    def last(self) -> int:
        return (self._next - 1) & _MASK
