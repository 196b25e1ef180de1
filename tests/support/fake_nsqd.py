"""A fake of nsq 1.3.0's nsqd for CI, which has no Go: `python fake_nsqd.py FLAGS` takes the flags
`polymq bench versus-nsqd` gives nsqd (`--data-path`, `--tcp-address`, `--http-address`, `--mem-queue-size`,
`--sync-every`, in Go's syntax) and becomes `polymq serve --in-memory` on those addresses (exec: its PID is
the server's, stopped by SIGTERM as nsqd is). Its figures are polymq's: only the bench's harness is under test.
"""

from __future__ import annotations

import os
import sys

from fake_nsq_common import INT, STRING, fatal, parse_flags

FLAGS = {"data-path": (STRING, ""), "tcp-address": (STRING, "0.0.0.0:4150"), "http-address": (STRING, "0.0.0.0:4151"),
         "mem-queue-size": (INT, 10000), "sync-every": (INT, 2500)}


def main(argv: list[str]) -> None:
    values = parse_flags("nsqd", argv, FLAGS)
    (tcp_host, _, tcp_port), (http_host, _, http_port) = (values[name].rpartition(":")
                                                          for name in ("tcp-address", "http-address"))
    if tcp_host != http_host:
        fatal("this fake serves TCP and HTTP on one address (--tcp-address and --http-address hosts differ)")
    os.execv(sys.executable, [sys.executable, "-m", "polymq", "serve", "--in-memory", "--bind", tcp_host,
                              "--nsq-tcp-port", tcp_port, "--nsq-http-port", http_port, "--mqks-port", "-1",
                              "--phpmq-port", "-1", "--phpmq-console-port", "-1", "--no-pzq", "--no-emqp",
                              "--admin-port", "-1"])


if __name__ == "__main__":
    main(sys.argv[1:])
