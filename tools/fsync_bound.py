"""What this disk allows a durable publish: a loop of a 200-byte write and an fdatasync, as polymq's
store does for each acknowledged PUB (records into zeros written ahead), in one or more threads.

    .venv/bin/python tools/fsync_bound.py --dir /path/of/the/data/dir --threads 1 --threads 2

Prints syncs per second and the fdatasync latency (p50, p99) for each thread count: one round trip
of a durable PUB can be no shorter than one of these syncs (docs/performance.md).
"""

from __future__ import annotations

import argparse

from polymq.bench.disk_bound import measure


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default=".", help="A folder on the disk to measure (the data dir's).")
    parser.add_argument("--threads", type=int, action="append", help="Writers at once (repeatable; default 1 and 2).")
    parser.add_argument("--seconds", type=float, default=2.0, help="Seconds per measurement.")
    args = parser.parse_args()
    for threads in args.threads or [1, 2]:
        rate, p50, p99 = measure(args.dir, threads, args.seconds)
        print(f"threads={threads}: {rate:,.0f} write+fdatasync/s, fdatasync p50 {p50:.0f} us, p99 {p99:.0f} us")


if __name__ == "__main__":
    main()
