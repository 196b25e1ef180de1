"""With `--fsync=always`, every publish acknowledgement (NSQ `OK`, MQKS confirm, PZQ producer ACK) waits for the fsync.

A kill -9 test cannot show this (the page cache survives a process kill), so the gateway runs
under strace and `support.syscall_trace.check_fsync_order` checks the order of its system calls:
write of the record to a data-dir file -> fsync/fdatasync of that file -> send of the `OK`.
"""

from __future__ import annotations

import secrets
import socket
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import zmq

from polymq.codecs import nsq_client as client

from support import syscall_trace
from support.mqks_wire import MQKSWire
from support.nsq_wire import RawClient
from support.syscall_trace import (
    EXTRA_ACK,
    NO_ACK,
    NOT_SYNCED,
    NOT_WRITTEN,
    OK_FRAME,
    WRITE_AFTER_ACK,
    AckFinder,
    CheckReport,
    StraceError,
    Syscall,
    TracedProcess,
    check_fsync_order,
    decode_c_string,
    mqks_acks,
    nsq_acks,
    parse_trace,
    pzq_acks,
    split_args,
    strace_command,
    traced_process,
)

TOPIC = "fsync_order"
SINGLE_PUBS = 100  # PUB, each waiting for its OK
BURST_EVERY, BURST_SIZE = 20, 10  # every 20th round, 10 pipelined PUBs (provokes group commit)
MPUB_EVERY, MPUB_SIZE = 4, 4  # every 4th round, an MPUB of 4 on the second connection
EXPECTED_ACKS = SINGLE_PUBS + (SINGLE_PUBS // BURST_EVERY) * BURST_SIZE + SINGLE_PUBS // MPUB_EVERY
EXPECTED_RECORDS = EXPECTED_ACKS - SINGLE_PUBS // MPUB_EVERY + (SINGLE_PUBS // MPUB_EVERY) * MPUB_SIZE
Publishes = dict[str, list[list[bytes]]]  # client address -> the tokens of each publish, in order
CLIENT_TIMEOUT = 20.0  # every syscall of interest stops in strace; fsync may be slow on CI disks


def _token() -> bytes:
    return secrets.token_hex(12).encode()  # 24 random hex chars: found in a record only if written


def _peer(conn: RawClient) -> str:
    host, port = conn.sock.getsockname()[:2]
    return f"{host}:{port}"  # how the server's -yy socket annotation names this client


def publish_workload(address: str) -> dict[str, list[list[bytes]]]:
    """PUBs (one at a time and in pipelined bursts) on one connection, MPUBs on another.

    Returns, per client address, the body tokens of each publish in send order: the n-th OK the
    server sent on that connection acknowledges the n-th entry.
    """
    sent: dict[str, list[list[bytes]]] = {}
    with RawClient(address, timeout=CLIENT_TIMEOUT) as single, RawClient(address, timeout=CLIENT_TIMEOUT) as multi:
        singles = sent.setdefault(_peer(single), [])
        batches = sent.setdefault(_peer(multi), [])
        for round_ in range(SINGLE_PUBS):
            token = _token()
            single.send(client.pub(TOPIC, b"fsync-order " + token))
            singles.append([token])
            single.expect_response(b"OK")
            if round_ % BURST_EVERY == BURST_EVERY - 1:
                burst = [_token() for _ in range(BURST_SIZE)]
                single.send(b"".join(client.pub(TOPIC, b"fsync-order " + t) for t in burst))
                singles.extend([t] for t in burst)
                for _ in burst:
                    single.expect_response(b"OK")
            if round_ % MPUB_EVERY == MPUB_EVERY - 1:
                batch = [_token() for _ in range(MPUB_SIZE)]
                multi.send(client.mpub(TOPIC, [b"fsync-order " + t for t in batch]))
                batches.append(batch)
                multi.expect_response(b"OK")
    return sent


def mqks_publish_workload(address: tuple[str, int]) -> dict[str, list[list[bytes]]]:
    """Confirmed MQKS publishes, one at a time and in pipelined bursts, to an event a queue is bound
    to (and nobody consumes: a copy delivered in the turn it came would need no record)."""
    with MQKSWire(address, timeout=CLIENT_TIMEOUT) as setup:
        setup.send(b"c0 consume --confirm fsync_q fsync_e")
        assert setup.line() == b"c0 ok "
        setup.send(b"x0 delete_consumer --confirm c0")
        assert setup.line() == b"x0 ok "
    singles: list[list[bytes]] = []
    with MQKSWire(address, timeout=CLIENT_TIMEOUT) as publisher:
        host, port = publisher.sock.getsockname()[:2]
        for round_ in range(SINGLE_PUBS):
            burst = [_token() for _ in range(BURST_SIZE if round_ % BURST_EVERY == BURST_EVERY - 1 else 1)]
            publisher.send(b"".join(b"m%d publish --confirm fsync_e fsync-order %s\n" % (len(singles) + i, token)
                                    for i, token in enumerate(burst)))
            for i in range(len(burst)):
                assert publisher.line() == b"m%d ok " % (len(singles) + i)
            singles.extend([token] for token in burst)
    return {f"{host}:{port}": singles}


def pzq_publish_workload(address: str) -> dict[str, list[list[bytes]]]:
    """PZQ producer messages, one at a time and in pipelined bursts, each waiting for its ACK.

    The DEALER connects from a port chosen here (ZeroMQ's `source;destination` endpoint), so the
    trace's connection can be told by its address."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        source_port = probe.getsockname()[1]
    context = zmq.Context()
    producer = context.socket(zmq.DEALER)
    producer.setsockopt(zmq.LINGER, 0)
    producer.setsockopt(zmq.RCVTIMEO, int(CLIENT_TIMEOUT * 1000))
    sent: list[list[bytes]] = []
    try:
        producer.connect(f"tcp://127.0.0.1:{source_port};{address}")
        for round_ in range(SINGLE_PUBS):
            burst = [_token() for _ in range(BURST_SIZE if round_ % BURST_EVERY == BURST_EVERY - 1 else 1)]
            ids = [b"p%d" % (len(sent) + i) for i in range(len(burst))]
            for message_id, token in zip(ids, burst, strict=True):
                producer.send_multipart([message_id, b"", b"fsync-order " + token])
            for message_id in ids:
                assert producer.recv_multipart() == [message_id, b"1", b""]
            sent.extend([token] for token in burst)
    finally:
        producer.close(linger=0)
        context.term()
    return {f"127.0.0.1:{source_port}": sent}


def _gateway_command(data_dir: Path, fsync: str, *, mqks: bool = False, pzq: bool = False) -> list[str]:
    return [
        sys.executable, "-m", "polymq", "serve",
        "--bind", "127.0.0.1",
        "--nsq-tcp-port", "0",
        "--nsq-http-port", "0",
        "--mqks-port", "0" if mqks else "-1",
        "--phpmq-port", "-1",
        "--phpmq-console-port", "-1",
        *(["--pzq", "--pzq-receive-port", "0", "--pzq-send-port", "-1", "--pzq-monitor-port", "-1"]
          if pzq else ["--no-pzq"]),
        "--no-emqp",
        "--admin-port", "-1",
        "--data-dir", str(data_dir),
        f"--fsync={fsync}",
    ]


def _traced_run(command: list[str], workdir: Path, workload: Callable[[TracedProcess], Publishes] | None = None,
                acks_in: AckFinder = nsq_acks) -> tuple[CheckReport, list[str]]:
    """Run `command` (its data dir is workdir/data) under strace, publish (NSQ unless `workload`
    says otherwise), check the trace.

    The trace stays in `workdir` (pytest's tmp_path, kept for the last runs) for inspection.
    """
    data_dir = workdir / "data"
    data_dir.mkdir(exist_ok=True)
    failure: Exception | None = None
    with traced_process(command, workdir / "trace.txt") as server:
        try:
            sent = workload(server) if workload is not None else publish_workload(server.nsq_tcp)
        except Exception as exc:  # shown with the server's whole output once it has stopped
            failure = exc
    if failure is not None:
        raise AssertionError("publishing failed; server output:\n" + "\n".join(server.log_lines[-60:])) from failure
    # The trace is complete here: strace exited after the server did.
    return check_fsync_order(server.events(), data_dir, sent, acks_in), server.log_lines


# -- the gateway -------------------------------------------------------------------------------


@pytest.mark.parametrize("syncs", ["fdatasync by kernel AIO", "fdatasync in a thread"])
def test_fsync_always_syncs_every_record_before_its_ack(tmp_path: Path, syncs: str,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    if "AIO" in syncs:
        monkeypatch.setenv("POLYMQ_SYNC_AIO", "1")
    report, log = _traced_run(_gateway_command(tmp_path / "data", "always"), tmp_path)
    assert any(f"fsync always ({syncs})" in line for line in log), log[:5]
    # Not vacuous: every publish's OK was found in the trace and its records looked at.
    assert report.acks_checked == EXPECTED_ACKS, report.describe()
    assert report.records_checked == EXPECTED_RECORDS, report.describe()
    trace = tmp_path / "trace.txt"
    assert not report.violations, f"{report.describe()}\ntrace: {trace}\ngateway output:\n" + "\n".join(log[-20:])


def _check_single_publishes(report: CheckReport, log: list[str], fsync: str, workdir: Path) -> None:
    """The MQKS and PZQ workloads: every publish acknowledged and checked; with `never`, the
    checker must see each acknowledgement come before any fdatasync (it is not vacuous)."""
    expected = SINGLE_PUBS + (SINGLE_PUBS // BURST_EVERY) * (BURST_SIZE - 1)
    assert (report.acks_checked, report.records_checked) == (expected, expected), report.describe()
    if fsync == "never":
        assert report.violations and {v.kind for v in report.violations} == {NOT_SYNCED}, report.describe()
        return
    assert not report.violations, f"{report.describe()}\ntrace: {workdir / 'trace.txt'}\ngateway output:\n" + \
        "\n".join(log[-20:])


@pytest.mark.parametrize("fsync", ["always", "never"])
def test_mqks_confirms_wait_for_the_fsync(tmp_path: Path, fsync: str) -> None:
    report, log = _traced_run(_gateway_command(tmp_path / "data", fsync, mqks=True), tmp_path,
                              lambda server: mqks_publish_workload(server.host_port("mqks")), mqks_acks)
    _check_single_publishes(report, log, fsync, tmp_path)


@pytest.mark.parametrize("fsync", ["always", "never"])
def test_pzq_producer_acks_wait_for_the_fsync(tmp_path: Path, fsync: str) -> None:
    report, log = _traced_run(_gateway_command(tmp_path / "data", fsync, pzq=True), tmp_path,
                              lambda server: pzq_publish_workload(server.addresses["pzq-receive"]), pzq_acks)
    _check_single_publishes(report, log, fsync, tmp_path)


def test_fsync_never_is_caught_by_the_checker(tmp_path: Path) -> None:
    """Negative control: without syncing, the same run must show unsynced acks."""
    report, _ = _traced_run(_gateway_command(tmp_path / "data", "never"), tmp_path)
    assert report.acks_checked == EXPECTED_ACKS, report.describe()
    # Written but not synced, not merely "not found": the check reached the fsync test.
    assert report.kinds().get(NOT_SYNCED, 0) > 0, report.describe()


# -- the checker against a reference server (independent of the gateway) ----------------------


def _reference_command(data_dir: Path, mode: str) -> list[str]:
    return [sys.executable, syscall_trace.__file__, "reference-server", str(data_dir), mode]


def test_checker_passes_a_server_that_syncs_from_another_thread(tmp_path: Path) -> None:
    report, _ = _traced_run(_reference_command(tmp_path / "data", "always"), tmp_path)
    assert report.acks_checked == EXPECTED_ACKS, report.describe()
    assert report.records_checked == EXPECTED_RECORDS, report.describe()
    assert not report.violations, report.describe()


def test_checker_fails_a_server_that_never_syncs(tmp_path: Path) -> None:
    report, _ = _traced_run(_reference_command(tmp_path / "data", "never"), tmp_path)
    assert report.acks_checked == EXPECTED_ACKS, report.describe()
    assert report.kinds() == {NOT_SYNCED: EXPECTED_RECORDS}, report.describe()


def test_missing_strace_fails_loudly(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty folder: no strace on it
    with pytest.raises(StraceError, match="strace is not installed"):
        strace_command(tmp_path / "trace.txt")
    assert issubclass(StraceError, AssertionError)  # a failed test, never a skip


# -- parser ------------------------------------------------------------------------------------

DATA = "/tmp/d"
PATH_HEX = "".join(f"\\x{b:02x}" for b in b"/tmp/d/topics/t/0.log")
TOKEN = b"0123456789abcdef01234567"
TOKEN_HEX = "".join(f"\\x{b:02x}" for b in b"\x00\x00\x00\x1c" + TOKEN + b"tail")
OK_HEX = "".join(f"\\x{b:02x}" for b in OK_FRAME)
SOCK = "TCP:[127.0.0.1:4150->127.0.0.1:5555]"
PEER = "127.0.0.1:5555"
OTHER_FILE_HEX = "".join(f"\\x{b:02x}" for b in b"/tmp/d/other.log")  # in the data dir, not the record's file


def _by_name(events: list[Syscall], name: str) -> Syscall:
    (event,) = (e for e in events if e.name == name)
    return event


def test_decode_c_string() -> None:
    assert decode_c_string(r"\x00\x4f\x4b") == b"\x00OK"
    assert decode_c_string(r"a\n\t\"\\\0\177b") == b'a\n\t"\\\x00\x7fb'


def test_split_args_handles_annotations_strings_and_nesting() -> None:
    args, after = split_args(f'5<{SOCK}>, [{{iov_base="a)b,", iov_len=4}}], 1) = 4 <0.000010>')  # type: ignore[misc]
    assert args == [f"5<{SOCK}>", '[{iov_base="a)b,", iov_len=4}]', "1"]
    assert after == " = 4 <0.000010>"
    args, _ = split_args(r'2<\x2f\x64\x65\x76\x2f\x6e\x75\x6c\x6c<char 1:3>>, "x", 1) = 1')  # type: ignore[misc]
    assert args[0] == r"2<\x2f\x64\x65\x76\x2f\x6e\x75\x6c\x6c<char 1:3>>"
    assert split_args('3, "cut') is None


def test_parse_complete_write_and_send_lines() -> None:
    events = parse_trace([
        f'101  1700000000.000001 write(7<{PATH_HEX}>, "{TOKEN_HEX}", 32) = 32 <0.000010>',
        f'101  1700000000.000002 sendto(9<{SOCK}>, "{OK_HEX}", 10, 0, NULL, 0) = 10 <0.000010>',
        r'101  1700000000.000003 write(2<\x2f\x64\x65\x76\x2f\x6e\x75\x6c\x6c<char 1:3>>, "\x68", 1) = 1 <0.000001>',
        "101  1700000000.000004 +++ exited with 0 +++",
    ])
    write, send, log = events
    assert (write.pid, write.name, write.fd, write.target) == (101, "write", 7, "/tmp/d/topics/t/0.log")
    assert write.data == b"\x00\x00\x00\x1c" + TOKEN + b"tail" and write.result == 32
    assert (write.line, write.start, write.end) == (1, 0, 1)
    assert send.target == SOCK and send.peer() == PEER and send.data == OK_FRAME
    assert (send.start, send.end) == (2, 3)
    assert log.target == "/dev/null" and log.data == b"h"


def test_parse_unfinished_and_resumed_across_threads() -> None:
    events = parse_trace([
        f"200  10:00:00.000001 fdatasync(7<{PATH_HEX}> <unfinished ...>",
        f'201  10:00:00.000002 sendto(9<{SOCK}>, "{OK_HEX}", 10, 0, NULL, 0 <unfinished ...>',
        "200  10:00:00.000003 <... fdatasync resumed>) = 0 <0.000002>",
        "201  10:00:00.000004 <... sendto resumed>) = 10 <0.000002>",
        f"202  10:00:00.000005 fsync(7<{PATH_HEX}> <unfinished ...>",
        "202  10:00:00.000006 +++ exited with 0 +++",
    ])
    sync = _by_name(events, "fdatasync")
    send = _by_name(events, "sendto")
    never = _by_name(events, "fsync")
    assert (sync.line, sync.start, sync.end, sync.result) == (1, 0, 5, 0)
    assert sync.target == "/tmp/d/topics/t/0.log"
    assert (send.start, send.end, send.data) == (2, 7, OK_FRAME)
    assert sync.end > send.start  # overlapping: this sync does not precede this send
    assert never.end is None and never.result is None


def test_a_send_whose_thread_was_killed_as_it_returned_keeps_its_buffer() -> None:
    # strace's record of a reference-server run stopped by SIGTERM just after the client read its
    # last OK: the send's exit reads as no errno at all.
    [send] = parse_trace([
        f'8134  1.470106 sendto(6<{SOCK}>, "{OK_HEX}", 10, 0, NULL, 0 <unfinished ...>',
        "8134  1.470492 <... sendto resumed>) = -1 (errno 18446744073709551572) <0.000368>",
        "8134  1.470549 +++ killed by SIGTERM +++",
    ])
    assert send.data == OK_FRAME and send.result is None and send.peer() == PEER


def test_parse_writev_sendmsg_partial_and_failed_writes() -> None:
    events = parse_trace([
        rf'1 1.000001 writev(7<{PATH_HEX}>, [{{iov_base="\x61\x62", iov_len=2}}, '
        rf'{{iov_base="\x63", iov_len=1}}], 2) = 3',
        rf'1 1.000002 sendmsg(9<{SOCK}>, {{msg_name=NULL, msg_namelen=0, msg_iov=[{{iov_base="\x78", iov_len=1}}, '
        rf'{{iov_base="\x79", iov_len=1}}], msg_iovlen=2, msg_controllen=0, msg_flags=0}}, 0) = 2',
        rf'1 1.000003 pwrite64(7<{PATH_HEX}>, "\x61\x62\x63\x64", 4, 0) = 2',
        rf'1 1.000004 sendto(9<{SOCK}>, "\x61", 1, 0, NULL, 0) = -1 EAGAIN (Resource temporarily unavailable)',
        rf'1 1.000005 write(7<{PATH_HEX}>, "\x61\x62"..., 5) = 5',
    ])
    writev, sendmsg, pwrite, failed, cut = events
    assert writev.data == b"abc"
    assert sendmsg.data == b"xy" and sendmsg.peer() == PEER
    assert pwrite.data == b"ab"  # only what the kernel took
    assert failed.data == b"" and failed.result == -1
    assert cut.truncated


# -- checker on hand-made traces ---------------------------------------------------------------


def _write(fd: int, path_hex: str, payload: bytes, tail: str = ") = {n}") -> str:
    hexed = "".join(f"\\x{b:02x}" for b in payload)
    return f'1 1.0 write({fd}<{path_hex}>, "{hexed}", {len(payload)}' + tail.format(n=len(payload))


def _send(payload: bytes, tail: str = ") = {n}") -> str:
    hexed = "".join(f"\\x{b:02x}" for b in payload)
    return f'2 1.0 sendto(9<{SOCK}>, "{hexed}", {len(payload)}, 0, NULL, 0' + tail.format(n=len(payload))


def _sync(name: str = "fdatasync", path_hex: str = PATH_HEX, pid: int = 3) -> str:
    return f"{pid} 1.0 {name}(7<{path_hex}>) = 0"


def _check(lines: list[str], publishes: dict[str, list[list[bytes]]] | None = None):
    return check_fsync_order(parse_trace(lines), DATA, publishes or {PEER: [[TOKEN]]})


def test_checker_accepts_write_sync_ack() -> None:
    report = _check([_write(7, PATH_HEX, TOKEN), _sync(), _send(OK_FRAME)])
    assert (report.acks_checked, report.records_checked, report.violations) == (1, 1, ())


@pytest.mark.parametrize(
    ("lines", "kind"),
    [
        ([_write(7, PATH_HEX, TOKEN), _send(OK_FRAME)], NOT_SYNCED),
        ([_sync(), _write(7, PATH_HEX, TOKEN), _send(OK_FRAME)], NOT_SYNCED),  # sync before the write
        ([_write(7, PATH_HEX, TOKEN), _send(OK_FRAME), _sync()], NOT_SYNCED),  # sync after the ack
        ([_write(7, PATH_HEX, TOKEN), _sync("sync_file_range"), _send(OK_FRAME)], NOT_SYNCED),  # not a barrier
        ([_write(7, PATH_HEX, TOKEN), _sync(path_hex=OTHER_FILE_HEX), _send(OK_FRAME)], NOT_SYNCED),
        ([_send(OK_FRAME)], NOT_WRITTEN),
        ([_write(7, r"\x2f\x65\x6c\x73\x65", TOKEN), _sync(), _send(OK_FRAME)], NOT_WRITTEN),  # outside data dir
        ([_write(7, PATH_HEX, TOKEN, " <unfinished ...>"), _send(OK_FRAME), "1 1.0 <... write resumed>) = 24"],
         WRITE_AFTER_ACK),
        ([_write(7, PATH_HEX, TOKEN), _sync()], NO_ACK),
        ([_write(7, PATH_HEX, TOKEN), _sync(), _send(OK_FRAME * 2)], EXTRA_ACK),
    ],
    ids=["no-sync", "sync-first", "sync-late", "sync-file-range", "other-file", "unwritten", "outside",
         "write-overlaps-ack", "no-ack", "extra-ack"],
)
def test_checker_rejects(lines: list[str], kind: str) -> None:
    report = _check(lines)
    assert kind in report.kinds(), report.describe()


def test_checker_sync_must_return_before_the_ack_starts() -> None:
    """A sync still running (another thread) when the send began does not count."""
    lines = [
        _write(7, PATH_HEX, TOKEN),
        f"3 1.0 fdatasync(7<{PATH_HEX}> <unfinished ...>",
        _send(OK_FRAME, " <unfinished ...>"),
        "3 1.0 <... fdatasync resumed>) = 0",
        "2 1.0 <... sendto resumed>) = 10",
    ]
    assert _check(lines).kinds() == {NOT_SYNCED: 1}
    # The same sync, returning before the send was entered, counts.
    lines[2], lines[3] = lines[3], lines[2]
    assert _check(lines).violations == ()


def test_checker_group_commit_and_split_frames() -> None:
    """Several records in one write, several OKs in one send, a frame split across sends: the
    n-th OK on a connection acks the n-th publish, and its first byte's send is the one that counts."""
    other = b"fedcba9876543210fedcba98"
    third = b"aaaaaaaaaaaaaaaaaaaaaaaa"
    lines = [
        _write(7, PATH_HEX, TOKEN + other),
        _sync(),
        _send(OK_FRAME + OK_FRAME[:3]),
        _write(7, PATH_HEX, third),
        _send(OK_FRAME[3:]),  # the second OK began before `third` was written or synced
        _sync(),
        _send(OK_FRAME),
    ]
    publishes = {PEER: [[TOKEN], [other], [third]]}
    report = _check(lines, publishes)
    assert (report.acks_checked, report.records_checked) == (3, 3)
    assert report.violations == ()
    publishes = {PEER: [[TOKEN, other], [third], []]}  # an MPUB, then `third` acked too early
    report = _check(lines, publishes)
    assert [(v.kind, v.ack_index) for v in report.violations] == [(WRITE_AFTER_ACK, 1)]


def _aio_submit(token: int, path_hex: str = PATH_HEX) -> str:
    return (f"3 1.0 io_submit(0x7f00, 1, [{{aio_data={token:#x}, aio_lio_opcode=IOCB_CMD_FDSYNC, "
            f"aio_fildes=7<{path_hex}>}}]) = 1")


def _aio_reaped(token: int, res: int = 0) -> str:
    return (f"3 1.0 io_getevents(0x7f00, 0, 1024, [{{data={token:#x}, obj=0x7f10, res={res}, res2=0}}], "
            "{tv_sec=0, tv_nsec=0}) = 1")


def test_checker_counts_an_aio_fdatasync_from_its_submit_to_the_report_of_its_end() -> None:
    """Linux AIO: the kernel runs the fdatasync; it began at io_submit and is known ended when io_getevents said so."""
    assert _check([_write(7, PATH_HEX, TOKEN), _aio_submit(5), _aio_reaped(5), _send(OK_FRAME)]).violations == ()
    not_synced = [
        [_write(7, PATH_HEX, TOKEN), _aio_submit(5), _send(OK_FRAME), _aio_reaped(5)],  # reported after the OK
        [_aio_submit(5), _write(7, PATH_HEX, TOKEN), _aio_reaped(5), _send(OK_FRAME)],  # submitted before the write
        [_write(7, PATH_HEX, TOKEN), _aio_submit(5), _aio_reaped(6), _send(OK_FRAME)],  # another sync's end
        [_write(7, PATH_HEX, TOKEN), _aio_submit(5), _aio_reaped(5, -5), _send(OK_FRAME)],  # it failed (EIO)
        [_write(7, PATH_HEX, TOKEN), _aio_submit(5, OTHER_FILE_HEX), _aio_reaped(5), _send(OK_FRAME)],
    ]
    for lines in not_synced:
        assert _check(lines).kinds() == {NOT_SYNCED: 1}, lines


def test_a_send_whose_socket_strace_could_not_name_counts_for_its_descriptor() -> None:
    # Under load strace's socket lookup can fail: the call shows `socket:[inode]` for the same fd 9.
    unnamed = _send(OK_FRAME).replace(f"9<{SOCK}>", "9<socket:[12345]>")
    second = b"fedcba9876543210fedcba98"
    report = _check([_write(7, PATH_HEX, TOKEN), _sync(), _send(OK_FRAME), _write(7, PATH_HEX, second), _sync(),
                     unnamed], {PEER: [[TOKEN], [second]]})
    assert (report.acks_checked, report.violations) == (2, ()), report.describe()
