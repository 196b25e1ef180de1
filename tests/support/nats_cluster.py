"""Real nats-server processes for the NATS and JetStream tests (`polymq.clients.nats_servers`), as fixtures:
`nats_server` (one server with JetStream, per test) and `nats_cluster` (three clustered servers with
JetStream, per module). Without the program the tests fail, saying so: CI installs it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from polymq.clients.nats_servers import (  # noqa: F401  (the tests import them from here)
    MAX_PAYLOAD,
    NatsCluster,
    NatsServer,
    NatsServerError,
    nats_server_program,
)


@pytest.fixture
def nats_server(tmp_path: Path) -> Iterator[NatsServer]:
    """One standalone nats-server with JetStream, for one test."""
    with NatsCluster(tmp_path / "nats", size=1) as cluster:
        yield cluster.servers[0]


@pytest.fixture(scope="module")
def nats_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsCluster]:
    """Three clustered nats-servers with JetStream, shared by a module's tests (a test that stops one
    starts it again)."""
    with NatsCluster(tmp_path_factory.mktemp("nats-cluster"), size=3) as cluster:
        yield cluster
