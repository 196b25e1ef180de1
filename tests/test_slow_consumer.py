"""A consumer that stops reading while much is published: the gateway disconnects it once its unsent
output stays past --max-client-output for the grace, its resident memory stays flat, and what it held
goes back to the queue for a consumer that reads (nothing lost).

`POLYMQ_TEST_FLOOD_MB` sets how much is published: 1024 MB by default (with --fsync never the
gateway takes it in a few seconds; the data dir needs that much free space for the while).
"""

from __future__ import annotations

import os
import re
import socket
import time
import urllib.request
from pathlib import Path

from polymq.codecs import nsq_client
from tests.support.gateway import GatewayProcess, running_gateway
from tests.support.nsq_wire import RawClient

FLOOD_MB = int(os.environ.get("POLYMQ_TEST_FLOOD_MB", "1024"))
BODY = 10 * 1024  # 10 KiB messages, 100 to an MPUB: 1 MiB a batch
BATCH = 100
IN_FLIGHT_BATCHES = 4  # MPUBs sent before their OK is read (a pipelined publisher)
RDY = 2500  # nsqd's --max-rdy-count: the most a consumer may hold, 25 MB of these messages
MAX_OUTPUT = 8 * 1024 * 1024
# The reader that checks nothing was lost holds at most half the output bound: on a loaded machine it may
# read slower than the grace allows, and it must never be taken for a slow client itself.
READER_RDY = MAX_OUTPUT // (2 * BODY)
GRACE_MS = 2000
# The gateway's resident memory may not pass this while the flood goes on: its idle size (~60 MB)
# plus one consumer's credit of output (25 MB) plus --mem-queue-size 1000 of 10 KiB (10 MB), with
# room for the allocator; without the bound a reader that never reads would not change it (RDY caps
# it), but a gateway keeping everything in memory would pass it many times over.
RSS_BOUND_MB = 200
DEADLINE_S = 300.0


def rss_mb(pid: int) -> float:
    status = Path(f"/proc/{pid}/status").read_text()
    found = re.search(r"^VmRSS:\s+(\d+) kB", status, re.M)
    assert found
    return int(found.group(1)) / 1024


def slow_disconnected(gateway: GatewayProcess) -> float:
    with urllib.request.urlopen(f"http://{gateway.http}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    found = re.search(r'^polymq_slow_clients_disconnected_total\{protocol="nsq"\} (\S+)$', text, re.M)
    assert found
    return float(found.group(1))


def test_a_consumer_that_never_reads_is_disconnected_and_memory_stays_flat() -> None:
    with running_gateway("--max-client-output", str(MAX_OUTPUT), "--slow-client-grace", str(GRACE_MS),
                         "--mem-queue-size", "1000", "--fsync", "never") as gateway:
        pid = gateway.process.pid
        slow = socket.socket()
        slow.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)  # it fills fast, then nothing moves
        slow.connect(gateway.host_port("nsq-tcp"))
        slow.sendall(nsq_client.magic() + nsq_client.sub("flood", "work") + nsq_client.rdy(RDY))

        batch = [bytes([65 + index % 26]) * BODY for index in range(BATCH)]
        batches = FLOOD_MB * 1024 * 1024 // (BODY * BATCH)
        peak = 0.0
        deadline = time.monotonic() + DEADLINE_S
        with RawClient(gateway.nsq_tcp, timeout=60) as producer:
            sent = answered = 0
            while answered < batches:
                while sent < batches and sent - answered < IN_FLIGHT_BATCHES:
                    producer.send(nsq_client.mpub("flood", batch))
                    sent += 1
                producer.expect_response(b"OK")
                answered += 1
                if answered % 16 == 0:
                    peak = max(peak, rss_mb(pid))
                assert time.monotonic() < deadline, f"only {answered} of {batches} MPUBs answered"
        while slow_disconnected(gateway) < 1:
            assert time.monotonic() < deadline, "the consumer that never reads is still connected"
            peak = max(peak, rss_mb(pid))
            time.sleep(0.05)
        peak = max(peak, rss_mb(pid))
        assert peak < RSS_BOUND_MB, f"the gateway's RSS reached {peak:.0f} MB"
        gateway.wait_for_log(lambda line: " nsq " in line and "disconnected with E_SLOW_CLIENT" in line)
        slow.close()

        # Nothing lost: a consumer that reads gets every message, those the slow one held among them.
        total = batches * BATCH
        received = 0
        with RawClient(gateway.nsq_tcp, timeout=30) as reader:
            reader.send(nsq_client.sub("flood", "work"))
            reader.expect_response(b"OK")
            reader.send(nsq_client.rdy(READER_RDY))
            while received < total:
                message = reader.read_message()
                assert len(message.body) == BODY
                reader.send(nsq_client.fin(message.msg_id))
                received += 1
                assert time.monotonic() < deadline, f"only {received} of {total} messages came back"
            reader.expect_nothing(0.2)
        print(f"published {FLOOD_MB} MB in {total} messages; the gateway's RSS peaked at {peak:.0f} MB")
