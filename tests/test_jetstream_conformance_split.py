"""`polymq conformance all` split across two nodes of the real three-server JetStream cluster: the endpoints
that produce on one node (the nsqd HTTP API, PZQ's receive socket, eMQP's frontend and pub/sub input), every
other on the other. Every check passes, or is one docs/cluster.md lists under "Split across two nodes" with
the reason it cannot."""

from __future__ import annotations

import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

from support.gateway import running_gateway
from support.nats_cluster import NatsCluster

ROOT = Path(__file__).resolve().parent.parent
# The section of docs/cluster.md whose table lists the checks a split run cannot pass, one a row: `| suite |
# check | why |`.
SECTION = "#### Split across two nodes"
# The whole run takes about two minutes here; this only turns a hang into a failure.
RUN_TIMEOUT_S = 900


def documented_exceptions() -> dict[tuple[str, str], str]:
    text = (ROOT / "docs" / "cluster.md").read_text()
    section = text[text.index(SECTION):]
    section = section[:section.index("\n#", len(SECTION))] if "\n#" in section[len(SECTION):] else section
    rows = re.findall(r"^\| (\w+) \| `([^`]+)` \| (.+) \|$", section, re.MULTILINE)
    return {(suite, check): why for suite, check, why in rows}


def test_the_split_run_passes_every_check_but_those_listed_with_their_reason(
        nats_cluster: NatsCluster, tmp_path: Path) -> None:
    listed = documented_exceptions()
    assert listed and all(why.strip() for why in listed.values())
    servers = ",".join(nats_cluster.urls)
    with running_gateway("--jetstream", servers) as one, running_gateway("--jetstream", servers) as two:
        a1, a2 = one.addresses, two.addresses
        junit = tmp_path / "split.xml"
        command = [sys.executable, "-m", "polymq", "conformance", "all",
                   "--nsq-http", a1["nsq-http"], "--pzq-receive", a1["pzq-receive"],
                   "--emqp-frontend", a1["emqp-frontend"], "--emqp-pubsub-in", a1["emqp-pubsub-in"],
                   "--nsq-tcp", a2["nsq-tcp"], "--mqks-addr", a2["mqks"], "--phpmq-addr", a2["phpmq"],
                   "--pzq-send", a2["pzq-send"], "--pzq-monitor", a2["pzq-monitor"],
                   "--emqp-backend", a2["emqp-backend"], "--emqp-admin", a2["emqp-admin"],
                   "--emqp-pubsub-out", a2["emqp-pubsub-out"], "--junit", str(junit)]
        result = subprocess.run(command, capture_output=True, text=True, timeout=RUN_TIMEOUT_S, cwd=ROOT)
    cases = ET.parse(junit).getroot().iter("testcase")
    ran = {(case.get("classname", "").split(".")[0], case.get("name", "")): case.find("failure") for case in cases}
    failed = {key: failure.get("message") for key, failure in ran.items() if failure is not None}
    assert len(ran) >= 150, result.stdout[-3000:]
    assert set(listed) <= set(ran), f"listed in docs/cluster.md but no such check: {set(listed) - set(ran)}"
    unexplained = {key: why for key, why in failed.items() if key not in listed}
    assert not unexplained, f"failed and not listed in docs/cluster.md: {unexplained}\n{result.stdout[-3000:]}"
