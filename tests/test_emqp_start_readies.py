"""A jobmanager's start-up READYs end jobs it has not run (found by `polymq torture`).

A jobmanager sends one READY per worker process when it starts and one after each job, without
saying which job; the gateway ends the oldest job the worker holds at every READY
(docs/protocols/emqp.md, "Jobs end"). When requests wait as a jobmanager with several slots joins,
its second start-up READY ends the job its first one brought, and so on: if the jobmanager then
goes, only its last job is handed back, and the others, acknowledged to their clients as
dispatched, are never run.
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


@pytest.mark.xfail(strict=True, reason="a READY cannot say which job it ends: start-up READYs end jobs not run")
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
