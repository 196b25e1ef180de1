"""The cross-protocol matrix across two nodes sharing their queues in a real three-server JetStream
cluster: every publisher on one gateway, every consumer on the other, each cell checked as
`test_matrix.py` checks it (bodies, ids, attempts, TTLs, headers), with the bodies every pair carries
but the 1 MiB one (NATS servers take 1 MiB messages by default, headers included: docs/cluster.md)."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import zmq
from test_matrix import ENDPOINTS, LARGE, NO_CONSUMER, bodies_of, check_delivery, engine_id

from support.gateway import GatewayProcess, running_gateway
from support.matrix_endpoints import PHPMQ_TTL_S, Cell, endpoints, state_of, wait_until
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
    bodies = [body for name, body in bodies_of(cell).items() if name != LARGE]
    with endpoints(consuming, cell, context, publisher_gateway=publishing) as (publisher, consumer):
        started, started_ns = time.monotonic(), time.time_ns()
        sent = publisher.publish(bodies)
        received = consumer.receive(len(sent))
        published_ns = (started_ns, time.time_ns())
        ttl_bound = PHPMQ_TTL_S - int(time.monotonic() - started) - 1
        assert len(received) == len(bodies)
        for one, got in zip(sent, received, strict=True):
            check_delivery(cell, one, got, ttl_bound, published_ns)
        ids = [engine_id(cell, got.shown_id, one) for one, got in zip(sent, received, strict=True)]
        shown = [found for found in ids if found is not None]
        assert shown == sorted(set(shown)), "the engine's ids: one per message, increasing in publish order"

        def drained() -> bool:
            state = state_of(consuming, "queues", consumer.queue)
            return state is not None and state["depth"] == 0 and state["in_flight"] == 0

        wait_until(drained, f"queue {consumer.queue} empty, nothing in flight (no copy left over)")

