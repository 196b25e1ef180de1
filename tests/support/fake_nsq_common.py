"""What the fakes of nsq's tools share: Go's flag syntax, lookupd and nsqd HTTP reads, and a consumer
that behaves on the wire as go-nsq 1.1.0's (the library nsq 1.3.0's tools are built with).

Written from go-nsq's `consumer.go`, `conn.go` and `config.go` and nsq's `internal/clusterinfo` at
v1.3.0 (CI has no Go). The consumer: the first lookupd query at once, then one after a random jitter
and one every poll interval, and one as soon as a connection closes; each producer found is connected
with IDENTIFY (feature negotiation) and SUB; the max-in-flight is spread over the connections
(`perConnMaxInFlight`, never more than the total) with RDY sent when a count changes; a message past
the max attempts is finished unread; CLS on stop, and a connection closes once nsqd has answered
CLOSE_WAIT and nothing is in flight. Messages reach the program's main thread through a queue; it
finishes them when it decides to (nsq_to_file, after a sync).

The fakes are run as `python path/to/fake_<tool>.py`; they import this module as their sibling.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import random
import re
import signal
import socket
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

import attrs

from polymq.clients import tcp
from polymq.clients.nsq import Connection, ErrorFrame
from polymq.codecs import nsq_client
from polymq.codecs.nsq import CLOSE_WAIT, HEARTBEAT, OK

# nsq's internal/version: the version the tools report (`--version`, user agents).
NSQ_VERSION = "1.3.0"
# go-nsq's VERSION in the release nsq 1.3.0's go.mod names.
GO_NSQ_VERSION = "1.1.0"
# go-nsq config.go defaults.
LOOKUPD_POLL_INTERVAL_S = 60.0
LOOKUPD_POLL_JITTER = 0.3
HEARTBEAT_INTERVAL_MS = 30_000
OUTPUT_BUFFER_SIZE = 16384
OUTPUT_BUFFER_TIMEOUT_MS = 250
DEFLATE_LEVEL = 6
MAX_ATTEMPTS = 5
READ_TIMEOUT_S = 60.0  # go-nsq's read_timeout
DIAL_TIMEOUT_S = 1.0  # go-nsq's dial_timeout
# go-nsq consumer.go: an RDY that could not be sent (over max-in-flight) is tried again after 5 s.
RDY_RETRY_S = 5.0
# go-nsq Consumer.Stop: past this, the consumer exits even with messages still held.
STOP_TIMEOUT_S = 30.0
# nsq's internal/http_api: the Accept header of the v1 API, and the tools' HTTP timeouts.
ACCEPT_V1 = "application/vnd.nsq; version=1.0"
HTTP_REQUEST_TIMEOUT_S = 5.0
# Go's log.Fatal exits 1; its flag package exits 2 on a bad command line.
EXIT_FATAL = 1
EXIT_USAGE = 2

# go-nsq protocol.go isValidName: what NewConsumer accepts as a topic or channel name.
_VALID_NAME = re.compile(r"^[.a-zA-Z0-9_-]+(#ephemeral)?$")
MAX_NAME_LENGTH = 64
# Go's net/http client names itself so; go-nsq and nsq's http_api set no User-Agent of their own.
HTTP_USER_AGENT = "Go-http-client/1.1"

_DURATION_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h)")
_DURATION_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def log(line: str) -> None:
    sys.stderr.write(time.strftime("%Y/%m/%d %H:%M:%S ") + line + "\n")
    sys.stderr.flush()


def fatal(line: str) -> NoReturn:
    """Go's log.Fatal: the line, then exit 1 at once, from whichever thread."""
    log(line)
    exit_now(EXIT_FATAL)


def parse_duration(text: str) -> float:
    """Go's time.ParseDuration, in seconds ("100ms", "1m30s", "0")."""
    if text == "0":
        return 0.0
    sign = -1.0 if text.startswith("-") else 1.0
    rest = text.lstrip("+-")
    total, position = 0.0, 0
    while position < len(rest):
        match = _DURATION_PART.match(rest, position)
        if match is None:
            raise ValueError(f'time: invalid duration "{text}"')
        total += float(match.group(1)) * _DURATION_UNITS[match.group(2)]
        position = match.end()
    if not rest:
        raise ValueError(f'time: invalid duration "{text}"')
    return sign * total


# A flag's kind: how Go's flag package reads its value.
STRING, INT, BOOL, DURATION, LIST = "string", "int", "bool", "duration", "list"


def parse_flags(program: str, argv: Sequence[str], spec: dict[str, tuple[str, Any]],
                unsupported: Sequence[str] = ()) -> dict[str, Any]:
    """Go's flag package: `-name value`, `--name=value`, `-name` alone for a bool, repeated for a
    list; parsing stops at `--` or the first argument that is not a flag. `spec` maps a name to its
    kind and default. A flag in `unsupported` is nsq's but not this fake's: it is refused, saying so."""
    values = {name: (list(default) if kind == LIST else default) for name, (kind, default) in spec.items()}
    values["args"] = []
    arguments = list(argv)
    while arguments:
        argument = arguments.pop(0)
        if argument == "--":
            break
        if not argument.startswith("-") or argument == "-":
            arguments.insert(0, argument)
            break
        name, has_value, value = argument.lstrip("-").partition("=")
        if name in unsupported:
            sys.stderr.write(f"{program}: --{name} is not supported by this test fake of {program}\n")
            sys.exit(EXIT_USAGE)
        if name not in spec:
            sys.stderr.write(f"flag provided but not defined: -{name}\n")
            sys.exit(EXIT_USAGE)
        kind = spec[name][0]
        if kind == BOOL:
            values[name] = value.lower() in ("1", "t", "true") if has_value else True
            continue
        if not has_value:
            if not arguments:
                sys.stderr.write(f"flag needs an argument: -{name}\n")
                sys.exit(EXIT_USAGE)
            value = arguments.pop(0)
        try:
            if kind == INT:
                values[name] = int(value)
            elif kind == DURATION:
                values[name] = parse_duration(value)
            elif kind == LIST:
                values[name].append(value)
            else:
                values[name] = value
        except ValueError as error:
            sys.stderr.write(f'invalid value "{value}" for flag -{name}: {error}\n')
            sys.exit(EXIT_USAGE)
    values["args"] = arguments
    return values


def get_v1(address: str, path: str, timeout: float = HTTP_REQUEST_TIMEOUT_S) -> Any:
    """GET of nsq's v1 HTTP API (internal/http_api GETV1): any status but 200 is an error."""
    request = urllib.request.Request(f"http://{address}{path}",
                                     headers={"Accept": ACCEPT_V1, "User-Agent": HTTP_USER_AGENT})
    with urllib.request.urlopen(request, timeout=timeout) as reply:
        return json.load(reply)


def lookup_path(topic: str) -> str:
    return "/lookup?topic=" + urllib.parse.quote_plus(topic)


def short_hostname() -> str:
    return socket.gethostname().split(".")[0]


def identify_body(user_agent: str) -> dict[str, Any]:
    """go-nsq conn.go's IDENTIFY with its config's defaults."""
    hostname = socket.gethostname()
    client_id = hostname.split(".")[0]
    return {"client_id": client_id, "hostname": hostname, "user_agent": user_agent,
            "short_id": client_id, "long_id": hostname, "tls_v1": False, "deflate": False,
            "deflate_level": DEFLATE_LEVEL, "snappy": False, "feature_negotiation": True,
            "heartbeat_interval": HEARTBEAT_INTERVAL_MS, "sample_rate": 0,
            "output_buffer_size": OUTPUT_BUFFER_SIZE, "output_buffer_timeout": OUTPUT_BUFFER_TIMEOUT_MS,
            "msg_timeout": 0}


def connect_identified(address: str, user_agent: str) -> tuple[Connection, dict[str, Any]]:
    """A connection past the magic and IDENTIFY; nsqd's negotiated settings (empty if it said OK)."""
    conn = Connection(address, DIAL_TIMEOUT_S)
    conn.timeout = READ_TIMEOUT_S
    conn.send(nsq_client.identify(identify_body(user_agent)))
    while True:
        frame = conn.next_frame(heartbeats=True)
        if frame is None:
            conn.close()
            raise TimeoutError(f"no answer to IDENTIFY from {address}")
        if frame.is_error:
            conn.close()
            raise ErrorFrame(f"IDENTIFY: {frame.data.decode(errors='replace')}")
        if frame.is_response and frame.data == HEARTBEAT:
            conn.send(nsq_client.nop())
            continue
        if frame.is_response:
            return conn, ({} if frame.data == OK else json.loads(frame.data))
        conn.close()
        raise nsq_client.FrameError(f"IDENTIFY: unexpected frame {frame!r}")


@attrs.define(slots=True, eq=False)
class NsqdConnection:
    """One subscribed connection of a consumer, and its RDY and in-flight counts."""

    address: str
    conn: Connection
    max_rdy: int
    rdy: int = 0
    last_rdy: int = 0
    in_flight: int = 0
    close_wait: bool = False  # nsqd acknowledged CLS
    closed: bool = False
    lock: threading.Lock = attrs.field(factory=threading.Lock)  # writes from several threads
    retry: threading.Timer | None = None

    def send(self, data: bytes) -> None:
        with self.lock:
            try:
                self.conn.send(data)
            except OSError as error:
                log(f"({self.address}) error writing - {error}")

    def shut(self) -> None:
        """Ends the connection; its reader then sees the end and removes it."""
        with contextlib.suppress(OSError):
            self.conn.sock.shutdown(socket.SHUT_RDWR)


@attrs.frozen(slots=True)
class Delivery:
    """A message from one connection, for the program's main thread; `message` None: the consumer stopped."""

    consumer: Consumer
    connection: NsqdConnection | None
    message: nsq_client.Message | None


class Consumer:
    """go-nsq's Consumer for one topic and channel, without backoff (the tools never requeue)."""

    def __init__(self, topic: str, channel: str, max_in_flight: int, user_agent: str,
                 deliveries: queue.Queue[Delivery]) -> None:
        """Raises ValueError for a name go-nsq refuses ("invalid topic name", "invalid channel name")."""
        for kind, name in (("topic", topic), ("channel", channel)):
            if not (1 <= len(name) <= MAX_NAME_LENGTH and _VALID_NAME.match(name)):
                raise ValueError(f"invalid {kind} name")
        self.topic, self.channel = topic, channel
        self.max_in_flight = max_in_flight
        self.user_agent = user_agent
        self.deliveries = deliveries
        self.prefix = f"[{topic}/{channel}]"
        self.lock = threading.RLock()
        self.connections: dict[str, NsqdConnection] = {}  # in the order they were made
        self.pending: set[str] = set()
        self.total_rdy = 0
        self.nsqd_addresses: list[str] = []
        self.lookupds: list[str] = []
        self.lookupd_index = 0
        self.stopping = threading.Event()
        self.stopped = False
        self.recheck = threading.Event()

    # discovery

    def connect_to_nsqds(self, addresses: Sequence[str]) -> None:
        for address in addresses:
            error = self.connect_to_nsqd(address)
            if error:
                fatal(error)

    def connect_to_lookupds(self, addresses: Sequence[str]) -> None:
        """The first query now; then a thread polls as go-nsq's lookupdLoop does."""
        if not addresses:
            return
        self.lookupds = list(dict.fromkeys(addresses))
        self.query_lookupd()
        threading.Thread(target=self._lookupd_loop, daemon=True).start()

    def _lookupd_loop(self) -> None:
        jitter = random.random() * LOOKUPD_POLL_JITTER * LOOKUPD_POLL_INTERVAL_S
        if self.stopping.wait(jitter):
            return
        next_poll = time.monotonic() + LOOKUPD_POLL_INTERVAL_S
        while not self.stopping.is_set():
            if self.recheck.wait(max(0.0, next_poll - time.monotonic())):
                self.recheck.clear()
            else:
                next_poll += LOOKUPD_POLL_INTERVAL_S
            if not self.stopping.is_set():
                self.query_lookupd()

    def query_lookupd(self) -> None:
        # Up to three tries, each with the next lookupd, as go-nsq's queryLookupd.
        for _ in range(3):
            lookupd = self.lookupds[self.lookupd_index % len(self.lookupds)]
            self.lookupd_index = (self.lookupd_index + 1) % len(self.lookupds)
            log(f"{self.prefix} querying nsqlookupd http://{lookupd}{lookup_path(self.topic)}")
            try:
                answer = get_v1(lookupd, lookup_path(self.topic))
            except (OSError, ValueError) as error:
                log(f"{self.prefix} error querying nsqlookupd ({lookupd}) - {error}")
                continue
            for producer in answer.get("producers") or []:
                address = f"{producer['broadcast_address']}:{producer['tcp_port']}"
                error_text = self.connect_to_nsqd(address)
                if error_text:
                    log(f"{self.prefix} ({address}) error connecting to nsqd - {error_text}")
            return

    # connections

    def connect_to_nsqd(self, address: str) -> str | None:
        """Connects and subscribes; an error's text, or None (also when already connected)."""
        with self.lock:
            if self.stopping.is_set():
                return "consumer stopped"
            if address in self.connections or address in self.pending:
                return None
            self.pending.add(address)
            if address not in self.nsqd_addresses:
                self.nsqd_addresses.append(address)
        log(f"{self.prefix} ({address}) connecting to nsqd")
        try:
            conn, settings = connect_identified(address, self.user_agent)
        except (OSError, ErrorFrame, TimeoutError, tcp.Closed, nsq_client.FrameError, ValueError) as error:
            with self.lock:
                self.pending.discard(address)
            return str(error)
        max_rdy = int(settings.get("max_rdy_count", 2500))  # nsqd's --max-rdy-count default
        if max_rdy < self.max_in_flight:
            log(f"{self.prefix} ({address}) max RDY count {max_rdy} < consumer max in flight "
                f"{self.max_in_flight}, truncation possible")
        connection = NsqdConnection(address, conn, max_rdy)
        try:
            conn.send(nsq_client.sub(self.topic, self.channel))
        except OSError as error:
            conn.close()
            with self.lock:
                self.pending.discard(address)
            return f"failed to subscribe to {self.topic}:{self.channel} - {error}"
        with self.lock:
            self.pending.discard(address)
            self.connections[address] = connection
            late = self.stopping.is_set()  # stop() sent CLS while this one was being made
        threading.Thread(target=self._read, args=(connection,), daemon=True).start()
        if late:
            connection.send(nsq_client.cls())
            return None
        with self.lock:
            for each in list(self.connections.values()):
                self.update_rdy(each, self.per_connection_max_in_flight())
        return None

    def per_connection_max_in_flight(self) -> int:
        share = self.max_in_flight / max(1, len(self.connections))
        return int(min(max(1.0, share), float(self.max_in_flight)))

    def update_rdy(self, connection: NsqdConnection, count: int) -> None:
        """go-nsq's updateRDY: never over nsqd's max, never over the consumer's max-in-flight."""
        with self.lock:
            if connection.closed or connection.close_wait:
                return
            count = min(count, connection.max_rdy)
            if connection.retry is not None:
                connection.retry.cancel()
                connection.retry = None
            possible = self.max_in_flight - self.total_rdy + connection.rdy
            if 0 < possible < count:
                count = possible
            if possible <= 0 and count > 0:
                if connection.rdy == 0:
                    wanted = count
                    connection.retry = threading.Timer(RDY_RETRY_S, lambda: self.update_rdy(connection, wanted))
                    connection.retry.daemon = True
                    connection.retry.start()
                return
            if count == 0 and connection.last_rdy == 0:
                return
            self.total_rdy += count - connection.rdy
            last, connection.rdy = connection.last_rdy, count
            if count != last:
                connection.last_rdy = count
                connection.send(nsq_client.rdy(count))

    def _read(self, connection: NsqdConnection) -> None:
        conn = connection.conn
        try:
            while True:
                frame = conn.next_frame(timeout=READ_TIMEOUT_S, heartbeats=True)
                if frame is None:
                    log(f"{self.prefix} ({connection.address}) IO error - read timeout")
                    break
                if frame.is_message:
                    message = nsq_client.decode_message(frame.data)
                    if message.attempts > MAX_ATTEMPTS:
                        log(f"{self.prefix} msg {message.msg_id.decode(errors='replace')} attempted "
                            f"{message.attempts} times, giving up")
                        connection.send(nsq_client.fin(message.msg_id))
                        continue
                    with self.lock:
                        connection.in_flight += 1
                    self.deliveries.put(Delivery(self, connection, message))
                elif frame.is_response and frame.data == HEARTBEAT:
                    connection.send(nsq_client.nop())
                elif frame.is_response and frame.data == CLOSE_WAIT:
                    log(f"{self.prefix} ({connection.address}) received CLOSE_WAIT from nsqd")
                    with self.lock:
                        connection.close_wait = True
                    self.maybe_close(connection)
                elif frame.is_error:
                    log(f"{self.prefix} ({connection.address}) protocol error - {frame.data.decode(errors='replace')}")
        except (tcp.Closed, OSError, nsq_client.FrameError) as error:
            if not connection.close_wait:
                log(f"{self.prefix} ({connection.address}) IO error - {error}")
        self._closed(connection)

    def _closed(self, connection: NsqdConnection) -> None:
        connection.conn.close()
        with self.lock:
            connection.closed = True
            if connection.retry is not None:
                connection.retry.cancel()
            self.total_rdy -= connection.rdy
            connection.rdy = 0
            self.connections.pop(connection.address, None)
            left = len(self.connections) + len(self.pending)
        log(f"{self.prefix} ({connection.address}) finished draining, cleanly exiting connection")
        if self.stopping.is_set():
            if left == 0:
                self._finish_stop()
        elif self.lookupds:
            self.recheck.set()  # go-nsq asks the lookupd again at once
        else:
            threading.Thread(target=self._reconnect, args=(connection.address,), daemon=True).start()

    def _reconnect(self, address: str) -> None:
        # go-nsq: a connection given as an nsqd address is tried again every poll interval.
        while not self.stopping.wait(LOOKUPD_POLL_INTERVAL_S):
            log(f"{self.prefix} ({address}) re-connecting to nsqd")
            error = self.connect_to_nsqd(address)
            if error is None:
                return
            log(f"{self.prefix} ({address}) error connecting to nsqd - {error}")

    # messages

    def finish(self, connection: NsqdConnection, message: nsq_client.Message) -> None:
        connection.send(nsq_client.fin(message.msg_id))
        with self.lock:
            connection.in_flight -= 1
        self.maybe_close(connection)

    def maybe_close(self, connection: NsqdConnection) -> None:
        with self.lock:
            done = connection.close_wait and connection.in_flight == 0 and not connection.closed
        if done:
            connection.shut()

    def is_starved(self) -> bool:
        """go-nsq IsStarved: a connection holds 85 % of its RDY count or more in flight."""
        with self.lock:
            return any(c.in_flight > 0 and c.in_flight >= int(c.rdy * 0.85) for c in self.connections.values())

    # stopping

    def stop(self) -> None:
        """CLS on every connection; a Delivery with no message comes once every one has closed."""
        with self.lock:
            if self.stopping.is_set():
                return
            self.stopping.set()
            self.recheck.set()
            connections = list(self.connections.values())
            nothing_open = not connections and not self.pending
        log(f"{self.prefix} stopping...")
        if nothing_open:
            self._finish_stop()
            return
        for connection in connections:
            connection.send(nsq_client.cls())
        timer = threading.Timer(STOP_TIMEOUT_S, self._finish_stop)
        timer.daemon = True
        timer.start()

    def _finish_stop(self) -> None:
        with self.lock:
            if self.stopped:
                return
            self.stopped = True
        self.deliveries.put(Delivery(self, None, None))


def consumer_flags() -> dict[str, tuple[str, Any]]:
    """The flags every consumer tool has."""
    return {"version": (BOOL, False), "nsqd-tcp-address": (LIST, []), "lookupd-http-address": (LIST, []),
            "topic": (LIST, [])}


def check_sources(values: dict[str, Any], end: str = "") -> None:
    """One of the two ways to find nsqds, not both (`end`: nsq_to_file's message has a full stop)."""
    if not values["nsqd-tcp-address"] and not values["lookupd-http-address"]:
        fatal(f"--nsqd-tcp-address or --lookupd-http-address required{end}")
    if values["nsqd-tcp-address"] and values["lookupd-http-address"]:
        fatal("use --nsqd-tcp-address or --lookupd-http-address not both")


def catch_signals(signals: Sequence[int]) -> threading.Event:
    """An event set when one of `signals` comes (Go's signal.Notify, done first in each tool's main)."""
    caught = threading.Event()
    for number in signals:
        signal.signal(number, lambda *_: caught.set())
    return caught


def exit_now(status: int = 0) -> NoReturn:
    """Go's os.Exit: no cleanup, what was written to stdout is already out."""
    sys.stdout.flush()
    os._exit(status)


# How often the main thread looks at whether a signal asked it to stop, while no message comes.
SIGNAL_CHECK_S = 0.2


def run(consumers: Sequence[Consumer], deliveries: queue.Queue[Delivery], asked: threading.Event,
        handle: Callable[[Delivery], None], idle: Callable[[], None] | None = None,
        idle_every: float = SIGNAL_CHECK_S, on_stop: Callable[[], None] | None = None) -> None:
    """The main thread's loop: each message to `handle`; `idle()` every `idle_every` seconds until
    `asked` is set (a signal); then every consumer stopped and `on_stop()`; returns once every
    consumer has stopped."""
    running = set(consumers)
    stopping = False
    next_idle = time.monotonic() + idle_every
    while running:
        if asked.is_set() and not stopping:
            stopping = True
            for consumer in consumers:
                consumer.stop()
            if on_stop is not None:
                on_stop()
        try:
            delivery = deliveries.get(timeout=max(0.0, min(SIGNAL_CHECK_S, next_idle - time.monotonic())))
        except queue.Empty:
            delivery = None
        if delivery is not None:
            if delivery.message is None:
                running.discard(delivery.consumer)
            else:
                handle(delivery)
        if idle is not None and not stopping and time.monotonic() >= next_idle:
            next_idle = time.monotonic() + idle_every
            idle()
