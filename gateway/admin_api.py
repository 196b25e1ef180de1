"""The admin API behind the admin page (docs/operations.md): `GET /api/state`, and one `POST` per action.

The state is every topic and queue the engine holds (up to `MAX_LISTED` of each, the deepest), with
the protocol that made it when the engine knows it, and every protocol's connections: counters, not
rates; the page computes rates from two readings. Actions pause, unpause, empty and delete a topic
or a queue, and put a queue's dead letters back into it; each answers once its change is durable.
Names come in the query string (`?topic=orders`, `?queue=orders/billing`), percent-encoded.
Errors are `{"message": "CODE", "reason": "…"}`. Access is checked first (gateway/admin_access.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from importlib import resources
from typing import Any

from polymq.adapters.http import JSON_TYPE, Later, QueryError, Request, Response, go_json, parse_query
from polymq.adapters.protocol import Service
from polymq.core.cluster import ClusterView
from polymq.core.dead_letters import requeue_dead_letters
from polymq.core.engine import MADE_BY_OPTION, Engine, Queue, Topic
from polymq.core.shared import SharedQueue
from polymq.core.trace import Tracer
from polymq.gateway.admin_access import AdminAccess
from polymq.gateway.admin_page import AdminPage
from polymq.gateway.admin_trace import TraceApi
from polymq.gateway.metrics import MAX_LABELLED
from polymq.gateway.stream_http_api import Handler

# Topics and queues the state lists at most (the deepest), as /metrics labels them: a gateway with a
# million queues still answers a page of bounded size; the rest are counted in `omitted`.
MAX_LISTED = MAX_LABELLED
# Names are up to this many characters in an error's reason.
REASON_NAME_CHARS = 200
NO_STORE = (("Cache-Control", "no-store"),)

Action = Callable[[Any], dict[str, Any] | Later]  # a Later answers for itself


def _answer(status: int, value: Any, after_sync: bool = False) -> Response:
    return Response(status, go_json(value), JSON_TYPE, NO_STORE, after_sync=after_sync)


def _failure(status: int, code: str, reason: str) -> Response:
    return _answer(status, {"message": code, "reason": reason})


def _deepest(items: Iterable[Any], depth: Callable[[Any], int], key: str = "name") -> tuple[list[Any], int]:
    """The `MAX_LISTED` deepest items sorted by name (`key`), and how many were left out."""
    ordered = sorted(items, key=depth, reverse=True)
    return sorted(ordered[:MAX_LISTED], key=lambda item: getattr(item, key)), max(0, len(ordered) - MAX_LISTED)


def _cluster(view: ClusterView | None) -> dict[str, Any] | None:
    """The whole cluster, for a node sharing its queues with others (core/cluster.py); None for a node alone."""
    if view is None:
        return None
    queues, omitted = _deepest(view.queues.values(), lambda queue: queue.depth)
    streams, streams_omitted = _deepest(view.streams.values(), lambda stream: stream.messages, key="topic")
    return {
        "node": view.node,
        "reporter": view.reporter,
        "nodes": [{"node": node.node, "host": node.host, "pid": node.pid, "started": node.started,
                   "heard_s": round(node.heard_s, 3), "this": node.this} for node in view.nodes],
        "queues": [{"name": queue.name, "topics": list(queue.topics), "depth": queue.depth,
                    "in_flight": queue.in_flight, "deferred": queue.deferred, "redelivered": queue.redelivered,
                    "consumers": queue.consumers, "read_s": round(queue.read_s, 3),
                    "nodes": [{"node": node, "consumers": part.consumers, "in_flight": part.in_flight,
                               "held": part.held} for node, part in queue.parts.items()]}
                   for queue in queues],
        "connected": view.connected,
        "streams": [{"topic": stream.topic, "leader": stream.leader, "messages": stream.messages,
                     "read_s": round(stream.read_s, 3),
                     "replicas": [{"server": replica.server, "current": replica.current, "lag": replica.lag,
                                   "active_s": None if replica.active_s is None else round(replica.active_s, 3),
                                   "offline": replica.offline} for replica in stream.replicas]}
                    for stream in streams],
        "omitted": {"queues": omitted, "streams": streams_omitted},
    }


class AdminApi:
    def __init__(self, engine: Engine, services: Callable[[], Mapping[str, Service]], access: AdminAccess,
                 tracer: Tracer | None = None) -> None:
        self.engine = engine
        self.services = services
        self.access = access
        self.tracer = tracer
        self.page = AdminPage(resources.files("polymq.gateway").joinpath("admin_page.html").read_bytes())

    def routes(self) -> dict[str, dict[str, Handler]]:
        routes: dict[str, dict[str, Handler]] = {"/": {"GET": self.page.serve},
                                                 "/api/state": {"GET": self._guarded(self._state)}}
        topic_actions: dict[str, Action] = {"pause": self._pause, "unpause": self._unpause, "empty": self._empty,
                                            "delete": self._delete_topic}
        queue_actions: dict[str, Action] = {"pause": self._pause, "unpause": self._unpause, "empty": self._empty,
                                            "delete": self._delete_queue, "requeue-dead": self._requeue_dead}
        for name, action in topic_actions.items():
            routes[f"/api/topic/{name}"] = {"POST": self._guarded(self._on("topic", action))}
        for name, action in queue_actions.items():
            routes[f"/api/queue/{name}"] = {"POST": self._guarded(self._on("queue", action))}
        if self.tracer is not None:
            routes.update(TraceApi(self.tracer).routes(self._guarded))
        return routes

    def _guarded(self, handler: Handler) -> Handler:
        def handle(request: Request, path: str) -> Response:
            refused = self.access.refused(request)
            if refused is not None:
                return refused
            answer = handler(request, path)
            assert isinstance(answer, Response | Later)
            return answer

        return handle

    # -- the state -----------------------------------------------------------------------------

    def _state(self, request: Request, _: str) -> Response:
        engine = self.engine
        topics, topics_omitted = _deepest(engine.topics.values(), lambda topic: topic.depth)
        queues, queues_omitted = _deepest(engine.queues.values(), lambda queue: queue.depth)
        dead_letters_of = {queue.dead_letter_topic: queue.name for queue in engine.queues.values()}
        return _answer(200, {
            "topics": [self._topic(topic, dead_letters_of.get(topic.name), self._traced(topic)) for topic in topics],
            "queues": [self._queue(queue) for queue in queues],
            "protocols": [self._protocol(name, service) for name, service in self.services().items()],
            "omitted": {"topics": topics_omitted, "queues": queues_omitted},
            "store_failure": engine.storage.failure,
            "backend": {key: value for key, value in engine.backend().items() if not key.startswith("publish_ack")},
            "cluster": _cluster(engine.cluster()),
        })

    def _traced(self, topic: Topic) -> bool | None:
        """Whether the topic is traced; None where it cannot be (the trace topic)."""
        tracer = self.tracer
        if tracer is None or topic.name in tracer.refused:
            return None
        return topic.name in tracer.topics

    @staticmethod
    def _topic(topic: Topic, dead_letters_of: str | None, traced: bool | None) -> dict[str, Any]:
        return {
            "name": topic.name,
            "traced": traced,
            "made_by": topic.made_by,
            "paused": topic.paused,
            "ephemeral": topic.ephemeral,
            "depth": topic.depth,
            "messages": topic.message_count,
            "queues": [queue.name for queue in topic.queues],
            "dead_letters_of": dead_letters_of,
        }

    def _queue(self, queue: Queue) -> dict[str, Any]:
        dead_topic = queue.dead_letter_topic
        return {
            "name": queue.name,
            "made_by": queue.options.get(MADE_BY_OPTION),
            "topics": list(queue.topics),
            "paused": queue.paused,
            "ephemeral": queue.ephemeral,
            "stream": queue.stream,
            "depth": queue.depth,
            "in_flight": len(queue.in_flight),
            "deferred": queue.deferred_count,
            "consumers": len(queue.consumers),
            "messages": queue.message_count,
            "requeued": queue.requeue_count,
            "timed_out": queue.timeout_count,
            "expired": queue.expired_count,
            "dead_lettered": queue.dead_letter_count,
            "dead_letter_topic": dead_topic,
            "dead_letters": self._dead_letters(queue, dead_topic),
        }

    def _dead_letters(self, queue: Queue, dead_topic: str) -> int:
        """Copies its dead-letter topic and the queues reading that hold, ready or deferred."""
        topic = self.engine.topics.get(dead_topic)
        if topic is None:
            return 0
        return topic.depth + sum(source.depth + source.deferred_count for source in topic.queues
                                 if source is not queue and not source.stream)

    @staticmethod
    def _protocol(name: str, service: Service) -> dict[str, Any]:
        traffic = service.traffic()
        peers = getattr(service, "peers", None)
        return {
            "name": name,
            "connections": service.connections(),
            "connections_opened": traffic.connections_opened,
            "bytes_received": traffic.bytes_in,
            "bytes_sent": traffic.bytes_out,
            "messages_received": traffic.messages_in,
            "messages_sent": traffic.messages_out,
            # None: the protocol does not list its clients (ZeroMQ hides its peers).
            "sessions": None if peers is None else [{"listener": listener, "peer": peer}
                                                    for listener, peer in peers()],
        }

    # -- actions -------------------------------------------------------------------------------

    def _on(self, kind: str, action: Action) -> Handler:
        def handle(request: Request, _: str) -> Response:
            try:
                params = parse_query(request.query)
            except QueryError:
                return _failure(400, "INVALID_REQUEST", "the query string cannot be parsed")
            values = params.get(kind.encode())
            if not values:
                return _failure(400, f"MISSING_ARG_{kind.upper()}", f"{kind} is required")
            name = values[0].decode("utf-8", "replace")
            found = (self.engine.topics if kind == "topic" else self.engine.queues).get(name)
            if found is None:
                return _failure(404, f"{kind.upper()}_NOT_FOUND", f"no {kind} {name[:REASON_NAME_CHARS]!r}")
            done = action(found)
            if isinstance(done, Later):
                return done
            return _answer(200, {kind: name, **done}, after_sync=True)

        return handle

    @staticmethod
    def _pause(item: Topic | Queue) -> dict[str, Any]:
        item.set_paused(True)
        return {"paused": True}

    @staticmethod
    def _unpause(item: Topic | Queue) -> dict[str, Any]:
        item.set_paused(False)
        return {"paused": False}

    @staticmethod
    def _empty(item: Topic | Queue) -> dict[str, Any]:
        item.empty()
        return {"depth": item.depth}

    def _delete_topic(self, topic: Topic) -> dict[str, Any]:
        # The engine's rule: the queues the topic owns go with it, the others are unbound.
        owned = [queue.name for queue in topic.queues if queue.owner_topic == topic.name]
        unbound = [queue.name for queue in topic.queues if queue.name not in owned]
        self.engine.delete_topic(topic.name)
        return {"deleted": True, "queues_deleted": owned, "queues_unbound": unbound}

    def _delete_queue(self, queue: Queue) -> dict[str, Any]:
        self.engine.delete_queue(queue.name)
        return {"deleted": True}

    def _requeue_dead(self, queue: Queue) -> dict[str, Any] | Later:
        if not isinstance(queue, SharedQueue) or queue.ephemeral:  # an ephemeral one's letters are the node's
            requeued = requeue_dead_letters(self.engine, queue)
            return {"moved": requeued.moved, "left": requeued.left}

        async def run() -> Response:  # the cluster's letters, read and stored by the shared engine
            try:
                requeued = await queue.link.requeue_dead(queue)
            except OSError as error:
                return _failure(503, "REQUEUE_FAILED", str(error))
            return _answer(200, {"queue": queue.name, "moved": requeued.moved, "left": requeued.left})

        return Later(run)
