"""A fake of nsq 1.3.0's nsq_to_file for CI, which has no Go (written from `apps/nsq_to_file/`).

Its flags, in Go's syntax; one consumer per `--topic` (channel `nsq_to_file` unless given), each
writing to `--output-dir`/`--filename-format` (`<TOPIC>.<HOST><REV>.<DATETIME>.log`: `<REV>` dropped
since this fake neither gzips, rotates nor moves files from a work dir; `<HOST>` the short hostname
or `--host-identifier`; `<DATETIME>` `--datetime-format` of now, a new name opening a new file),
opened for appending. Each message's body and a newline are written and held unfinished; every
`--sync-interval`, when max-in-flight messages are held, or when a connection is starved, the file is
fsynced and then every held message FINished. SIGINT or SIGTERM: CLS, a sync, then (messages still
coming are synced at once) exit 0 once every connection has closed, the files synced and closed.
"""

from __future__ import annotations

import os
import queue
import signal
import socket
import sys
import time
from pathlib import Path
from typing import BinaryIO

import attrs
from fake_nsq_common import (
    DURATION,
    GO_NSQ_VERSION,
    INT,
    NSQ_VERSION,
    STRING,
    Consumer,
    Delivery,
    NsqdConnection,
    catch_signals,
    check_sources,
    consumer_flags,
    fatal,
    log,
    parse_flags,
    run,
    short_hostname,
)

from polymq.codecs import nsq_client

# nsq_to_file's flag defaults (nsq_to_file.go flagSet).
CHANNEL = "nsq_to_file"
MAX_IN_FLIGHT = 200
OUTPUT_DIR = "/tmp"
DATETIME_FORMAT = "%Y-%m-%d_%H"
FILENAME_FORMAT = "<TOPIC>.<HOST><REV>.<DATETIME>.log"
SYNC_INTERVAL_S = 30.0
# The features this fake leaves out: nsq's flags for them are refused rather than ignored.
UNSUPPORTED = ["consumer-opt", "work-dir", "gzip", "gzip-level", "rotate-size", "rotate-interval",
               "skip-empty-files", "topic-pattern", "topic-refresh"]


@attrs.define(slots=True, eq=False)
class FileLogger:
    """One topic's file and the messages written to it, not yet finished."""

    consumer: Consumer
    directory: Path
    filename_format: str
    datetime_format: str
    max_in_flight: int
    out: BinaryIO | None = None
    filename: str = ""
    held: list[tuple[NsqdConnection, nsq_client.Message]] = attrs.field(factory=list)

    def current_filename(self) -> str:
        return self.filename_format.replace("<DATETIME>", time.strftime(self.datetime_format))

    def write(self, connection: NsqdConnection, message: nsq_client.Message) -> None:
        if self.out is None or self.current_filename() != self.filename:
            self.open_current()
        assert self.out is not None
        self.out.write(message.body + b"\n")
        self.held.append((connection, message))
        if len(self.held) >= self.max_in_flight or self.consumer.is_starved():
            self.sync()

    def open_current(self) -> None:
        self.close()
        self.filename = self.current_filename()
        path = self.directory / self.filename
        path.parent.mkdir(mode=0o770, parents=True, exist_ok=True)
        self.out = path.open("ab")
        log(f"[{self.consumer.topic}/{self.consumer.channel}] opening {path}")

    def sync(self) -> None:
        """fsync, then FIN what the file now holds for sure (the newest first, as nsq_to_file does)."""
        if not self.held:
            return
        assert self.out is not None
        log(f"[{self.consumer.topic}/{self.consumer.channel}] syncing {len(self.held)} records to disk")
        self.out.flush()
        os.fsync(self.out.fileno())
        while self.held:
            connection, message = self.held.pop()
            self.consumer.finish(connection, message)

    def close(self) -> None:
        if self.out is not None:
            self.sync()
            self.out.flush()
            os.fsync(self.out.fileno())
            self.out.close()
            self.out = None


def filename_format(template: str, topic: str, host_identifier: str) -> str:
    """nsq_to_file's computeFilenameFormat, for a plain file (no gzip, rotation or work dir)."""
    hostname = socket.gethostname()
    identifier = short_hostname()
    if host_identifier:
        identifier = host_identifier.replace("<SHORT_HOST>", short_hostname()).replace("<HOSTNAME>", hostname)
    return (template.replace("<REV>", "").replace("<TOPIC>", topic).replace("<HOST>", identifier)
            .replace("<PID>", str(os.getpid())))


def main(argv: list[str]) -> None:
    stop_asked = catch_signals([signal.SIGINT, signal.SIGTERM])
    values = parse_flags("nsq_to_file", argv, {
        **consumer_flags(), "log-level": (STRING, "info"), "log-prefix": (STRING, "[nsq_to_file] "),
        "channel": (STRING, CHANNEL), "max-in-flight": (INT, MAX_IN_FLIGHT), "output-dir": (STRING, OUTPUT_DIR),
        "datetime-format": (STRING, DATETIME_FORMAT), "filename-format": (STRING, FILENAME_FORMAT),
        "host-identifier": (STRING, ""), "sync-interval": (DURATION, SYNC_INTERVAL_S),
        "http-client-connect-timeout": (DURATION, 2.0), "http-client-request-timeout": (DURATION, 5.0)},
        unsupported=UNSUPPORTED)
    if values["args"]:
        fatal(f"unknown arguments: {values['args']}")
    if values["version"]:
        print(f"nsq_to_file v{NSQ_VERSION}")
        return
    if not values["channel"]:
        fatal("--channel is required")
    check_sources(values, end=".")
    if not values["topic"]:
        fatal("--topic or --topic-pattern required")
    if values["sync-interval"] <= 0:
        fatal("--sync-interval should be positive")
    user_agent = f"nsq_to_file/{NSQ_VERSION} go-nsq/{GO_NSQ_VERSION}"
    deliveries: queue.Queue[Delivery] = queue.Queue()
    loggers: dict[Consumer, FileLogger] = {}
    for topic in dict.fromkeys(values["topic"]):
        try:
            consumer = Consumer(topic, values["channel"], values["max-in-flight"], user_agent, deliveries)
        except ValueError as error:  # nsq_to_file logs it and goes on without the topic
            log(f"ERROR: couldn't create logger for new topic {topic}: {error}")
            continue
        loggers[consumer] = FileLogger(consumer, Path(values["output-dir"]),
                                       filename_format(values["filename-format"], topic, values["host-identifier"]),
                                       values["datetime-format"], values["max-in-flight"])
        consumer.connect_to_nsqds(values["nsqd-tcp-address"])
        consumer.connect_to_lookupds(values["lookupd-http-address"])
    if not loggers:  # nothing to write: nsq_to_file waits for its signal all the same
        stop_asked.wait()
        return
    stopping = False

    def handle(delivery: Delivery) -> None:
        assert delivery.connection is not None and delivery.message is not None
        logger = loggers[delivery.consumer]
        logger.write(delivery.connection, delivery.message)
        if stopping:
            logger.sync()  # no more ticks once stopping: nothing may stay held

    def tick() -> None:
        # As nsq_to_file's ticker: a file is opened (created, empty) at the first tick, and a new one
        # when the name changes.
        for logger in loggers.values():
            if logger.out is None or logger.current_filename() != logger.filename:
                logger.open_current()
            logger.sync()

    def stop() -> None:
        nonlocal stopping
        stopping = True
        for logger in loggers.values():
            logger.sync()

    run(list(loggers), deliveries, stop_asked, handle, idle=tick,
        idle_every=values["sync-interval"], on_stop=stop)
    for logger in loggers.values():
        logger.close()


if __name__ == "__main__":
    main(sys.argv[1:])
