"""A fake of nsq 1.3.0's to_nsq for CI, which has no Go (written from `apps/to_nsq/to_nsq.go` and
go-nsq's producer).

Its flags, in Go's syntax. Reads stdin up to each `--delimiter` byte; the chunk less its last byte
(to_nsq drops the last byte even of a final chunk that has no delimiter), when not empty, is
PUBlished to every `--nsqd-tcp-address`, each publish waiting for its OK; a connection is made at the
first publish (magic, IDENTIFY). `--rate=N` spaces the publishes at N a second. At the end of
stdin, or on SIGINT or SIGTERM, the connections are closed and it exits 0; an error answer is fatal.
"""

from __future__ import annotations

import signal
import sys
import threading
import time
from typing import Any

from fake_nsq_common import (
    GO_NSQ_VERSION,
    INT,
    LIST,
    NSQ_VERSION,
    STRING,
    catch_signals,
    connect_identified,
    exit_now,
    fatal,
    log,
    parse_flags,
)

from polymq.clients import tcp
from polymq.clients.nsq import Connection, ErrorFrame
from polymq.codecs import nsq_client


def publish_all(values: dict[str, Any], done: threading.Event) -> None:
    addresses: list[str] = list(dict.fromkeys(values["nsqd-tcp-address"]))
    topic: str = values["topic"]
    delimiter: bytes = values["delimiter"].encode()
    rate: int = values["rate"]
    user_agent = f"to_nsq/{NSQ_VERSION} go-nsq/{GO_NSQ_VERSION}"
    connections: dict[str, Connection] = {}
    stdin = sys.stdin.buffer
    if rate >= 1:
        log(f"Throttling messages rate to max:{rate}/second")
    next_publish = time.monotonic()
    while True:
        chunk = bytearray()
        while not chunk.endswith(delimiter):
            byte = stdin.read(1)
            if not byte:
                break
            chunk += byte
        at_end = not chunk.endswith(delimiter)
        body = bytes(chunk[:-1])
        if body:
            if rate >= 1:
                time.sleep(max(0.0, next_publish - time.monotonic()))
                next_publish = max(next_publish, time.monotonic()) + 1 / rate
            for address in addresses:
                try:
                    if address not in connections:
                        connections[address] = connect_identified(address, user_agent)[0]
                    connection = connections[address]
                    connection.send(nsq_client.pub(topic, body))
                    connection.wait_for_ok("PUB")
                except (OSError, ErrorFrame, TimeoutError, tcp.Closed, nsq_client.FrameError, ValueError) as error:
                    fatal(str(error))
        if at_end:
            break
    for connection in connections.values():
        connection.close()
    done.set()


def main(argv: list[str]) -> None:
    values = parse_flags("to_nsq", argv, {"topic": (STRING, ""), "delimiter": (STRING, "\n"), "rate": (INT, 0),
                                          "nsqd-tcp-address": (LIST, [])}, unsupported=["producer-opt"])
    if not values["topic"]:
        fatal("--topic required")
    if len(values["delimiter"].encode()) != 1:
        fatal("--delimiter must be a single byte")
    done = catch_signals([signal.SIGINT, signal.SIGTERM])
    if not values["nsqd-tcp-address"]:
        fatal("--nsqd-tcp-address required")
    worker = threading.Thread(target=publish_all, args=(values, done), daemon=True)
    worker.start()
    done.wait()
    exit_now(0)


if __name__ == "__main__":
    main(sys.argv[1:])
