"""Interop: the real EventMQ 0.3.13 (PyPI) against the gateway's eMQP broker.

The unchanged `emq-jobmanager` runs jobs of tests/interop/eventmq/jobs.py in its worker processes;
requests come from EventMQ's own client library (tests/interop/eventmq/client_driver.py), both in
the `.interop/eventmq` environment that setup_envs.sh builds. Every job writes one line when it
runs, so the tests count exactly how often each job ran and on which jobmanager.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

from polymq.codecs import emqp

from support.emqp_wire import admin_json
from support.gateway import GatewayProcess, running_gateway

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
INTEROP_DIR = Path(os.environ.get("INTEROP_DIR", ROOT / ".interop"))
ENV_BIN = INTEROP_DIR / "eventmq" / "bin"
JOBS_DIR = HERE / "eventmq"
# Each jobmanager's worker processes (its CONCURRENT_JOBS); the gateway is told the same count.
PROCESSES = 2
WORKER_PROCESSES = ("--emqp-worker-processes", str(PROCESSES))


@pytest.fixture(scope="module")
def eventmq_env() -> Path:
    done = subprocess.run(["bash", str(HERE / "setup_envs.sh"), "eventmq"], capture_output=True, text=True,
                          timeout=900, env={**os.environ, "INTEROP_DIR": str(INTEROP_DIR)})
    if done.returncode != 0:
        pytest.fail(f"tests/interop/setup_envs.sh eventmq failed:\n{done.stdout}\n{done.stderr}")
    return ENV_BIN


class JobManager:
    """`emq-jobmanager` in its own session (its worker processes with it), stopped by its PID."""

    def __init__(self, name: str, backend: str, queues: list[tuple[int, str]], jobs: int, job_log: Path,
                 tmp_path: Path) -> None:
        self.name = name
        env = {**os.environ, "EVENTMQ_QUEUES": json.dumps([[weight, queue] for weight, queue in queues]),
               "EVENTMQ_WORKER_ADDR": f"tcp://{backend}", "EVENTMQ_CONCURRENT_JOBS": str(jobs),
               "EVENTMQ_CONFIG_FILE": str(tmp_path / "no-eventmq.conf"), "EMQP_JOB_LOG": str(job_log),
               "EMQP_WORKER_NAME": name, "PYTHONPATH": str(JOBS_DIR)}
        self.output = tmp_path / f"jobmanager-{name}.log"
        self.process = subprocess.Popen([str(ENV_BIN / "python"), str(ENV_BIN / "emq-jobmanager")], env=env,
                                        stdout=self.output.open("w"), stderr=subprocess.STDOUT,
                                        start_new_session=True)

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)  # its KBYE, then it drains and exits
            try:
                self.process.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(5)


@pytest.fixture
def jobmanagers() -> Iterator[list[JobManager]]:
    started: list[JobManager] = []
    yield started
    for manager in started:
        manager.stop()


def wait_until(check: Any, what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout} s: {what}")
        time.sleep(0.05)


def free_slots(context: zmq.Context, gateway: GatewayProcess, queue: str) -> list[tuple[int, int]]:
    """(weight, free slots) of each worker of `queue`, the heaviest first."""
    shown = admin_json(context, gateway.addresses["emqp-admin"], emqp.ROUTER_SHOW_WORKERS)
    workers: dict[str, Any] = shown["connected_workers"]  # type: ignore[assignment]
    queues: dict[str, Any] = shown["connected_queues"]  # type: ignore[assignment]
    return [(weight, workers[identity]["available_slots"]) for weight, identity in queues.get(queue, [])]


def runs(job_log: Path) -> list[dict[str, Any]]:
    if not job_log.exists():
        return []
    return [json.loads(line) for line in job_log.read_text().splitlines() if line.strip()]


def send_requests(gateway: GatewayProcess, requests: list[dict[str, Any]],
                  schedules: list[dict[str, Any]] | None = None, read_replies_s: float = 1.0) -> dict[str, list[str]]:
    spec = {"requests": requests, "schedules": schedules or [], "read_replies_s": read_replies_s}
    done = subprocess.run([str(ENV_BIN / "python"), str(JOBS_DIR / "client_driver.py"),
                           gateway.addresses["emqp-frontend"], json.dumps(spec)],
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@pytest.mark.interop
def test_real_client_requests_run_exactly_once_on_real_jobmanagers(
        eventmq_env: Path, tmp_path: Path, context: zmq.Context, jobmanagers: list[JobManager]) -> None:
    job_log = tmp_path / "runs.jsonl"
    with running_gateway(*WORKER_PROCESSES, data_dir=tmp_path / "data") as gateway:
        for name in ("a", "b"):
            jobmanagers.append(JobManager(name, gateway.addresses["emqp-backend"], [(10, "jobs")], PROCESSES,
                                          job_log, tmp_path))
        wait_until(lambda: free_slots(context, gateway, "jobs") == [(10, 2), (10, 2)], "both jobmanagers ready")
        requests = [{"tag": f"job{index}", "queue": "jobs", "reply": index % 2 == 0} for index in range(30)]
        answer = send_requests(gateway, requests)
        wait_until(lambda: len(runs(job_log)) >= 30, "30 jobs run")
        # Every READY (and REPLY) back: nothing held, nothing waiting, every slot free again.
        wait_until(lambda: admin_json(context, gateway.addresses["emqp-admin"], emqp.STATUS)[
            "inflight_messages_by_queue"] == {} and free_slots(context, gateway, "jobs") == [(10, 2), (10, 2)],
            "all jobs ended")
        status = admin_json(context, gateway.addresses["emqp-admin"], emqp.STATUS)
        time.sleep(0.5)  # a job run twice would show now
    ran = runs(job_log)
    assert sorted(run["tag"] for run in ran) == sorted(f"job{index}" for index in range(30))
    assert set(Counter(run["worker"] for run in ran)) == {"a", "b"}  # equal weights take turns
    assert status["polymq"]["handed_out_by_queue"] == {"jobs": 30}  # every job handed out once
    # As the original, STATUS counts as processed the requests handed over as they arrived, each of
    # which said "dispatched" (the client reads those REPLYs for a while only: some may come later).
    assert len(set(answer["dispatched"])) <= status["processed_messages_by_queue"]["jobs"] <= 30
    assert status["waiting_messages_by_queue"] == {}
    assert len(set(answer["sent"])) == 30
    # Four free slots: at least the first four were handed over at once and said "dispatched";
    # a REPLY names only requests that were sent.
    assert set(answer["sent"][:4]) <= set(answer["dispatched"]) <= set(answer["sent"])


@pytest.mark.interop
def test_the_heavier_jobmanager_is_served_first(eventmq_env: Path, tmp_path: Path, context: zmq.Context,
                                                jobmanagers: list[JobManager]) -> None:
    job_log = tmp_path / "runs.jsonl"
    with running_gateway(*WORKER_PROCESSES, data_dir=tmp_path / "data") as gateway:
        backend = gateway.addresses["emqp-backend"]
        jobmanagers.append(JobManager("heavy", backend, [(20, "w")], PROCESSES, job_log, tmp_path))
        jobmanagers.append(JobManager("light", backend, [(5, "w")], PROCESSES, job_log, tmp_path))
        wait_until(lambda: free_slots(context, gateway, "w") == [(20, 2), (5, 2)], "both jobmanagers ready")
        send_requests(gateway, [{"tag": f"first{index}", "queue": "w", "seconds": 0.3} for index in range(2)])
        wait_until(lambda: len(runs(job_log)) >= 2, "two jobs run")
        wait_until(lambda: free_slots(context, gateway, "w") == [(20, 2), (5, 2)], "slots back")
        # Jobs long enough that all three requests arrive while the heavier one's two still run.
        send_requests(gateway, [{"tag": f"second{index}", "queue": "w", "seconds": 2.0} for index in range(3)])
        wait_until(lambda: len(runs(job_log)) >= 5, "five jobs run")
        time.sleep(0.5)
    by_tag = {run["tag"]: run["worker"] for run in runs(job_log)}
    assert len(runs(job_log)) == 5
    assert by_tag["first0"] == by_tag["first1"] == "heavy"
    assert Counter(by_tag[f"second{index}"] for index in range(3)) == {"heavy": 2, "light": 1}


@pytest.mark.interop
def test_jobs_a_killed_jobmanager_took_at_start_up_all_run_on_another(
        eventmq_env: Path, tmp_path: Path, context: zmq.Context, jobmanagers: list[JobManager]) -> None:
    job_log = tmp_path / "runs.jsonl"
    started_log = Path(f"{job_log}.started")
    gate = tmp_path / "gate"  # the jobs run until it exists
    tags = [f"held{index}" for index in range(PROCESSES)]
    with running_gateway(*WORKER_PROCESSES, "--emqp-heartbeat-timeout", "1000",
                         data_dir=tmp_path / "data") as gateway:
        # The requests wait, so the jobmanager's start-up READYs are what pull them.
        send_requests(gateway, [{"tag": tag, "queue": "held", "gate": str(gate)} for tag in tags], read_replies_s=0)
        doomed = JobManager("doomed", gateway.addresses["emqp-backend"], [(10, "held")], PROCESSES, job_log,
                            tmp_path)
        jobmanagers.append(doomed)
        wait_until(lambda: started_log.exists() and len(started_log.read_text().splitlines()) == PROCESSES,
                   "both jobs running on the doomed jobmanager")
        os.killpg(doomed.process.pid, signal.SIGKILL)  # no KBYE: it falls silent
        doomed.process.wait(5)
        gate.touch()
        jobmanagers.append(JobManager("rescuer", gateway.addresses["emqp-backend"], [(10, "held")], PROCESSES,
                                      job_log, tmp_path))
        wait_until(lambda: len(runs(job_log)) >= PROCESSES, "the jobs run again")
        wait_until(lambda: admin_json(context, gateway.addresses["emqp-admin"], emqp.STATUS)[
            "inflight_messages_by_queue"] == {}, "every job ended")
        redelivered = admin_json(context, gateway.addresses["emqp-admin"], emqp.STATUS)["polymq"]["redelivered"]
    assert sorted((run["tag"], run["worker"]) for run in runs(job_log)) == [(tag, "rescuer") for tag in tags]
    assert redelivered == PROCESSES


@pytest.mark.interop
def test_scheduled_jobs_run_as_often_as_asked_and_stop_when_unscheduled(
        eventmq_env: Path, tmp_path: Path, context: zmq.Context, jobmanagers: list[JobManager]) -> None:
    job_log = tmp_path / "runs.jsonl"
    with running_gateway(*WORKER_PROCESSES, data_dir=tmp_path / "data") as gateway:
        jobmanagers.append(JobManager("s", gateway.addresses["emqp-backend"], [(10, "sched")], PROCESSES, job_log,
                                      tmp_path))
        wait_until(lambda: free_slots(context, gateway, "sched") == [(10, 2)], "the jobmanager ready")
        send_requests(gateway, [], [{"tag": "thrice", "queue": "sched", "interval": 1, "headers": ["run_count:3"]},
                                    {"tag": "until", "queue": "sched", "interval": 1}], read_replies_s=0)
        wait_until(lambda: Counter(run["tag"] for run in runs(job_log))["until"] >= 2, "two runs of 'until'")
        send_requests(gateway, [], [{"tag": "until", "queue": "sched", "interval": 1, "unschedule": True}],
                      read_replies_s=0)
        wait_until(lambda: admin_json(context, gateway.addresses["emqp-admin"], emqp.STATUS)["polymq"][
            "schedules"] == {}, "both schedules done")
        wait_until(lambda: admin_json(context, gateway.addresses["emqp-admin"], emqp.STATUS)[
            "inflight_messages_by_queue"] == {}, "the last firings run")
        stopped_at = Counter(run["tag"] for run in runs(job_log))["until"]
        time.sleep(2.2)  # two more intervals: neither schedule may fire again
    counts = Counter(run["tag"] for run in runs(job_log))
    assert counts["thrice"] == 3  # the first at once, then one a second, then done
    assert counts["until"] == stopped_at >= 2


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
