"""The gateway's run file: how `polymq wait` learns that the gateway it waits for will not serve.

A gateway whose own HTTP listener has a port of its choosing writes `gateway-HOST-PORT.json` in
the user's run dir as it starts (its pid, "starting"), its start-up failure line there if it fails
("failed"), and removes the file once it serves. `polymq wait` reads the file of the address it
waits for: a failed start, or a starting gateway whose process has gone, ends the wait at once.
The run dir is `$XDG_RUNTIME_DIR/polymq`, else `polymq-UID` in the temporary folder, the user's
alone (a folder of another owner, or a link, is not used: the file is then not written).
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
import tempfile
import time
from pathlib import Path

import attrs

STARTING = "starting"
FAILED = "failed"
# Hosts a listener bound to answers on every address: `wait` for 127.0.0.1:4181 reads their files too.
WILDCARD_HOSTS = ("0.0.0.0", "::")


def run_dir(*, create: bool) -> Path | None:
    """The user's run dir, made private if `create`; None if it is missing or not the user's own."""
    base = os.environ.get("XDG_RUNTIME_DIR")
    folder = Path(base) / "polymq" if base else Path(tempfile.gettempdir()) / f"polymq-{os.geteuid()}"
    if create:
        with contextlib.suppress(OSError):
            folder.mkdir(mode=0o700, exist_ok=True)
    try:
        found = folder.lstat()
    except OSError:
        return None
    private = stat.S_ISDIR(found.st_mode) and found.st_uid == os.geteuid() and not found.st_mode & 0o077
    return folder if private else None


def file_name(host: str, port: int) -> str:
    return f"gateway-{host.strip('[]')}-{port}.json"


@attrs.frozen
class Record:
    """What a run file says: which process, its state, its failure line, when it was written."""

    pid: int
    state: str
    error: str
    written_at: float  # time.time()


def read(host: str, port: int) -> Record | None:
    """The newest record of a gateway answering at HOST:PORT (bound to it or to every address)."""
    folder = run_dir(create=False)
    if folder is None:
        return None
    found = [record for name in {host.strip("[]"), *WILDCARD_HOSTS}
             if (record := _read_file(folder / file_name(name, port))) is not None]
    return max(found, key=lambda record: record.written_at, default=None)


def _read_file(path: Path) -> Record | None:
    try:
        fields = json.loads(path.read_text(encoding="utf-8"))
        return Record(int(fields["pid"]), str(fields["state"]), str(fields.get("error", "")),
                      float(fields["written_at"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None  # missing, or being replaced


def running(pid: int) -> bool:
    """Whether process `pid` still runs (a zombie its parent has not waited for yet does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return True  # no /proc: alive as far as kill says
    return state != "Z"


# /proc/PID/stat's starttime is its 22nd field, the 20th after the command's ")".
START_TIME_FIELD = 19


def process_started_at() -> float:
    """When this process started (time.time()): from Linux's /proc; elsewhere now, which is later
    and only makes `wait` take a record written meanwhile for an older one."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rpartition(")")[2].split()[START_TIME_FIELD])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return time.time()
    return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))


@attrs.define
class RunFile:
    """A starting gateway's run file (`path` None: none is kept, the port being chosen by the OS)."""

    path: Path | None
    pid: int = attrs.Factory(os.getpid)
    served: bool = False

    @classmethod
    def of_gateway(cls, host: str, port: int) -> RunFile:
        folder = run_dir(create=True) if port > 0 else None
        return cls(folder / file_name(host, port) if folder is not None else None)

    def starting(self) -> None:
        self._write(STARTING, "")

    def failed(self, line: str) -> None:
        """The start-up failure line, for `wait` (nothing once the gateway has served)."""
        if not self.served:
            self._write(FAILED, line)

    def serving(self) -> None:
        """Started: the file goes, unless another gateway has written it since."""
        self.served = True
        if self.path is not None and (record := _read_file(self.path)) is not None and record.pid == self.pid:
            with contextlib.suppress(OSError):
                self.path.unlink()

    def _write(self, state: str, error: str) -> None:
        if self.path is None:
            return
        text = json.dumps({"pid": self.pid, "state": state, "error": error, "written_at": time.time()})
        temporary = self.path.with_name(f".{self.path.name}.{self.pid}")
        try:
            temporary.write_text(text, encoding="utf-8")
            os.replace(temporary, self.path)  # a reader sees the old record or the new, never half of one
        except OSError:
            with contextlib.suppress(OSError):
                temporary.unlink()
