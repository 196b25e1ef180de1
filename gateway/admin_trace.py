"""The admin API's tracing (docs/operations.md, "Tracing a topic"), guarded as the rest of the API.

- `GET /api/trace`: the traced topics and their rings' counts, the trace topic, the settings;
- `GET /api/trace/recent?topic=T`: the latest traced messages of T, each with its last event and gaps;
- `GET /api/trace/find?q=TEXT`: the timelines of the traced messages one of whose ids (engine, NSQ,
  MQKS, PHPMQ, PZQ, eMQP) is TEXT, or whose kept body prefix starts with it;
- `POST /api/trace/on?topic=T`, `POST /api/trace/off?topic=T`: switch a topic's tracing (an admin
  action, as pausing is). The trace topic is refused.

Names and ids come back as the clients chose them, as JSON strings: the page shows them as text.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from polymq.adapters.http import JSON_TYPE, QueryError, Request, Response, go_json, parse_query
from polymq.core.trace import Traced, Tracer, event_json, gaps
from polymq.gateway.stream_http_api import Handler

log = logging.getLogger("polymq.trace")

# The longest topic name tracing takes: longer than any protocol's (NSQ: 64, MQKS: a line).
MAX_NAME = 1024
# A search's text at most: ids are short; a body prefix is at most --trace-body-prefix.
MAX_QUERY = 1024
NO_STORE = (("Cache-Control", "no-store"),)


def _answer(status: int, value: Any) -> Response:
    return Response(status, go_json(value), JSON_TYPE, NO_STORE)


def _failure(status: int, code: str, reason: str) -> Response:
    return _answer(status, {"message": code, "reason": reason})


class TraceApi:
    def __init__(self, tracer: Tracer) -> None:
        self.tracer = tracer

    def routes(self, guarded: Callable[[Handler], Handler]) -> dict[str, dict[str, Handler]]:
        return {
            "/api/trace": {"GET": guarded(self._state)},
            "/api/trace/recent": {"GET": guarded(self._recent)},
            "/api/trace/find": {"GET": guarded(self._find)},
            "/api/trace/on": {"POST": guarded(self._switch(True))},
            "/api/trace/off": {"POST": guarded(self._switch(False))},
        }

    def _state(self, request: Request, _: str) -> Response:
        tracer = self.tracer
        names = sorted(set(tracer.rings) | tracer.topics)
        rings = tracer.rings
        return _answer(200, {
            "topics": [{"name": name, "traced": name in tracer.topics,
                        "events": len(rings[name].events) if name in rings else 0,
                        "recorded": rings[name].recorded if name in rings else 0,
                        "dropped": rings[name].dropped if name in rings else 0} for name in names],
            "trace_topic": sorted(tracer.refused),
            "ring_size": tracer.ring_size,
            "body_prefix": tracer.body_prefix,
            "node": tracer.node,
        })

    def _recent(self, request: Request, _: str) -> Response:
        name = _param(request, b"topic")
        if isinstance(name, Response):
            return name
        return _answer(200, {"topic": name, "messages": [self._summary(traced)
                                                         for traced in self.tracer.recent(name)]})

    def _find(self, request: Request, _: str) -> Response:
        text = _param(request, b"q", MAX_QUERY)
        if isinstance(text, Response):
            return text
        return _answer(200, {"query": text, "messages": [self._timeline(traced) for traced in self.tracer.find(text)]})

    def _summary(self, traced: Traced) -> dict[str, Any]:
        events = Tracer.timeline(traced)
        last = events[-1] if events else None
        return {"message_id": traced.id, "topic": traced.topic, "ids": traced.ids, "size": traced.size,
                "protocol": traced.origin, "events": len(events),
                "last_event": None if last is None else last.kind,
                "time_ns": events[0].time_ns if events else None, "gaps": gaps(events)}

    def _timeline(self, traced: Traced) -> dict[str, Any]:
        events = Tracer.timeline(traced)
        return {"message_id": traced.id, "topic": traced.topic, "ids": traced.ids, "gaps": gaps(events),
                "events": [event_json(event, self.tracer.node) for event in events]}

    def _switch(self, on: bool) -> Handler:
        def handle(request: Request, _: str) -> Response:
            name = _param(request, b"topic")
            if isinstance(name, Response):
                return name
            if name in self.tracer.refused:
                return _failure(400, "TRACE_REFUSED", f"{name[:200]!r} is the trace topic: its own events are "
                                                      "never traced")
            if on:
                self.tracer.trace(name)
            else:
                self.tracer.untrace(name)
            log.info("tracing topic %r %s (admin API)", name, "on" if on else "off")
            return _answer(200, {"topic": name, "traced": on})

        return handle


def _param(request: Request, key: bytes, limit: int = MAX_NAME) -> str | Response:
    """The first value of `key` in the query string, as text, checked."""
    try:
        params = parse_query(request.query)
    except QueryError:
        return _failure(400, "INVALID_REQUEST", "the query string cannot be parsed")
    name = key.decode()
    values = params.get(key)
    if not values or not values[0]:
        return _failure(400, f"MISSING_ARG_{name.upper()}", f"{name} is required")
    value = values[0].decode("utf-8", "replace")
    if len(value) > limit:
        return _failure(400, f"INVALID_{name.upper()}", f"{name} is longer than {limit} characters")
    return value
