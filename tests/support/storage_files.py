"""Find the embedded store's files and damage them the way a crash, a bad disk or a full disk would.

Read-only helpers (`owner_dirs`, `segments`, `record_spans`) parse the files with the store's own
record format (`polymq.core.records`); the damaging helpers change bytes in place, so a test states
exactly which record it hit.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import attrs
import pytest

from polymq.core import records

META_FILE = "meta.log"


@attrs.frozen
class Span:
    """One intact record of a file: where it starts, its type, its whole length (header included)."""

    offset: int
    type: int
    length: int

    @property
    def end(self) -> int:
        return self.offset + self.length

    @property
    def payload_offset(self) -> int:
        return self.offset + records.HEADER.size


def meta_changes(data_dir: Path) -> list[dict]:
    """The intact META records of the journal, in order."""
    data = (data_dir / META_FILE).read_bytes()
    return [records.decode_meta(payload) for _, kind, payload in records.scan(data) if kind == records.META]


def owner_dirs(data_dir: Path) -> dict[str, Path]:
    """`topic:<name>` / `queue:<name>` → its log directory, from the journal (last record wins)."""
    found: dict[str, Path] = {}
    for change in meta_changes(data_dir):
        kind = change.get("t")
        if kind in ("topic", "queue"):
            found[f"{kind}:{change['name']}"] = data_dir / f"{kind[0]}{change['uid']}"
        elif kind in ("topic-", "queue-"):
            found.pop(f"{kind[:-1]}:{change['name']}", None)
    return found


def queue_dir(data_dir: Path, name: str) -> Path:
    return owner_dirs(data_dir)[f"queue:{name}"]


def topic_dir(data_dir: Path, name: str) -> Path:
    return owner_dirs(data_dir)[f"topic:{name}"]


def segments(directory: Path) -> list[Path]:
    """The segment files of one log, oldest first."""
    return sorted(path for path in directory.glob("*.seg") if path.stem.isdigit())


def last_segment(directory: Path) -> Path:
    """The newest segment that holds any bytes (a restart opens a new, still absent, segment)."""
    found = [path for path in segments(directory) if path.stat().st_size]
    assert found, f"no segment with data in {directory}"
    return found[-1]


def all_data_files(data_dir: Path) -> list[Path]:
    return sorted(path for path in data_dir.rglob("*") if path.is_file())


def record_spans(path: Path) -> list[Span]:
    """Every intact record of a file, in order (asserts the file has no damage yet)."""
    data = path.read_bytes()
    damage: list[records.Damage] = []
    spans = [Span(offset, kind, records.HEADER.size + len(payload))
             for offset, kind, payload in records.scan(data, 0, damage)]
    assert not damage, f"{path} is damaged already: {damage}"
    return spans


def add_spans(path: Path) -> list[Span]:
    return [span for span in record_spans(path) if span.type == records.ADD]


# -- damage ----------------------------------------------------------------------------------------


def truncate(path: Path, size: int) -> None:
    os.truncate(path, size)


def flip_byte(path: Path, offset: int, mask: int = 0xFF) -> None:
    """XOR one byte: what a bad sector or a bit flip does to a record."""
    with open(path, "r+b") as file:
        file.seek(offset)
        value = file.read(1)[0]
        file.seek(offset)
        file.write(bytes([value ^ mask]))


def write_at(path: Path, offset: int, data: bytes) -> None:
    with open(path, "r+b") as file:
        file.seek(offset)
        file.write(data)


def set_length(path: Path, span: Span, length: int) -> None:
    """Overwrite a record's length field (the CRC is left alone, so the record no longer checks)."""
    write_at(path, span.offset + 2, length.to_bytes(4, "little"))


def append(path: Path, data: bytes) -> None:
    with open(path, "ab") as file:
        file.write(data)


# -- a disk that fills up ------------------------------------------------------------------------------


@contextlib.contextmanager
def small_tmpfs(mount_point: Path, size: str = "2m") -> Iterator[Path]:
    """A tmpfs of `size` mounted at `mount_point` (needs root): a file system that really fills up.

    Fails the test (never skips) when it cannot be mounted. If a file on it is still open when the block
    ends (a leaked descriptor), the unmount is lazy: the mount goes at once, its memory when the file closes.
    """
    mount_point.mkdir()
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount_point)],
                            capture_output=True, text=True)
    if result.returncode != 0:
        pytest.fail(f"the disk-full test needs to mount a tmpfs (as root): {result.stderr.strip()}")
    try:
        yield mount_point
    finally:
        if subprocess.run(["umount", str(mount_point)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "--lazy", str(mount_point)], check=True)


def fill_disk(path: Path, headroom: int) -> None:
    """Write a file that leaves `headroom` bytes free (written, not truncated: a sparse file takes no space)."""
    stats = os.statvfs(path.parent)
    free = stats.f_bavail * stats.f_frsize
    assert free > headroom, f"only {free} bytes free on {path.parent}"
    with open(path, "wb") as file:
        file.write(bytes(free - headroom))
