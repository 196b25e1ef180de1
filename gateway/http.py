"""The gateway's own HTTP listener (`--admin-port`, 4181, loopback by default): the admin page `/` and
its API `/api/...` (gateway/admin_api.py), `/ping`, `/metrics` (Prometheus), the Spark stream API.
With a token (gateway/admin_access.py) everything but `/ping` and the page itself asks for it.

It serves whatever protocols are on (turning NSQ off leaves it on), on the shared HTTP skeleton
(adapters/http.py). Errors are `{"message": "CODE", "reason": "…"}` as JSON.
"""

from __future__ import annotations

import socket
from typing import Any

import trio

from polymq.adapters.http import JSON_TYPE, HttpApp, Later, NeedBody, Request, Response, go_json, serve_http, then
from polymq.adapters.traffic import Traffic
from polymq.core.engine import Engine
from polymq.core.streams import SharedStreams
from polymq.gateway.admin_access import AdminAccess
from polymq.gateway.admin_api import AdminApi
from polymq.gateway.metrics import CONTENT_TYPE as METRICS_TYPE
from polymq.gateway.metrics import Metrics
from polymq.gateway.stream_http_api import Handler, StreamHttpApi

# Answers from this status on are errors, counted by status.
HTTP_ERROR = 400
# The answer when the store failed to make what an answer hands out durable.
STORAGE_FAILED = Response(503, go_json({"message": "EXITING", "reason": "the store failed"}), JSON_TYPE)


def _error(status: int, code: str, reason: str, headers: tuple[tuple[str, str], ...] = ()) -> Response:
    return Response(status, go_json({"message": code, "reason": reason}), JSON_TYPE, headers)


class GatewayHttpApi:
    """Routes by exact path, then by method; counts the error answers by their status (the metrics'
    `http` protocol: a bounded set of codes)."""

    def __init__(self, engine: Engine, routes: dict[str, dict[str, Handler]], traffic: Traffic | None = None) -> None:
        self.engine = engine
        self.routes = routes
        self.traffic = traffic if traffic is not None else Traffic()

    def handle(self, request: Request) -> Response | NeedBody | Later:
        return then(self._route(request), self._counted)

    def _counted(self, response: Response) -> Response:
        if response.status >= HTTP_ERROR:
            self.traffic.error(str(response.status))
        return response

    def _route(self, request: Request) -> Response | NeedBody | Later:
        methods = self.routes.get(request.path)
        if methods is None:
            return _error(404, "NOT_FOUND", f"no endpoint {request.path[:200]!r}")
        handler = methods.get(request.method)
        if handler is None:
            allowed = ", ".join(methods)
            return _error(405, "METHOD_NOT_ALLOWED", f"{request.path} takes {allowed}", (("Allow", allowed),))
        return handler(request, "")


def _with_token(access: AdminAccess, handler: Handler, what: str) -> Handler:
    """`handler` behind the gateway's token when one is required (bound beyond loopback, --admin-token)."""
    if access.token is None:
        return handler

    def guarded(request: Request, path: str) -> Response | NeedBody | Later:
        return access.token_refused(request, what) or handler(request, path)

    return guarded


def _ping(request: Request, _: str) -> Response:
    """Answers once the gateway serves: `polymq wait` and health checks ask it."""
    return Response(200, b"OK", "text/plain; charset=utf-8")


async def serve_gateway_http(engine: Engine, sock: socket.socket, options: Any, snapshot_memory: int,
                             metrics: Metrics, admin: AdminApi, *, shared_streams: SharedStreams | None = None,
                             task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    stream = StreamHttpApi(engine, max_row=options.max_row_size, max_batch=options.max_batch_size,
                           snapshot_memory=snapshot_memory, shared=shared_streams)

    def scrape(request: Request, _: str) -> Response:
        return Response(200, metrics.exposition(), METRICS_TYPE)

    access = admin.access
    stream_routes = {path: {method: _with_token(access, handler, "the stream API")
                            for method, handler in methods.items()}
                     for path, methods in stream.routes().items()}
    api = GatewayHttpApi(engine, {"/ping": {"GET": _ping},
                                  "/metrics": {"GET": _with_token(access, scrape, "/metrics")},
                                  **stream_routes, **admin.routes()}, stream.traffic)
    metrics.count_http(stream.traffic)
    await serve_http(HttpApp(api, STORAGE_FAILED), sock, task_status=task_status)
