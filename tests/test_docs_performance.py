"""Every block of docs/performance.md and its history, and the benchmark blocks of other pages, runs here as
printed, on a small count: its benchmarks, profiles and comparisons with an earlier checkout are minutes of the whole
machine, their figures the page's, so each program's counts and durations are made small (SMALL_COUNTS: set
where the block prints them, added after the program where it does not) and nothing else is changed. What a
recipe leaves to the reader is filled in: PID is a durable gateway on the default ports started for the
block, DIR a fresh folder, BEFORE a folder whose `polymq` is this checkout; a block that benches a server it
does not start (the text around it names the one measured: an original, or polymq on its default ports) gets
the same gateway. nsq's programs are nsq 1.3.0's where they are built (~/ref/nsq/bin), else their fakes (CI).

Each block is pasted whole into bash (`set -e`: a failing line fails the block) in a network namespace of its
own, every default port free; what it leaves running is stopped by its PID with the namespace."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from test_docs_commands import blocks as docs_blocks

from support.namespace import Namespace, namespace
from support.nsq_programs import home_with_nsq_programs

ROOT = Path(__file__).resolve().parent.parent
# The performance page and its history: their blocks are benchmarks and profiling recipes.
PAGES = ("docs/performance.md", "docs/performance-history.md")
# The benchmark blocks of other pages (page: the block's first line).
BENCHMARKS_ELSEWHERE = {
    "docs/protocols/emqp.md": ".venv/bin/polymq serve &                          # durable, every protocol on "
                              "its default ports",
    "docs/spark.md": ".venv/bin/polymq serve --no-pzq --no-emqp &",
}
# Each program's counts and durations on a small count: flag -> value.
SMALL_COUNTS: dict[str, dict[str, str]] = {
    "polymq bench nsq": {"--count": "2000"},
    "polymq bench mqks": {"--messages": "500", "--latency-messages": "20", "--client-messages": "200"},
    "polymq bench phpmq": {"--messages": "500", "--latency-messages": "20"},
    "polymq bench pzq": {"--messages": "500", "--latency-messages": "20"},
    "polymq bench emqp": {"--messages": "500", "--latency-messages": "20"},
    "polymq bench spark": {"--rows": "2000"},
    "polymq bench jetstream": {"--messages": "100"},
    "polymq bench versus-nsqd": {"--runfor": "0.5", "--backlog": "5000"},
    "polymq torture": {"--duration": "3"},
    "tools/mqks_replay.py": {"--messages": "2000"},
    "tools/cpu_per_message.py": {"--runfor": "0.5", "--backlog": "5000"},
    "tools/round_trip_syscalls.py": {"--round-trips": "100"},
    "py-spy record": {"-d": "3"},  # the bench's few seconds within it: a profile with the loop's samples
}
# The README's command, alone in its block (a comment at most).
README_VERSUS_NSQD = re.compile(r"\.venv/bin/polymq bench versus-nsqd(\s+#[^\n]*)?\n?$")
# What a recipe leaves to the reader (see the module's text).
PLACEHOLDERS = re.compile(r"\b(PID|DIR|BEFORE)\b")
# A bench of a server on its default ports, and the lines that start one.
BENCH_OF_A_SERVER = re.compile(r"polymq bench (nsq|mqks|phpmq|pzq|emqp|spark)\b")
STARTS_A_SERVER = re.compile(r"polymq serve|emq-router|nats-server")
BACKGROUND_GATEWAY = re.compile(r"polymq serve\b[^#]*&\s*(#.*)?$")
# A block on a small count takes seconds to a minute (Spark's start, three NATS servers); this only turns a
# hang into a failure.
BLOCK_TIMEOUT_S = 600
READER_GATEWAY_TIMEOUT_S = 60


def blocks() -> list[tuple[str, int, str]]:
    """(page, line, text) of each shell block of the performance page, but the README's versus-nsqd
    (tests/test_bench_versus_nsqd.py runs it as printed), and the benchmark blocks of other pages."""
    return [(block.page, block.line, block.text) for block in docs_blocks()
            if (block.page in PAGES and not README_VERSUS_NSQD.match(block.text))
            or block.key[1] == BENCHMARKS_ELSEWHERE.get(block.page)]


def on_a_small_count(line: str) -> str:
    """One logical line with each program's counts made small (its comment as printed)."""
    code, comment = re.match(r"(.*?)((?:^|\s)#.*)?$", line).groups()  # type: ignore[union-attr]
    return _small_counts(code) + (comment or "")


def _small_counts(line: str) -> str:
    for program, flags in SMALL_COUNTS.items():
        found = re.search(re.escape(program) + r"(?=\s|$)", line)
        if found is None:
            continue
        added = ""
        for flag, value in flags.items():
            printed = re.compile(rf"(?<=\s){re.escape(flag)}[ =]\S+")
            if printed.search(line):
                line = printed.sub(f"{flag} {value}", line)
            else:
                added += f" {flag} {value}"
        end = found.end()
        line = line[:end] + added + line[end:]
    return line


def small(text: str, filled: dict[str, str]) -> str:
    """The block as bash runs it: continuations joined, counts small, placeholders filled."""
    lines = [on_a_small_count(line) for line in text.replace("\\\n", " ").splitlines()]
    return PLACEHOLDERS.sub(lambda match: filled[match.group(1)], "\n".join(lines))


def _reader_gateway(space: Namespace) -> str:
    """A durable gateway on the default ports, as the reader of a recipe has running: its PID."""
    space.run(".venv/bin/polymq serve --data-dir reader-data > reader-gateway.log 2>&1 & echo $! > reader.pid; "
              f".venv/bin/polymq wait --timeout {READER_GATEWAY_TIMEOUT_S}")
    return (space.folder / "reader.pid").read_text().strip()


def _absolute_tmp(text: str) -> set[Path]:
    return {Path(found) for found in re.findall(r"/tmp/[\w.-]+", text)}


@pytest.mark.slow
@pytest.mark.parametrize(("page", "line", "text"), blocks(),
                         ids=[f"{Path(page).stem}-{line}" for page, line, _ in blocks()])
def test_a_block_runs_as_printed_on_a_small_count(page: str, line: int, text: str, tmp_path: Path) -> None:
    home = home_with_nsq_programs(tmp_path / "home")
    for folder in _absolute_tmp(text):  # a reader's scratch folders, as a fresh machine has them: none
        shutil.rmtree(folder, ignore_errors=True)
    try:
        with namespace() as space:
            (space.folder / "DIR").mkdir()
            (space.folder / "BEFORE").mkdir()
            (space.folder / "BEFORE" / "polymq").symlink_to(ROOT)
            filled = {"DIR": "DIR", "BEFORE": "BEFORE"}
            if "PID" in PLACEHOLDERS.findall(text) or \
                    (BENCH_OF_A_SERVER.search(text) and not STARTS_A_SERVER.search(text)):
                filled["PID"] = _reader_gateway(space)
            script = small(text, filled)
            # Into a file, not a pipe: what the block leaves running in the background holds its output open.
            with (tmp_path / "output").open("w+") as output:
                done = subprocess.run(
                    [*space.enter, "bash", "-c",
                     "set -e -o pipefail -x\n" + script], cwd=space.folder, stdout=output, stderr=subprocess.STDOUT,
                    timeout=BLOCK_TIMEOUT_S, env={**os.environ, "HOME": str(home)})
                output.seek(0)
                printed = output.read()
            assert done.returncode == 0, f"{page}:{line}\n{script}\nexit {done.returncode}\n{printed[-8000:]}"
            assert "Traceback" not in printed, printed[-8000:]
    finally:
        for folder in _absolute_tmp(text):
            shutil.rmtree(folder, ignore_errors=True)


def test_a_gateway_started_in_the_background_is_waited_for_before_it_is_used() -> None:
    """A reader pastes the block: the next line must not race the gateway's start."""
    for page, line, text in blocks():
        lines = text.replace("\\\n", " ").splitlines()
        for index, command in enumerate(lines):
            if BACKGROUND_GATEWAY.search(command):
                following = lines[index + 1] if index + 1 < len(lines) else ""
                assert following.startswith(".venv/bin/polymq wait"), f"{page}:{line}: {command}"


def test_small_counts_are_set_where_printed_and_added_where_not() -> None:
    assert on_a_small_count(".venv/bin/polymq bench mqks --addr 127.0.0.1:43117 --messages 300000 --json") == (
        ".venv/bin/polymq bench mqks --latency-messages 20 --client-messages 200 --addr 127.0.0.1:43117 "
        "--messages 500 --json")
    assert on_a_small_count(".venv/bin/python tools/round_trip_syscalls.py --round-trips 5000 -- --fsync=always") \
        == ".venv/bin/python tools/round_trip_syscalls.py --round-trips 100 -- --fsync=always"
    assert on_a_small_count(".venv/bin/polymq bench versus-nsqd     # --runfor S") == (
        ".venv/bin/polymq bench versus-nsqd --runfor 0.5 --backlog 5000     # --runfor S")
    assert on_a_small_count("curl -s http://127.0.0.1:4151/stats") == "curl -s http://127.0.0.1:4151/stats"
    assert small("py-spy record -p PID -d 7 -o x.raw", {"PID": "42"}) == "py-spy record -p 42 -d 3 -o x.raw"
