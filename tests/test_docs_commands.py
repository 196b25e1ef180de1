"""Every shell block of README.md and docs/: each is run here as printed, or by the test named for it, or
is the same commands as a block run here.
A block added to a page, or changed, must be given its place here: the inventory test fails until it is.

The blocks run here go in scenes: each scene is one network namespace (tests/support/namespace.py: every
protocol's default port free) and one folder, its blocks run in turn as a reader pastes them. A line that
serves in the foreground (`make serve`, `polymq serve` without `&`: a reader leaves it running and goes on
in another terminal) is started, waited for with `polymq wait`, and stopped by its PID at the next such
line or the block's end; every other line runs as printed."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import attrs
import pytest

from support.namespace import BLOCK_TIMEOUT_S, Namespace, namespace

ROOT = Path(__file__).resolve().parent.parent
PAGES = ["README.md", *sorted(str(path.relative_to(ROOT)) for path in (ROOT / "docs").rglob("*.md"))]
SH_BLOCK = re.compile(r"^```sh\n(.*?)^```$", re.MULTILINE | re.DOTALL)
PYTHON_EXAMPLE = re.compile(r"^\.venv/bin/python - <<'EOF'\n")
FOREGROUND = re.compile(r"^(make serve|\.venv/bin/polymq serve)(?![^#]*&)")
# A block's last line that a reader leaves reading until Ctrl-C, its comment saying what it prints first.
UNTIL_CTRL_C = re.compile(r"^(?P<command>[^#]*?)\s*#\s*(?P<shows>.*?)\s*…\s*\(Ctrl-C to stop\)$")
# A conformance suite against a gateway in memory takes about a minute; this only turns a hang into a failure.
CONFORMANCE_TIMEOUT_S = 600
STOP_TIMEOUT_S = 30
# `make serve` compiles the hot modules first when a source is newer than them (a minute or two): `polymq wait`
# (60 s) is asked again while it works. This only turns a hang into a failure.
SERVE_TIMEOUT_S = 600


@attrs.frozen(slots=True)
class Block:
    page: str
    line: int  # where it starts in the page
    text: str

    @property
    def key(self) -> tuple[str, str]:
        return (self.page, self.text.splitlines()[0].rstrip())

    @property
    def commands(self) -> list[str]:
        """Its lines without comments, blank lines and backslash continuations."""
        joined = self.text.replace("\\\n", " ")
        return [re.sub(r"\s+", " ", line.split(" #", 1)[0]).strip() for line in joined.splitlines()
                if line.strip() and not line.lstrip().startswith("#")]


@functools.cache
def blocks() -> tuple[Block, ...]:
    found = []
    for page in PAGES:
        text = (ROOT / page).read_text()
        for match in SH_BLOCK.finditer(text):
            found.append(Block(page, text.count("\n", 0, match.start()) + 1, match.group(1)))
    return tuple(found)


# -- where each block is run ------------------------------------------------------------------------

@attrs.frozen(slots=True)
class RunBy:
    """Run by another test (`tests/…py::function`), or by CI itself (`.ci/run`): `how` says how."""

    test: str
    how: str = "as printed"


ON_A_SMALL_COUNT = "as printed on a small count, a recipe's PID, DIR and BEFORE filled in"
PERFORMANCE_BLOCKS = "tests/test_docs_performance.py::test_a_block_runs_as_printed_on_a_small_count"
SPARK_EXAMPLE = "tests/test_spark.py::test_the_example_pipeline_runs_end_to_end_from_one_command"
CLUSTER_EXAMPLE = ("tests/test_docs_cluster.py::test_the_shared_queues_example_runs_as_printed_twice_and_the_split_"
                   "conformance_run_passes")
LOOKUPD_EXAMPLE = "tests/test_docs_lookupd.py::test_the_lookupd_example_and_its_tools_run_as_printed"
NSQ_OR_FAKES = "with nsq 1.3.0's programs where they are built, else their fakes (CI)"
VERSUS_NSQD = "tests/test_bench_versus_nsqd.py::test_the_readmes_command_measures_every_server_as_printed"
TRACE_EXAMPLE = "tests/test_trace_cross.py::test_the_documented_commands_run_as_printed"

PYNSQ_BLOCK = "python3 -m venv pynsq-env && pynsq-env/bin/pip install pynsq"
# Blocks run here, by scene, in order: (page, the block's first line).
SCENES: dict[str, list[tuple[str, str]]] = {
    # The README's gateway in memory, every example against it, then the suites and tools the pages point
    # at it, then its stop.
    "trying-it": [
        ("README.md", "make install                     # once: .venv, polymq and its dependencies, then the "
                      "compiled hot modules (a few minutes the first time; each step is printed)"),
        ("README.md", "curl -d 'hello' 'http://127.0.0.1:4151/pub?topic=greetings'      # OK"),
        ("README.md", PYNSQ_BLOCK),
        ("docs/spark.md", "curl -X POST 'http://127.0.0.1:4181/stream/open?stream=peek&topic=greetings'"),
        ("docs/testing.md", "# against a running gateway (the README's *Trying it* starts one), or `make conformance`"),
        ("docs/protocols/mqks.md", ".venv/bin/polymq conformance mqks --addr 127.0.0.1:25000    # black-box checks, "
                                   "hold for the original too"),
    ],
    # Alternatives of starting a gateway, one after the other.
    "starting": [
        ("docs/operations.md", "make serve                                   # installs into .venv, then "
                               ".venv/bin/polymq serve"),
        ("docs/protocols/nsq.md", ".venv/bin/polymq serve                                            # NSQ on 4150, "
                                  "HTTP on 4151"),
    ],
}
# What the README says stops its gateway (in its text, not a block).
README_STOP = "kill $(cat polymq-try.pid)"

ELSEWHERE: dict[tuple[str, str], RunBy] = {
    ("README.md", "make serve   # fresh machine: installs into .venv and starts the gateway (NSQ 4150/4151, MQKS "
                  "25000, PHPMQ 9100/9101, PZQ 11131-11133, eMQP 47290-47299, its own HTTP 4181; loopback, "
                  "durable storage in ./data)"):
        RunBy(".ci/run", "`make test` is CI's own command on a fresh machine; `make serve` runs here in "
                         "docs/operations.md's block"),
    ("README.md", ".venv/bin/polymq bench versus-nsqd    # needs nsq 1.3.0's nsqd, bench_writer and bench_reader "
                  "in ~/ref/nsq/bin (--nsq-bin DIR)"): RunBy(VERSUS_NSQD, NSQ_OR_FAKES),
    ("docs/cluster.md", "nsqlookupd --broadcast-address=127.0.0.1 &                              # TCP 4160, HTTP "
                        "4161"): RunBy(LOOKUPD_EXAMPLE, NSQ_OR_FAKES),
    ("docs/cluster.md", "polymq serve --bind 0.0.0.0 --lookupd-tcp-address lookupd1:4160 --lookupd-tcp-address "
                        "lookupd2:4160"):
        RunBy("tests/test_docs_deployment.py::test_a_node_of_a_deployment_registers_with_both_lookupds_it_names",
              "as printed, lookupd1 and lookupd2 named in the namespace's own /etc/hosts"),
    ("docs/cluster.md", "nsq_tail --lookupd-http-address=127.0.0.1:4161 --topic=orders"):
        RunBy(LOOKUPD_EXAMPLE, "each line in the background, against the block above, " + NSQ_OR_FAKES),
    ("docs/cluster.md", "mkdir -p js"):
        RunBy(CLUSTER_EXAMPLE, "as printed, twice"),
    ("docs/cluster.md", "SERVERS=nats://127.0.0.1:4221,nats://127.0.0.1:4222,nats://127.0.0.1:4223"):
        RunBy(CLUSTER_EXAMPLE, "as printed, twice"),
    ("docs/cluster.md", "kill $(cat node1.pid node2.pid js/n1.pid js/n2.pid js/n3.pid)"):
        RunBy(CLUSTER_EXAMPLE, "as printed, twice"),
    ("docs/cluster.md", ".venv/bin/polymq conformance all --nsq-http 127.0.0.1:4151 --pzq-receive 127.0.0.1:11131 \\"):
        RunBy(CLUSTER_EXAMPLE, "as printed"),
    ("docs/matrix.md", "POLYMQ_MATRIX_RESULTS=/tmp/polymq-matrix.json .venv/bin/pytest -q tests/test_matrix.py"):
        RunBy("tests/test_matrix.py::test_the_printed_command_rewrites_the_table",
              "its second line as printed on a stale copy of the page; the first is the suite's own run of "
              "tests/test_matrix.py"),
    ("docs/operations.md", "sysctl -w net.ipv4.ip_local_reserved_ports=47290-47299"):
        RunBy("tests/test_docs_deployment.py::test_the_reserved_ports_are_set_now_and_for_the_next_boot",
              "as printed, in a namespace with its own network settings and /etc/sysctl.d"),
    ("docs/operations.md", "openssl rand -hex 16 > admin-token && chmod 600 admin-token"):
        RunBy("tests/test_admin_api.py::test_a_real_gateway_says_how_its_api_is_guarded_and_checks_the_token",
              "the same flags and header on loopback: the block names a deployment's address (192.0.2.10)"),
    ("docs/operations.md", "curl -s http://127.0.0.1:4181/api/state | python3 -m json.tool"):
        RunBy("tests/test_admin_api.py::test_the_documented_curl_examples_run_as_printed",
              "as printed, its port moved, each answer as its comment says"),
    ("docs/operations.md", ".venv/bin/polymq serve --in-memory --trace orders > polymq-try.log 2>&1 & echo $! > "
                           "polymq-try.pid"):
        RunBy(TRACE_EXAMPLE, "its curl lines as printed, ports moved, on a gateway started with its options"),
    ("docs/protocols/emqp.md", ".venv/bin/polymq serve &                          # durable, every protocol on "
                               "its default ports"): RunBy(PERFORMANCE_BLOCKS, ON_A_SMALL_COUNT),
    ("docs/protocols/emqp.md", ".venv/bin/python -m pytest tests/interop/test_eventmq.py -v"):
        RunBy(".ci/run", "the suite runs tests/interop/test_eventmq.py"),
    ("docs/spark.md", "make example-spark     # the orders pipeline below, end to end, on local[2] against a "
                      "gateway it starts"):
        RunBy(SPARK_EXAMPLE, "its script, as make runs it"),
    ("docs/spark.md", "make install                                             # this clone's .venv has it "
                      "(and polymq) already"):
        RunBy("tests/test_docs_deployment.py::test_another_python_gets_polymq_and_its_spark_source_from_the_clone",
              "as printed, /tmp/spark-env the test's, pip given wheels built beforehand"),
    ("docs/spark.md", "make example-spark          # or: .venv/bin/python examples/spark_orders/run.py"):
        RunBy(SPARK_EXAMPLE, "its script, as make runs it"),
    ("docs/spark.md", "pip install '/path/to/polymq[spark]'                     # on the driver's and every "
                      "executor's Python (a clone)"):
        RunBy("tests/test_docs_deployment.py::test_the_example_job_runs_on_a_spark_cluster_as_submitted",
              "as printed, its names filled in: a standalone Spark master and worker on loopback, a gateway"),
    ("docs/spark.md", ".venv/bin/polymq serve --no-pzq --no-emqp &"): RunBy(PERFORMANCE_BLOCKS, ON_A_SMALL_COUNT),
    ("docs/testing.md", "make test"): RunBy(".ci/run", "CI's own command"),
    ("docs/testing.md", ".venv/bin/pytest -q tests/test_mqks.py"):
        RunBy(".ci/run", "the suite runs tests/test_mqks.py and tests/test_engine.py whole"),
    ("docs/testing.md", ".venv/bin/python tests/support/crash_loop.py --rounds 20 --seed 7"):
        RunBy("tests/test_crash_loop.py::test_crash_loop_kill9_loses_no_acknowledged_publish",
              "the same harness, fewer rounds, each protocol"),
    ("docs/testing.md", ".venv/bin/polymq torture --duration 300 --seed 7"):
        RunBy("tests/test_torture.py::test_thirty_seconds_of_every_protocol_under_sigkills_lose_nothing",
              "30 s instead of 300"),
    ("docs/testing.md", ".venv/bin/polymq torture --duration 60 --seed 3 --jetstream --partitions"):
        RunBy("tests/test_torture.py::test_two_gateways_under_cuts_and_pauses_lose_nothing_and_no_queue_stalls",
              "40 s instead of 60"),
    ("docs/testing.md", ".venv/bin/polymq torture --duration 60 --seed 2 --jetstream"):
        RunBy("tests/test_torture.py::test_two_gateways_on_three_nats_servers_under_sigkills_of_both_kinds_lose_"
              "nothing", "a shorter run"),
    ("docs/testing.md", ".venv/bin/polymq conformance all --skip robustness --skip current-generation "
                        "--emqp-pubsub-in 127.0.0.1:47298 --emqp-pubsub-out 127.0.0.1:47299"):
        RunBy(".ci/run", "against the originals (its table); against polymq `conformance all` runs here"),
}


def _performance(block: Block) -> RunBy:
    """The performance pages' blocks: benchmarks and profiling recipes, their figures the page's."""
    if block.commands == [".venv/bin/polymq bench versus-nsqd"]:
        return RunBy(VERSUS_NSQD, NSQ_OR_FAKES)
    return RunBy(PERFORMANCE_BLOCKS, ON_A_SMALL_COUNT)


def placed(block: Block) -> str | RunBy:
    """Where the block is run: a scene's name, or a test."""
    for scene, keys in SCENES.items():
        if block.key in keys:
            return scene
    if PYTHON_EXAMPLE.match(block.text):
        if block.page in ("README.md", *(p for p in PAGES if "/protocols/" in p)):
            return RunBy("tests/test_docs_examples.py::test_an_example_runs_as_printed_twice_in_a_row",
                         "as printed, twice, its ports moved")
        if block.page == "docs/cluster.md":
            return RunBy(CLUSTER_EXAMPLE, "as printed, twice, its output compared with its comments")
        if block.page == "docs/operations.md":
            return RunBy(TRACE_EXAMPLE, "as printed, against the gateway the block before starts")
    if block.key in ELSEWHERE:
        return ELSEWHERE[block.key]
    if block.page in ("docs/performance.md", "docs/performance-history.md"):
        return _performance(block)
    same = _same_as_run(block)
    if same is not None:
        return same
    raise LookupError(f"{block.page}:{block.line} is not placed: run it in a scene, or name its test")


def _same_as_run(block: Block) -> RunBy | None:
    """A block whose every command is one a scene's block runs."""
    run = {command for other in blocks() if other.key in {k for keys in SCENES.values() for k in keys}
           for command in other.commands}
    if block.commands and set(block.commands) <= run:
        return RunBy("tests/test_docs_commands.py::test_a_scene_runs_as_printed", "the same commands, run there")
    return None


def test_every_block_is_placed_and_every_place_is_a_block() -> None:
    found = blocks()
    assert len(found) >= 80
    for block in found:
        placed(block)  # raises for a block with no place
    keys = {block.key for block in found}
    named = {key for scene in SCENES.values() for key in scene} | set(ELSEWHERE)
    assert named <= keys, f"placed, but no such block (changed or gone): {sorted(named - keys)}"


def test_every_test_named_for_a_block_exists() -> None:
    ci = (ROOT / ".ci" / "run").read_text()
    for block in blocks():
        where = placed(block)
        if not isinstance(where, RunBy):
            continue
        if where.test == ".ci/run":
            assert "make test" in ci or "README" in ci, ci
            continue
        path, function = where.test.split("::")
        source = (ROOT / path).read_text()
        assert re.search(rf"^(async )?def {function}\(", source, re.MULTILINE), f"{where.test} ({block.key})"


# -- the scenes --------------------------------------------------------------------------------------

def _by_key() -> dict[tuple[str, str], Block]:
    return {block.key: block for block in blocks()}


def _logical_lines(text: str) -> list[str]:
    assert "<<" not in text, "a block with a heredoc runs whole"
    return [line for line in text.replace("\\\n", " ").splitlines() if line.strip()]


class Foreground:
    """A gateway a line started in the foreground: waited for, then stopped by its process group."""

    def __init__(self, space: Namespace, line: str) -> None:
        self.line = line
        self.process = subprocess.Popen(
            [*space.enter, "bash", "-c", line],
            cwd=space.folder, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
        deadline = time.monotonic() + SERVE_TIMEOUT_S
        while (waited := space._run(".venv/bin/polymq wait", BLOCK_TIMEOUT_S)).returncode:
            if self.process.poll() is not None or time.monotonic() > deadline:  # gone, or hung
                self.stop()
                pytest.fail(f"{line}\ndid not serve: {waited.stdout}{waited.stderr}\n{self.output}")

    output = ""

    def stop(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.output, _ = self.process.communicate(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            pytest.fail(f"{self.line}: still running {STOP_TIMEOUT_S} s after SIGTERM")
        deadline = time.monotonic() + STOP_TIMEOUT_S
        while _group_alive(self.process.pid):
            assert time.monotonic() < deadline, f"{self.line}: its processes outlived it"
            time.sleep(0.05)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def read_until_ctrl_c(space: Namespace, command: str, shows: str, timeout: float) -> str:
    """Run `command` on a terminal of its own (its prints reach the reader line by line there, not held in a
    pipe's buffer) until it prints `shows`, then press Ctrl-C (SIGINT to its process group); all it printed."""
    terminal, its_end = os.openpty()
    process = subprocess.Popen([*space.enter, "bash", "-c",
                                command], cwd=space.folder, stdin=its_end, stdout=its_end, stderr=its_end,
                               start_new_session=True)
    os.close(its_end)
    printed = b""
    try:
        deadline = time.monotonic() + timeout
        while shows.encode() not in printed:
            left = deadline - time.monotonic()
            assert left > 0 and process.poll() is None, f"{command}: never printed {shows!r}:\n{printed.decode()}"
            if select.select([terminal], [], [], left)[0]:
                printed += os.read(terminal, 65536)
        os.killpg(process.pid, signal.SIGINT)
        with contextlib.suppress(OSError):  # EIO once the process and the terminal's last user are gone
            while chunk := os.read(terminal, 65536):
                printed += chunk
        process.wait(STOP_TIMEOUT_S)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        os.close(terminal)
    return printed.decode(errors="replace")


def run_block(space: Namespace, block: Block, timeout: float) -> str:
    """Run as a reader pastes it; what it printed."""
    before, _, last = block.text.rstrip("\n").rpartition("\n")
    if reader := UNTIL_CTRL_C.match(last):
        return space.run(before, timeout).stdout + read_until_ctrl_c(space, reader["command"], reader["shows"],
                                                                   timeout)
    if not any(FOREGROUND.match(line) for line in block.text.splitlines()):
        return space.run(block.text, timeout).stdout
    printed, serving = [], None
    try:
        for line in _logical_lines(block.text):
            if FOREGROUND.match(line):
                if serving is not None:
                    serving.stop()
                serving = Foreground(space, line)
            elif not line.lstrip().startswith("#"):
                printed.append(space.run(line, timeout).stdout)
    finally:
        if serving is not None:
            serving.stop()
    return "".join(printed)


def _check_trying_it(key: tuple[str, str], printed: str) -> None:
    if key[1].startswith("curl -d 'hello'"):  # OK, OK, then nsqd's /stats with the topic's 3 messages
        assert printed.startswith("OKOK"), printed
        stats = json.loads(printed[4:])
        [topic] = [t for t in stats["topics"] if t["topic_name"] == "greetings"]
        assert topic["message_count"] == 3, topic
    elif key[1] == PYNSQ_BLOCK:  # pynsq's Reader, on a new channel, gets the topic's first message first
        assert "b'hello' 1" in printed, printed
    elif key[1].startswith("curl -X POST"):  # the stream opened, the publish, its offsets
        assert '"stream":"peek"' in printed and "OK" in printed and '"message"' not in printed, printed
    elif "conformance" in key[1]:
        assert re.search(r"\b0 failed\b", printed) and "FAIL " not in printed, printed[-3000:]


def _check_starting(key: tuple[str, str], printed: str) -> None:
    if key[0] == "docs/operations.md":  # `config --show`: the effective configuration as TOML
        assert re.search(r"^tcp_port = 4150$", printed, re.MULTILINE) and "[storage]" in printed, printed
    else:  # the NSQ page: OK, then /stats with the topic
        assert printed.startswith("OK") and '"topic_name":"greetings"' in printed.replace(" ", ""), printed


CHECKS: dict[str, Callable[[tuple[str, str], str], None]] = {"trying-it": _check_trying_it,
                                                             "starting": _check_starting}
# What a scene's blocks install from PyPI, which its network namespace cannot reach: fetched beforehand, and given
# to pip from a folder (the commands run as printed). pynsq comes as source: setuptools and wheel build it.
FROM_PYPI = {"trying-it": ["pynsq", "setuptools", "wheel"]}
# Outside the scene's folder, what its blocks make (operations.md's `--data-dir /var/lib/polymq`): removed after
# when it was not there before.
MADE_OUTSIDE = {"starting": [Path("/var/lib/polymq")]}


@pytest.mark.slow
@pytest.mark.parametrize("scene", sorted(SCENES))
def test_a_scene_runs_as_printed(scene: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    by_key = _by_key()
    if scene in FROM_PYPI:
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--dest", str(tmp_path / "packages"),
                        *FROM_PYPI[scene]], check=True, capture_output=True, timeout=BLOCK_TIMEOUT_S)
        monkeypatch.setenv("PIP_NO_INDEX", "1")
        monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "packages"))
    check = CHECKS.get(scene, lambda key, printed: None)
    made = [path for path in MADE_OUTSIDE.get(scene, []) if not path.exists()]
    with namespace() as space, contextlib.ExitStack() as cleanup:
        for path in made:
            cleanup.callback(shutil.rmtree, path, ignore_errors=True)
        for key in SCENES[scene]:
            block = by_key[key]
            timeout = CONFORMANCE_TIMEOUT_S if "conformance" in block.text else BLOCK_TIMEOUT_S
            check(key, run_block(space, block, timeout))
        if scene == "trying-it":
            pids = space.pids()
            assert pids, "the README's gateway wrote no pid file"
            space.run(README_STOP)
            space.wait_gone(pids)
            assert README_STOP in (ROOT / "README.md").read_text()
