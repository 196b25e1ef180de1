"""docs/cluster.md's lookupd example, run as printed: nsqlookupd, three nodes registering with it and nsqadmin
over it; then the page's tools against it (nsq_tail shows what a node is given, nsq_stat prints its table).

nsq's own programs where they are (POLYMQ_NSQ_BIN, tests/support/nsq_cluster.py), else their fakes (CI has no
Go): the block finds them on PATH, as a reader's shell does. Fixed ports (nsqlookupd's 4160 and 4161,
nsqadmin's 4171), so in a network namespace of its own (tests/support/namespace.py)."""

from __future__ import annotations

import os
import re
import shlex
import sys
from pathlib import Path

from support.namespace import Namespace, namespace
from support.nsq_cluster import FAKES_DIR, NSQ_BIN, NSQ_FAKES, nsq_tool, wait_until

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "cluster.md"
BLOCK = re.compile(r"^```sh\n(.*?)^```$", re.MULTILINE | re.DOTALL)
LOOKUPD_BLOCK_START = "nsqlookupd --broadcast-address=127.0.0.1 &"
TOOLS_BLOCK_START = "nsq_tail --lookupd-http-address=127.0.0.1:4161 --topic=orders"
# Each node's line once its lookupd answered its IDENTIFY (docs/cluster.md says so).
REGISTERED = "lookupd 127.0.0.1:4160: connected (lookupd 1.3.0 at 127.0.0.1), registering 0 topics and channels"


def page_block(start: str) -> str:
    return next(block for block in BLOCK.findall(PAGE.read_text()) if block.startswith(start))


def programs(folder: Path) -> str:
    """A folder for PATH with nsqlookupd, nsqadmin, nsq_tail and nsq_stat: nsq's own where they are (and
    POLYMQ_NSQ_FAKES is not set), else scripts that run their fakes."""
    folder.mkdir()
    real_lookupd = NSQ_BIN / "nsqlookupd"
    for name in ("nsqlookupd", "nsqadmin", "nsq_tail", "nsq_stat"):
        if name == "nsqlookupd":
            fake = NSQ_FAKES or not os.access(real_lookupd, os.X_OK)
            argv = [sys.executable, str(FAKES_DIR / "fake_lookupd.py")] if fake else [str(real_lookupd)]
        else:
            argv = list(nsq_tool(name).argv)
        script = folder / name
        script.write_text(f"#!/bin/sh\nexec {shlex.join(argv)} \"$@\"\n")
        script.chmod(0o755)
    return str(folder)


def wait_for(space: Namespace, command: str, wanted: str, count: int = 1) -> str:
    """Run `command` in the namespace until its output holds `wanted` `count` times; that output."""

    def seen() -> str | None:
        out = space._run(command).stdout
        return out if out.count(wanted) >= count else None

    return wait_until(seen, f"{wanted!r} {count} times in what `{command}` prints")


def test_the_lookupd_example_and_its_tools_run_as_printed() -> None:
    lookupd_block, tools_block = page_block(LOOKUPD_BLOCK_START), page_block(TOOLS_BLOCK_START)
    with namespace() as space:
        path = programs(space.folder / "nsq-bin")
        # The block starts its programs in the background; their output goes to a file, not to the test's pipe.
        space.run(f"export PATH={path}:$PATH\n{{\n{lookupd_block}}} > lookupd-example.log 2>&1\n")
        nodes = wait_for(space, "curl -s 127.0.0.1:4161/nodes", '"broadcast_address":"127.0.0.1"', 3)
        assert nodes.count('"version":"1.3.0"') == 3, nodes
        wait_for(space, "cat lookupd-example.log", REGISTERED, 3)
        wait_for(space, "curl -s 127.0.0.1:4171/api/nodes", '"broadcast_address":"127.0.0.1"', 3)
        # A topic published to through one node: the tools find it through the lookupd.
        http = re.findall(r"listening nsq-http (127\.0\.0\.1:\d+)", (space.folder / "lookupd-example.log").read_text())
        assert len(http) == 3, http
        space.run(f"curl -sf -X POST 'http://{http[0]}/topic/create?topic=orders' && "
                  f"curl -sf -X POST 'http://{http[0]}/channel/create?topic=orders&channel=billing'")
        wait_for(space, "curl -s '127.0.0.1:4161/lookup?topic=orders'", '"tcp_port"')
        tail, stat = tools_block.strip().splitlines()
        space.run(f"export PATH={path}:$PATH\n{{ {tail}; }} > tail.log 2>&1 &\n{{ {stat}; }} > stat.log 2>&1 &\n")
        wait_for(space, f"curl -s 'http://{http[0]}/stats?format=json&topic=orders'", "#ephemeral")
        space.run(f"curl -sf -d 'hello from the docs' 'http://{http[0]}/pub?topic=orders'")
        wait_for(space, "cat tail.log", "hello from the docs\n")
        wait_for(space, "cat stat.log", "depth")
