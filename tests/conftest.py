from __future__ import annotations

from collections.abc import Iterator

import pytest
import zmq

from support.gateway import GatewayProcess, running_gateway
from support.nats_cluster import nats_cluster, nats_server  # noqa: F401  (real nats-server fixtures)


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
