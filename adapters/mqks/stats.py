"""MQKS `_eval` without code execution (docs/protocols/mqks.md).

The original evaluates any Python a client sends. polymq answers only the read-only stats
expressions that MQKS tools send — the upstream tests (`len(state.queues)`), `stats.py`'s spells
and its combined `[spell, spell, …]` form, `WORKERS` — and nothing else. The client's text is
parsed with `ast` (which never runs it) and compared, node for node, with the known expressions,
so spacing or quoting differences still match and nothing unknown is ever evaluated.
"""

from __future__ import annotations

import ast
import copy
from collections.abc import Callable, Mapping
from typing import Any

# Longer code is refused before parsing (the longest whitelisted combination is ~1.5 KB).
MAX_CODE_LENGTH = 8192

Stat = Callable[[Any], Any]  # gets the stats source (the MQKS server), returns the value

# The spells of the original's `stats.py` (Python 2 spelling) with polymq's value for each.
# polymq is one worker, so cross-worker command counters are always 0.
_SPELLS: dict[str, Stat] = {
    "state.published": lambda s: s.published,
    "state.queued": lambda s: s.queued,
    "state.consumed": lambda s: s.consumed,
    "len(state.queues)": lambda s: len(s.engine.queues),
    "len([u for u in state.queues_used.itervalues() if u.is_set()])": lambda s: s.queues_in_use(),
    "len(state.queues_to_delete_when_unused)":
        lambda s: sum(1 for q in s.engine.queues.values() if q.auto_delete is not None),
    "state.commands_put": lambda s: 0,
    "state.commands_got": lambda s: 0,
    "sum(c.qsize() for c in state.commands_to_workers.itervalues())": lambda s: 0,
    "sum(q.qsize() for q in state.queues.itervalues())": lambda s: sum(q.depth for q in s.engine.queues.values()),
    "sum(len(ms) for ms in state.messages_by_consumer_ids.itervalues())": lambda s: s.unacked_count(),
    "sum(q.qsize() for q in state.responses_by_clients.itervalues())": lambda s: s.responses_waiting(),
    "len(state.queues_by_events)": lambda s: len({e for events in s.events_by_queue().values() for e in events}),
    "len(state.events_by_queues)": lambda s: len(s.events_by_queue()),
    "len(state.queues_by_consumer_ids)": lambda s: len(s.consumers),
    "sum(len(cs) for cs in state.consumers_by_queues.itervalues())": lambda s: len(s.consumers),
    "len(state.consumer_ids_by_clients)": lambda s: s.sessions_with_consumers(),
    "len(set(state.clients_by_consumer_ids.itervalues()))": lambda s: s.sessions_with_consumers(),
    "len(state.socks_by_clients)": lambda s: len(s.sessions),
    "WORKERS": lambda s: 1,
    # stats.py reads the worker list as "host:worker_port:client_port" entries.
    "' '.join(config['workers'])": lambda s: s.worker_address(),
}


# Spells about one queue, named by any string literal where QUEUE stands (the original's client
# tests read a queue's events this way); a queue with no events gives the empty string.
QUEUE = "QUEUE"
_QUEUE_SPELLS: dict[str, Callable[[Any, str], Any]] = {
    "' '.join(sorted(state.events_by_queues[QUEUE]))":
        lambda s, queue: " ".join(sorted(s.events_by_queue().get(queue, []))),
}


class _QueueName(ast.NodeTransformer):
    """Replaces the string literal a subscript is indexed with by the name QUEUE, and keeps it."""

    def __init__(self) -> None:
        self.names: list[str] = []

    def visit_Subscript(self, node: ast.Subscript) -> ast.AST:
        self.generic_visit(node)
        if isinstance(node.slice, ast.Constant) and isinstance(node.slice.value, str):
            self.names.append(node.slice.value)
            node.slice = ast.Name(QUEUE, ast.Load())
        return node


def _key(code: str) -> str | None:
    try:
        tree = ast.parse(code.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    return ast.dump(tree.body)


def _python3_spelling(spell: str) -> str:
    return spell.replace(".itervalues()", ".values()")


def _build() -> dict[str, Stat]:
    known: dict[str, Stat] = {}
    for spell, stat in _SPELLS.items():
        for spelling in (spell, _python3_spelling(spell)):
            key = _key(spelling)
            assert key is not None, spelling
            known[key] = stat
    return known


_KNOWN: Mapping[str, Stat] = _build()
_KNOWN_PER_QUEUE: Mapping[str, Callable[[Any, str], Any]] = {
    key: stat for spell, stat in _QUEUE_SPELLS.items() if (key := _key(spell)) is not None}


class UnknownExpression(ValueError):
    pass


def _evaluate(node: ast.expr, source: Any) -> Any:
    if isinstance(node, ast.List | ast.Tuple):
        values = [_evaluate(element, source) for element in node.elts]
        return values if isinstance(node, ast.List) else tuple(values)
    stat = _KNOWN.get(ast.dump(node))
    if stat is not None:
        return stat(source)
    named = _QueueName()
    template = named.visit(copy.deepcopy(node))
    per_queue = _KNOWN_PER_QUEUE.get(ast.dump(template)) if len(named.names) == 1 else None
    if per_queue is None:
        raise UnknownExpression(ast.unparse(node)[:200])
    return per_queue(source, named.names[0])


def answer(code: str, source: Any) -> str:
    """`str()` of the value, as the original prints it; `UnknownExpression` for anything else."""
    if len(code) > MAX_CODE_LENGTH:
        raise UnknownExpression(f"code longer than {MAX_CODE_LENGTH} characters")
    try:
        tree = ast.parse(code.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as error:
        raise UnknownExpression(f"not an expression: {error}") from None
    try:
        return str(_evaluate(tree.body, source))
    except RecursionError:
        # A deep tree that parses (`not not … 1`, `a[0][0]…`) is too deep for `ast.dump`/`ast.unparse`.
        raise UnknownExpression("expression nested too deeply") from None
