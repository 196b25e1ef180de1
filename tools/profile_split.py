"""Where a gateway's CPU went, from a py-spy `--native` raw profile: kernel, compiled, interpreted.

    .venv/bin/py-spy record -p PID -r 1000 -f raw --native -d 6 -o pub.raw
    .venv/bin/python tools/profile_split.py pub.raw

A sample whose innermost frame is a system call (send, recv, epoll_wait, ...) is the kernel's.
Any other sample belongs to the innermost frame of its stack that is either Python source (the
interpreter ran it: trio's, a session module's, or another) or mypyc's C (`CPyDef_…`,
`__native_compiled.c`): the C runtime's work (a dict lookup, a refcount) counts for what called
it. Prints each part as a share of the samples (docs/performance.md, "The compiled hot modules").
"""

from __future__ import annotations

import sys
from collections import Counter

# libc functions that are system calls of the loop and its sockets (py-spy names the leaf "name (libc…)").
SYSCALLS = ("send", "recv", "sendto", "recvfrom", "sendmsg", "epoll_wait", "epoll_ctl", "read", "write",
            "pwrite64", "munmap", "mmap", "madvise", "io_submit", "io_getevents")
# The modules of the NSQ session path, counted apart when they run interpreted.
SESSION_MODULES = ("adapters/session.py", "adapters/transport.py", "adapters/nsq/tcp.py")
COMPILED_MARKS = ("CPyDef_", "CPyPy_", "__native_compiled")


def owner(frames: list[str]) -> str:
    if frames[-1].split(" (", 1)[0] in SYSCALLS:
        return "kernel (system calls)"
    for frame in reversed(frames):
        if any(mark in frame for mark in COMPILED_MARKS):
            return "compiled (mypyc)"
        if ".py:" in frame or "<attrs generated" in frame:
            where = frame.split(" (", 1)[-1]
            if where.startswith(("trio/", "outcome/")) or "/trio/" in where:
                return "interpreted: trio"
            for module in SESSION_MODULES:
                if module in where:
                    return f"interpreted: {module}"
            return "interpreted: other"
    return "other native"


def split(path: str) -> tuple[int, Counter[str]]:
    parts: Counter[str] = Counter()
    total = 0
    with open(path) as profile:
        for line in profile:
            stack, _, count = line.rstrip().rpartition(" ")
            if not stack:
                continue
            total += int(count)
            parts[owner(stack.split(";"))] += int(count)
    return total, parts


def main() -> None:
    for path in sys.argv[1:]:
        total, parts = split(path)
        print(f"{path}: {total} samples")
        for part, count in parts.most_common():
            print(f"  {100 * count / total:5.1f} %  {part}")
        interpreted = sum(count for part, count in parts.items() if part.startswith("interpreted"))
        print(f"  {100 * interpreted / total:5.1f} %  interpreted in all")


if __name__ == "__main__":
    main()
