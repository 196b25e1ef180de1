"""The nsqd HTTP API listener: an ASGI app served by hypercorn's trio worker in the gateway's trio run.

The request logic is in `nsq_http_api` (sans-IO); this module only reads bodies under a cap,
writes responses and runs hypercorn on the socket `serve.py` bound.
"""

from __future__ import annotations

import contextlib
import logging
import socket
from typing import Any

import trio
from hypercorn.config import Config, Sockets
from hypercorn.trio.run import worker_serve
from hypercorn.utils import wrap_app

from polymq.adapters.nsq import NSQServer
from polymq.core.engine import Engine
from polymq.gateway.nsq_http_api import STORAGE_FAILED, GcPauses, NeedBody, NsqHttpApi, Request, Response
from polymq.gateway.stream_http_api import StreamHttpApi

log = logging.getLogger("polymq.nsq_http")

# After answering without reading the whole body, read and drop up to this much more so the
# connection can be reused and the client sees the answer rather than a reset: Go's net/http
# does the same (maxPostHandlerReadBytes, 256 KiB). Past it, hypercorn closes the connection.
DRAIN_LIMIT = 256 * 1024
DRAIN_TIMEOUT_S = 1.0
# nsqd's http.Server has no idle timeout; hypercorn's 5 s default would drop pooled client
# connections between publishes, so keep them as long as common proxies do.
KEEP_ALIVE_TIMEOUT_S = 75.0
# How long in-flight requests get to finish when the gateway stops.
GRACEFUL_TIMEOUT_S = 3.0

Scope = dict[str, Any]
Receive = Any
Send = Any


class _Disconnected(Exception):
    pass


class NsqHttpApp:
    """ASGI 3 application over `NsqHttpApi`."""

    def __init__(self, api: NsqHttpApi) -> None:
        self.api = api

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        with contextlib.suppress(_Disconnected):  # the client left: nothing to answer
            await self._http(scope, receive, send)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _http(self, scope: Scope, receive: Receive, send: Send) -> None:
        request = Request(
            method=scope["method"],
            path=scope["path"],
            query=scope.get("query_string", b""),
            content_length=_content_length(scope["headers"]),
        )
        result = self.api.handle(request)
        finished = False
        consumed = 0
        if isinstance(result, NeedBody):
            body, finished = await _read_body(receive, result.read_max)
            consumed = len(body)
            response = result.complete(body)
        else:
            response = result
        length = request.content_length
        if not finished and (length is None or length - consumed <= DRAIN_LIMIT):
            await _drain(receive)
        if response.after_sync:
            stored = await self._synced()
            if stored and response.then is not None:
                response.then()
                stored = await self._synced()
            if not stored:
                response = STORAGE_FAILED
        await _send(send, response)

    async def _synced(self) -> bool:
        """Wait until everything stored so far is durable; False if the store failed."""
        synced = trio.Event()
        failed: list[OSError] = []

        def stored(error: OSError | None) -> None:
            if error is not None:
                failed.append(error)
            synced.set()

        self.api.engine.storage.sync(stored)
        await synced.wait()
        return not failed


def _content_length(headers: list[tuple[bytes, bytes]]) -> int | None:
    for name, value in headers:
        if name.lower() == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None  # h11 has already refused a malformed one
    return None


async def _read_body(receive: Receive, read_max: int) -> tuple[bytes, bool]:
    """Up to `read_max` bytes of the body, and whether the body ended; never buffers more."""
    chunks = bytearray()
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise _Disconnected
        chunks += message.get("body", b"")
        more = message.get("more_body", False)
        if len(chunks) >= read_max:
            del chunks[read_max:]
            return bytes(chunks), not more
        if not more:
            return bytes(chunks), True


async def _drain(receive: Receive) -> None:
    dropped = 0
    with trio.move_on_after(DRAIN_TIMEOUT_S):
        while dropped <= DRAIN_LIMIT:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise _Disconnected
            dropped += len(message.get("body", b""))
            if not message.get("more_body", False):
                return


async def _send(send: Send, response: Response) -> None:
    await send({
        "type": "http.response.start",
        "status": response.status,
        "headers": [(name.encode("latin-1"), value.encode("latin-1")) for name, value in response.all_headers()],
    })
    await send({"type": "http.response.body", "body": response.body})


def hypercorn_config() -> Config:
    config = Config()
    config.include_server_header = False  # nsqd (Go net/http) sends no Server header
    config.keep_alive_timeout = KEEP_ALIVE_TIMEOUT_S
    config.graceful_timeout = GRACEFUL_TIMEOUT_S
    config.errorlog = log
    config.accesslog = None
    return config


async def serve_nsq_http(engine: Engine, nsq: NSQServer, sock: socket.socket, snapshot_memory: int, *,
                         task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    """Serve the nsqd HTTP API on `sock` (bound and listening) until cancelled."""
    config = hypercorn_config()
    gc_pauses = GcPauses()
    gc_pauses.install()
    api = NsqHttpApi(engine, nsq, bind_host=sock.getsockname()[0], gc_pauses=gc_pauses,
                     extra_routes=StreamHttpApi(engine, lambda: nsq.limits, snapshot_memory=snapshot_memory).routes())
    app = wrap_app(NsqHttpApp(api), config.wsgi_max_body_size, "asgi")
    try:
        async with trio.open_nursery() as nursery:
            # Hand hypercorn the socket itself (not "fd://", which would wrap the same fd twice).
            await nursery.start(lambda task_status: worker_serve(
                app, config, sockets=Sockets([], [sock], []), task_status=task_status))
            task_status.started()
    finally:
        gc_pauses.uninstall()
