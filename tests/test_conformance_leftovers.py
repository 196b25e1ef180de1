"""Each conformance suite leaves nothing behind in the server it checked: no topic or queue of
its own, no message or job held (seen through the gateway's own `/api/state`)."""

from __future__ import annotations

import json
import time
import urllib.request
from pathlib import Path
from typing import Any

import click
import pytest
from click.testing import CliRunner

from polymq.conformance import emqp, mqks, nsq, phpmq, pzq

from support.gateway import GatewayProcess, running_gateway

# The forget-empty delays are shortened so the wait below is for the gateway's timers, not a minute.
GATEWAY_ARGS = ("--emqp-heartbeat-interval", "300", "--pzq-ack-timeout", "500",
                "--phpmq-forget-empty", "0.5", "--emqp-forget-empty", "0.5")
WAIT_S = 20.0


def suite_args(name: str, gateway: GatewayProcess) -> list[str]:
    a = gateway.addresses
    return {
        "nsq": ["--tcp", a["nsq-tcp"], "--http", a["nsq-http"]],
        "mqks": ["--addr", a["mqks"]],
        "phpmq": ["--addr", a["phpmq"]],
        "pzq": ["--receive", a["pzq-receive"], "--send", a["pzq-send"], "--monitor", a["pzq-monitor"],
                "--ack-timeout", "0.5"],
        "emqp": ["--frontend", a["emqp-frontend"], "--backend", a["emqp-backend"], "--admin", a["emqp-admin"],
                 "--pubsub-in", a["emqp-pubsub-in"], "--pubsub-out", a["emqp-pubsub-out"],
                 "--heartbeat-interval", "0.3"],
    }[name]


COMMANDS: dict[str, click.Command] = {"nsq": nsq.command, "mqks": mqks.command, "phpmq": phpmq.command,
                                      "pzq": pzq.command, "emqp": emqp.command}


def state(gateway: GatewayProcess) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://{gateway.http}/api/state", timeout=5) as response:
        return json.loads(response.read())  # type: ignore[no-any-return]


def leftovers(snapshot: dict[str, Any]) -> list[str]:
    """What a suite should not have left: its own topics and queues, and anything held anywhere."""
    found = []
    for topic in snapshot["topics"]:
        if "conformance" in topic["name"] or topic["depth"]:
            found.append(f"topic {topic['name']} depth {topic['depth']}")
    for queue in snapshot["queues"]:
        if "conformance" in queue["name"] or queue["depth"] or queue["in_flight"]:
            found.append(f"queue {queue['name']} depth {queue['depth']} in flight {queue['in_flight']}")
    return found


@pytest.mark.parametrize("name", list(COMMANDS))
def test_a_suite_leaves_no_topic_queue_or_job_behind(name: str, tmp_path: Path) -> None:
    with running_gateway(*GATEWAY_ARGS, data_dir=tmp_path) as gateway:
        result = CliRunner().invoke(COMMANDS[name], suite_args(name, gateway), catch_exceptions=False)
        assert result.output.splitlines()[-1].endswith(" 0 failed"), result.output
        deadline = time.monotonic() + WAIT_S
        left = leftovers(state(gateway))
        while left and time.monotonic() < deadline:
            time.sleep(0.1)
            left = leftovers(state(gateway))
        assert left == []
