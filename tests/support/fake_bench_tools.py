"""Fakes of nsq 1.3.0's bench_writer and bench_reader for CI, which has no Go (written from
`bench/bench_writer/bench_writer.go` and `bench/bench_reader/bench_reader.go`), run as
`python fake_bench_tools.py bench_writer|bench_reader FLAGS`.

Their flags, in Go's syntax, with the programs' defaults. Like the real ones each opens one connection per
processor (GOMAXPROCS, else the machine's CPUs), sends the magic and an IDENTIFY, then, for `--runfor`:
bench_writer MPUBs `--batch-size` messages of `--size` bytes and waits for each answer; bench_reader SUBs
`--channel` of `--topic` with `RDY --rdy` and FINs what comes. Both end with the real tools' one log line,
`duration: … - …mb/s - …ops/s - …us/op`. Their figures measure a Python client: only the bench's harness
is under test.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Any

from fake_nsq_common import DURATION, INT, NSQ_VERSION, STRING, fatal, log, parse_flags

from polymq.clients import tcp
from polymq.clients.nsq import Connection
from polymq.codecs import nsq_client

COMMON = {"runfor": (DURATION, 10.0), "nsqd-tcp-address": (STRING, "127.0.0.1:4150"), "size": (INT, 200),
          "topic": (STRING, "sub_bench"), "deadline": (STRING, "")}
FLAGS = {"bench_writer": {**COMMON, "batch-size": (INT, 200)},
         "bench_reader": {**COMMON, "channel": (STRING, "ch"), "rdy": (INT, 2500)}}
# A read waits this long at most, so a worker sees the end of its run.
READ_SLICE_S = 0.1


def _connect(values: dict[str, Any], tool: str) -> Connection:
    connection = Connection(values["nsqd-tcp-address"], timeout=30.0)
    connection.send(nsq_client.identify({"client_id": tool.removeprefix("bench_"),
                                         "hostname": tool.removeprefix("bench_"),
                                         "user_agent": f"{tool}/{NSQ_VERSION}"}))
    connection.wait_for_ok("IDENTIFY")
    return connection


def _write(values: dict[str, Any], counts: list[int], index: int) -> None:
    connection = _connect(values, "bench_writer")
    command = nsq_client.mpub(values["topic"], [b"a" * values["size"]] * values["batch-size"])
    end = time.monotonic() + values["runfor"]
    while True:
        connection.send(command)
        connection.wait_for_ok("MPUB")
        counts[index] += values["batch-size"]
        if time.monotonic() > end:
            break
    connection.close()


def _read(values: dict[str, Any], counts: list[int], index: int) -> None:
    connection = _connect(values, "bench_reader")
    connection.send(nsq_client.sub(values["topic"], values["channel"]))
    connection.wait_for_ok("SUB")
    connection.send(nsq_client.rdy(values["rdy"]))
    end = time.monotonic() + values["runfor"]
    while time.monotonic() < end:
        frame = connection.next_frame(READ_SLICE_S, heartbeats=True)
        if frame is None:
            continue
        if frame.is_message:
            connection.send(nsq_client.fin(nsq_client.decode_message(frame.data).msg_id))
            counts[index] += 1
        elif frame.is_response:
            connection.send(nsq_client.nop())  # a heartbeat
        else:
            fatal(frame.data.decode(errors="replace"))
    connection.close()


def main(tool: str, argv: list[str]) -> None:
    values = parse_flags(tool, argv, FLAGS[tool], unsupported=["deadline"])
    workers = int(os.environ.get("GOMAXPROCS") or os.cpu_count() or 1)
    counts = [0] * workers
    errors: list[BaseException] = []

    def run(index: int) -> None:
        try:
            (_write if tool == "bench_writer" else _read)(values, counts, index)
        except (OSError, tcp.Closed, TimeoutError, ValueError, nsq_client.FrameError) as error:
            errors.append(error)

    start = time.monotonic()
    threads = [threading.Thread(target=run, args=(index,)) for index in range(workers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    duration = time.monotonic() - start
    if errors:
        fatal(str(errors[0]))
    total = sum(counts)
    log(f"[{tool}] duration: {duration:.6f}s - {total * values['size'] / duration / 1024 / 1024:.03f}mb/s - "
        f"{total / duration:.03f}ops/s - {duration * 1e6 / max(total, 1):.03f}us/op")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
