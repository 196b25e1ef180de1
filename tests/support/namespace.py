"""A network namespace of its own for docs blocks that use fixed ports (every protocol's defaults, the NATS
servers'): nothing else on the machine holds those ports, and no connection of another test is given one as
its ephemeral port. Root gets one at once; anyone else in a user namespace of their own.

The blocks run in a folder of their own whose entries are links to this checkout's (its `.venv`, `Makefile`,
`tools`, …), so what they write (logs, pid files, a `./data`) stays there."""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent.parent
AS_ROOT = os.geteuid() == 0
NAMESPACE = ("unshare", "--net", *(() if AS_ROOT else ("--user", "--map-root-user")))
ENTER = () if AS_ROOT else ("-U", "--preserve-credentials")
# A block starts processes and waits for them (`polymq wait`); this only turns a hang into a failure.
BLOCK_TIMEOUT_S = 120
STOP_TIMEOUT_S = 30
# What a block writes in its folder rather than the checkout's: left out of the links.
NOT_LINKED = {".git", "data", ".pytest_cache", ".ruff_cache", ".hypothesis"}


class Namespace:
    """A network namespace with its loopback up, held open by a sleeping process, and a folder to run in.
    `covered`: machine paths (/etc/hosts, /etc/sysctl.d) each covered, in a mount namespace of its own, by a
    file or folder of the test's, so what a block reads or writes there stays the test's."""

    def __init__(self, folder: Path, covered: Mapping[str, Path] | None = None) -> None:
        self.folder = folder
        self.covered = dict(covered or {})
        for entry in ROOT.iterdir():
            if entry.name not in NOT_LINKED and not entry.name.endswith((".log", ".pid")):
                (folder / entry.name).symlink_to(entry)
        # A covered path that is not there gets a mount point for the while (removed at the close).
        self.made = [Path(path) for path in self.covered if not os.path.lexists(path)]
        for path in self.made:
            path.mkdir() if self.covered[str(path)].is_dir() else path.touch()
        mounts = "".join(f" && mount --bind {shlex.quote(str(mine))} {shlex.quote(path)}"
                         for path, mine in self.covered.items())
        unshare = [*NAMESPACE, "--mount"] if self.covered else list(NAMESPACE)
        self.holder = subprocess.Popen([*unshare, "sh", "-c", f"ip link set lo up{mounts} && exec sleep 3600"])
        deadline = time.monotonic() + 10
        while self._run("ip -o link show lo").stdout.find("UP") < 0:
            assert self.holder.poll() is None and time.monotonic() < deadline, "the namespace did not come up"
            time.sleep(0.05)

    @property
    def enter(self) -> list[str]:
        """nsenter's arguments into it."""
        # Entering a mount namespace starts at its root: back to the folder.
        mount = [f"--mount=/proc/{self.holder.pid}/ns/mnt", f"--wd={self.folder}"] if self.covered else []
        return ["nsenter", *ENTER, f"--net=/proc/{self.holder.pid}/ns/net", *mount, "--"]

    def _run(self, script: str, timeout: float = BLOCK_TIMEOUT_S) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*self.enter, "bash", "-c", script], cwd=self.folder, capture_output=True, text=True,
                              timeout=timeout)

    def run(self, script: str, timeout: float = BLOCK_TIMEOUT_S) -> subprocess.CompletedProcess[str]:
        result = self._run(script, timeout)
        assert result.returncode == 0, f"{script}\nexit {result.returncode}\n{result.stdout}\n{result.stderr}"
        return result

    def pids(self) -> list[int]:
        """The processes the blocks wrote pid files for (`… & echo $! > x.pid`), in its folder and below."""
        found = []
        # os.walk passes over a folder gone meanwhile (a NATS server deletes its raft groups' as it runs),
        # where Path.rglob raises.
        for folder, _, files in os.walk(self.folder):
            for name in files:
                if not name.endswith(".pid"):
                    continue
                try:
                    found.append(int(Path(folder, name).read_text()))
                except (OSError, ValueError):
                    continue
        return found

    def wait_gone(self, pids: list[int]) -> None:
        deadline = time.monotonic() + STOP_TIMEOUT_S
        while any(alive(pid) for pid in pids):
            assert time.monotonic() < deadline, f"still running after the stop: {[p for p in pids if alive(p)]}"
            time.sleep(0.05)

    def processes(self) -> list[int]:
        """Every process in the namespace but the one holding it: what its blocks started, pid file or not."""
        own = os.readlink(f"/proc/{self.holder.pid}/ns/net")
        found = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) == self.holder.pid:
                continue
            try:
                if os.readlink(entry / "ns" / "net") == own:
                    found.append(int(entry.name))
            except OSError:
                continue  # gone meanwhile, or not ours to look at
        return found

    def close(self) -> None:
        for pid in {*self.pids(), *self.processes()}:  # whatever the blocks left running, by its PID
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        self.holder.kill()
        self.holder.wait()
        for path in self.made:
            path.rmdir() if path.is_dir() else path.unlink()


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}").exists() and "zombie" not in Path(f"/proc/{pid}/status").read_text().lower()


@contextmanager
def namespace(covered: Mapping[str, Path] | None = None) -> Iterator[Namespace]:
    if shutil.which("unshare") is None or shutil.which("nsenter") is None or shutil.which("ip") is None:
        pytest.fail("the docs blocks need unshare, nsenter (util-linux) and ip (iproute2): make system-tools")
    folder = Path(tempfile.mkdtemp(prefix="polymq-docs-"))
    space = Namespace(folder, covered)
    try:
        yield space
    finally:
        space.close()
        shutil.rmtree(folder, ignore_errors=True)
