"""`polymq conformance mqks`: black-box checks of any MQKS-compatible server (one TCP port).

Every check is written from how MQKS v0.4.3 (one worker) behaves on the wire, so the suite
passes against the original server as well as against polymq (docs/protocols/mqks.md). Where
polymq deliberately differs from a defect of the original, both forms are accepted, or the
behaviour is not checked: a TAB may close the connection or answer `{id} error …`; `_eval` is
only asked `len(state.queues)` and a queue's events, as the original's own tests ask; a delivery
may arrive before the `ok ` of its own `consume --confirm`.

Each check opens its own connections (blocking sockets with timeouts, so a broken server makes a
check fail rather than hang), uses queue, event and id names unique to the run, and deletes its
queues (`delete_queue --confirm`) afterwards. "Nothing more arrived" is tested with a ping round
trip as a barrier (responses of one connection come in order), after a short quiet wait when the
thing that must not arrive would come from another connection. The checks that count queues
with `_eval len(state.queues)` assume no other client creates or deletes queues meanwhile. Only
`polymq.clients`, `polymq.codecs` and the shared runner are imported (docs/architecture.md).
"""

from __future__ import annotations

import datetime
import re
import secrets
import select
import time
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from typing import Any

import attrs
import click

from polymq.clients import mqks_blocking
from polymq.clients.tcp import Closed
from polymq.codecs import mqks_client as mc
from polymq.codecs.mqks import ALL_FLAG, ID_LENGTH, MANUAL_ACK_FLAG, NO_ID, WHEN_UNUSED_FLAG
from polymq.conformance import runner
from polymq.conformance.runner import CheckFailed, Registry, expect_equal

# ---------------------------------------------------------------------------------------------
# What the original does (docs/protocols/mqks.md)

# A one-worker deployment of the original listens on 25000 (`port_for_clients`, docs/protocols/mqks.md).
DEFAULT_ADDRESS = "127.0.0.1:25000"
# error_id: UTC `%Y%m%d%H%M%S%f` (20 digits) + 4 base62 characters (docs/protocols/mqks.md).
ERROR_ID_TIME_DIGITS = 20
ERROR_ID_TIME_FORMAT = "%Y%m%d%H%M%S%f"
_ERROR_ID = re.compile(rf"[0-9]{{{ERROR_ID_TIME_DIGITS}}}[0-9A-Za-z]{{{ID_LENGTH - ERROR_ID_TIME_DIGITS}}}")
UPDATE_PREFIX = "--update"  # the data of a `--update` line starts with it (docs/protocols/mqks.md)

# ---------------------------------------------------------------------------------------------
# Timing

# How long a check watches for "nothing arrives" from another connection before its ping
# barrier. Well above loopback latency; the original delivers from a greenlet at once.
QUIET_S = 0.25
# `--delete-queue-when-unused=N` checks: N is short so the suite stays fast; the margin lets the
# server's timer fire (docs/protocols/mqks.md: "wait N s for a new consumer, then delete").
WHEN_UNUSED_S = 0.3
WHEN_UNUSED_MARGIN_S = 0.4
# Accepted difference between an error id's timestamp and this machine's clock.
CLOCK_SKEW_S = 60.0
# Cleanup must not make a run slow when the server is broken.
CLEANUP_TIMEOUT_S = 2.0
# Messages published in the competing-consumers check (enough that both consumers are tried).
COMPETING_MESSAGES = 10


def show_lines(lines: Iterable[bytes]) -> str:
    shown = [repr(line) for line in lines]
    return ", ".join(shown) if shown else "nothing"


# ---------------------------------------------------------------------------------------------
# One TCP connection


class Conn(runner.CheckedConnection, mqks_blocking.Connection):
    """The blocking MQKS client, its failures told as CheckFailed."""

    def __init__(self, address: tuple[str, int], timeout: float, label: str) -> None:
        self.label = label
        super().__init__(address, timeout)

    # -- input ---------------------------------------------------------------------------------

    def read_lines(self, deadline: float) -> bool:
        try:
            return super().read_lines(deadline)
        except mc.ResponseError as exc:
            raise CheckFailed(f"{self.label}: a response line", "a line ending in \\n", str(exc)) from exc

    def next_line_or_fail(self, what: str, expected: Any) -> bytes:
        try:
            line = self.next_line()
        except Closed as exc:
            raise CheckFailed(what, expected, f"connection closed ({exc})") from exc
        if line is None:
            raise CheckFailed(what, expected, f"nothing within {self.timeout} s")
        return line

    # -- expectations --------------------------------------------------------------------------

    def expect_line(self, what: str, expected: bytes) -> None:
        line = self.next_line_or_fail(what, expected)
        if line != expected:
            raise CheckFailed(what, expected, line)

    def expect_lines(self, what: str, expected: list[bytes], *, ordered: bool = True) -> None:
        """The next len(expected) lines are exactly these (in any order unless `ordered`)."""
        got = []
        for _ in expected:
            try:
                line = self.next_line()
            except Closed as exc:
                raise CheckFailed(what, show_lines(expected), f"{show_lines(got)}, then connection closed") from exc
            if line is None:
                raise CheckFailed(what, show_lines(expected), f"{show_lines(got)}, then nothing for {self.timeout} s")
            got.append(line)
        if (got if ordered else sorted(got)) != (expected if ordered else sorted(expected)):
            raise CheckFailed(what + ("" if ordered else " (any order)"), show_lines(expected), show_lines(got))

    def expect_refused(self, request_id: str, action: str, data: str) -> str:
        """A request answered `{id} error …`; returns the line sent (for messages)."""
        line = self.request(request_id, action, data)
        self.expect_error(f"{line!r}", request_id)
        return line

    def expect_line_refused(self, line: str, request_id: str) -> None:
        """A line sent as it is, answered `{request_id} error …`."""
        self.send(line.encode() + b"\n")
        self.expect_error(f"{line!r}", request_id)

    def expect_confirm(self, what: str, request_id: str) -> None:
        """`{id} ok ` with its trailing space (docs/protocols/mqks.md)."""
        self.expect_line(f"{what}: confirm", f"{request_id} ok ".encode())

    def expect_error(self, what: str, request_id: str) -> str:
        """`{id} error <24-char error id>`; returns the error id."""
        expected = f"{request_id} error <{ID_LENGTH}-char error id>"
        line = self.next_line_or_fail(what, expected)
        prefix = f"{request_id} error ".encode()
        if not line.startswith(prefix) or not _ERROR_ID.fullmatch(line[len(prefix) :].decode(errors="replace")):
            raise CheckFailed(what, expected, line)
        return line[len(prefix) :].decode()

    def expect_nothing(self, what: str, quiet: float = 0.0) -> None:
        """Nothing arrives for `quiet` seconds, nor before the answer to a ping sent then."""
        try:
            line = self.next_line(quiet) if quiet > 0 else None
        except Closed as exc:
            raise CheckFailed(what, "nothing more, connection open", "connection closed") from exc
        if line is not None:
            raise CheckFailed(what, "nothing more", line)
        request_id = self.barrier_id()
        try:
            before = self.barrier(request_id)
        except Closed as exc:
            raise CheckFailed(f"{what}: ping barrier", self.pong(request_id), f"connection closed ({exc})") from exc
        except TimeoutError as exc:
            raise CheckFailed(f"{what}: ping barrier", self.pong(request_id), str(exc)) from exc
        except mqks_blocking.NotAResponse as exc:
            raise CheckFailed(f"{what}: ping barrier", self.pong(request_id), exc.line) from exc
        if before:
            raise CheckFailed(what, "nothing more (only the ping answer)", show_lines(before))


def _is_delivery(data: bytes) -> bool:
    try:
        mc.parse_delivery(data)
    except (mc.ResponseError, ValueError):
        return False
    return True


# ---------------------------------------------------------------------------------------------
# The per-check context


@attrs.define(slots=True)
class Target:
    """What a check gets: the server's address, the timeout, unique names, connections and cleanup."""

    address: tuple[str, int]
    timeout: float
    check_name: str
    run: runner.RunState = attrs.Factory(lambda: runner.RunState())
    token: str = attrs.Factory(lambda: secrets.token_hex(3))
    queues: list[str] = attrs.Factory(list)
    conns: list[Conn] = attrs.Factory(list)
    _ctl: Conn | None = None

    # -- names ---------------------------------------------------------------------------------

    def queue(self, label: str = "q") -> str:
        """A queue name no other check or run uses; it is deleted when the check ends."""
        stem = runner.name_stem(self.check_name, 24)
        name = f"cf-{stem}-{self.token}-{label}"
        self.queues.append(name)
        return name

    def event(self, name: str) -> str:
        """`name` made unique to this check; the prefix has no dot, so masks see only `name`'s dots."""
        return f"cf{self.token}-{name}"

    def ident(self, label: str) -> str:
        """A request / consumer / msg id unique to this check (consumer ids are global in MQKS)."""
        return f"{label}-{self.token}"

    # -- connections ---------------------------------------------------------------------------

    def connect(self, label: str = "conn") -> Conn:
        conn = Conn(self.address, self.timeout, label)
        self.conns.append(conn)
        return conn

    def consumers(self, count: int) -> tuple[list[Conn], list[str]]:
        """`count` connections (`consumer N`) and the ids of their consumers (`cN`), not consuming yet."""
        numbers = range(1, count + 1)
        return [self.connect(f"consumer {n}") for n in numbers], [self.ident(f"c{n}") for n in numbers]

    def subscriber(self, flags: str = "", label: str = "conn") -> tuple[Conn, str, str, str]:
        """A connection whose consumer of a fresh queue, bound to a fresh event, is confirmed:
        (connection, consumer id, queue, event)."""
        queue, event = self.queue(), self.event("e")
        conn = self.connect(label)
        consumer = self.ident("c")
        self.consume(conn, consumer, f"{queue} {event} {flags}".rstrip())
        return conn, consumer, queue, event

    @property
    def ctl(self) -> Conn:
        """The connection that publishes and sends control requests (rebind, ack, …), each confirmed."""
        if self._ctl is None:
            self._ctl = self.connect("control")
        return self._ctl

    def consume(self, conn: Conn, consumer_id: str, data: str) -> list[bytes]:
        """`{cid} consume --confirm {data}` up to its `ok `; returns the `--update` lines that came first.

        A delivery that came first is put back (the original may deliver before the confirm, docs/protocols/mqks.md).
        """
        line = conn.request(consumer_id, "consume", data, confirm=True)
        confirm = f"{consumer_id} ok ".encode()
        error = f"{consumer_id} error ".encode()
        updates: list[bytes] = []
        early: list[bytes] = []
        while True:
            got = conn.next_line_or_fail(f"{line!r}", confirm)
            if got == confirm:
                conn.unread(early)
                return updates
            if got.startswith(error):
                raise CheckFailed(f"{line!r}", confirm, got)
            try:
                response = mc.parse_response(got)
            except mc.ResponseError as exc:
                raise CheckFailed(f"{line!r}", confirm, got) from exc
            if response.ok and mc.is_update(response.data) and response.request_id == consumer_id:
                updates.append(got)
            elif response.ok and _is_delivery(response.data):
                early.append(got)
            else:
                raise CheckFailed(f"{line!r}", confirm, got)

    def publish(self, event: str, data: str, msg_id: str) -> None:
        """`{msg_id} publish --confirm {event} {data}` on the control connection, up to its `ok `."""
        line = self.ctl.request(msg_id, "publish", f"{event} {data}", confirm=True)
        self.ctl.expect_confirm(f"{line!r}", msg_id)

    def confirmed(self, request_id: str, action: str, data: str) -> None:
        """A control request with `--confirm`, up to its `ok `."""
        line = self.ctl.request(request_id, action, data, confirm=True)
        self.ctl.expect_confirm(f"{line!r}", request_id)

    def eval_queue_count(self, label: str, *, worker: bool = False) -> int:
        request_id = self.ident(label)
        code = "--worker=0 len(state.queues)" if worker else "len(state.queues)"
        line = self.ctl.request(request_id, "_eval", code)
        expected = f"{request_id} ok <integer>"
        got = self.ctl.next_line_or_fail(f"{line!r}", expected)
        prefix = f"{request_id} ok ".encode()
        if not got.startswith(prefix) or not got[len(prefix) :].isdigit():
            raise CheckFailed(f"{line!r}", expected, got)
        return int(got[len(prefix) :])

    def collect(self, conns: list[Conn], count: int, what: str) -> list[bytes]:
        """`count` lines from any of `conns`, in arrival order per connection."""
        got: list[bytes] = []
        deadline = time.monotonic() + self.timeout
        while True:
            for conn in conns:
                while len(got) < count and (line := conn.buffered()) is not None:
                    got.append(line)
            if len(got) >= count:
                return got
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise CheckFailed(what, f"{count} lines", f"{show_lines(got)} within {self.timeout} s")
            ready, _, _ = select.select([c.sock for c in conns], [], [], remaining)
            for conn in conns:
                if conn.sock in ready:
                    try:
                        conn.read_lines(time.monotonic() + self.timeout)
                    except Closed as exc:
                        got_text = f"{show_lines(got)}, then {conn.label} closed"
                        raise CheckFailed(what, f"{count} lines", got_text) from exc

    # -- cleanup -------------------------------------------------------------------------------

    def cleanup(self) -> None:
        for conn in self.conns:
            conn.close()
        if not self.queues or self.run.cleanup_failed:
            return
        try:
            conn = Conn(self.address, min(self.timeout, CLEANUP_TIMEOUT_S), "cleanup")
        except CheckFailed:
            self.run.cleanup_failed = True
            return
        try:
            for index, queue in enumerate(self.queues):
                request_id = self.ident(f"cleanup{index}")
                conn.request(request_id, "delete_queue", queue, confirm=True)
                # Any answer to this id will do: cleanup removes, the checks judge.
                if not conn.next_line_or_fail("cleanup", "an answer").startswith(f"{request_id} ".encode()):
                    raise CheckFailed("cleanup")
        except (CheckFailed, Closed):
            self.run.cleanup_failed = True
        finally:
            conn.close()


checks: Registry[Target] = Registry()
check = checks.check


def expect_nothing_more(what: str, consumers: Iterable[tuple[Conn, str]], quiet: float = 0.0) -> None:
    """Nothing more for each consumer (its connection, and its id or name for failures): `quiet`
    seconds watched on the first (the others had them meanwhile), then a ping barrier on each."""
    for index, (conn, name) in enumerate(consumers):
        conn.expect_nothing(f"{name}: {what}", quiet if index == 0 else 0.0)


def delivery(consumer_id: str, msg_id: str, event: str, data: str, retry: int = 0) -> bytes:
    """`{consumer_id} ok {msg_id} event={event}[,retry={n}] {data}` (docs/protocols/mqks.md)."""
    props = f"event={event}" + (f",retry={retry}" if retry else "")
    return f"{consumer_id} ok {msg_id} {props} {data}".encode()


def delivered(line: bytes, what: str, consumers: list[str]) -> tuple[str, str]:
    """(consumer_id, msg_id) of a delivery line to one of `consumers`."""
    expected = f"a delivery to {' or '.join(consumers)}"
    try:
        response = mc.parse_response(line)
        parsed = mc.parse_delivery(response.data) if response.ok else None
    except (mc.ResponseError, ValueError) as exc:
        raise CheckFailed(what, expected, line) from exc
    if parsed is None or response.request_id not in consumers:
        raise CheckFailed(what, expected, line)
    return response.request_id, parsed.msg_id


def update(consumer_id: str, queue: str, events: Iterable[str], suffix: str = "") -> bytes:
    """`{consumer_id} ok --update {queue}[ sorted events]{suffix}` (docs/protocols/mqks.md)."""
    ordered = sorted(events)
    return f"{consumer_id} ok {UPDATE_PREFIX} {queue}{''.join(' ' + e for e in ordered)}{suffix}".encode()


# =============================================================================================
# framing, parsing, errors


@check("ping")
def _ping(t: Target) -> None:
    """ping is answered `{id} ok {data}`."""
    conn = t.connect()
    conn.send(b"pg1 ping service1\n")
    conn.expect_line("'pg1 ping service1'", b"pg1 ok service1")


@check("ping-data-spaces-and-confirm")
def _ping_data(t: Target) -> None:
    """A request's data is everything after the second space, inner spaces kept; ping --confirm answers once."""
    conn = t.connect()
    # Data is everything after the second space, inner spaces included (docs/protocols/mqks.md).
    conn.send(b"pg2 ping a b  c\n")
    conn.expect_line("'pg2 ping a b  c'", b"pg2 ok a b  c")
    # `--confirm` is stripped and ping answers once with the rest (docs/protocols/mqks.md).
    conn.send(b"pg4 ping --confirm x\n")
    conn.expect_line("'pg4 ping --confirm x'", b"pg4 ok x")
    conn.expect_nothing("'pg4 ping --confirm x': one response only")


@check("short-line-none-error")
def _short_line(t: Target) -> None:
    """A line of fewer than three fields gets an error with the literal id None, and the connection stays open."""
    conn = t.connect()
    # Fewer than three fields after rstrip: literal id `None` (docs/protocols/mqks.md).
    for line in (b"pg3 ping", b"", b"dq9 delete_queue", b"pg5 ping   "):
        conn.send(line + b"\n")
        conn.expect_error(f"{line!r}", NO_ID)
    conn.expect_nothing("after malformed lines: one error each, connection still open")


@check("error-id-shape")
def _error_id_shape(t: Target) -> None:
    """An error id starts with the UTC time as %Y%m%d%H%M%S%f, near now, and differs from error to error."""
    conn = t.connect()
    ids = []
    for _ in range(2):
        conn.send(b"pg3 ping\n")
        ids.append(conn.expect_error("'pg3 ping'", NO_ID))
    now = datetime.datetime.now(datetime.UTC).replace(tzinfo=None)
    for error_id in ids:
        try:
            stamp = datetime.datetime.strptime(error_id[:ERROR_ID_TIME_DIGITS], ERROR_ID_TIME_FORMAT)
        except ValueError as exc:
            raise CheckFailed("error id: first 20 digits", "UTC %Y%m%d%H%M%S%f", error_id) from exc
        if abs((stamp - now).total_seconds()) > CLOCK_SKEW_S:
            raise CheckFailed("error id: timestamp", f"UTC now ({now:%Y%m%d%H%M%S%f}) ± {CLOCK_SKEW_S:.0f} s",
                              error_id)
    if ids[0] == ids[1]:
        raise CheckFailed("two errors: error ids", "different ids", ids)


@check("unknown-action-error")
def _unknown_action(t: Target) -> None:
    """An unknown action gets `{id} error {error id}` and the connection stays open."""
    conn = t.connect()
    request_id = t.ident("x1")
    line = conn.expect_refused(request_id, "blabla", "123")
    conn.expect_nothing(f"{line!r}: connection stays open")


@check("double-space-error")
def _double_space(t: Target) -> None:
    """Two spaces after the id make the action empty: an error."""
    # The split is on single spaces: the action is '' (docs/protocols/mqks.md).
    conn = t.connect()
    request_id = t.ident("x2")
    conn.expect_line_refused(f"{request_id}  publish {t.event('e1')} d", request_id)


@check("publish-without-data-error")
def _publish_without_data(t: Target) -> None:
    """publish without data (a trailing space stripped first) is an error."""
    conn = t.connect()
    event = t.event("e1")
    for suffix in ("", " "):  # the trailing space is stripped first (docs/protocols/mqks.md)
        request_id = t.ident(f"m{len(suffix)}")
        conn.expect_line_refused(f"{request_id} publish {event}{suffix}", request_id)


@check("missing-argument-errors")
def _missing_arguments(t: Target) -> None:
    """ack, reject and rebind without their arguments, and consume with an unknown --flag, are errors."""
    conn = t.connect()
    queue = t.queue()
    requests = [
        ("ack", t.ident("c1")),  # ack needs {consumer_id} {msg_id}|--all
        ("reject", t.ident("c1")),
        ("rebind", queue),  # rebind needs at least one token after the queue
        ("consume", f"{queue} {t.event('e1')} --bogus"),  # any other --flag is an error (docs/protocols/mqks.md)
    ]
    for index, (action, data) in enumerate(requests):
        conn.expect_refused(t.ident(f"r{index}"), action, data)
    conn.expect_nothing("after the errors: connection still open")


@check("tab-error-or-close")
def _tab(t: Target) -> None:
    """A TAB in a request closes the connection unanswered (the original) or is an error on an open connection."""
    # The original closes the connection on a TAB; polymq answers `{id} error …` (docs/protocols/mqks.md).
    conn = t.connect()
    request_id = t.ident("t1")
    line = f"{request_id} ping a\tb".encode()
    conn.send(line + b"\n")
    try:
        first = conn.next_line()
    except Closed:
        return  # the original's form: closed with no answer
    if first is None:
        raise CheckFailed(f"{line!r}", f"{request_id} error <error id>, or connection closed with no answer",
                          f"nothing within {t.timeout} s")
    conn.unread([first])
    conn.expect_error(f"{line!r} (polymq's form)", request_id)
    conn.expect_nothing(f"{line!r}: after the error the connection still works")


@check("crlf-requests")
def _crlf(t: Target) -> None:
    """Requests ending in \\r\\n are read as ones ending in \\n (ping, consume, publish)."""
    conn = t.connect()
    conn.send(b"pg1 ping x\r\n")
    conn.expect_line("'pg1 ping x\\r\\n'", b"pg1 ok x")
    queue, event = t.queue(), t.event("e1")
    consumer, msg_id = t.ident("c1"), t.ident("m1")
    conn.send(f"{consumer} consume --confirm {queue} {event}\r\n".encode())
    conn.expect_confirm(f"'{consumer} consume --confirm {queue} {event}\\r\\n'", consumer)
    t.ctl.send(f"{msg_id} publish --confirm {event} hello\r\n".encode())
    t.ctl.expect_confirm(f"'{msg_id} publish --confirm {event} hello\\r\\n'", msg_id)
    conn.expect_line("delivery of a CRLF publish", delivery(consumer, msg_id, event, "hello"))


# =============================================================================================
# confirms


@check("confirm-publish")
def _confirm_publish(t: Target) -> None:
    """publish --confirm is answered `{id} ok` once, with no subscribers as well."""
    conn = t.connect()
    msg_id = t.ident("m1")
    line = conn.request(msg_id, "publish", f"{t.event('e1')} d1", confirm=True)
    conn.expect_confirm(f"{line!r} (no subscribers)", msg_id)
    conn.expect_nothing(f"{line!r}: one response only")


@check("confirm-rebind")
def _confirm_rebind(t: Target) -> None:
    """rebind --confirm is confirmed, a rebind that changes nothing too, and only a change sends --update."""
    queue, e1, e2, e3 = t.queue(), t.event("e1"), t.event("e2"), t.event("e3")
    conn = t.connect()
    consumer = t.ident("c1")
    t.consume(conn, consumer, f"{queue} {e1}")
    t.confirmed(t.ident("rb1"), "rebind", f"{queue} {e2}")
    t.confirmed(t.ident("rb2"), "rebind", f"{queue} {e2}")  # no change: still confirmed
    t.confirmed(t.ident("rb3"), "rebind", f"{queue} --add {e3}")
    # No --update for the rebind that changed nothing (docs/protocols/mqks.md).
    conn.expect_lines("consumer after 'rebind q e2', 'rebind q e2', 'rebind q --add e3'",
                      [update(consumer, queue, [e2]), update(consumer, queue, [e2, e3])])
    conn.expect_nothing("consumer after the rebinds")


@check("confirm-delete-queue")
def _confirm_delete_queue(t: Target) -> None:
    """delete_queue --confirm is confirmed, for a queue that is gone or never was as well."""
    queue = t.queue()
    t.consume(t.connect(), t.ident("c1"), f"{queue} {t.event('e1')}")
    t.confirmed(t.ident("dq1"), "delete_queue", queue)
    t.confirmed(t.ident("dq2"), "delete_queue", queue)  # now missing (docs/protocols/mqks.md: confirmed even if absent)
    t.confirmed(t.ident("dq3"), "delete_queue", t.queue("never"))
    t.ctl.expect_nothing("after the delete_queue confirms")


@check("confirm-ack-reject-unknown-msg")
def _confirm_unknown_msg(t: Target) -> None:
    """ack and reject of an unknown message id, and --all with nothing held, are confirmed and redeliver nothing."""
    queue = t.queue()
    conn = t.connect()
    consumer = t.ident("c1")
    t.consume(conn, consumer, f"{queue} {t.event('e1')} {MANUAL_ACK_FLAG}")
    unknown = t.ident("nosuch")
    t.confirmed(t.ident("a1"), "ack", f"{consumer} {unknown}")
    t.confirmed(t.ident("r1"), "reject", f"{consumer} {unknown}")
    t.confirmed(t.ident("a2"), "ack", f"{consumer} {ALL_FLAG}")
    t.confirmed(t.ident("r2"), "reject", f"{consumer} {ALL_FLAG}")
    t.ctl.expect_nothing("control connection after the confirms")
    conn.expect_nothing("consumer: nothing to redeliver", QUIET_S)


@check("unknown-consumer-silent")
def _unknown_consumer(t: Target) -> None:
    """ack, reject and delete_consumer naming an unknown consumer get no answer, even with --confirm."""
    # No response at all, even with --confirm (docs/protocols/mqks.md).
    conn = t.connect()
    consumer, msg_id = t.ident("nosuch"), t.ident("m1")
    sent = [
        conn.request(t.ident("a1"), "ack", f"{consumer} {msg_id}", confirm=True),
        conn.request(t.ident("a2"), "ack", f"{consumer} {ALL_FLAG}", confirm=True),
        conn.request(t.ident("a3"), "ack", f"{consumer} {msg_id}"),
        conn.request(t.ident("r1"), "reject", f"{consumer} {msg_id}", confirm=True),
        conn.request(t.ident("r2"), "reject", f"{consumer} {ALL_FLAG}", confirm=True),
        conn.request(t.ident("d1"), "delete_consumer", consumer, confirm=True),
        conn.request(t.ident("d2"), "delete_consumer", consumer),
    ]
    conn.expect_nothing(f"after {sent}")


# =============================================================================================
# consume and delivery


@check("delivery-line-bytes")
def _delivery_line(t: Target) -> None:
    """A delivery is `{consumer_id} ok {msg_id} event={event} {data}`, byte for byte."""
    conn, consumer, _, event = t.subscriber()
    msg_id = t.ident("m")
    t.publish(event, "data", msg_id)
    conn.expect_line(f"delivery of '{msg_id} publish {event} data'", delivery(consumer, msg_id, event, "data"))
    conn.expect_nothing("after one delivery", QUIET_S)


@check("delivery-data-with-spaces")
def _delivery_spaces(t: Target) -> None:
    """Data with spaces, double spaces and --flags travels unchanged."""
    conn, consumer, _, event = t.subscriber()
    msg_id = t.ident("m")
    data = "hello big  world --add x"
    t.publish(event, data, msg_id)
    conn.expect_line(f"delivery of '{msg_id} publish {event} {data}'", delivery(consumer, msg_id, event, data))


@check("trailing-spaces-stripped")
def _trailing_spaces(t: Target) -> None:
    """A request line loses its trailing spaces: the data is delivered without them."""
    conn, consumer, _, event = t.subscriber()
    msg_id = t.ident("m")
    line = f"{msg_id} publish --confirm {event} d1   "
    t.ctl.send(line.encode() + b"\n")
    t.ctl.expect_confirm(f"{line!r}", msg_id)
    # The request line is rstripped, so the data loses its trailing spaces (docs/protocols/mqks.md).
    conn.expect_line(f"delivery of {line!r}", delivery(consumer, msg_id, event, "d1"))


@check("fan-out")
def _fan_out(t: Target) -> None:
    """Every queue bound to an event gets one copy of each message."""
    q1, q2, event = t.queue("q1"), t.queue("q2"), t.event("e")
    (a, b), (c1, c2) = t.consumers(2)
    t.consume(a, c1, f"{q1} {event}")
    t.consume(b, c2, f"{q2} {event}")
    m1, m2 = t.ident("m1"), t.ident("m2")
    t.publish(event, "d1", m1)
    t.publish(event, "d2", m2)
    for conn, consumer in ((a, c1), (b, c2)):
        conn.expect_lines(f"{consumer}: one copy of each message",
                          [delivery(consumer, m1, event, "d1"), delivery(consumer, m2, event, "d2")])
    expect_nothing_more("no duplicate", [(a, c1), (b, c2)], QUIET_S)


@check("competing-consumers")
def _competing(t: Target) -> None:
    """Consumers of one queue share its messages: each goes to exactly one of them."""
    queue, event = t.queue(), t.event("hello")
    a, b = t.connect("Alice"), t.connect("Bob")
    alice, bob = t.ident("Alice"), t.ident("Bob")
    # The spec's hello world: both consume the same queue with the same events.
    t.consume(a, alice, f"{queue} {event}")
    t.consume(b, bob, f"{queue} {event}")
    msg_ids = [t.ident(f"m{i}") for i in range(COMPETING_MESSAGES)]
    for msg_id in msg_ids:
        t.publish(event, "world", msg_id)
    lines = t.collect([a, b], COMPETING_MESSAGES, f"{COMPETING_MESSAGES} messages to 2 consumers of one queue")
    got = []
    for line in lines:
        consumer, msg_id = delivered(line, "competing consumers: lines", [alice, bob])
        expect_equal("competing consumers: delivery", delivery(consumer, msg_id, event, "world"), line)
        got.append(msg_id)
    expect_equal("competing consumers: each message exactly once", sorted(msg_ids), sorted(got))
    expect_nothing_more("no duplicate", [(a, "Alice"), (b, "Bob")], QUIET_S)


@check("publish-without-binding-dropped")
def _publish_unbound(t: Target) -> None:
    """A publish to an event no queue is bound to is dropped."""
    queue, event = t.queue(), t.event("e")
    m1, m2 = t.ident("m1"), t.ident("m2")
    t.publish(event, "early", m1)  # no queue is bound to the event yet: dropped (docs/protocols/mqks.md)
    conn = t.connect()
    consumer = t.ident("c")
    t.consume(conn, consumer, f"{queue} {event}")
    t.publish(event, "late", m2)
    # The queue is FIFO: had m1 been kept, it would come first.
    conn.expect_line("first delivery to a consumer bound after a publish", delivery(consumer, m2, event, "late"))


@check("rebind-only-queue-drops-until-consumed")
def _rebind_only_drops(t: Target) -> None:
    """A queue bound by rebind alone drops publishes until first consumed, then keeps them."""
    queue, event = t.queue(), t.event("e")
    m1, m2, m3 = t.ident("m1"), t.ident("m2"), t.ident("m3")
    t.confirmed(t.ident("rb"), "rebind", f"{queue} {event}")
    # Bound by rebind alone, never consumed: no queue yet, the publish is dropped (the original's
    # own test_add_to_undefined_queue expects that).
    t.publish(event, "dropped", m1)
    conn = t.connect()
    consumer = t.ident("c")
    t.consume(conn, consumer, queue)  # no events: it keeps the rebind's
    t.publish(event, "kept", m2)
    conn.expect_line(f"first delivery after 'rebind {queue} {event}', a publish, then 'consume {queue}'",
                     delivery(consumer, m2, event, "kept"))
    # Consumed once, it is a queue: it keeps what comes while no one consumes it.
    t.confirmed(t.ident("dc"), "delete_consumer", consumer)
    t.publish(event, "waiting", m3)
    other = t.ident("c2")
    t.consume(conn, other, queue)
    conn.expect_line(f"{other}: the message published while {queue} had no consumer",
                     delivery(other, m3, event, "waiting"))


@check("consume-without-events-keeps-bindings")
def _consume_keeps(t: Target) -> None:
    """consume of a queue without events keeps the queue's bindings."""
    queue, e1, e2, e3 = t.queue(), t.event("e1"), t.event("e2"), t.event("e3")
    (a, b), (c1, c2) = t.consumers(2)
    t.consume(a, c1, f"{queue} {e1} {e2}")
    updates = t.consume(b, c2, queue)
    expect_equal(f"'{c2} consume --confirm {queue}': lines before its ok", [], updates)
    t.confirmed(t.ident("rb"), "rebind", f"{queue} --add {e3}")
    # Had `consume q` dropped the bindings, c1 would first have got `--update q` with no events.
    a.expect_line(f"{c1} after 'consume {queue}' and 'rebind {queue} --add {e3}'", update(c1, queue, [e1, e2, e3]))
    b.expect_line(f"{c2} after 'rebind {queue} --add {e3}'", update(c2, queue, [e1, e2, e3]))
    msg_id = t.ident("m")
    t.publish(e2, "d", msg_id)
    [line] = t.collect([a, b], 1, f"delivery of a publish to {e2}")
    if line not in (delivery(c1, msg_id, e2, "d"), delivery(c2, msg_id, e2, "d")):
        raise CheckFailed(f"delivery of a publish to {e2}", delivery(c1, msg_id, e2, "d"), line)
    expect_nothing_more("nothing more", [(a, c1), (b, c2)], QUIET_S)


@check("consume-add")
def _consume_add(t: Target) -> None:
    """consume --add adds events to the bindings and sends every consumer --update, the issuer before its ok."""
    queue, e1, e2 = t.queue(), t.event("e1"), t.event("e2")
    (a, b), (c1, c2) = t.consumers(2)
    t.consume(a, c1, f"{queue} {e1}")
    updates = t.consume(b, c2, f"{queue} --add {e2}")
    # The issuer of `consume --add` gets the --update too, before its own ok (docs/protocols/mqks.md).
    expect_equal(f"'{c2} consume --confirm {queue} --add {e2}': lines before its ok",
                 [update(c2, queue, [e1, e2])], updates)
    a.expect_line(f"{c1} after '{c2} consume {queue} --add {e2}'", update(c1, queue, [e1, e2]))
    msg_ids = [t.ident("m1"), t.ident("m2")]
    t.publish(e1, "d1", msg_ids[0])
    t.publish(e2, "d2", msg_ids[1])
    lines = t.collect([a, b], 2, f"deliveries of publishes to {e1} and {e2}")
    got = sorted(delivered(line, "deliveries", [c1, c2])[1] for line in lines)
    expect_equal("messages of both events, once each", sorted(msg_ids), got)
    expect_nothing_more("nothing more", [(a, c1), (b, c2)], QUIET_S)


# =============================================================================================
# rebind (docs/protocols/mqks.md)


def _routed(t: Target, conn: Conn, consumer: str, events: list[str], bound: set[str], what: str) -> None:
    """Publish one message per event (in order) and expect exactly those of `bound`, in order.

    The last event must be bound: the queue is FIFO, so when its message arrives, any wrongly
    routed earlier message would already have come.
    """
    if events[-1] not in bound:
        raise ValueError("the last event must be bound (it is the sentinel)")
    expected = []
    for index, event in enumerate(events):
        msg_id = t.ident(f"m{index}")
        t.publish(event, "d", msg_id)
        if event in bound:
            expected.append(delivery(consumer, msg_id, event, "d"))
    conn.expect_lines(what, expected)


@check("rebind-replace")
def _rebind_replace(t: Target) -> None:
    """rebind with events replaces the queue's bindings: --update, and only the new events are routed."""
    queue = t.queue()
    e1, e2, e3 = t.event("e1"), t.event("e2"), t.event("e3")
    conn = t.connect()
    consumer = t.ident("c")
    t.consume(conn, consumer, f"{queue} {e1}")
    t.confirmed(t.ident("rb"), "rebind", f"{queue} {e3} {e2}")
    conn.expect_line(f"{consumer} after 'rebind {queue} {e3} {e2}'", update(consumer, queue, [e2, e3]))
    _routed(t, conn, consumer, [e1, e2, e1, e3], {e2, e3}, f"deliveries after 'rebind {queue} {e3} {e2}'")


@check("rebind-remove-add")
def _rebind_remove_add(t: Target) -> None:
    """rebind --remove and --add change the bindings (unknown events ignored), each change an --update."""
    queue = t.queue()
    e1, e2, e3, e4, e9 = (t.event(n) for n in ("e1", "e2", "e3", "e4", "e9"))
    conn = t.connect()
    consumer = t.ident("c")
    t.consume(conn, consumer, f"{queue} {e1} {e2} {e3}")
    data = f"{queue} --remove {e1} {e9} --add {e4}"
    t.confirmed(t.ident("rb1"), "rebind", data)
    conn.expect_line(f"{consumer} after 'rebind {data}'", update(consumer, queue, [e2, e3, e4]))
    _routed(t, conn, consumer, [e1, e2, e9, e4, e3], {e2, e3, e4}, f"deliveries after 'rebind {data}'")
    data = f"{queue} --add {e1}"
    t.confirmed(t.ident("rb2"), "rebind", data)
    conn.expect_line(f"{consumer} after 'rebind {data}'", update(consumer, queue, [e1, e2, e3, e4]))
    _routed(t, conn, consumer, [e9, e1], {e1}, f"deliveries after 'rebind {data}'")


@check("rebind-remove-mask")
def _rebind_remove_mask(t: Target) -> None:
    """rebind --remove-mask removes events matching masks (`*`: non-dot characters, anchored; dotted events only)."""
    queue = t.queue()
    names = ["e5.id1.a1", "e5.id2.a2", "e5.id1.b1", "e4.x.y", "e4..y", "e3.123.c", "user.updated", "plain"]
    events = {name: t.event(name) for name in names}
    conn = t.connect()
    consumer = t.ident("c")
    t.consume(conn, consumer, f"{queue} {' '.join(events.values())}")
    # `*` is zero or more non-dot characters, anchored; only events with a dot are candidates
    # (docs/protocols/mqks.md): `e3.*` keeps `e3.123.c`, `pla*` keeps `plain` (no dot), `*.updated` needs no prefix.
    masks = [t.event("e5.*.a1"), t.event("e5.*.a2"), t.event("e4.*.y"), t.event("e3.*"), "*.updated", t.event("pla*")]
    e8 = t.event("e8")
    data = f"{queue} --remove-mask {' '.join(masks)} --add {e8}"
    t.confirmed(t.ident("rb"), "rebind", data)
    kept = {events["e5.id1.b1"], events["e3.123.c"], events["plain"], e8}
    conn.expect_line(f"{consumer} after 'rebind {data}'", update(consumer, queue, kept))
    _routed(t, conn, consumer, [*events.values(), e8], kept, f"deliveries after 'rebind {data}'")


# =============================================================================================
# --update lines


@check("update-lines")
def _update_lines(t: Target) -> None:
    """--update lists sorted events, --delete-queue-when-unused as a float, --manual-ack per consumer."""
    queue = t.queue()
    e0, e1, e2, e3 = (t.event(n) for n in ("e0", "e1", "e2", "e3"))
    (a, b, c), (c1, c2, c3) = t.consumers(3)
    expect_equal(f"'{c1} consume {queue} {e1}': lines before its ok", [], t.consume(a, c1, f"{queue} {e1}"))
    a.expect_nothing(f"{c1}: the issuer of a plain consume gets no --update")
    data = f"{queue} {e2} {e1} {e0} {WHEN_UNUSED_FLAG}=5 {MANUAL_ACK_FLAG}"
    expect_equal(f"'{c2} consume {data}': lines before its ok", [], t.consume(b, c2, data))
    b.expect_nothing(f"{c2}: the issuer of a plain consume gets no --update")
    # Sorted events; `=5` printed as Python's str of a float (docs/protocols/mqks.md).
    suffix = f" {WHEN_UNUSED_FLAG}=5.0"
    a.expect_line(f"{c1} after '{c2} consume {data}'", update(c1, queue, [e0, e1, e2], suffix))
    data = f"{queue} --add {e3} {WHEN_UNUSED_FLAG}=5 {MANUAL_ACK_FLAG}"
    expect_equal(f"'{c3} consume {data}': lines before its ok",
                 [update(c3, queue, [e0, e1, e2, e3], f"{suffix} {MANUAL_ACK_FLAG}")], t.consume(c, c3, data))
    a.expect_line(f"{c1} after '{c3} consume {data}'", update(c1, queue, [e0, e1, e2, e3], suffix))
    b.expect_line(f"{c2} (manual-ack) after '{c3} consume {data}'",
                  update(c2, queue, [e0, e1, e2, e3], f"{suffix} {MANUAL_ACK_FLAG}"))
    expect_nothing_more("nothing more", [(a, c1), (b, c2), (c, c3)])


def _update_for_the_first(t: Target, first: str, second: str, suffix: str, about_first: str = "") -> None:
    """c1 consumes `first`, then c2 `second` (both formatted with `queue` and `event`): c2 gets no
    --update before its ok, c1 one of the queue with its one event and `suffix`; then neither more."""
    queue, event = t.queue(), t.event("e1")
    (a, b), (c1, c2) = t.consumers(2)
    t.consume(a, c1, first.format(queue=queue, event=event))
    data = second.format(queue=queue, event=event)
    expect_equal(f"'{c2} consume {data}': lines before its ok", [], t.consume(b, c2, data))
    a.expect_line(f"{c1}{about_first} after '{c2} consume {data}'", update(c1, queue, [event], suffix))
    expect_nothing_more("nothing more", [(a, c1), (b, c2)])


@check("update-bare-flag")
def _update_bare(t: Target) -> None:
    """A consume that sets only the bare --delete-queue-when-unused sends the others --update with the bare flag."""
    # Only the when-unused setting changes: the others still get --update, with the bare flag.
    _update_for_the_first(t, f"{{queue}} {{event}} {MANUAL_ACK_FLAG}", f"{{queue}} {WHEN_UNUSED_FLAG}",
                          f" {WHEN_UNUSED_FLAG} {MANUAL_ACK_FLAG}", " (manual-ack)")


@check("update-when-unused-cleared")
def _update_when_unused_cleared(t: Target) -> None:
    """A consume without --delete-queue-when-unused clears it, an --update for the others."""
    # A consume without the flag clears the queue's setting, and that change is an --update for the
    # others (the original's server/actions/consume.py: `queues_to_delete_when_unused.pop`).
    _update_for_the_first(t, f"{{queue}} {{event}} {WHEN_UNUSED_FLAG}=60", "{queue} {event}", "")


# =============================================================================================
# manual ack, reject, requeue


def _manual_consumer(t: Target, count: int) -> tuple[Conn, str, str, str, list[str]]:
    """A manual-ack consumer holding `count` delivered messages m0…; returns conn, consumer, queue, event, ids."""
    conn, consumer, queue, event = t.subscriber(MANUAL_ACK_FLAG, "consumer")
    msg_ids = [t.ident(f"m{i}") for i in range(count)]
    for msg_id in msg_ids:
        t.publish(event, f"d-{msg_id}", msg_id)
    conn.expect_lines(f"{consumer} (manual-ack): deliveries",
                      [delivery(consumer, msg_id, event, f"d-{msg_id}") for msg_id in msg_ids])
    return conn, consumer, queue, event, msg_ids


def _then_sentinel(t: Target, conn: Conn, consumer: str, event: str, requests: list[tuple[str, str]],
                   before: list[bytes] | None = None, what: str = "") -> None:
    """The consumer's (action, message id or --all) requests, confirmed, then a sentinel published:
    `before`, then its delivery, are the next lines (the queue is FIFO: what was requeued or kept would
    come ahead of it)."""
    for index, (action, msg_id) in enumerate(requests):
        t.confirmed(t.ident(f"{action}{index}"), action, f"{consumer} {msg_id}")
    sentinel = t.ident("sentinel")
    t.publish(event, "sentinel", sentinel)
    what = what or "after " + ", ".join(f"'{action} {consumer} {msg_id}'" for action, msg_id in requests)
    if before is None:
        conn.expect_line(what, delivery(consumer, sentinel, event, "sentinel"))
    else:
        conn.expect_lines(what, [*before, delivery(consumer, sentinel, event, "sentinel")])


@check("manual-ack-reject-retry")
def _reject_retry(t: Target) -> None:
    """reject requeues a manual-ack delivery at the queue's tail with retry+1."""
    conn, consumer, _, event, (m0, m1) = _manual_consumer(t, 2)
    # Requeued at the tail with retry+1 (docs/protocols/mqks.md): after m2, published before the reject.
    m2 = t.ident("m2")
    t.publish(event, f"d-{m2}", m2)
    t.confirmed(t.ident("r1"), "reject", f"{consumer} {m0}")
    conn.expect_lines(f"after 'publish {m2}' and 'reject {consumer} {m0}'",
                      [delivery(consumer, m2, event, f"d-{m2}"), delivery(consumer, m0, event, f"d-{m0}", 1)])
    t.confirmed(t.ident("r2"), "reject", f"{consumer} {m0}")
    conn.expect_line(f"after a second 'reject {consumer} {m0}'", delivery(consumer, m0, event, f"d-{m0}", 2))
    t.confirmed(t.ident("r3"), "reject", f"{consumer} {m1}")
    conn.expect_line(f"after 'reject {consumer} {m1}'", delivery(consumer, m1, event, f"d-{m1}", 1))
    conn.expect_nothing("nothing more", QUIET_S)


@check("manual-ack-reject-all")
def _reject_all(t: Target) -> None:
    """reject --all requeues every held delivery with retry+1; ack --all then reject --all hold nothing back."""
    conn, consumer, _, event, (m0, m1) = _manual_consumer(t, 2)
    t.confirmed(t.ident("r1"), "reject", f"{consumer} {ALL_FLAG}")
    conn.expect_lines(f"after 'reject {consumer} --all'",
                      [delivery(consumer, m0, event, f"d-{m0}", 1), delivery(consumer, m1, event, f"d-{m1}", 1)],
                      ordered=False)
    t.confirmed(t.ident("r2"), "reject", f"{consumer} {ALL_FLAG}")
    conn.expect_lines(f"after a second 'reject {consumer} --all'",
                      [delivery(consumer, m0, event, f"d-{m0}", 2), delivery(consumer, m1, event, f"d-{m1}", 2)],
                      ordered=False)
    _then_sentinel(t, conn, consumer, event, [("ack", ALL_FLAG), ("reject", ALL_FLAG)])


@check("manual-ack-ack-removes")
def _ack_removes(t: Target) -> None:
    """ack removes a message: a later reject --all does not return it."""
    conn, consumer, _, event, (m0, m1) = _manual_consumer(t, 2)
    _then_sentinel(t, conn, consumer, event, [("ack", m0), ("reject", ALL_FLAG)],
                   [delivery(consumer, m1, event, f"d-{m1}", 1)])


@check("auto-ack-reject-nothing")
def _auto_ack_reject(t: Target) -> None:
    """An auto-ack consumer's reject has nothing to return: delivered is done."""
    # Auto-ack: delivered = done, reject has nothing to return (docs/protocols/mqks.md).
    conn, consumer, _, event = t.subscriber()
    m0 = t.ident("m0")
    t.publish(event, "d", m0)
    conn.expect_line("delivery", delivery(consumer, m0, event, "d"))
    _then_sentinel(t, conn, consumer, event, [("reject", m0), ("reject", ALL_FLAG)],
                   what=f"after 'reject {consumer} {m0}' of an auto-ack consumer")


@check("manual-ack-disconnect-requeues")
def _disconnect_requeues(t: Target) -> None:
    """A manual-ack consumer's disconnect returns what it held to another consumer with retry+1."""
    conn, consumer, queue, event, (m0, m1) = _manual_consumer(t, 2)
    t.confirmed(t.ident("r1"), "reject", f"{consumer} {m1}")
    conn.expect_line(f"after 'reject {consumer} {m1}'", delivery(consumer, m1, event, f"d-{m1}", 1))
    other = t.connect("consumer 2")
    c2 = t.ident("c2")
    t.consume(other, c2, f"{queue} {MANUAL_ACK_FLAG}")
    conn.close()  # disconnect = delete_consumer: unacked go back with retry+1 (docs/protocols/mqks.md)
    other.expect_lines(f"{c2} after {consumer} disconnected holding {m0} and {m1} (retry=1)",
                       [delivery(c2, m0, event, f"d-{m0}", 1), delivery(c2, m1, event, f"d-{m1}", 2)], ordered=False)
    other.expect_nothing(f"{c2}: nothing more", QUIET_S)


@check("delete-consumer-requeues")
def _delete_consumer_requeues(t: Target) -> None:
    """delete_consumer returns the consumer's held messages to the queue, and the consumer is then unknown."""
    conn, consumer, queue, event, (m0,) = _manual_consumer(t, 1)
    other = t.connect("consumer 2")
    c2 = t.ident("c2")
    t.consume(other, c2, f"{queue} {MANUAL_ACK_FLAG}")
    t.confirmed(t.ident("dc"), "delete_consumer", consumer)
    other.expect_line(f"{c2} after 'delete_consumer {consumer}' holding {m0}", delivery(c2, m0, event, f"d-{m0}", 1))
    conn.expect_nothing(f"{consumer} after its delete_consumer", QUIET_S)
    # The consumer is gone: ack of it is now an unknown consumer, answered by nothing.
    line = t.ctl.request(t.ident("a1"), "ack", f"{consumer} {m0}", confirm=True)
    t.ctl.expect_nothing(f"{line!r} after the consumer was deleted")
    other.expect_nothing(f"{c2}: nothing more")


# =============================================================================================
# delete_queue, delete-queue-when-unused (docs/protocols/mqks.md)


@check("delete-queue")
def _delete_queue(t: Target) -> None:
    """delete_queue sends its consumers an --update without events, and they get nothing more."""
    queue, event = t.queue(), t.event("e")
    (a, b), (c1, c2) = t.consumers(2)
    t.consume(a, c1, f"{queue} {event}")
    t.consume(b, c2, f"{queue} {event} {MANUAL_ACK_FLAG}")
    t.confirmed(t.ident("dq"), "delete_queue", queue)
    a.expect_line(f"{c1} after 'delete_queue {queue}'", update(c1, queue, []))
    b.expect_line(f"{c2} (manual-ack) after 'delete_queue {queue}'", update(c2, queue, [], f" {MANUAL_ACK_FLAG}"))
    t.publish(event, "d", t.ident("m"))
    expect_nothing_more("after its queue was deleted", [(a, c1), (b, c2)], QUIET_S)
    line = t.ctl.request(t.ident("a1"), "ack", f"{c1} {ALL_FLAG}", confirm=True)
    t.ctl.expect_nothing(f"{line!r}: the consumers of a deleted queue are gone")


@check("delete-queue-without-events")
def _delete_queue_without_events(t: Target) -> None:
    """delete_queue of a queue without events still sends its consumers an --update."""
    queue = t.queue()
    (a, b), (c1, c2) = t.consumers(2)
    t.consume(a, c1, queue)
    t.consume(b, c2, f"{queue} {MANUAL_ACK_FLAG}")
    t.confirmed(t.ident("dq"), "delete_queue", queue)
    # The consumers hear of it even though the queue had no events.
    a.expect_line(f"{c1} after 'delete_queue {queue}' of a queue without events", update(c1, queue, []))
    b.expect_line(f"{c2} (manual-ack) after 'delete_queue {queue}' of a queue without events",
                  update(c2, queue, [], f" {MANUAL_ACK_FLAG}"))


def _recreated(t: Target, queue: str, event: str, flags: str, number: int, lost: str, kept: str) -> None:
    """The queue went with its bindings: `lost` published now is dropped, so the first delivery to a
    new consumer (`cN`) is `kept`, published after it came (FIFO: a kept `lost` would come first)."""
    t.publish(event, "lost", lost)  # no queue, no binding: dropped
    conn, consumer = t.connect(f"consumer {number}"), t.ident(f"c{number}")
    t.consume(conn, consumer, f"{queue} {event} {flags}")
    t.publish(event, "kept", kept)
    conn.expect_line(f"{consumer}: first delivery on the re-created queue (FIFO: a kept {lost} would come first)",
                     delivery(consumer, kept, event, "kept"))


@check("when-unused-bare")
def _when_unused_bare(t: Target) -> None:
    """A bare --delete-queue-when-unused queue goes, with its bindings, when its last consumer leaves."""
    queue, event = t.queue(), t.event("e")
    consumer = t.ident("c1")
    t.consume(t.connect(), consumer, f"{queue} {event} {WHEN_UNUSED_FLAG}")
    before = t.eval_queue_count("ev1")
    t.confirmed(t.ident("dc"), "delete_consumer", consumer)  # the last consumer: the queue goes at once
    after = t.eval_queue_count("ev2")
    if after > before - 1:
        raise CheckFailed("_eval len(state.queues) after the last consumer left", f"at most {before - 1}", after)
    _recreated(t, queue, event, WHEN_UNUSED_FLAG, 2, t.ident("m1"), t.ident("m2"))


@check("when-unused-seconds")
def _when_unused_seconds(t: Target) -> None:
    """--delete-queue-when-unused=N keeps an unused queue N seconds with its messages, then deletes it."""
    queue, event = t.queue(), t.event("e")
    flags = f"{WHEN_UNUSED_FLAG}={WHEN_UNUSED_S}"
    c1, c2, c3 = (t.ident(f"c{i}") for i in range(1, 4))
    first = t.connect("consumer 1")
    t.consume(first, c1, f"{queue} {event} {flags}")
    first.close()
    # Reconnecting within N keeps the queue, even after N has passed since.
    conn = t.connect("consumer 2")
    t.consume(conn, c2, f"{queue} {event} {flags}")
    time.sleep(WHEN_UNUSED_S + WHEN_UNUSED_MARGIN_S)
    m1 = t.ident("m1")
    t.publish(event, "d1", m1)
    conn.expect_line(f"{c2} reconnected within {WHEN_UNUSED_S} s, {WHEN_UNUSED_S + WHEN_UNUSED_MARGIN_S} s later",
                     delivery(c2, m1, event, "d1"))
    # Unused, the queue keeps its messages for N seconds.
    t.confirmed(t.ident("dc2"), "delete_consumer", c2)
    m2 = t.ident("m2")
    t.publish(event, "d2", m2)
    conn = t.connect("consumer 3")
    t.consume(conn, c3, f"{queue} {event} {flags}")
    conn.expect_line(f"{c3}: the message published while the queue was unused", delivery(c3, m2, event, "d2"))
    # After N seconds unused, it is deleted with its bindings.
    t.confirmed(t.ident("dc3"), "delete_consumer", c3)
    before = t.eval_queue_count("ev1")
    time.sleep(WHEN_UNUSED_S + WHEN_UNUSED_MARGIN_S)
    after = t.eval_queue_count("ev2")
    if after > before - 1:
        raise CheckFailed(f"_eval len(state.queues) {WHEN_UNUSED_S + WHEN_UNUSED_MARGIN_S} s after the last consumer "
                          f"of a {flags} queue left", f"at most {before - 1}", after)
    _recreated(t, queue, event, flags, 4, t.ident("m3"), t.ident("m4"))


# =============================================================================================
# _eval (docs/protocols/mqks.md: the upstream tests ask `len(state.queues)`)


@check("eval-queue-count")
def _eval_count(t: Target) -> None:
    """_eval len(state.queues) counts the queues, a new one and a deleted one included."""
    before = t.eval_queue_count("ev1")
    t.eval_queue_count("ev2", worker=True)
    queue = t.queue()
    t.consume(t.connect(), t.ident("c"), f"{queue} {t.event('e')}")
    expect_equal("_eval len(state.queues) after a consume of a new queue", before + 1, t.eval_queue_count("ev3"))
    t.confirmed(t.ident("dq"), "delete_queue", queue)
    expect_equal("_eval len(state.queues) after its delete_queue", before, t.eval_queue_count("ev4"))


@check("eval-events-of-a-queue")
def _eval_events_of_queue(t: Target) -> None:
    """_eval of state.events_by_queues[queue] reads a queue's events as the original's client tests do."""
    queue, e1, e2 = t.queue(), t.event("e1"), t.event("e2")
    conn = t.connect()
    t.consume(conn, t.ident("c"), f"{queue} {e2} {e1}")
    # How the original's own client tests read a queue's events.
    for label, code in (("ev1", f"' '.join(sorted(state.events_by_queues['{queue}']))"),
                        ("ev2", f'" ".join(sorted(state.events_by_queues["{queue}"]))')):
        request_id = t.ident(label)
        line = t.ctl.request(request_id, "_eval", code)
        expected = f"{request_id} ok {' '.join(sorted([e1, e2]))}".encode()
        t.ctl.expect_line(f"{line!r}", expected)


# =============================================================================================
# The command


def make_context_factory(address: tuple[str, int], timeout: float) -> Callable[[str], AbstractContextManager[Target]]:
    run = runner.RunState()
    return runner.contexts(lambda name: Target(address, timeout, name, run), Target.cleanup, (OSError,))


@click.command()
@click.option("--addr", "address", default=DEFAULT_ADDRESS, show_default=True, help="MQKS server address HOST:PORT")
@runner.selection_options()
@runner.timeout_option("reply")
def command(address: str, timeout: float) -> None:
    """Check that an MQKS server behaves like MQKS v0.4.3 (one worker).

    Prints `PASS name` or `FAIL name: reason` per check, then `N passed, M failed`;
    exits 0 only if every check passed.
    """
    runner.run_command(checks, make_context_factory(runner.parse_address(address), timeout),
                       address=("--addr", address))
