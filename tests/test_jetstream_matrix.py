"""The cross-protocol matrix across two nodes sharing their queues in a real three-server JetStream
cluster: every publisher on one gateway, every consumer on the other, each cell checked as
`test_matrix.py` checks it (bodies, ids, attempts, TTLs, headers, the 1 MiB body: the test servers take
8 MB messages, as docs/cluster.md sets them up)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import zmq
from test_matrix import ENDPOINTS, NO_CONSUMER, bodies_of, run_cell

from support.gateway import GatewayProcess, running_gateway
from support.matrix_endpoints import Cell
from support.nats_cluster import NatsCluster

# A stream is a queue read by position, which the shared engine does not keep (docs/cluster.md).
SHARED = [name for name in ENDPOINTS if name != "stream"]
CELLS = [Cell(publisher, consumer) for publisher in SHARED for consumer in SHARED if consumer not in NO_CONSUMER]
GATEWAY_ARGS = ("--phpmq-generation", "current", "--emqp-heartbeat-timeout", "600000")


@pytest.fixture(scope="module")
def nodes(nats_cluster: NatsCluster) -> Iterator[tuple[GatewayProcess, GatewayProcess]]:
    servers = ",".join(nats_cluster.urls)
    with running_gateway("--jetstream", servers, *GATEWAY_ARGS) as publishing, \
            running_gateway("--jetstream", servers, *GATEWAY_ARGS) as consuming:
        yield publishing, consuming


@pytest.mark.parametrize("cell", CELLS, ids=lambda c: c.name)
def test_cell_across_nodes(cell: Cell, nodes: tuple[GatewayProcess, GatewayProcess], context: zmq.Context) -> None:
    publishing, consuming = nodes
    run_cell(cell, list(bodies_of(cell).values()), consuming, context, publisher_gateway=publishing)
