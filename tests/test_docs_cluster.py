"""docs/cluster.md's example of shared queues, run as printed, twice in a row: three nats-servers, two nodes
(the second on 127.0.0.2), an MQKS consumer on one and a publisher on the other (the output its comments
show), the stop. The first time, the split conformance run of the page's "Split across two nodes" too:
every check passes but those its table lists, each with its reason.

The blocks use fixed ports (the servers', every protocol's defaults), so they run in a network namespace of
their own (root has one at once; anyone else in a user namespace of their own): nothing else on the machine
holds those ports, and no connection of another test is given one as its ephemeral port."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "cluster.md"
EXAMPLE = ("### One machine: three NATS servers, two nodes", "### Options")
SPLIT = ("#### Split across two nodes", "### Tests")
BLOCK = re.compile(r"^```sh\n(.*?)^```$", re.MULTILINE | re.DOTALL)
AS_ROOT = os.geteuid() == 0
NAMESPACE = ("unshare", "--net", *(() if AS_ROOT else ("--user", "--map-root-user")))
ENTER = () if AS_ROOT else ("-U", "--preserve-credentials")
# A block starts processes and waits for them (`polymq wait`); the conformance run takes about two minutes.
# These only turn a hang into a failure.
BLOCK_TIMEOUT_S = 120
CONFORMANCE_TIMEOUT_S = 900
STOP_TIMEOUT_S = 30
PID_FILES = ("node1.pid", "node2.pid", "js/n1.pid", "js/n2.pid", "js/n3.pid")


def _section(text: str, bounds: tuple[str, str]) -> str:
    start = text.index(bounds[0])
    return text[start:text.index(bounds[1], start)]


def example_blocks() -> list[str]:
    return BLOCK.findall(_section(PAGE.read_text(), EXAMPLE))


def split_block_and_exceptions() -> tuple[str, set[tuple[str, str]]]:
    section = _section(PAGE.read_text(), SPLIT)
    [block] = BLOCK.findall(section)
    listed = set(re.findall(r"^\| (\w+) \| `([^`]+)` \| .+ \|$", section, re.MULTILINE))
    return block, listed


def expected_output(block: str) -> str:
    """What the demo prints: the comment after each print."""
    return "".join(line.split("# ", 1)[1].rstrip() + "\n" for line in block.splitlines() if "print(" in line)


class Namespace:
    """A network namespace with its loopback up, held open by a sleeping process, and a folder to run in
    (its `.venv` this checkout's)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        (folder / ".venv").symlink_to(ROOT / ".venv")
        self.holder = subprocess.Popen([*NAMESPACE, "sh", "-c", "ip link set lo up && exec sleep 3600"])
        deadline = time.monotonic() + 10
        while self._run("ip -o link show lo").stdout.find("UP") < 0:
            assert self.holder.poll() is None and time.monotonic() < deadline, "the namespace did not come up"
            time.sleep(0.05)

    def _run(self, script: str, timeout: float = BLOCK_TIMEOUT_S) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["nsenter", *ENTER, f"--net=/proc/{self.holder.pid}/ns/net", "--", "bash", "-c",
                               script], cwd=self.folder, capture_output=True, text=True, timeout=timeout)

    def run(self, script: str, timeout: float = BLOCK_TIMEOUT_S) -> subprocess.CompletedProcess[str]:
        result = self._run(script, timeout)
        assert result.returncode == 0, f"{script}\nexit {result.returncode}\n{result.stdout}\n{result.stderr}"
        return result

    def pids(self) -> list[int]:
        return [int(path.read_text()) for name in PID_FILES if (path := self.folder / name).exists()]

    def wait_gone(self, pids: list[int]) -> None:
        deadline = time.monotonic() + STOP_TIMEOUT_S
        while any(_alive(pid) for pid in pids):
            assert time.monotonic() < deadline, f"still running after the stop: {[p for p in pids if _alive(p)]}"
            time.sleep(0.05)

    def close(self) -> None:
        for pid in self.pids():  # whatever a failed block left running, by its PID
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        self.holder.kill()
        self.holder.wait()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}").exists() and "zombie" not in Path(f"/proc/{pid}/status").read_text().lower()


@contextmanager
def namespace() -> Iterator[Namespace]:
    if shutil.which("unshare") is None or shutil.which("nsenter") is None or shutil.which("ip") is None:
        pytest.fail("the cluster example needs unshare, nsenter (util-linux) and ip (iproute2): make system-tools")
    folder = Path(tempfile.mkdtemp(prefix="polymq-docs-cluster-"))
    space = Namespace(folder)
    try:
        yield space
    finally:
        space.close()
        shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.slow
def test_the_shared_queues_example_runs_as_printed_twice_and_the_split_conformance_run_passes() -> None:
    servers, nodes, demo, stop = example_blocks()
    split, listed = split_block_and_exceptions()
    with namespace() as space:
        for run in (1, 2):
            space.run(servers)
            space.run(nodes)
            printed = "".join(line.rstrip() + "\n" for line in space.run(demo).stdout.splitlines())
            assert printed == expected_output(demo), f"run {run}"  # MQKS's lines end in a space the comments leave out
            if run == 1:
                result = space._run(split, CONFORMANCE_TIMEOUT_S)
                failed = set(re.findall(r"^FAIL (.+?): ", result.stdout, re.MULTILINE))
                total = re.search(r"== all: (\d+) passed, (\d+) failed", result.stdout)
                assert total is not None, result.stdout[-3000:] + result.stderr[-3000:]
                assert int(total.group(1)) + int(total.group(2)) >= 150
                unexplained = {name for name in failed if not any(name == check for _, check in listed)}
                why = [line for line in result.stdout.splitlines() if line.startswith("FAIL ")]
                assert not unexplained, f"failed, not listed in docs/cluster.md: {unexplained}\n" + "\n".join(why)
            pids = space.pids()
            space.run(stop)
            space.wait_gone(pids)
