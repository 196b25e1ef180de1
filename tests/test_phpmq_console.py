"""The PHPMQ maintenance console against a real gateway: every command, confirmations, the switch
that turns flushing off, its own loopback bind, and lines that are not commands."""

from __future__ import annotations

import socket
import time
import uuid
from pathlib import Path

from support.gateway import GatewayProcess, running_gateway
from support.phpmq_wire import PHPMQWire, queue_stats

PROMPT = b"phpmq> "


class Console:
    def __init__(self, host_port: tuple[str, int], timeout: float = 3.0) -> None:
        self.sock = socket.create_connection(host_port, timeout=timeout)
        self.timeout = timeout
        self.buffer = b""
        self.banner = self.until(PROMPT)

    def until(self, marker: bytes) -> bytes:
        """Everything up to and including `marker` (the next prompt, usually)."""
        deadline = time.monotonic() + self.timeout
        while marker not in self.buffer:
            self.sock.settimeout(max(0.01, deadline - time.monotonic()))
            data = self.sock.recv(65536)
            if not data:
                raise EOFError(self.buffer)
            self.buffer += data
        end = self.buffer.index(marker) + len(marker)
        out, self.buffer = self.buffer[:end], self.buffer[end:]
        return out

    def command(self, line: str, marker: bytes = PROMPT) -> str:
        self.sock.sendall(line.encode() + b"\r\n")
        return self.until(marker).decode()

    def close(self) -> None:
        self.sock.close()


def console(gateway: GatewayProcess) -> Console:
    return Console(gateway.host_port("phpmq-console"))


def test_help_search_show_and_monitor(module_gateway: GatewayProcess) -> None:
    queue = f"console-{uuid.uuid4().hex[:8]}"
    with PHPMQWire(module_gateway.host_port("phpmq")) as php:
        php.publish(queue, b"one")
        php.publish(queue, b"two")
        php.barrier()
    shell = console(module_gateway)
    try:
        assert b"maintenance console" in shell.banner
        assert "flushall" in shell.command("help") and "monitor" in shell.command("help")
        assert "delete every message of <queue>" in shell.command("help flush")
        assert f"{queue}  (2 ready)" in shell.command(f"search {queue[:12]}")
        assert "no queue name contains" in shell.command("search no-such-thing-anywhere")
        shown = shell.command(f"show {queue}", b"type q to leave")
        assert "\x1b[2J" in shown and f"queue {queue}" in shown and "ready: 2 (0 on disk only)" in shown
        assert "type q to leave" in shell.command("ignored while the view is live", b"type q to leave")  # redrawn
        assert shell.command("q").endswith("phpmq> ")
        screen = shell.command("monitor", b"type q to leave")
        assert "queues:" in screen and queue in screen
        shell.command("q")
        assert "no queue" in shell.command("show no-such-queue")
        assert "unknown command" in shell.command("drop everything")
        assert shell.command("clear").startswith("\x1b[2J")
        assert "bye" in shell.command("quit", b"bye")
    finally:
        shell.close()


def test_flush_asks_first_then_deletes(module_gateway: GatewayProcess) -> None:
    queue = f"console-flush-{uuid.uuid4().hex[:8]}"
    with PHPMQWire(module_gateway.host_port("phpmq")) as php:
        for body in (b"a", b"b", b"c"):
            php.publish(queue, body)
        php.barrier()
    shell = console(module_gateway)
    try:
        assert f"flush {queue}: delete its 3 messages? Type yes to confirm." in shell.command(f"flush {queue}")
        assert "not done" in shell.command("no")
        assert queue_stats(module_gateway.nsq_http, queue)["depth"] == 3
        shell.command(f"flush {queue}")
        assert "flushed: 3 messages deleted" in shell.command("yes")
        assert queue_stats(module_gateway.nsq_http, queue)["depth"] == 0
        assert "flush needs a queue name" in shell.command("flush")
    finally:
        shell.close()
    module_gateway.wait_for_log(lambda line: "console flushed 3 messages" in line)


def test_flushing_can_be_turned_off_and_flushall_asks_too(tmp_path: Path) -> None:
    with running_gateway("--no-phpmq-console-destructive", data_dir=tmp_path) as gateway:
        with PHPMQWire(gateway.host_port("phpmq")) as php:
            php.publish("kept", b"x")
            php.barrier()
        shell = console(gateway)
        try:
            assert "flushall is turned off" in shell.command("flushall")
            assert "flush is turned off" in shell.command("flush kept")
        finally:
            shell.close()
        assert queue_stats(gateway.nsq_http, "kept")["depth"] == 1
    with running_gateway(data_dir=tmp_path) as gateway:
        shell = console(gateway)
        try:
            asked = shell.command("flushall")
            assert "flushall: delete the 1 messages of all" in asked and "of every protocol" in asked
            assert "flushed: 1 messages deleted" in shell.command("yes")
        finally:
            shell.close()


def test_the_console_binds_loopback_whatever_bind_says(tmp_path: Path) -> None:
    with running_gateway("--bind", "0.0.0.0", data_dir=tmp_path) as gateway:
        assert gateway.addresses["phpmq-console"].startswith("127.0.0.1:")
        assert gateway.addresses["phpmq"].startswith("0.0.0.0:")


def test_an_overlong_line_is_not_a_command(module_gateway: GatewayProcess) -> None:
    shell = console(module_gateway)
    try:
        shell.sock.sendall(b"x" * 10_000)
        assert "not a command" in shell.command("")
        assert "Commands:" in shell.command("help")
    finally:
        shell.close()
