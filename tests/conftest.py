from __future__ import annotations

from collections.abc import Iterator

import pytest
import zmq

from support.gateway import GatewayProcess, running_gateway
from support.nats_cluster import nats_cluster, nats_server  # noqa: F401  (real nats-server fixtures)
from support.nsq_cluster import lookupd  # noqa: F401  (the suite's lookupd and nsqlookupd)


@pytest.fixture(scope="session", autouse=True)
def own_run_files(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """The run files of the gateways the tests start (gateway/run_file.py) in a folder of the run's
    own, not the user's: a start-up failure a test causes on the default ports is no one's `wait`'s."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("XDG_RUNTIME_DIR", str(tmp_path_factory.mktemp("run")))
        yield


@pytest.fixture
def gateway() -> Iterator[GatewayProcess]:
    """A fresh `polymq serve` process (its own temporary data dir, loopback, OS-chosen ports)."""
    with running_gateway() as process:
        yield process


@pytest.fixture(scope="module")
def module_gateway() -> Iterator[GatewayProcess]:
    """One gateway shared by the tests of a module (use distinct topic names per test)."""
    with running_gateway() as process:
        yield process


@pytest.fixture
def context() -> Iterator[zmq.Context]:
    """A pyzmq context for the test's ZeroMQ peers (PZQ, eMQP), terminated after the test."""
    context = zmq.Context()
    yield context
    context.term()
