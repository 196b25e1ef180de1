"""Runs ```python fragments of the docs as printed, in the Python and the context a reader has them in:
`python docs_fragments.py REQUEST.json` with a list of fragments (name, kind, code; `fill`, a line of the
fragment that stands for the reader's own code with what stands in its place here; `names`, values of names the
page gives in words). tests/test_docs_fragments.py
starts what they name (a lookupd, gateways, NATS servers) in a namespace and runs this there; it prints one JSON
object, each fragment's name with what it found.

Kinds: `spark-frame`, a fragment whose last expression is a streaming frame, read here into memory until it has
read what is there (`Trigger.AvailableNow`), its rows' bodies the result; `spark`, statements, after which every
query they started processes what is available and stops; `trio`, statements with top-level `await` and
`async with`, awaited under trio, with `until_drained(topic)` at hand for a `fill` (waits until the gateway's
topic holds what was published to it and none of its channels or queues holds anything, ready or in flight).
`spark` in a fragment is a local Spark session."""

from __future__ import annotations

import ast
import json
import sys
import urllib.request
from pathlib import Path
from typing import Any

# A micro-batch of a fragment's query on a loaded 2-core machine; this only turns a hang into a failure.
QUERY_TIMEOUT_S = 300
# The gateway whose nsqd /stats `until_drained` reads: the NSQ HTTP default.
STATS = "http://127.0.0.1:4151/stats?format=json&topic="
# A consumer's delivery and ACK; this only turns a hang into a failure.
DRAIN_TIMEOUT_S = 60


def filled(code: str, fill: dict[str, str]) -> str:
    lines = code.splitlines()
    for line, instead in fill.items():
        assert lines.count(line) == 1, f"the line {line!r} is not in the fragment once"
        lines[lines.index(line)] = instead
    return "\n".join(lines) + "\n"


def run_statements(code: str, name: str, names: dict[str, Any]) -> Any:
    """Runs `code` in `names`; the value of its last line when that is an expression, as an interpreter shows it."""
    module = ast.parse(code, name)
    last = module.body.pop() if module.body and isinstance(module.body[-1], ast.Expr) else None
    exec(compile(module, name, "exec"), names)
    return None if last is None else eval(compile(ast.Expression(last.value), name, "eval"), names)


def spark_frame(spark: Any, name: str, code: str, names: dict[str, Any]) -> list[str]:
    frame = run_statements(code, name, {"spark": spark, **names})
    table = "fragment_" + "".join(c if c.isalnum() else "_" for c in name)
    query = frame.writeStream.format("memory").queryName(table).trigger(availableNow=True).start()
    assert query.awaitTermination(QUERY_TIMEOUT_S), f"{name}: the query did not finish"
    return sorted(bytes(row.body).decode() for row in spark.table(table).collect())


def spark_statements(spark: Any, name: str, code: str, names: dict[str, Any]) -> list[str]:
    run_statements(code, name, {"spark": spark, **names})
    started = []
    for query in spark.streams.active:
        query.processAllAvailable()
        query.stop()
        started.append(query.name or query.id)
    return started


def drained(topic: str) -> bool:
    with urllib.request.urlopen(STATS + topic, timeout=30) as response:
        [found] = [t for t in json.load(response)["topics"] if t["topic_name"] == topic]
    return found["message_count"] > 0 and found["depth"] == 0 and all(
        channel["depth"] == 0 and channel["in_flight_count"] == 0 and channel["deferred_count"] == 0
        for channel in found["channels"])


def trio_statements(name: str, code: str) -> None:
    import trio

    compiled = compile(code, name, "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)

    async def until_drained(topic: str) -> None:
        with trio.fail_after(DRAIN_TIMEOUT_S):
            while not await trio.to_thread.run_sync(drained, topic):
                await trio.sleep(0.05)

    async def main() -> None:
        # A coroutine when the code awaits at its top level.
        awaited = eval(compiled, {"trio": trio, "until_drained": until_drained})
        if awaited is not None:
            await awaited

    trio.run(main)


def main() -> None:
    request = json.loads(Path(sys.argv[1]).read_text())
    results: dict[str, Any] = {}
    spark = None
    for fragment in request:
        name, kind = fragment["name"], fragment["kind"]
        code = filled(fragment["code"], fragment.get("fill", {}))
        if kind.startswith("spark") and spark is None:
            sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
            from support.spark import spark_session

            spark = spark_session()
        if kind == "spark-frame":
            results[name] = spark_frame(spark, name, code, fragment.get("names", {}))
        elif kind == "spark":
            results[name] = spark_statements(spark, name, code, fragment.get("names", {}))
        elif kind == "trio":
            results[name] = trio_statements(name, code)
        else:
            raise ValueError(f"{name}: no kind {kind!r}")
    if spark is not None:
        spark.stop()
    print(json.dumps(results))


if __name__ == "__main__":
    main()
