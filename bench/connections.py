"""What the connection benches share (`polymq bench nsq`, `mqks`): publishers and consumers on plain
blocking sockets, spread over spawned worker processes (several in one process go through
`common.run_selector`), each with the same life: opened, ready, started together, driven until it
finishes, its counts sent back to the parent.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Iterable
from typing import Any

import attrs
import click

from polymq.bench import common
from polymq.clients import tcp

# Blocking reads give up after this long (`tcp.set_read_timeout`) so idle workers notice stop
# signals and deadlines.
IDLE_POLL_S = 0.2
CONNECT_TIMEOUT_S = 10.0
# The parent stops a scenario whose counters have not moved for this long.
STALL_TIMEOUT_S = 15.0


class ServerError(Exception):
    """The server answered with an error or closed the connection."""


@attrs.frozen(slots=True)
class ConnSpec:
    """One connection of a worker process; each bench adds what its role needs."""

    role: str  # a publisher's (the bench's names) or "sub"
    slot: int  # index into the shared counters


@attrs.frozen(slots=True)
class WorkerPlan:
    """What one worker process is told; each bench adds its protocol's settings."""

    host: str
    port: int
    size: int
    consumer_slots: tuple[int, ...]
    conns: tuple[ConnSpec, ...]


def spread(specs: list[ConnSpec], processes: int) -> list[list[ConnSpec]]:
    """The connections over `processes` workers, in turns (publisher i and consumer i together when
    there are as many publishers as consumers and processes)."""
    groups: list[list[ConnSpec]] = [[] for _ in range(processes)]
    for index, spec in enumerate(specs):
        groups[index % processes].append(spec)
    return groups


class Conn:
    """One connection in a worker process: its slot in the shared counters, its count and its end."""

    sending = False  # wants its socket writable (`common.run_selector`)

    def __init__(self, spec: ConnSpec, shared: common.SharedState) -> None:
        self.spec = spec
        self.shared = shared
        self.slot = spec.slot
        self.sock: socket.socket | None = None
        self.count = 0
        self.last_ns = 0
        self.finished = False

    def finish(self) -> None:
        self.finished = True
        self.shared.counters[self.slot] = self.count
        self.shared.done[self.slot] = 1

    def told_to_stop(self, consumer_slots: Iterable[int]) -> bool:
        """The parent said stop, or the consumers together have the messages they wait for."""
        shared = self.shared
        target = shared.target.value
        return bool(shared.stop.value) or (target >= 0 and sum(shared.counters[s] for s in consumer_slots) >= target)

    def begin(self, start_mono: float) -> None:
        """The run started at `start_mono` (time.monotonic): deadlines and schedules count from it."""

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None

    def on_readable(self) -> None:
        raise NotImplementedError

    def on_writable(self) -> None:
        raise NotImplementedError

    def on_idle(self) -> None:
        """Nothing to read for a while: notice the stop signal and deadlines."""
        raise NotImplementedError

    def result(self) -> dict[str, Any]:
        return {"role": self.spec.role, "slot": self.slot, "messages": self.count, "last_ns": self.last_ns}


def run_worker(shared: common.SharedState, index: int, openers: Iterable[Callable[[], Conn]],
               drive: Callable[[list[Conn], float], None]) -> list[dict[str, Any]]:
    """A worker process's life: open its connections in order, say it is ready, wait for the start,
    `drive(connections, start)` and return their results; whatever happens, they are closed."""
    conns: list[Conn] = []
    try:
        for open_one in openers:
            conns.append(open_one())
        common.ready_and_wait(shared, index)
        if shared.stop.value:
            return []
        # Schedules and deadlines count from the parent's start time, whenever this process woke up.
        drive(conns, time.monotonic() - (time.time_ns() - shared.start_ns.value) / 1e9)
        return [conn.result() for conn in conns]
    finally:
        for conn in conns:
            conn.close()


def read_until_finished(conns: list[Conn]) -> None:
    """One connection reads until it finishes; several share the process through a selector."""
    if len(conns) == 1:
        while not conns[0].finished:
            conns[0].on_readable()
    else:
        common.run_selector(conns, IDLE_POLL_S)


def run_scenario(name: str, group: common.WorkerGroup, tick: Callable[[common.SharedState], None],
                 progress: common.Progress) -> tuple[int, list[dict[str, Any]]]:
    """Run a scenario's workers: the start (wall-clock ns) and every connection's result; a worker that
    failed is one line naming the scenario."""
    try:
        start_ns, results = group.run(tick)
    except common.WorkerFailed as exc:
        raise click.ClickException(f"scenario {name}: {exc}") from None
    finally:
        progress.done()
    return start_ns, [result for worker in results for result in worker]


def stalled_note(name: str) -> str:
    return f"{name}: stopped early, the server made no progress for {STALL_TIMEOUT_S:.0f} s"


def cpu_fields(server_cpu: tuple[float, float, float] | None) -> dict[str, float | None]:
    """The server's CPU shares as the JSON reports name them."""
    return {
        "server_cpu_user": server_cpu and round(server_cpu[0], 3),
        "server_cpu_system": server_cpu and round(server_cpu[1], 3),
        "server_runqueue_wait": server_cpu and round(server_cpu[2], 3),
    }


def address_option(_ctx: click.Context, _param: click.Parameter, value: str | None) -> tuple[str, int] | None:
    """A click callback: `HOST:PORT`, `:PORT` or `[v6]:PORT`."""
    if value is None:
        return None
    try:
        return tcp.split_address(value, "127.0.0.1")
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None
