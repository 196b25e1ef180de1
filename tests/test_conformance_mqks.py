"""`polymq conformance mqks`: passes against a real gateway, and fails (usefully) against wrong servers.

Wrong servers are fakes (garbage, silence) and a line-rewriting proxy in front of a real gateway
that injects one defect at a time, so a test shows the suite pinpoints that defect.
"""

from __future__ import annotations

import contextlib
import json
import re
import socket
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

from polymq.conformance.mqks import checks, command

from support.fake_tcp import POLL_S, fake_server, serving
from support.gateway import GatewayProcess, running_gateway
from support.mqks_wire import MQKSWire

# A rewrite of one server line (without its `\n`) into the lines the client gets instead.
Rewrite = Callable[[bytes], list[bytes]]

# How the runner prints a check's description under its result line.
DESCRIPTION = "     checks: "


def run_suite(*args: str) -> tuple[int, list[str]]:
    """The exit code and the report's lines, without the description printed under each check."""
    result = CliRunner().invoke(command, list(args), catch_exceptions=False)
    return result.exit_code, [line for line in result.output.splitlines() if not line.startswith(DESCRIPTION)]


def address_of(gateway: GatewayProcess) -> str:
    host, port = gateway.host_port("mqks")
    return f"{host}:{port}"


@contextlib.contextmanager
def rewriting_proxy(upstream: tuple[str, int], rewrite: Rewrite) -> Iterator[str]:
    """A proxy to `upstream` passing requests unchanged and each response line through `rewrite`."""

    def pump(src: socket.socket, dst: socket.socket, stop: threading.Event, lines: bool) -> None:
        buffer = b""
        src.settimeout(POLL_S)
        while not stop.is_set():
            try:
                data = src.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                break
            if not data:
                break
            if lines:
                buffer += data
                *complete, buffer = buffer.split(b"\n")
                data = b"".join(out + b"\n" for line in complete for out in rewrite(line))
            with contextlib.suppress(OSError):
                dst.sendall(data)
        # One side closed: close both, as a proxy would.
        for sock in (src, dst):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def serve_conn(client: socket.socket, stop: threading.Event) -> None:
        with client, socket.create_connection(upstream) as server:
            up = threading.Thread(target=pump, args=(client, server, stop, False), daemon=True)
            up.start()
            pump(server, client, stop, True)
            up.join()

    with serving(serve_conn) as address:
        yield address


def failures(lines: list[str]) -> dict[str, str]:
    return {m[1]: m[2] for line in lines if (m := re.match(r"FAIL ([^:]+): (.*)", line))}


# ---------------------------------------------------------------------------------------------
# Against polymq


@pytest.mark.slow
def test_suite_passes_against_the_gateway(module_gateway: GatewayProcess) -> None:
    code, lines = run_suite("--addr", address_of(module_gateway))
    assert [line for line in lines if line.startswith("FAIL")] == []
    assert lines[-1] == f"{len(checks.checks)} passed, 0 failed"
    assert code == 0


def test_only_filters_by_substring(module_gateway: GatewayProcess) -> None:
    code, lines = run_suite("--addr", address_of(module_gateway), "--only", "rebind-re")
    assert lines == ["PASS rebind-replace", "PASS rebind-remove-add", "PASS rebind-remove-mask", "3 passed, 0 failed"]
    assert code == 0


def test_unknown_only_pattern_is_a_usage_error() -> None:
    code, lines = run_suite("--only", "no-such-check")
    assert code == 2
    assert any("no check matches" in line for line in lines)


# ---------------------------------------------------------------------------------------------
# Against fakes


def test_suite_fails_fast_against_a_garbage_server() -> None:
    # Not MQKS at all: every check fails at its first read, none waits for the timeout.
    start = time.monotonic()
    with fake_server(lambda _: b"garbage, not a protocol\n") as address:
        code, lines = run_suite("--addr", address, "--timeout", "5")
    assert time.monotonic() - start < 5
    assert code == 1
    assert lines[-1] == f"0 passed, {len(checks.checks)} failed"
    assert lines[0] == ("FAIL ping: 'pg1 ping service1' (expected b'pg1 ok service1', "
                        "got b'garbage, not a protocol')")


def test_suite_fails_against_a_silent_server() -> None:
    with fake_server(lambda _: b"") as address:
        code, lines = run_suite("--addr", address, "--timeout", "0.3", "--only", "ping")
    assert code == 1
    assert lines == [
        "FAIL ping: 'pg1 ping service1' (expected b'pg1 ok service1', got nothing within 0.3 s)",
        "FAIL ping-data-spaces-and-confirm: 'pg2 ping a b  c' (expected b'pg2 ok a b  c', got nothing within 0.3 s)",
        "0 passed, 2 failed",
    ]


def test_suite_fails_against_a_fake_that_confirms_without_the_trailing_space() -> None:
    # Answers every request line `{id} ok`: the spec's spelling, not the original's `{id} ok `.
    def ok_without_space(chunk: bytes) -> bytes:
        return b"".join(line.split(b" ")[0] + b" ok\n" for line in chunk.splitlines() if line)

    with fake_server(ok_without_space) as address:
        code, lines = run_suite("--addr", address, "--timeout", "0.5", "--only", "confirm-publish")
    assert code == 1
    assert re.fullmatch(r"FAIL confirm-publish: '(m1-\w+) publish --confirm \S+ d1' \(no subscribers\): confirm "
                        r"\(expected b'\1 ok ', got b'\1 ok'\)", lines[0])
    assert lines[1:] == ["0 passed, 1 failed"]


def test_suite_fails_against_a_server_that_closes() -> None:
    def closing(conn: socket.socket, stop: threading.Event) -> None:
        with conn, contextlib.suppress(OSError):
            conn.settimeout(POLL_S * 10)
            conn.recv(65536)  # the first request, then close without answering

    with serving(closing) as address:
        code, lines = run_suite("--addr", address, "--timeout", "1", "--only", "short-line")
    assert code == 1
    assert lines[0].startswith("FAIL short-line-none-error: b'pg3 ping' (expected None error <24-char error id>, "
                               "got connection closed")


# ---------------------------------------------------------------------------------------------
# Against the gateway with one defect injected


def suite_through(gateway: GatewayProcess, rewrite: Rewrite, *args: str) -> tuple[int, dict[str, str]]:
    with rewriting_proxy(gateway.host_port("mqks"), rewrite) as address:
        code, lines = run_suite("--addr", address, "--timeout", "1", *args)
    return code, failures(lines)


def test_confirm_without_the_trailing_space_fails_the_confirm_checks(module_gateway: GatewayProcess) -> None:
    def no_trailing_space(line: bytes) -> list[bytes]:
        return [line.rstrip(b" ")]

    code, failed = suite_through(module_gateway, no_trailing_space, "--only", "confirm-")
    assert code == 1
    assert set(failed) == {"confirm-publish", "confirm-rebind", "confirm-delete-queue",
                           "confirm-ack-reject-unknown-msg"}
    assert re.fullmatch(r"'(m1-\w+) publish --confirm \S+ d1' \(no subscribers\): confirm "
                        r"\(expected b'\1 ok ', got b'\1 ok'\)", failed["confirm-publish"])


def test_missing_update_lines_fail_the_update_checks(module_gateway: GatewayProcess) -> None:
    def no_updates(line: bytes) -> list[bytes]:
        return [] if b" ok --update " in line else [line]

    code, failed = suite_through(module_gateway, no_updates, "--only", "update")
    assert code == 1
    assert set(failed) == {"update-lines", "update-bare-flag", "update-when-unused-cleared"}
    assert failed["update-lines"].endswith(" --delete-queue-when-unused=5.0', got nothing within 1.0 s)")


def test_unsorted_update_events_fail(module_gateway: GatewayProcess) -> None:
    def reversed_events(line: bytes) -> list[bytes]:
        head, sep, rest = line.partition(b" ok --update ")
        if not sep:
            return [line]
        queue, *tokens = rest.split(b" ")
        events = [t for t in tokens if not t.startswith(b"--")]
        flags = [t for t in tokens if t.startswith(b"--")]
        return [b" ".join([head + sep + queue, *reversed(events), *flags])]

    code, failed = suite_through(module_gateway, reversed_events, "--only", "rebind-re")
    assert code == 1
    assert set(failed) == {"rebind-replace", "rebind-remove-add", "rebind-remove-mask"}


def test_missing_retry_counter_fails_the_requeue_checks(module_gateway: GatewayProcess) -> None:
    def no_retry(line: bytes) -> list[bytes]:
        return [re.sub(rb",retry=\d+", b"", line)]

    code, failed = suite_through(module_gateway, no_retry, "--only", "-re")
    assert code == 1
    assert {"manual-ack-reject-retry", "manual-ack-reject-all", "manual-ack-ack-removes",
            "manual-ack-disconnect-requeues", "delete-consumer-requeues"} <= set(failed)
    assert "rebind-remove-add" not in failed


def test_duplicated_deliveries_fail_the_exactly_once_checks(module_gateway: GatewayProcess) -> None:
    def twice(line: bytes) -> list[bytes]:
        return [line, line] if b" event=" in line else [line]

    code, failed = suite_through(module_gateway, twice)
    assert code == 1
    assert {"delivery-line-bytes", "fan-out", "competing-consumers", "consume-add", "rebind-replace",
            "manual-ack-reject-retry", "auto-ack-reject-nothing", "delete-consumer-requeues"} <= set(failed)
    assert failed["fan-out"].startswith("c1-")
    assert "one copy of each message" in failed["fan-out"]
    assert "ping" not in failed and "confirm-publish" not in failed


def test_a_stray_answer_fails_the_silence_checks(module_gateway: GatewayProcess) -> None:
    # The original answers nothing to ack/reject/delete_consumer of an unknown consumer; here every
    # ping barrier is preceded by a stray confirm, as if one of them had been answered.
    def stray_confirm(line: bytes) -> list[bytes]:
        return [line.split(b" ")[0] + b" ok ", line] if line.startswith(b"barrier") else [line]

    code, failed = suite_through(module_gateway, stray_confirm, "--only", "unknown-consumer")
    assert code == 1
    assert "nothing more (only the ping answer)" in failed["unknown-consumer-silent"]


def test_the_suite_leaves_nothing_behind(tmp_path: Path) -> None:
    with running_gateway(data_dir=tmp_path) as gateway:
        code, lines = run_suite("--addr", address_of(gateway))
        assert code == 0, "\n".join(line for line in lines if line.startswith("FAIL"))
        with urllib.request.urlopen(f"http://{gateway.nsq_http}/stats?format=json", timeout=10) as response:
            assert json.load(response)["topics"] == []
        with MQKSWire(gateway.host_port("mqks")) as client:
            client.send(b"s1 _eval [len(state.queues), len(state.events_by_queues), len(state.queues_by_events)]")
            assert client.line() == b"s1 ok [0, 0, 0]"
        assert gateway.stop() == 0
    with running_gateway(data_dir=tmp_path) as gateway:
        assert any("restored 0 topics, 0 queues, 0 messages" in line for line in gateway.log_lines)
