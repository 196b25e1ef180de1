"""Placeholder until the nsqd HTTP API lands: answers nothing, keeps the socket open."""

from __future__ import annotations

import socket

import trio
from polymq.adapters.nsq import NSQServer
from polymq.core.engine import Engine


async def serve_nsq_http(engine: Engine, nsq: NSQServer, sock: socket.socket, *,
                         task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    task_status.started()
    await trio.sleep_forever()
