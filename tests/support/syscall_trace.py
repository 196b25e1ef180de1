"""Record a server's system calls with strace and check that every publish `OK` waited for the disk.

A kill -9 test cannot prove an acknowledgement waited for fsync: the OS page cache outlives the
process. The system-call order can: with `--fsync=always`, for every `OK` frame sent to a
publisher, the record's bytes must have been written to a data-dir file, then that file
fsync'd/fdatasync'd, and only then the `OK` sent.

Three parts:

* `traced_process` starts a command as strace's child (`strace -f ... -- python -m polymq serve`),
  reads its `listening ...` / `ready` lines, and stops it by SIGTERM to the traced
  child's PID (found as the child of the strace process we started), then waits for strace.
* `parse_trace` turns strace's text (`-f -ttt -T -yy -xx`) into `Syscall` events, joining
  `<unfinished ...>` / `<... resumed>` halves of multithreaded traces.
* `check_fsync_order` is a pure function over those events.

Ordering uses the position of lines in the trace, not timestamps. strace is one process handling
one ptrace stop at a time, and a tracee stays stopped until strace has printed that stop: a call's
entry is printed before the kernel runs it, its exit after the kernel returned. So "fsync's exit
line comes before send's entry line" proves the fsync returned before the send began, whichever
threads ran them (timestamps are kept only for messages).

Not seen by this check: writes through mmap or io_uring, and O_DSYNC files (counted as unsynced).

Run as a script, this file is also a tiny reference NSQ publish server (`reference-server DIR
MODE`) that writes, fdatasyncs from a writer thread and then acks: the tests use it to show the
checker passes a correct server and fails an unsynced one, independently of the gateway.
"""

from __future__ import annotations

import bisect
import os
import re
import shutil
import signal
import struct
import subprocess
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from pathlib import Path

import attrs

# write-like calls: to a data-dir file they write records, to the client's socket they send frames.
WRITE_CALLS = frozenset({"write", "writev", "pwrite64", "pwritev", "pwritev2", "sendto", "sendmsg"})
# Only these make written data durable. sync_file_range does not (no metadata, no disk-cache
# flush), so it is traced for the record but never counts.
SYNC_CALLS = frozenset({"fsync", "fdatasync"})
# Linux AIO: an `io_submit` of IOCB_CMD_FDSYNC control blocks starts fdatasyncs that a kernel worker
# runs; `io_getevents` reports each one's end under the block's aio_data. Such a sync spans from
# the submit's entry to the exit of the call that reported it.
AIO_CALLS = frozenset({"io_submit", "io_getevents"})
TRACED_CALLS = (*sorted(WRITE_CALLS), *sorted(SYNC_CALLS), *sorted(AIO_CALLS), "sync_file_range")

# strace cuts strings longer than -s; a cut record or frame would be misread, so it is large and
# a cut string in a relevant call is an error rather than a silent miss.
MAX_STRING = 1 << 20
READY_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 20.0

OK_FRAME = b"\x00\x00\x00\x06\x00\x00\x00\x00OK"
_FRAME_HEADER = struct.Struct(">ii")
_FRAME_TYPE_RESPONSE = 0


class StraceError(AssertionError):
    """strace is missing, failed to start, or wrote a trace this module cannot use.

    An AssertionError so a test using it fails (never skips) with the message.
    """


# --------------------------------------------------------------------------------------------
# Events


@attrs.frozen(slots=True)
class Syscall:
    """One traced system call.

    `start` and `end` are order keys from the trace's line positions (entry and exit
    observations); `end` is None when the call never returned within the trace.
    """

    line: int  # 1-based line of the entry, for messages
    pid: int
    name: str
    fd: int | None
    target: str | None  # the -yy annotation: a file path or e.g. "TCP:[a:p->b:q]"
    data: bytes  # bytes this call actually transferred (cut at the return value)
    result: int | None  # None for "?" (unknown)
    start: int
    end: int | None
    timestamp: str
    truncated: bool = False  # strace cut the buffer (-s too small)
    arguments: str = ""  # the argument text, kept for the AIO calls only

    @property
    def completed(self) -> bool:
        return self.end is not None

    def peer(self) -> str | None:
        """The remote address of a TCP socket target, e.g. "127.0.0.1:5555"."""
        if self.target is None:
            return None
        match = _SOCKET_TARGET.fullmatch(self.target)
        return match["peer"] if match else None

    def describe(self) -> str:
        return f"line {self.line} pid {self.pid} {self.name}({self.fd}<{self.target}>) = {self.result}"


# --------------------------------------------------------------------------------------------
# Parsing

_LINE = re.compile(
    r"(?:(?P<pid>\d+)\s+)?(?P<time>\d+\.\d+|\d\d:\d\d:\d\d(?:\.\d+)?)\s+(?P<rest>.*)"
)
_RESUMED = re.compile(r"<\.\.\. (?P<name>\w+) resumed>(?P<text>.*)")
_CALL = re.compile(r"(?P<name>\w+)\((?P<text>.*)")
_UNFINISHED = " <unfinished ...>"
_RESULT = re.compile(r"\s*=\s*(?P<value>-?\d+|0x[0-9a-fA-F]+|\?)")
# A call whose thread was killed (SIGTERM at the end of a run) as it returned shows "= -1 (errno N)"
# with N no errno at all (Linux's end at 4095): what it transferred is unknown, and its peer may
# have had every byte (a client counted the OK it carried), so its buffer is kept.
_CUT_AT_EXIT = re.compile(r"\s*=\s*-1 \(errno (?P<errno>\d+)\)")
MAX_ERRNO = 4095
_STRING = re.compile(r'"(?P<body>(?:[^"\\]|\\.)*)"(?P<cut>\.\.\.)?', re.S)
_IOV_STRING = re.compile(r'iov_base="(?P<body>(?:[^"\\]|\\.)*)"(?P<cut>\.\.\.)?', re.S)
_FD = re.compile(r"(?P<fd>\d+)(?:<(?P<annotation>.*)>)?", re.S)
_SOCKET_TARGET = re.compile(r"(?:TCP|TCPv6):\[(?P<local>[^\]]*?)->(?P<peer>[^\]]*)\]")
_ESCAPE = re.compile(r"\\(x[0-9a-fA-F]{2}|[0-7]{1,3}|.)", re.S)
_SIMPLE_ESCAPES = {"n": 10, "t": 9, "r": 13, "v": 11, "f": 12, "a": 7, "b": 8, '"': 34, "\\": 92, "'": 39}


def decode_c_string(text: str) -> bytes:
    """The bytes of a strace string body (C escapes; with -xx every byte is \\xHH)."""
    out = bytearray()
    pos = 0
    for match in _ESCAPE.finditer(text):
        out += text[pos : match.start()].encode("latin-1")
        code = match[1]
        if code[0] == "x" and len(code) == 3:
            out.append(int(code[1:], 16))
        elif code[0] in "01234567":
            out.append(int(code, 8) & 0xFF)
        else:
            out.append(_SIMPLE_ESCAPES.get(code, ord(code)))
        pos = match.end()
    out += text[pos:].encode("latin-1")
    return bytes(out)


def split_args(text: str) -> tuple[list[str], str] | None:
    """Split `a, b, [c, d]) = 5 <0.1>` into top-level args and the text after the closing `)`.

    Quoted strings are skipped whole; a `<` right after an fd number opens a -yy annotation, in
    which `[...]` hides `>` (sockets print as `TCP:[a:1->b:2]`) and `<...>` may nest
    (`/dev/null<char 1:3>`). None if the closing `)` is missing (a cut line).
    """
    args: list[str] = []
    stack: list[str] = []
    begin = 0
    i = 0
    n = len(text)
    while i < n:
        char = text[i]
        if char == '"':
            i += 1
            while i < n and text[i] != '"':
                i += 2 if text[i] == "\\" else 1
            i += 1
            continue
        in_annotation = "<" in stack
        if in_annotation:
            if stack[-1] == "[":
                if char == "]":
                    stack.pop()
            elif char in "[<":
                stack.append(char)
            elif char == ">":
                stack.pop()
        elif char == "<" and i > 0 and text[i - 1].isdigit():
            stack.append("<")
        elif char in "([{":
            stack.append(char)
        elif char in ")]}":
            if not stack:
                if char != ")":
                    return None
                last = text[begin:i].strip()
                if last or args:
                    args.append(last)
                return args, text[i + 1 :]
            stack.pop()
        elif char == "," and not stack:
            args.append(text[begin:i].strip())
            begin = i + 1
        i += 1
    return None


def _decode_annotation(annotation: str) -> str:
    if annotation.endswith("]"):  # sockets, pipes: `TCP:[a:1->b:2]`, printed unescaped
        return decode_c_string(annotation).decode("utf-8", "surrogateescape")
    # A nested annotation follows device paths (`/dev/null<char 1:3>`); raw `<` never occurs in
    # an escaped path.
    raw = annotation.split("<", 1)[0]
    path = decode_c_string(raw).decode("utf-8", "surrogateescape")
    return path.removesuffix(" (deleted)")


def _payload(name: str, args: list[str]) -> tuple[bytes, bool]:
    """The buffer a write-like call passed, and whether strace cut it."""
    if name in ("writev", "pwritev", "pwritev2", "sendmsg"):
        if len(args) < 2:
            return b"", False
        parts = list(_IOV_STRING.finditer(args[1]))
        return b"".join(decode_c_string(m["body"]) for m in parts), any(m["cut"] for m in parts)
    if len(args) < 2:
        return b"", False
    match = _STRING.fullmatch(args[1])
    if match is None:
        return b"", False
    return decode_c_string(match["body"]), bool(match["cut"])


def _event(
    line: int, pid: int, name: str, text: str, start: int, end: int | None, timestamp: str
) -> Syscall | None:
    split = split_args(text)
    if split is None:
        return None
    args, after = split
    fd: int | None = None
    target: str | None = None
    if args:
        fd_match = _FD.fullmatch(args[0])
        if fd_match:
            fd = int(fd_match["fd"])
            if fd_match["annotation"] is not None:
                target = _decode_annotation(fd_match["annotation"])
    result_match = _RESULT.match(after)
    result: int | None = None
    if result_match and result_match["value"] != "?":
        result = int(result_match["value"], 0)
    if end is None:
        result = None  # never returned: nothing was transferred as far as the trace shows
    cut = _CUT_AT_EXIT.match(after)
    cut_at_exit = end is not None and cut is not None and int(cut["errno"]) > MAX_ERRNO
    if cut_at_exit:
        result = None
    data = b""
    truncated = False
    if name in WRITE_CALLS:
        data, truncated = _payload(name, args)  # cut at exit: the whole buffer, what it may have sent
        if not cut_at_exit and (result is None or result < 0):
            data = b""
        elif result is not None:
            truncated = truncated and len(data) < result
            data = data[:result]
    return Syscall(line, pid, name, fd, target, data, result, start, end, timestamp, truncated,
                   text if name in AIO_CALLS else "")


def parse_trace(lines: Iterable[str]) -> list[Syscall]:
    """Events of a `strace -f -yy -xx` trace (with or without pids, -tt/-ttt, -T), in entry order.

    Order keys: line i's entry is 2*i, its exit 2*i+1, so a complete line's call sits between
    the lines around it and a resumed call ends where its `<... resumed>` line is.
    """
    pending: dict[int, tuple[int, str, str, str]] = {}  # pid -> (line index, name, text, time)
    events: list[Syscall] = []
    for index, raw in enumerate(lines):
        match = _LINE.fullmatch(raw.rstrip("\n"))
        if match is None:
            continue
        pid = int(match["pid"] or 0)
        rest = match["rest"]
        timestamp = match["time"]
        resumed = _RESUMED.fullmatch(rest)
        if resumed:
            begun = pending.pop(pid, None)
            if begun is None or begun[1] != resumed["name"]:
                continue  # its entry was before the trace began: no order key for it
            first, name, text, started_at = begun
            event = _event(first + 1, pid, name, text + resumed["text"], 2 * first, 2 * index + 1, started_at)
            if event is not None:
                events.append(event)
            continue
        call = _CALL.fullmatch(rest)
        if call is None:
            continue  # "+++ exited", "--- SIGxxx", strace notes
        if rest.endswith(_UNFINISHED):
            pending[pid] = (index, call["name"], call["text"].removesuffix(_UNFINISHED), timestamp)
            continue
        event = _event(index + 1, pid, call["name"], call["text"], 2 * index, 2 * index + 1, timestamp)
        if event is not None:
            events.append(event)
    # Calls still pending when their thread died or the trace ended: entered, never returned.
    for pid, (first, name, text, started_at) in pending.items():
        # Its entry printed all input args; close the list so it splits like a complete call.
        event = _event(first + 1, pid, name, text + ")", 2 * first, None, started_at)
        if event is not None:
            events.append(event)
    events.sort(key=lambda e: e.start)
    return events


_AIO_FDSYNC = re.compile(r"\{aio_data=(?P<token>0x[0-9a-fA-F]+|\d+), aio_lio_opcode=IOCB_CMD_FDSYNC, "
                         r"aio_fildes=(?P<fd>\d+)(?:<(?P<annotation>[^>]*)>)?")
_AIO_EVENT = re.compile(r"\{data=(?P<token>0x[0-9a-fA-F]+|\d+), obj=[^,]*, res=(?P<res>-?\d+)")


def aio_syncs(events: Sequence[Syscall]) -> list[Syscall]:
    """The fdatasyncs run through Linux AIO, as `fdatasync` events: entry at their `io_submit`,
    exit at the `io_getevents` that reported them (None if none did), result as reported."""
    started: dict[int, list[tuple[Syscall, int, str | None]]] = {}
    syncs: list[Syscall] = []
    for event in sorted(events, key=lambda e: e.start):
        if event.name == "io_submit" and event.result is not None and event.result > 0:
            for match in list(_AIO_FDSYNC.finditer(event.arguments))[: event.result]:
                target = _decode_annotation(match["annotation"]) if match["annotation"] is not None else None
                started.setdefault(int(match["token"], 0), []).append((event, int(match["fd"]), target))
        elif event.name == "io_getevents" and event.end is not None:
            for match in _AIO_EVENT.finditer(event.arguments):
                waiting = started.get(int(match["token"], 0))
                if not waiting:
                    continue
                submit, fd, target = waiting.pop(0)
                syncs.append(attrs.evolve(submit, name="fdatasync", fd=fd, target=target, result=int(match["res"]),
                                          end=event.end, arguments=""))
    for waiting in started.values():
        syncs += [attrs.evolve(submit, name="fdatasync", fd=fd, target=target, result=None, end=None, arguments="")
                  for submit, fd, target in waiting]
    return syncs


def parse_trace_file(path: Path) -> list[Syscall]:
    with open(path, encoding="latin-1") as file:
        return parse_trace(file)


# --------------------------------------------------------------------------------------------
# The ordering check

NO_ACK = "no-ack"  # the trace shows fewer OK frames on the connection than publishes
EXTRA_ACK = "extra-ack"  # more OK frames than publishes: the mapping would be guesswork
NOT_WRITTEN = "not-written"  # the body token is in no write to a data-dir file
WRITE_AFTER_ACK = "write-after-ack"  # written, but the write had not returned before the OK went out
NOT_SYNCED = "not-synced"  # written before the OK, but no fsync/fdatasync of that file in between


@attrs.frozen(slots=True)
class Violation:
    kind: str
    connection: str  # the client's address as the server saw it
    ack_index: int  # 0-based: the n-th OK on that connection
    token: bytes | None
    detail: str

    def __str__(self) -> str:
        token = self.token.decode("latin-1") if self.token else "-"
        return f"{self.kind}: {self.connection} OK #{self.ack_index} token {token}: {self.detail}"


@attrs.frozen(slots=True)
class CheckReport:
    acks_checked: int  # OK frames matched to a publish
    records_checked: int  # (body token, OK) pairs checked
    violations: tuple[Violation, ...]

    def kinds(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for violation in self.violations:
            counts[violation.kind] = counts.get(violation.kind, 0) + 1
        return counts

    def describe(self, limit: int = 10) -> str:
        head = (
            f"{self.acks_checked} acks / {self.records_checked} records checked, "
            f"{len(self.violations)} violations {self.kinds()}"
        )
        shown = [str(v) for v in self.violations[:limit]]
        if len(self.violations) > limit:
            shown.append(f"... {len(self.violations) - limit} more")
        return "\n  ".join([head, *shown])


class _Stream:
    """Bytes written to one file or socket in call order, with which call wrote which byte."""

    def __init__(self) -> None:
        self.data = bytearray()
        self.offsets: list[int] = []
        self.events: list[Syscall] = []

    def add(self, event: Syscall) -> None:
        self.offsets.append(len(self.data))
        self.events.append(event)
        self.data += event.data

    def covering(self, low: int, high: int) -> list[Syscall]:
        """The calls that wrote bytes [low, high)."""
        first = bisect.bisect_right(self.offsets, low) - 1
        last = bisect.bisect_left(self.offsets, high)
        return self.events[first:last]


def _in_dir(path: str | None, root: str) -> bool:
    return path is not None and path.startswith(root)


def nsq_acks(stream: _Stream) -> list[Syscall]:
    """For each NSQ `OK` response frame on a socket, the call that sent its first byte."""
    acks: list[Syscall] = []
    data = stream.data
    offset = 0
    while offset + _FRAME_HEADER.size <= len(data):
        size, frame_type = _FRAME_HEADER.unpack_from(data, offset)
        end = offset + 4 + size
        if size < 4 or end > len(data):
            break
        if frame_type == _FRAME_TYPE_RESPONSE and data[offset + 8 : end] == b"OK":
            acks.append(stream.covering(offset, offset + 1)[0])
        offset = end
    return acks


def mqks_acks(stream: _Stream) -> list[Syscall]:
    """For each MQKS confirm (`{id} ok ` with nothing after it) on a socket, the call that sent its first byte."""
    acks: list[Syscall] = []
    data = stream.data
    offset = 0
    while (end := data.find(b"\n", offset)) >= 0:
        if data[offset:end].endswith(b" ok ") and b" " not in data[offset:end - 4]:
            acks.append(stream.covering(offset, offset + 1)[0])
        offset = end + 1
    return acks


# ZMTP 3 (ZeroMQ's wire protocol): a 64-byte greeting, then frames of a flags byte (MORE, LONG,
# COMMAND) and a 1- or 8-byte size.
ZMTP_GREETING = 64
ZMTP_MORE, ZMTP_LONG, ZMTP_COMMAND = 0x01, 0x02, 0x04


def pzq_acks(stream: _Stream) -> list[Syscall]:
    """For each PZQ producer ACK `[id, '1', '']` a ZeroMQ socket sent, the call that sent its first byte."""
    acks: list[Syscall] = []
    data = stream.data
    offset = ZMTP_GREETING
    frames: list[bytes] = []
    start = offset
    while offset + 2 <= len(data):
        flags = data[offset]
        if flags & ZMTP_LONG:
            if offset + 9 > len(data):
                break
            head, size = 9, int.from_bytes(data[offset + 1 : offset + 9], "big")
        else:
            head, size = 2, data[offset + 1]
        end = offset + head + size
        if end > len(data):
            break
        if not flags & ZMTP_COMMAND:  # commands (READY, PING) are not messages
            if not frames:
                start = offset
            frames.append(bytes(data[offset + head : end]))
            if not flags & ZMTP_MORE:
                if len(frames) == 3 and frames[1:] == [b"1", b""]:
                    acks.append(stream.covering(start, start + 1)[0])
                frames = []
        offset = end
    return acks


AckFinder = Callable[[_Stream], list[Syscall]]


def check_fsync_order(
    events: Sequence[Syscall], data_dir: str | os.PathLike[str], publishes: Mapping[str, Sequence[Sequence[bytes]]],
    acks_in: AckFinder = nsq_acks,
) -> CheckReport:
    """Check that each publish's OK was sent only after its record was written and synced.

    `publishes` maps a client's address as the server sees it ("127.0.0.1:PORT") to its
    publishes in send order, each the body tokens it carried (one for PUB, several for MPUB); the
    n-th acknowledgement the server sent on that connection (`acks_in` finds them: NSQ `OK`
    frames by default) acknowledges the n-th publish.

    A record passes when some data-dir file has: writes carrying the token's bytes that all
    returned before an fsync/fdatasync of that same file path began, and that sync returned
    before the call sending the first byte of the OK began. (Any file will do: a record synced in
    one file is durable even if a copy elsewhere is not.)
    """
    root = os.path.realpath(data_dir).rstrip("/") + "/"
    ordered = sorted([*events, *aio_syncs(events)], key=lambda e: e.start)
    files: dict[str, _Stream] = {}
    sockets: dict[str, _Stream] = {}
    syncs: dict[str, list[Syscall]] = {}
    # A socket's annotation is looked up by strace at each call; on a loaded machine the lookup can
    # fail (`socket:[inode]`): such a call is the socket's its descriptor last named.
    fd_peers: dict[int, str] = {}
    for event in ordered:
        if event.name in SYNC_CALLS and _in_dir(event.target, root) and event.result == 0:
            syncs.setdefault(event.target or "", []).append(event)
        peer = event.peer()
        if event.fd is not None:
            if peer is not None:
                fd_peers[event.fd] = peer
            elif event.target is not None and "/" in event.target:
                fd_peers.pop(event.fd, None)  # the descriptor is a file now
            elif event.target is not None:
                peer = fd_peers.get(event.fd)
        if event.name not in WRITE_CALLS or not event.data:
            continue
        if _in_dir(event.target, root):
            stream = files.setdefault(event.target or "", _Stream())
        elif peer in publishes:
            stream = sockets.setdefault(peer, _Stream())
        else:
            continue
        if event.truncated:
            raise StraceError(f"strace cut the buffer of {event.describe()}: raise MAX_STRING")
        stream.add(event)

    violations: list[Violation] = []
    acks_checked = records_checked = 0
    for connection, sent in publishes.items():
        acks = acks_in(sockets[connection]) if connection in sockets else []
        if len(acks) > len(sent):
            violations.append(
                Violation(EXTRA_ACK, connection, len(sent), None, f"{len(acks)} OK frames for {len(sent)} publishes")
            )
        for index, tokens in enumerate(sent):
            if index >= len(acks):
                violations.append(Violation(NO_ACK, connection, index, None, "no OK frame for it in the trace"))
                continue
            ack = acks[index]
            acks_checked += 1
            for token in tokens:
                records_checked += 1
                problem = _check_record(token, ack, files, syncs)
                if problem is not None:
                    violations.append(Violation(problem[0], connection, index, token, problem[1]))
    return CheckReport(acks_checked, records_checked, tuple(violations))


def _check_record(
    token: bytes, ack: Syscall, files: Mapping[str, _Stream], syncs: Mapping[str, list[Syscall]]
) -> tuple[str, str] | None:
    """None if the record carrying `token` was synced between its write and `ack`, else (kind, why)."""
    best: tuple[str, str] | None = None
    for path, stream in files.items():
        position = stream.data.find(token)
        if position < 0:
            continue
        writes = stream.covering(position, position + len(token))
        ends = [w.end for w in writes]
        write_lines = ",".join(str(w.line) for w in writes)
        if any(end is None or end > ack.start for end in ends):
            best = best or (
                WRITE_AFTER_ACK,
                f"write of {path} (line {write_lines}) had not returned when the OK was sent (line {ack.line})",
            )
            continue
        written = max(end for end in ends if end is not None)
        for sync in syncs.get(path, ()):
            if sync.start > written and sync.end is not None and sync.end < ack.start:
                return None
        best = (
            NOT_SYNCED,
            f"no fsync/fdatasync of {path} began after its write (line {write_lines}) "
            f"and returned before the OK was sent (line {ack.line})",
        )
    return best or (NOT_WRITTEN, f"no write to a data-dir file carried it before the trace ended (OK line {ack.line})")


# --------------------------------------------------------------------------------------------
# Running a command under strace


def strace_command(trace_path: Path) -> list[str]:
    """`strace ... --` options; raises StraceError (a test failure, never a skip) without strace."""
    strace = shutil.which("strace")
    if strace is None:
        raise StraceError(
            "strace is not installed (not on PATH): the fsync-ordering test records the gateway's "
            "system calls with it; install it (e.g. `apt-get install strace`)"
        )
    return [
        strace,
        "-f",  # follow threads: records may be synced by a storage thread
        "--seccomp-bpf",  # stop only on traced calls, so the gateway runs near full speed
        "-ttt",
        "-T",
        "-yy",  # fd annotations: file paths and socket addresses
        "-xx",  # every string byte as \xHH: nothing in a buffer can confuse the parser
        "-s",
        str(MAX_STRING),
        "-e",
        "trace=" + ",".join(TRACED_CALLS),
        "-o",
        str(trace_path),
        "--",
    ]


@attrs.define
class TracedProcess:
    strace: subprocess.Popen[str]  # the process we started; the traced command is its child
    trace_path: Path
    addresses: dict[str, str]
    log_lines: list[str]
    pid: int | None = None  # the traced command's PID (strace's child)

    def host_port(self, name: str) -> tuple[str, int]:
        host, port = self.addresses[name].rsplit(":", 1)
        return host, int(port)

    @property
    def nsq_tcp(self) -> str:
        return self.addresses["nsq-tcp"]

    def stop(self) -> None:
        """SIGTERM the traced command (strace exits once its tracees have), then wait for strace.

        Signalling strace itself would only make it detach and leave the command running, so
        the signal goes to the child PID; SIGKILL to that child if it ignores SIGTERM.
        """
        if self.strace.poll() is not None:
            return
        if self.pid is None:  # stopped before it was ready: strace may have forked it since
            self.pid = _child_pid(self.strace.pid)
        if self.pid is not None:
            for sig in (signal.SIGTERM, signal.SIGKILL):
                with suppress(ProcessLookupError):
                    os.kill(self.pid, sig)
                try:
                    self.strace.wait(STOP_TIMEOUT_S)
                    return
                except subprocess.TimeoutExpired:
                    continue
        # No child found, or it outlived SIGKILL: end strace itself, the process we started.
        self.strace.kill()
        self.strace.wait(STOP_TIMEOUT_S)

    def events(self) -> list[Syscall]:
        """The parsed trace; only complete once `stop` returned."""
        return parse_trace_file(self.trace_path)


def _child_pid(parent: int) -> int | None:
    """The PID of `parent`'s child (strace forks exactly one: the command it runs)."""
    try:
        children = Path(f"/proc/{parent}/task/{parent}/children").read_text().split()
        if children:
            return int(children[0])
    except OSError:
        pass
    # Kernels without the children file: scan for a process whose parent is `parent`.
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[1]) == parent:
            return int(stat.parent.name)
    return None


@contextmanager
def traced_process(command: Sequence[str], trace_path: Path) -> Iterator[TracedProcess]:
    """Run `command` as strace's child until the block ends; the trace is complete afterwards."""
    from support.gateway import read_announcements  # not at the top: this file also runs as a script

    process = subprocess.Popen(
        [*strace_command(trace_path), *command],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,  # strace's own errors (e.g. ptrace refused) land in log_lines
        text=True,
        bufsize=1,
    )
    lines: list[str] = []
    addresses: dict[str, str] = {}
    ready = threading.Event()
    threading.Thread(target=read_announcements, args=(process.stdout, lines, ready, addresses), daemon=True).start()
    traced = TracedProcess(process, trace_path, addresses, lines)
    try:
        if not ready.wait(READY_TIMEOUT_S) or process.poll() is not None:
            raise StraceError("traced process did not start:\n" + "\n".join(lines))
        traced.pid = _child_pid(process.pid)
        yield traced
    finally:
        traced.stop()


# --------------------------------------------------------------------------------------------
# Reference server: a minimal NSQ publish endpoint with known-correct (or known-wrong) ordering


def _read_exact(conn, size: int) -> bytes:
    data = bytearray()
    while len(data) < size:
        chunk = conn.recv(size - len(data))
        if not chunk:
            raise EOFError
        data += chunk
    return bytes(data)


def _read_line(conn) -> bytes:
    line = bytearray()
    while not line.endswith(b"\n"):
        line += _read_exact(conn, 1)
    return bytes(line[:-1])


def _reference_server(data_dir: str, mode: str) -> None:
    """PUB/MPUB only. A writer thread group-commits records (length + body) to one file and, in
    mode "always", fdatasyncs before releasing the acks; in mode "never" it does not sync."""
    import queue
    import socket

    os.makedirs(os.path.join(data_dir, "topics"), exist_ok=True)
    fd = os.open(os.path.join(data_dir, "topics", "records.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    pending: queue.Queue[tuple[list[bytes], threading.Event]] = queue.Queue()

    def writer() -> None:
        while True:
            batch = [pending.get()]
            while not pending.empty():
                batch.append(pending.get())
            os.write(fd, b"".join(struct.pack(">i", len(b)) + b for bodies, _ in batch for b in bodies))
            if mode == "always":
                os.fdatasync(fd)
            for _, done in batch:
                done.set()

    def session(conn: socket.socket) -> None:
        with conn:
            try:
                _read_exact(conn, 4)  # "  V2"
                while True:
                    command = _read_line(conn).split()
                    body = _read_exact(conn, struct.unpack(">i", _read_exact(conn, 4))[0])
                    if command[0] == b"MPUB":
                        bodies, offset = [], 4
                        for _ in range(struct.unpack_from(">i", body)[0]):
                            size = struct.unpack_from(">i", body, offset)[0]
                            bodies.append(body[offset + 4 : offset + 4 + size])
                            offset += 4 + size
                    else:
                        bodies = [body]
                    done = threading.Event()
                    pending.put((bodies, done))
                    done.wait()
                    conn.sendall(OK_FRAME)
            except (EOFError, OSError):
                return

    threading.Thread(target=writer, daemon=True).start()
    listener = socket.create_server(("127.0.0.1", 0))
    print(f"reference listening nsq-tcp 127.0.0.1:{listener.getsockname()[1]}", flush=True)
    print("reference ready", flush=True)
    while True:
        conn, _ = listener.accept()
        threading.Thread(target=session, args=(conn,), daemon=True).start()


if __name__ == "__main__":
    import sys

    if len(sys.argv) != 4 or sys.argv[1] != "reference-server":
        sys.exit(f"usage: {sys.argv[0]} reference-server DATA_DIR always|never")
    _reference_server(sys.argv[2], sys.argv[3])
