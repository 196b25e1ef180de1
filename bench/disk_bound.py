"""What a disk allows a durable publish: a loop of a 200-byte write and an fdatasync, as polymq's store
does for each acknowledged PUB (records into zeros written ahead), in one or more threads. One round
trip of a durable PUB can be no shorter than one of these syncs (docs/performance.md)."""

from __future__ import annotations

import os
import tempfile
import threading
import time

RECORD_BYTES = 200  # nsq's bench_writer's message size, as in docs/performance.md
ZEROS_AHEAD = 64 << 20  # the file is filled with zeros first: a sync then changes no file size


def measure(directory: str, threads: int, seconds: float) -> tuple[float, float, float]:
    """(syncs per second, p50 and p99 of one fdatasync in µs) of `threads` writers of one file."""
    with tempfile.NamedTemporaryFile(dir=directory, prefix="fsync-bound-") as handle:
        fd = handle.fileno()
        os.pwrite(fd, b"\0" * ZEROS_AHEAD, 0)
        os.fsync(fd)
        offset = [0]
        lock = threading.Lock()
        latencies: list[float] = []
        stop = time.monotonic() + seconds

        def writer() -> None:
            record = b"x" * RECORD_BYTES
            while time.monotonic() < stop:
                with lock:
                    at = offset[0]
                    offset[0] += RECORD_BYTES
                os.pwrite(fd, record, at)
                started = time.perf_counter()
                os.fdatasync(fd)
                latencies.append(time.perf_counter() - started)

        running = [threading.Thread(target=writer) for _ in range(threads)]
        for thread in running:
            thread.start()
        for thread in running:
            thread.join()
    latencies.sort()
    return (len(latencies) / seconds, latencies[len(latencies) // 2] * 1e6,
            latencies[int(len(latencies) * 0.99)] * 1e6)
