"""The queue of a topic's own name, bound to it: how PHPMQ, PZQ and eMQP name where a publish goes
and where their consumers read (docs/architecture.md, the shared model)."""

from __future__ import annotations

from polymq.core.engine import AUTO_DELETE_EMPTY_OPTION, MAX_ATTEMPTS_OPTION, Engine, Queue


def named_queue(engine: Engine, name: str, *, origin: str, max_attempts: int = 0,
                forget_empty_after: float | None = None) -> Queue:
    """Queue `name`, bound to topic `name`; made if missing with these settings (a max of attempts,
    deletion once empty and unused for `forget_empty_after` seconds, with its topic when nothing else
    uses that)."""
    queue = engine.queue(name)
    if queue is None or name not in queue.topics:
        if queue is None:
            options: dict[str, object] = {}
            if max_attempts:
                options[MAX_ATTEMPTS_OPTION] = max_attempts
            if forget_empty_after is not None:
                options[AUTO_DELETE_EMPTY_OPTION] = True
                forget_their_topics(engine)
            queue = engine.ensure_queue(name, auto_delete=forget_empty_after, options=options, origin=origin)
        engine.bind(name, name)
    return queue


class _TopicForgetter:
    """On the deletion of a forgotten (empty, unused) named queue: its topic goes too, when no other
    queue reads it and it holds nothing (the original servers keep no queue nobody uses)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def __call__(self, queue: Queue, bound: list[str]) -> None:
        if not queue.forgotten_empty or queue.name not in bound:
            return
        topic = self.engine.topics.get(queue.name)
        if topic is not None and not topic.queues and not topic.depth:
            self.engine.delete_topic(queue.name)


def forget_their_topics(engine: Engine) -> None:
    """Delete the topic of a forgotten named queue with it (once per engine: the protocols that name
    queues so call it at start, for the queues a restart brought back)."""
    if not any(isinstance(observer, _TopicForgetter) for observer in engine.on_queue_deleted):
        engine.on_queue_deleted.append(_TopicForgetter(engine))
