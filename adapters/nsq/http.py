"""The nsqd HTTP API listener: `NsqHttpApi` (sans-IO, `http_api.py`) on the shared HTTP skeleton."""

from __future__ import annotations

import socket

import trio

from polymq.adapters.http import HttpApp, serve_http
from polymq.adapters.nsq.http_api import NSQ_CONTENT_TYPE_HEADER, STORAGE_FAILED, GcPauses, NsqHttpApi
from polymq.adapters.nsq.lookupd import LookupdRegistrar
from polymq.adapters.nsq.tcp import NSQServer
from polymq.core.engine import Engine


def nsq_http_app(api: NsqHttpApi) -> HttpApp:
    """Every nsqd API response carries nsqd's content-type header."""
    return HttpApp(api, STORAGE_FAILED, base_headers=(NSQ_CONTENT_TYPE_HEADER,))


async def serve_nsq_http(engine: Engine, nsq: NSQServer, sock: socket.socket, *, info_extra: dict[str, str],
                         lookupd: LookupdRegistrar | None = None,
                         task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    """Serve the nsqd HTTP API on `sock` (bound and listening) until cancelled."""
    gc_pauses = GcPauses()
    gc_pauses.install()
    api = NsqHttpApi(engine, nsq, bind_host=sock.getsockname()[0], gc_pauses=gc_pauses, info_extra=info_extra,
                     lookupd=lookupd)
    try:
        await serve_http(nsq_http_app(api), sock, task_status=task_status)
    finally:
        gc_pauses.uninstall()
