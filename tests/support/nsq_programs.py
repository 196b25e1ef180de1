"""A home folder whose ref/nsq/bin (where `polymq bench versus-nsqd` and tools/cpu_per_message.py look by
default) holds nsq 1.3.0's nsqd, bench_writer and bench_reader, or their fakes (fake_nsqd.py,
fake_bench_tools.py) on a machine without Go."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from support.nsq_cluster import NSQ_BIN, NSQ_FAKES, nsq_program

SUPPORT = Path(__file__).resolve().parent
PROGRAMS = ("nsqd", "bench_writer", "bench_reader")
FAKES = {"nsqd": ("fake_nsqd.py",), "bench_writer": ("fake_bench_tools.py", "bench_writer"),
         "bench_reader": ("fake_bench_tools.py", "bench_reader")}
REAL = "nsq 1.3.0"


def built() -> bool:
    """Whether nsq's own programs are here to be run (else their fakes are)."""
    return not NSQ_FAKES and all(os.access(NSQ_BIN / name, os.X_OK) for name in PROGRAMS)


def home_with_nsq_programs(home: Path, programs: str | None = None) -> Path:
    """`home` with ref/nsq/bin holding links to nsq's programs (`programs` REAL) or their fakes ("fakes");
    by default the real ones where they are built."""
    programs = programs or (REAL if built() else "fakes")
    folder = home / "ref" / "nsq" / "bin"
    folder.mkdir(parents=True)
    for name in PROGRAMS:
        if programs == "fakes":
            script, *first = FAKES[name]
            wrapper = folder / name
            wrapper.write_text(f'#!/bin/sh\nexec {sys.executable} {SUPPORT / script} {" ".join(first)} "$@"\n')
            wrapper.chmod(0o755)
        else:
            (folder / name).symlink_to(nsq_program(name))
    return home
