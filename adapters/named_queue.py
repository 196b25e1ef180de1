"""The queue of a topic's own name, bound to it: how PHPMQ, PZQ and eMQP name where a publish goes
and where their consumers read (docs/architecture.md, the shared model)."""

from __future__ import annotations

from polymq.core.engine import AUTO_DELETE_EMPTY_OPTION, MAX_ATTEMPTS_OPTION, Engine, Queue


def named_queue(engine: Engine, name: str, *, origin: str, max_attempts: int = 0,
                forget_empty_after: float | None = None) -> Queue:
    """Queue `name`, bound to topic `name`; made if missing with these settings (a max of attempts,
    deletion once empty and unused for `forget_empty_after` seconds)."""
    queue = engine.queue(name)
    if queue is None or name not in queue.topics:
        if queue is None:
            options: dict[str, object] = {}
            if max_attempts:
                options[MAX_ATTEMPTS_OPTION] = max_attempts
            if forget_empty_after is not None:
                options[AUTO_DELETE_EMPTY_OPTION] = True
            queue = engine.ensure_queue(name, auto_delete=forget_empty_after, options=options, origin=origin)
        engine.bind(name, name)
    return queue
