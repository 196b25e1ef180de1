"""The Python examples of the README and the protocol pages, run as printed against one gateway.

Each block `.venv/bin/python - <<'EOF' … EOF` runs twice in a row against the same gateway (its
ports put where the block names the defaults): an example must finish what it starts, so that a
second run, or the next example, never waits on what an earlier one left. A Spark block must also
print the same both times (it commits what it read). Blocks that need a separate environment
(pynsq) are run by their own tests (tests/interop).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from polymq.clients.stream import StreamClient

from support.gateway import GatewayProcess, running_gateway
from support.nsq_cluster import http
from support.spark import SPARK_ENV

ROOT = Path(__file__).resolve().parent.parent
PAGES = ["README.md", *sorted(str(path.relative_to(ROOT)) for path in (ROOT / "docs" / "protocols").glob("*.md"))]
BLOCK = re.compile(r"^\.venv/bin/python - <<'EOF'\n(.*?)^EOF$", re.MULTILINE | re.DOTALL)
# The default ports the examples name, by listener.
DEFAULT_PORTS = {"nsq-tcp": 4150, "nsq-http": 4151, "mqks": 25000, "phpmq": 9100, "phpmq-console": 9101,
                 "pzq-receive": 11131, "pzq-send": 11132, "pzq-monitor": 11133, "emqp-backend": 47290,
                 "emqp-frontend": 47291, "emqp-admin": 47293, "emqp-pubsub-in": 47298, "emqp-pubsub-out": 47299,
                 "http": 4181}
# Generous: an example takes well under a second; this only turns a hang into a failure.
EXAMPLE_TIMEOUT_S = 60
# A Spark example starts a JVM (10-40 s on a loaded 2-core machine); this only turns a hang into a failure.
SPARK_EXAMPLE_TIMEOUT_S = 300


def _examples(spark: bool) -> list[tuple[str, int, str]]:
    found = []
    for page in PAGES:
        for number, match in enumerate(BLOCK.finditer((ROOT / page).read_text()), start=1):
            code = match.group(1)
            if ("pyspark" in code) == spark:
                found.append((page, number, code))
    return found


EXAMPLES = _examples(spark=False)
SPARK_EXAMPLES = _examples(spark=True)


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> GatewayProcess:
    with running_gateway("--in-memory", data_dir=tmp_path_factory.mktemp("docs")) as running:
        yield running


def _on(gateway: GatewayProcess, code: str) -> str:
    for name, port in DEFAULT_PORTS.items():
        code = re.sub(rf"\b{port}\b", str(gateway.host_port(name)[1]), code)
    return code


def test_the_pages_have_examples() -> None:
    assert {page for page, _, _ in EXAMPLES} >= {"README.md", "docs/protocols/emqp.md", "docs/protocols/pzq.md",
                                                "docs/protocols/phpmq.md", "docs/protocols/mqks.md"}
    assert [page for page, _, _ in SPARK_EXAMPLES] == ["README.md"]


@pytest.mark.parametrize(("page", "number", "code"), EXAMPLES, ids=[f"{page}#{n}" for page, n, _ in EXAMPLES])
def test_an_example_runs_as_printed_twice_in_a_row(gateway: GatewayProcess, page: str, number: int,
                                                   code: str) -> None:
    for run in (1, 2):
        result = subprocess.run([sys.executable, "-"], input=_on(gateway, code), capture_output=True, text=True,
                                timeout=EXAMPLE_TIMEOUT_S, cwd=ROOT)
        assert result.returncode == 0, f"{page} example {number}, run {run}:\n{result.stdout}{result.stderr}"
        assert "Traceback" not in result.stderr


@pytest.mark.slow
@pytest.mark.parametrize(("page", "number", "code"), SPARK_EXAMPLES,
                         ids=[f"{page}#{n}" for page, n, _ in SPARK_EXAMPLES])
def test_a_spark_example_prints_the_same_twice_in_a_row(gateway: GatewayProcess, page: str, number: int,
                                                         code: str) -> None:
    # The NSQ example before it left its messages in the topic: the Spark example prints its own rows.
    status, answer = http(gateway.nsq_http, "/pub?topic=greetings", "POST", b"from the NSQ example")
    assert status == 200, answer
    printed = []
    for run in (1, 2):
        result = subprocess.run([sys.executable, "-"], input=_on(gateway, code), capture_output=True, text=True,
                                timeout=SPARK_EXAMPLE_TIMEOUT_S, cwd=ROOT, env={**os.environ, **SPARK_ENV})
        assert result.returncode == 0, f"{page} example {number}, run {run}:\n{result.stdout}{result.stderr}"
        printed.append(result.stdout)
    assert printed[0] == printed[1] == "[('greetings', 'hello'), ('greetings', 'world')]\n"
    with StreamClient(gateway.http) as client:  # it finished what it read: nothing left in the stream
        offsets = client.offsets("readme-spark")
    assert offsets["start"] == offsets["end"] == offsets["committed"]
