"""Every ```python fragment of README.md and docs/ runs here as printed, in the context its page gives it, in a
network (and mount) namespace of its own where the addresses it names are free: a lookupd on 4160/4161 and a
gateway registered with it on the default ports (the fragments at 127.0.0.1), two nodes on a three-server
JetStream cluster at 10.0.0.1 and 10.0.0.2 (on the namespace's loopback), `/tmp/ck` a folder of the test's.
Spark fragments run with `spark` a local session, pynsq's in pynsq's own Python (tests/interop), the PZQ client's
top-level `async with` under trio; where a fragment has `...` for the reader's own code, the test waits there
for what the code before it set going (tests/support/docs_fragments.py). A fragment added to a page, or
changed, must be given its place here: the inventory test fails until it is."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest
from test_docs_commands import PAGES, Block
from test_docs_deployment import page_block
from test_docs_lookupd import programs

from support.namespace import Namespace, namespace
from support.nsq_cluster import wait_until

ROOT = Path(__file__).resolve().parent.parent
INTEROP_DIR = Path(os.environ.get("INTEROP_DIR", ROOT / ".interop"))
FRAGMENT = re.compile(r"^```python\n(.*?)^```$", re.MULTILINE | re.DOTALL)
# Setting up pynsq's environment from PyPI (tests/interop/setup_envs.sh) the first time; after, a stamp check.
SETUP_TIMEOUT_S = 900
# A local Spark's start and four fragments' queries on a loaded 2-core machine, a pynsq Reader's first message;
# these only turn a hang into a failure.
FRAGMENTS_TIMEOUT_S = 900
READER_TIMEOUT_S = 120
# What the JetStream nodes ask of stream requests (bound beyond loopback, they need a token).
TOKEN = "fragments-test-token-0123"
NODES = ("10.0.0.1", "10.0.0.2")

PYNSQ_READER = ("docs/cluster.md", 'nsq.Reader(message_handler=handle, topic="orders", channel="billing",')
LOOKUPD_STREAM = ("docs/cluster.md", 'spark.readStream.format("polymq").option("lookupd", "127.0.0.1:4161")'
                                     '.option("stream", "orders-job") \\')
SPARK_SUMMARY = ("docs/spark.md", 'frame = spark.readStream.format("polymq").option("gateway", "127.0.0.1:4181") \\')
SHARED_STREAM = ("docs/spark.md", 'spark.readStream.format("polymq").option("gateway", "10.0.0.1:4181,10.0.0.2:4181") '
                                  '\\')
PZQ_CLIENT = ("docs/protocols/pzq.md", "from polymq.clients.pzq import PZQConsumer, PZQProducer")
# How each runs (tests/support/docs_fragments.py's kinds; pynsq's runs in its own Python, below).
KINDS = {PYNSQ_READER: "pynsq", LOOKUPD_STREAM: "spark-frame", SPARK_SUMMARY: "spark",
         SHARED_STREAM: "spark-frame", PZQ_CLIENT: "trio"}
# The lines that stand for a reader's own code, and what the test does there.
FILLS = {PZQ_CLIENT: {"    ...": '    await until_drained("pzq")'}}
# Names a fragment uses that its page gives in words: the nodes' `--admin-token`.
NAMES = {SHARED_STREAM: {"token": TOKEN}}
# The handler pynsq's Reader is given, which its page names: it prints what it gets, then ends the Reader's loop.
PYNSQ_PRELUDE = """import nsq
import tornado.ioloop


def handle(message):
    print(message.body.decode(), message.attempts, flush=True)
    tornado.ioloop.IOLoop.current().stop()
    return True


"""
PYNSQ_RUN = "\nnsq.run()\n"

# Reads `count` messages of a channel of the gateway's over NSQ; prints their bodies, a line each.
READ_MESSAGES = """.venv/bin/python - <<'EOF'
from polymq.clients import nsq
from polymq.codecs import nsq_client
with nsq.Connection('127.0.0.1:4150', 30) as connection:
    connection.send(nsq_client.sub({topic!r}, {channel!r}))
    connection.wait_for_ok('SUB')
    connection.send(nsq_client.rdy({count}))
    for _ in range({count}):
        while not (frame := connection.next_frame(30)).is_message:
            pass
        message = nsq_client.decode_message(frame.data)
        connection.send(nsq_client.fin(message.msg_id))
        print(message.body.decode())
EOF
"""


def fragments() -> dict[tuple[str, str], Block]:
    found = {}
    for page in PAGES:
        text = (ROOT / page).read_text()
        for match in FRAGMENT.finditer(text):
            fragment = Block(page, text.count("\n", 0, match.start()) + 1, match.group(1))
            found[fragment.key] = fragment
    return found


def test_every_python_fragment_of_the_docs_is_run_here() -> None:
    found = fragments()
    assert sorted(set(found) - set(KINDS)) == [], "fragments not run here: give each a kind (and a check)"
    assert sorted(set(KINDS) - set(found)) == [], "kinds of fragments no page has"


def _curl(space: Namespace, script: str) -> str:
    return space.run("set -e\n" + script).stdout  # each request must succeed


def _start(space: Namespace) -> None:
    """The lookupd and the gateway at 127.0.0.1, the NATS servers (cluster.md's block) and the two nodes."""
    space.run(" && ".join(f"ip addr add {address}/32 dev lo" for address in NODES))
    nsq_bin = programs(space.folder / "nsq-bin")
    space.run(f"{nsq_bin}/nsqlookupd --broadcast-address=127.0.0.1 > lookupd.log 2>&1 & echo $! > lookupd.pid")
    wait_until(lambda: space._run("curl -sf 127.0.0.1:4161/ping").stdout == "OK", "the lookupd")
    space.run(".venv/bin/polymq serve --in-memory --lookupd-tcp-address 127.0.0.1:4160 --broadcast-address "
              "127.0.0.1 > gateway.log 2>&1 & echo $! > gateway.pid\n.venv/bin/polymq wait\n")
    space.run(page_block("docs/cluster.md", "mkdir -p js"))
    servers = "nats://127.0.0.1:4221,nats://127.0.0.1:4222,nats://127.0.0.1:4223"
    for number, address in enumerate(NODES, 1):
        space.run(f".venv/bin/polymq serve --jetstream {servers} --bind {address} --admin-bind {address} "
                  f"--admin-token {TOKEN} --no-mqks --no-phpmq --no-pzq --no-emqp > node{number}.log 2>&1 "
                  f"& echo $! > node{number}.pid")
    for address in NODES:
        space.run(f".venv/bin/polymq wait --address {address}:4181")


def _publish(space: Namespace) -> None:
    """What the fragments read: on the gateway, the orders channel and streams they name, made before the first
    order as a job's earlier run leaves them; on the cluster, its stream, then an order through each node."""
    _curl(space, "curl -sf -X POST '127.0.0.1:4151/topic/create?topic=orders'\n"
                 "curl -sf -X POST '127.0.0.1:4151/channel/create?topic=orders&channel=billing'\n"
                 "curl -sf -X POST '127.0.0.1:4181/stream/open?stream=orders-job&topic=orders'\n"
                 "curl -sf -X POST '127.0.0.1:4181/stream/open?stream=orders-spark&topic=orders'\n"
                 "curl -sf -X POST '127.0.0.1:4151/topic/create?topic=totals'\n"
                 "curl -sf -X POST '127.0.0.1:4151/channel/create?topic=totals&channel=check'\n"
                 "curl -sf -d 'first order' '127.0.0.1:4151/pub?topic=orders'\n")
    _curl(space, f"curl -sf -X POST -H 'Authorization: Bearer {TOKEN}' "
                 f"'{NODES[0]}:4181/stream/open?stream=orders-job&topic=orders'\n"
                 + "".join(f"curl -sf -d 'through {address}' '{address}:4151/pub?topic=orders'\n" for address in NODES))


@pytest.fixture(scope="module")
def pynsq_python() -> Path:
    done = subprocess.run(["bash", str(ROOT / "tests" / "interop" / "setup_envs.sh"), "pynsq"], capture_output=True,
                          text=True, timeout=SETUP_TIMEOUT_S, env={**os.environ, "INTEROP_DIR": str(INTEROP_DIR)})
    assert done.returncode == 0, f"tests/interop/setup_envs.sh pynsq failed:\n{done.stdout}\n{done.stderr}"
    return INTEROP_DIR / "pynsq" / "bin" / "python"


@pytest.mark.slow
def test_the_python_fragments_run_as_printed(tmp_path: Path, pynsq_python: Path) -> None:
    found = fragments()
    checkpoint = tmp_path / "ck"
    checkpoint.mkdir()
    with namespace({"/tmp/ck": checkpoint}) as space:
        _start(space)
        _publish(space)

        reader = space.folder / "pynsq_reader.py"
        reader.write_text(PYNSQ_PRELUDE + found[PYNSQ_READER].text + PYNSQ_RUN)
        read = space.run(f"env -u PYTHONPATH {pynsq_python} {reader.name}", READER_TIMEOUT_S).stdout
        assert read == "first order 1\n", read  # over the lookupd, to the gateway it lists, the order's first try

        request = [{"name": f"{key[0]}:{found[key].line}", "kind": KINDS[key], "code": found[key].text,
                    "fill": FILLS.get(key, {}), "names": NAMES.get(key, {})}
                   for key in (LOOKUPD_STREAM, SPARK_SUMMARY, SHARED_STREAM, PZQ_CLIENT)]
        (space.folder / "fragments.json").write_text(json.dumps(request))
        ran = space._run(".venv/bin/python tests/support/docs_fragments.py fragments.json", FRAGMENTS_TIMEOUT_S)
        assert ran.returncode == 0, f"{ran.stdout[-3000:]}\n{ran.stderr[-6000:]}"
        results = json.loads(ran.stdout.splitlines()[-1])
        lookupd, summary, shared, pzq = (results[fragment["name"]] for fragment in request)

        assert lookupd == ["first order"]  # the stream of the one node the lookupd lists
        assert len(summary) == 1  # the summary's streaming query, which ran until it had written what it read
        # ...its rows' bodies on the totals topic: the order before, and the row its batch write published.
        assert sorted(space.run(READ_MESSAGES.format(topic="totals", channel="check", count=2)).stdout
                      .splitlines()) == ["an order", "first order"]
        assert shared == [f"through {address}" for address in NODES]  # each once, through either node
        assert pzq is None  # produced, then taken and ACKed by the consumer (until_drained)
        assert any(checkpoint.iterdir()), "the summary's query kept no checkpoint in /tmp/ck"
