"""A jobmanager's start-up READYs end none of its jobs (found by `polymq torture`).

A jobmanager sends one READY per worker process when it starts and one after each job, without
saying which job. When the gateway ended the oldest job the worker held at every READY, a
jobmanager with several processes joining while requests waited had its second start-up READY end
the job its first one brought, and so on: if it then went, only its last job was handed back, and
the others, confirmed to their clients as dispatched, were never run. A worker's first
`--emqp-worker-processes` READYs now end no job (docs/protocols/emqp.md, "Jobs end").
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from polymq.codecs import emqp

from support.emqp_wire import Client, Worker
from support.gateway import GatewayProcess, running_gateway

QUEUE = "email"
SLOTS = 3


@pytest.fixture
def gateway(tmp_path: Path) -> Iterator[GatewayProcess]:
    with running_gateway(data_dir=tmp_path) as process:
        yield process


def test_jobs_of_a_jobmanager_that_goes_before_finishing_any_all_come_back(
        gateway: GatewayProcess, context: zmq.Context) -> None:
    payloads = [b"job-%d" % number for number in range(SLOTS)]
    with Client(context, gateway.addresses["emqp-frontend"]) as client:
        for payload in payloads:
            client.request(QUEUE, payload)
        with Worker(context, gateway.addresses["emqp-backend"]) as first:
            first.inform([(10, QUEUE)])
            first.ready(SLOTS)  # its worker processes start: one READY each
            assert [first.job()[6] for _ in range(SLOTS)] == payloads
            first.send(emqp.KBYE)  # it goes before any job is done: all three are handed back
        with Worker(context, gateway.addresses["emqp-backend"]) as second:
            second.inform([(10, QUEUE)])
            second.ready(SLOTS)
            got = [frames[6] for _ in range(SLOTS) if (frames := second.next_message(5.0)) is not None]
            assert got == payloads


def test_readies_past_the_processes_end_jobs_and_only_those_left_come_back(
        tmp_path: Path, context: zmq.Context) -> None:
    payloads = [b"job-%d" % number for number in range(SLOTS + 1)]
    with running_gateway("--emqp-worker-processes", str(SLOTS), data_dir=tmp_path) as gateway, \
            Client(context, gateway.addresses["emqp-frontend"]) as client:
        for payload in payloads:
            client.request(QUEUE, payload)
        with Worker(context, gateway.addresses["emqp-backend"]) as first:
            first.inform([(10, QUEUE)])
            first.ready(SLOTS)
            assert [first.job()[6] for _ in range(SLOTS)] == payloads[:SLOTS]
            first.ready()  # the first job is done: it ends it and brings the last
            assert first.job()[6] == payloads[SLOTS]
            first.send(emqp.KBYE)
        with Worker(context, gateway.addresses["emqp-backend"]) as second:
            second.inform([(10, QUEUE)])
            second.ready(SLOTS + 1)
            got = [frames[6] for _ in range(SLOTS) if (frames := second.next_message(5.0)) is not None]
            assert got == payloads[1:]
            assert second.nothing_within(150)  # the finished job does not come again
