"""The HTTP skeleton the gateway's HTTP APIs share: sans-IO requests and responses, and their
serving by hypercorn's trio worker in the gateway's trio run.

An API is sans-IO (`HttpApi.handle(Request)` answers a `Response`, or `NeedBody` when it reads
the request body: the server reads at most `read_max` bytes and calls `complete(body)`). The app
reads bodies within that bound, drains what a client sent beyond it (up to `DRAIN_LIMIT`), holds an
answer marked `after_sync` until the store has made durable everything stored so far, and sends
every response with a Content-Length (never chunked).
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import socket
from collections.abc import Awaitable, Callable
from typing import Any, Protocol
from urllib.parse import unquote_to_bytes

import attrs
import trio
from hypercorn.config import Config, Sockets
from hypercorn.trio.run import worker_serve
from hypercorn.utils import wrap_app

from polymq.core.engine import Engine

log = logging.getLogger("polymq.http")

Scope = dict[str, Any]
Receive = Callable[[], Any]
Send = Callable[[dict[str, Any]], Any]

JSON_TYPE = "application/json; charset=utf-8"
_BAD_ESCAPE = re.compile(rb"%(?![0-9a-fA-F]{2})")
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


@attrs.frozen(slots=True)
class Request:
    method: str
    path: str  # percent-decoded, as Go's req.URL.Path
    query: bytes = b""  # raw query string, parsed like Go's url.ParseQuery
    content_length: int | None = None
    headers: tuple[tuple[bytes, bytes], ...] = ()  # as received: names in lower case (ASGI)
    peer: str = ""  # the client's host:port, when the server knows it

    def header(self, name: bytes) -> bytes | None:
        """The first value of header `name` (lower case), or None."""
        return next((value for key, value in self.headers if key == name), None)


@attrs.frozen(slots=True)
class Response:
    status: int
    body: bytes = b""
    content_type: str | None = None
    headers: tuple[tuple[str, str], ...] = ()
    # Send only once everything stored so far is durable (`Storage.sync`): a publish's `OK`.
    after_sync: bool = False
    # Called once that sync is done; the answer then waits for one more sync: what it stores must
    # not reach the disk before what the first covered (a de-duplication record after its rows).
    then: Callable[[], None] | None = None
    # Without the app's base headers: nsqd's PlainText answers (/ping) skip its V1 decorator.
    plain: bool = False

    def all_headers(self, base: tuple[tuple[str, str], ...] = ()) -> list[tuple[str, str]]:
        """Headers to send: the app's (unless plain), ours, then Content-Type and Content-Length (never chunked)."""
        headers = [*(() if self.plain else base), *self.headers]
        if self.content_type is not None:
            headers.append(("Content-Type", self.content_type))
        headers.append(("Content-Length", str(len(self.body))))
        return headers


@attrs.frozen(slots=True)
class NeedBody:
    """Read at most `read_max` bytes of the body (one more than allowed, as nsqd's LimitReader)."""

    read_max: int
    complete: Callable[[bytes], Response | Later]


@attrs.frozen(slots=True)
class Later:
    """An answer that waits on I/O elsewhere (a shared engine's): `run` is awaited for the response."""

    run: Callable[[], Awaitable[Response]]


def then(answer: Response | NeedBody | Later, after: Callable[[Response], Response]) -> Response | NeedBody | Later:
    """`after` applied to the response: now, once the body a `NeedBody` waits for is read, or once a `Later` ran."""
    if isinstance(answer, NeedBody):
        complete = answer.complete
        return NeedBody(answer.read_max, lambda body: _then(complete(body), after))
    return _then(answer, after)


def _then(answer: Response | Later, after: Callable[[Response], Response]) -> Response | Later:
    if isinstance(answer, Later):
        run = answer.run

        async def ran() -> Response:
            return after(await run())

        return Later(ran)
    return after(answer)


def go_json(value: Any) -> bytes:
    """encoding/json.Marshal: compact, UTF-8, with <, >, & and U+2028/9 escaped as Go does."""
    text = json.dumps(value, separators=(",", ":"), ensure_ascii=False)
    text = (text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
            .replace("\u2028", "\\u2028").replace("\u2029", "\\u2029"))
    return text.encode("utf-8", "replace")


class QueryError(ValueError):
    pass


def parse_query(raw: bytes) -> dict[bytes, list[bytes]]:
    """url.ParseQuery: `&`-separated, `+` is a space; a `;` or a bad %-escape is an error."""
    values: dict[bytes, list[bytes]] = {}
    failed = False
    for part in raw.split(b"&"):
        if b";" in part:
            failed = True
            continue
        if not part:
            continue
        key, _, value = part.partition(b"=")
        if _BAD_ESCAPE.search(key) or _BAD_ESCAPE.search(value):
            failed = True
            continue
        key = unquote_to_bytes(key.replace(b"+", b" "))
        values.setdefault(key, []).append(unquote_to_bytes(value.replace(b"+", b" ")))
    if failed:
        # Go returns the first error; every nsqd handler then answers INVALID_REQUEST.
        raise QueryError(raw)
    return values



class _Disconnected(Exception):
    pass


class HttpApi(Protocol):
    """A sans-IO API: a request in, a response (or a request for its body) out."""

    engine: Engine

    def handle(self, request: Request) -> Response | NeedBody | Later: ...


class HttpApp:
    """ASGI 3 application over a sans-IO `HttpApi`; `base_headers` go on every response."""

    def __init__(self, api: HttpApi, storage_failed: Response, base_headers: tuple[tuple[str, str], ...] = ()) -> None:
        self.api = api
        self.storage_failed = storage_failed  # the answer when the store failed to make a publish durable
        self.base_headers = base_headers

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
            headers=tuple(scope["headers"]),
            peer=_peer(scope.get("client")),
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
        if isinstance(response, Later):
            response = await response.run()
        length = request.content_length
        if not finished and (length is None or length - consumed <= DRAIN_LIMIT):
            await _drain(receive)
        if response.after_sync:
            stored = await self._synced()
            if stored and response.then is not None:
                response.then()
                stored = await self._synced()
            if not stored:
                response = self.storage_failed
        await _send(send, response, self.base_headers)

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


def _peer(client: Any) -> str:
    """The ASGI scope's `client` (host, port) as host:port; "" when the server does not give it."""
    if not client:
        return ""
    host, port = client[0], client[1]
    return f"[{host}]:{port}" if ":" in str(host) else f"{host}:{port}"


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


async def _send(send: Send, response: Response, base: tuple[tuple[str, str], ...]) -> None:
    await send({
        "type": "http.response.start",
        "status": response.status,
        "headers": [(name.encode("latin-1"), value.encode("latin-1")) for name, value in response.all_headers(base)],
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




async def serve_http(app: HttpApp, sock: socket.socket, *,
                     task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    """Serve `app` on `sock` (bound and listening) until cancelled."""
    config = hypercorn_config()
    # HttpApp takes ASGI's messages as plain dicts; hypercorn types them as its TypedDicts.
    asgi = wrap_app(app, config.wsgi_max_body_size, "asgi")  # type: ignore[arg-type]
    async with trio.open_nursery() as nursery:
        # Hand hypercorn the socket itself (not "fd://", which would wrap the same fd twice).
        await nursery.start(lambda task_status: worker_serve(
            asgi, config, sockets=Sockets([], [sock], []), task_status=task_status))
        task_status.started()
