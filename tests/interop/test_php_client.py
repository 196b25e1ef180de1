"""Interop: a real PHP process (Debian's php-cli) speaking PHPMQ over plain PHP streams to a gateway.

tests/interop/phpmq/PhpmqClient.php is a PHP client of both protocol generations; scenario.php
drives it: a window over three messages with an ack from a second connection, a disconnect with
unacknowledged messages, and, in the current generation, a TTL that runs out, a requeue with a new
TTL and a dead letter read from `<queue>.dead`. What the PHP side saw is asserted exactly.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import uuid
from pathlib import Path

from support.gateway import running_gateway

SCENARIO = Path(__file__).resolve().parent / "phpmq" / "scenario.php"


def php() -> str:
    found = shutil.which("php")
    # `make test` installs Debian's php-cli when it is missing (`make system-tools`).
    assert found is not None, "php is not installed: `apt-get install php-cli` (make system-tools does)"
    return found


def test_php_clients_of_both_generations_against_the_gateway(tmp_path: Path) -> None:
    prefix = f"php-{uuid.uuid4().hex[:8]}"
    with running_gateway(data_dir=tmp_path) as gateway:
        host, port = gateway.host_port("phpmq")
        done = subprocess.run([php(), str(SCENARIO), host, str(port), prefix, gateway.nsq_http],
                              capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr + done.stdout
    seen = json.loads(done.stdout)
    assert seen == {
        "window": [["m1", None], ["m2", None]],
        "after_ack_from_another_connection": ["m3", None],
        "ids_are_32_hex": True,
        "after_disconnect": [["u1", None], ["u2", None], ["u3", None]],
        "same_ids_after_disconnect": [True, True],
        "ttl_left_after_the_short_one_expired": ["long", True],
        "behind_the_requeued_one": ["none", 0],
        "requeued": [["long", 900], True],
        "dead_letter": [f"{prefix}-ttl.dead", ["long", None], True],
    }
