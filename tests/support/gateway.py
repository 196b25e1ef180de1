"""Start a real `polymq serve` process for a test and stop it by its PID (the process itself is
`polymq.torture.gateway`'s, which `polymq torture` shares).
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from polymq.torture.gateway import (  # noqa: F401  (the tests import them from here)
    READY_TIMEOUT_S,
    GatewayDidNotStart,
    GatewayProcess,
    read_announcements,
    start_gateway,
)


@contextmanager
def running_gateway(*extra_args: str, data_dir: Path | None = None,
                    prefix: tuple[str, ...] = ()) -> Iterator[GatewayProcess]:
    """Run `python -m polymq serve` on loopback with OS-chosen ports until the block ends.

    Without `data_dir` the gateway stores in a fresh temporary folder, removed afterwards. `prefix`
    is a command the gateway's command line is given to, which must exec it (the PID stays the
    gateway's): a private mount namespace, say.
    """
    own_dir = None
    if data_dir is None:
        own_dir = data_dir = Path(tempfile.mkdtemp(prefix="polymq-test-"))
    try:
        try:
            gateway = start_gateway(data_dir, extra_args, prefix)
        except GatewayDidNotStart as error:
            raise RuntimeError(str(error)) from None
        try:
            yield gateway
        finally:
            gateway.stop()
    finally:
        if own_dir is not None:
            shutil.rmtree(own_dir, ignore_errors=True)
