"""pynsq 0.9.1's Reader given only lookupd addresses: finds the nodes of a topic and reads them all.

One JSON request on stdin: lookupd_http (["host:port", ...]), topic, channel, count, quiet_s,
deadline_s. It FINs every message, waits `quiet_s` past the `count`-th for anything more (a
duplicate would show), then prints one JSON result: received (body base64, attempts, id), the
nodes it connected to, errors.
"""

from __future__ import annotations

import base64
import json
import logging
import sys
import time

import nsq
import tornado.ioloop

request = json.load(sys.stdin)
result: dict = {"received": [], "connected": [], "errors": []}
started = time.monotonic()


class Errors(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        if record.levelno >= logging.ERROR:
            result["errors"].append(record.getMessage())


logging.getLogger().addHandler(Errors())


def handler(message: nsq.Message) -> bool:
    result["received"].append({"body": base64.b64encode(message.body).decode(), "attempts": message.attempts,
                               "id": message.id.decode()})
    return True  # FIN


reader = nsq.Reader(topic=request["topic"], channel=request["channel"],
                    lookupd_http_addresses=request["lookupd_http"], message_handler=handler, max_in_flight=30)
full_since: list[float] = []


def check() -> None:
    result["connected"] = sorted(reader.conns)
    if len(result["received"]) >= request["count"] and not full_since:
        full_since.append(time.monotonic())
    late = time.monotonic() - started > request["deadline_s"]
    if late or (full_since and time.monotonic() - full_since[0] >= request["quiet_s"]):
        if late:
            result["errors"].append("deadline passed")
        reader.close()
        tornado.ioloop.IOLoop.current().stop()


tornado.ioloop.PeriodicCallback(check, 20).start()
tornado.ioloop.IOLoop.current().start()
print(json.dumps(result))
