"""`polymq serve`: run the gateway in one trio run, the guest of the epoll loop that serves the TCP
sessions' sockets (`--loop epoll`, the default: adapters/host_loop.py) or on trio's own loop.

Start-up is in two steps. `prepare` binds every listener first, then opens the store: a port in
use or an unusable data dir fails before anything is created, as one clear log line naming the
listener and address or the path and the pid holding it (`StartupError`, exit status 1; the
traceback only with `--debug`). `run_gateway` then serves. It logs `listening <name> <host>:<port>`
for each listener and then `ready` (tests and scripts start it with port 0 and read those lines).
SIGTERM and SIGINT stop it cleanly with exit status 0, after a last line saying what was written.
Until it serves it keeps a run file (gateway/run_file.py) with its start-up failure line, which
`polymq wait` prints. See docs/operations.md.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import math
import os
import shutil
import signal
import socket
import sys
from functools import partial
from pathlib import Path
from typing import Any

import attrs
import click
import trio
import zmq

import polymq
from polymq.adapters.host_loop import HostLoop
from polymq.adapters.protocol import Context, Endpoint, GatewayInfo, OutputLimit, Protocol, Service, ServiceError
from polymq.adapters.registry import protocols
from polymq.adapters.zmq_sockets import SocketSpec, ZmqSockets
from polymq.core.clock import SystemClock
from polymq.core.disk_storage import DiskStorage
from polymq.core.engine import Engine
from polymq.core.storage import DataDirInUse, MemoryStorage
from polymq.gateway import jetstream_engine, logs
from polymq.gateway.admin_access import AccessError, AdminAccess
from polymq.gateway.admin_api import AdminApi
from polymq.gateway.cluster_trace import ClusterTrace
from polymq.gateway.collector import collect_on_a_clock
from polymq.gateway.committer import Committer
from polymq.gateway.config import (
    DATA_DIR_KEY,
    HTTP_LISTENER,
    LOOP_EPOLL,
    OPTIONS_BY_KEY,
    Config,
    click_options,
    from_command_line,
    to_toml,
)
from polymq.gateway.http import serve_gateway_http
from polymq.gateway.metrics import Metrics
from polymq.gateway.port_holder import in_use_hint
from polymq.gateway.run_file import RunFile
from polymq.gateway.tracing import TraceCollector, make_tracer
from polymq.jetstream.backend import JetStreamLink
from polymq.native import zmq_loops

log = logging.getLogger("polymq")

# The listen backlog; the original MQKS used 256, nsqd the OS default.
LISTEN_BACKLOG = 1024
# What the store does in its data dir: lists, creates and removes files in every folder; reads,
# appends to and cuts back every file.
FOLDER_ACCESS = os.R_OK | os.W_OK | os.X_OK
FILE_ACCESS = os.R_OK | os.W_OK


class StartupError(Exception):
    """A start-up failure a user can fix: the message names the thing and what to do."""


@attrs.define
class Prepared:
    """What start-up made before serving: bound listeners, the opened store."""

    config: Config
    bound: list[Bound]  # every enabled protocol's endpoints, bound
    http: socket.socket | None  # the gateway's own HTTP listener
    storage: DiskStorage | MemoryStorage
    committer: Committer | None
    access: AdminAccess  # who may use the admin API (checked before anything is bound)
    run_file: RunFile = attrs.Factory(lambda: RunFile(None))  # told once the gateway serves

    def close(self) -> None:
        for bound in self.bound:
            bound.close()
        if self.http is not None:
            self.http.close()
        if isinstance(self.storage, DiskStorage):
            self.storage.close()


@attrs.define
class Bound:
    """A protocol's endpoints, bound before the store opens, and what its check returned."""

    protocol: Protocol
    options: Any
    checked: Any
    listeners: dict[str, socket.socket] = attrs.Factory(dict)
    zmq: ZmqSockets | None = None

    def close(self) -> None:
        for sock in self.listeners.values():
            sock.close()
        if self.zmq is not None:
            self.zmq.close()


class TimerTask:
    """Services the engine's timer heap: sleeps until the next deadline or a new, earlier one."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._wake = trio.Event()
        engine.timers.on_new_earliest = self._on_new_earliest

    def _on_new_earliest(self) -> None:
        self._wake.set()

    async def run(self) -> None:
        engine = self.engine
        while True:
            due = engine.timers.next_due()
            delay = math.inf if due is None else max(0.0, due - engine.clock.now())
            if delay > 0:
                with trio.move_on_after(delay):
                    await self._wake.wait()
            else:
                await trio.lowlevel.checkpoint()  # a timer due at once (a backlog pump) must not starve the loop
            self._wake = trio.Event()
            engine.run_timers()


def _why(error: OSError) -> str:
    return (error.strerror or str(error)).lower()


def listening_socket(name: str, host: str, port: int, flag: str) -> socket.socket:
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
    except OSError as error:
        raise StartupError(f"cannot listen for {name} on {address}: {_why(error)}") from error
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(LISTEN_BACKLOG)
    except (OSError, OverflowError) as error:
        sock.close()
        if isinstance(error, OSError) and error.errno == errno.EADDRINUSE:
            hint = in_use_hint(port, flag, name)
        elif isinstance(error, OSError) and error.errno == errno.EACCES:
            hint = f"ports below 1024 need privileges: choose another with {flag}"
        elif isinstance(error, socket.gaierror | OSError) and error.errno in (
                errno.EADDRNOTAVAIL, socket.EAI_NONAME, socket.EAI_AGAIN):
            hint = "is --bind an address of this machine?"
        else:
            hint = f"check --bind and {flag}"
        why = _why(error) if isinstance(error, OSError) else str(error)
        raise StartupError(f"cannot listen for {name} on {address}: {why}; {hint}") from error
    return sock


def _missing_ancestor(path: Path) -> Path | None:
    """The outermost folder of `path` that does not exist yet (what opening the store would create)."""
    missing = None
    for candidate in (path, *path.parents):
        if candidate.exists():
            break
        missing = candidate
    return missing


def _refuse_what_cannot_be_written(data_dir: Path) -> None:
    """Raises PermissionError naming the first folder or file of an existing data dir this process
    may not read and write: the store appends to, cuts back and removes every file of it, and adds
    and removes files in every folder (one left by another user, root say, would otherwise fail
    later, in the sync thread)."""
    if not data_dir.is_dir():
        return  # DiskStorage creates it, or says why not
    effective = os.access in os.supports_effective_ids  # root without CAP_DAC_OVERRIDE: its own rights
    for folder, _, files in os.walk(data_dir, onerror=_raise):
        for path, needed in ((folder, FOLDER_ACCESS), *((os.path.join(folder, name), FILE_ACCESS) for name in files)):
            if not os.access(path, needed, effective_ids=effective):
                raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), path)


def _raise(error: OSError) -> None:
    raise error


def open_storage(config: Config) -> tuple[DiskStorage | MemoryStorage, Committer | None]:
    clock = SystemClock()
    if jetstream_engine.server_urls(config.jetstream):
        if config.storage.in_memory:
            raise StartupError("--in-memory and --jetstream contradict each other: the JetStream cluster keeps "
                               "every message; give one of them")
        return MemoryStorage(), None  # unused: the engine stores through the cluster
    if config.storage.in_memory:
        if DATA_DIR_KEY in config.given:
            raise StartupError("--in-memory and --data-dir contradict each other: --in-memory keeps nothing on "
                               "disk; give one of them")
        return MemoryStorage(), None
    data_dir = config.storage.data_dir.absolute()
    created: Path | None = None
    try:
        created = _missing_ancestor(data_dir)  # a folder above it this user may not search raises here
        _refuse_what_cannot_be_written(data_dir)
        storage = DiskStorage(data_dir, clock, policy=config.storage.fsync,
                              mem_queue_size=config.storage.mem_queue_size)
    except DataDirInUse as error:
        holder = f"pid {error.pid}" if error.pid else "another process"
        raise StartupError(f"data dir {data_dir} is in use by another polymq process ({holder}); stop it, "
                           "or give this gateway another --data-dir") from error
    except OSError as error:
        if created is not None:
            shutil.rmtree(created, ignore_errors=True)
        path = error.filename or data_dir
        raise StartupError(f"cannot use data dir {data_dir}: {path}: {_why(error)}; "
                           "choose a writable folder with --data-dir") from error
    return storage, Committer(storage)


def _flag(protocol: Protocol, setting: str) -> str:
    return protocol.setting(setting).flag.split("/")[0]


def bind_protocol(protocol: Protocol, options: Any, config: Config) -> Bound:
    """Checks the protocol's options, then binds its endpoints that are on (a port of -1 is off)."""
    try:
        checked = protocol.check(options) if protocol.check is not None else None
    except ServiceError as error:
        raise StartupError(str(error)) from error
    bound = Bound(protocol, options, checked)
    zmq_specs: dict[str, SocketSpec] = {}
    zmq_endpoints: dict[str, Endpoint] = {}
    try:
        for endpoint in protocol.endpoints:
            port = getattr(options, endpoint.port)
            if port < 0:
                continue
            host = getattr(options, endpoint.host) if endpoint.host is not None else config.bind
            if endpoint.zmq is None:
                bound.listeners[endpoint.name] = listening_socket(endpoint.name, host, port,
                                                                  _flag(protocol, endpoint.port))
            else:
                zmq_specs[endpoint.name] = attrs.evolve(endpoint.zmq(options), port=port, host=host)
                zmq_endpoints[endpoint.name] = endpoint
        if zmq_specs:
            bound.zmq = zmq_sockets(config.bind, zmq_specs, protocol, zmq_endpoints)
    except BaseException:
        bound.close()
        raise
    return bound


def prepare(config: Config) -> Prepared:
    """Binds every listener, then opens the store; on failure closes what it made and raises StartupError."""
    if config.trace.topic in config.trace.topics:
        raise StartupError(f"--trace {config.trace.topic!r} names the trace topic (--trace-topic): its own events "
                           "are never traced")
    access = AdminAccess(None)
    if config.http.port >= 0:
        try:
            access = AdminAccess.configured(config.http.bind, config.http.token, config.http.token_file)
        except AccessError as error:
            raise StartupError(str(error)) from error
    bound: list[Bound] = []
    http: socket.socket | None = None
    try:
        for protocol in protocols():
            options = config.protocol(protocol.name)
            if options.enabled:
                bound.append(bind_protocol(protocol, options, config))
        if config.http.port >= 0:
            http = listening_socket(HTTP_LISTENER, config.http.bind, config.http.port,
                                    OPTIONS_BY_KEY["http.port"].flag)
        storage, committer = open_storage(config)
    except BaseException:
        for made in bound:
            made.close()
        if http is not None:
            http.close()
        raise
    return Prepared(config, bound, http, storage, committer, access)


def zmq_sockets(host: str, specs: dict[str, SocketSpec], protocol: Protocol,
                endpoints: dict[str, Endpoint]) -> ZmqSockets:
    try:
        return ZmqSockets.bind(host, specs)
    except zmq.ZMQError as error:
        name = getattr(error, "listener", next(iter(specs)))
        spec = specs[name]
        host = spec.host or host
        address = f"[{host}]:{spec.port}" if ":" in host else f"{host}:{spec.port}"
        flag = _flag(protocol, endpoints[name].port)
        why = os.strerror(error.errno).lower() if error.errno else str(error)
        if error.errno == errno.EADDRINUSE:
            hint = in_use_hint(spec.port, flag, name)
        else:
            hint = f"check --bind and {flag}"
        raise StartupError(f"cannot listen for {name} on {address}: {why}; {hint}") from error


def _stop_self() -> None:
    """A clean stop asked for through a protocol (eMQP's admin DISCONNECT): as a SIGTERM would."""
    os.kill(os.getpid(), signal.SIGTERM)


def _address(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"{host}:{port}"


def _in_flight(engine: Engine) -> int:
    return sum(len(queue.in_flight) for queue in engine.queues.values())


def _stored(engine: Engine) -> int:
    return (sum(queue.depth + len(queue.deferred) for queue in engine.queues.values())
            + sum(topic.depth for topic in engine.topics.values()))


async def run_gateway(
    prepared: Prepared, *, task_status: trio.TaskStatus[Engine] = trio.TASK_STATUS_IGNORED
) -> None:
    """Serve on the embedded engine, or on one whose queues live in a JetStream cluster (`--jetstream`)."""
    config = prepared.config
    clock = SystemClock()
    log.info("polymq %s, hot modules %s", polymq.__version__,
             ("compiled (mypyc, ZeroMQ frames in C)" if zmq_loops.in_use() else "compiled (mypyc)")
             if polymq.COMPILED else "pure Python")
    if not jetstream_engine.server_urls(config.jetstream):
        await _serve(prepared, Engine(clock=clock, storage=prepared.storage), clock, None, task_status)
        return
    async with trio.open_nursery() as link_nursery:
        try:
            engine, link = await jetstream_engine.open_engine(config.jetstream, link_nursery, clock)
        except jetstream_engine.JetStreamStartError as error:
            raise StartupError(str(error)) from error
        log.info("storage %s", jetstream_engine.describe(link))
        await _serve(prepared, engine, clock, link, task_status)
        await link.connection.close()  # what the sessions gave back (-NAK) leaves before the link goes
        link_nursery.cancel_scope.cancel()


async def _serve(prepared: Prepared, engine: Engine, clock: SystemClock, link: JetStreamLink | None,
                 task_status: trio.TaskStatus[Engine]) -> None:
    config, storage, committer = prepared.config, prepared.storage, prepared.committer
    engine.dedup.window_s = config.storage.dedup_window_s  # before the restore, which forgets the expired
    engine.max_queue_depth = config.limits.max_queue_depth
    engine.overflow = config.limits.queue_overflow
    started = clock.now()
    engine.restore()
    if link is not None:
        pass  # the cluster keeps everything: nothing to restore on the node
    elif committer is None:
        log.warning("storage in memory only: nothing is written, a restart starts empty")
    else:
        log.info("storage %s, fsync %s (%s): restored %d topics, %d queues, %d messages in %.2f s",
                 config.storage.data_dir.absolute(), config.storage.fsync, committer.driver.name, len(engine.topics),
                 len(engine.queues), _stored(engine), clock.now() - started)
    timer_task = TimerTask(engine)
    shared_streams = jetstream_engine.shared_streams(link) if link is not None else None
    tracer, trace_topic = make_tracer(engine, config.trace)
    cluster_trace = ClusterTrace.attach(engine, tracer)  # on a cluster: traced on every node, one timeline
    http = prepared.http
    http_address = _address(http) if http is not None else None
    output_limit = OutputLimit(config.limits.max_client_output, config.limits.slow_client_grace_ms / 1000)
    gateway = GatewayInfo(bind=config.bind, http_address=http_address, stop=_stop_self, output_limit=output_limit)
    by_protocol: dict[str, Service] = {
        bound.protocol.name: bound.protocol.start(
            Context(engine, bound.options, bound.listeners, bound.zmq, bound.checked, gateway))
        for bound in prepared.bound}
    services = list(by_protocol.values())
    metrics = Metrics(engine, lambda: by_protocol, committer)
    metrics.registry.register(TraceCollector(tracer, trace_topic))
    in_flight = 0
    # Installed before any listener serves, so a signal at any moment after start-up is a clean stop.
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(timer_task.run)
            nursery.start_soon(metrics.measure_loop_lag)
            nursery.start_soon(collect_on_a_clock)
            nursery.start_soon(trace_topic.run)
            if cluster_trace is not None:
                cluster_trace.start()
                nursery.start_soon(cluster_trace.run)
            if committer is not None:
                nursery.start_soon(committer.run)
            for bound in prepared.bound:
                for name, sock in bound.listeners.items():
                    log.info("listening %s %s", name, _address(sock))
                if bound.zmq is not None:
                    for name, address in bound.zmq.addresses.items():
                        log.info("listening %s %s", name, address)
            if http is not None:
                log.info("listening %s %s", HTTP_LISTENER, http_address)
                log.info("%s", prepared.access.describe(http_address or ""))
            for service in services:
                await nursery.start(service.run)
            if http is not None:
                await nursery.start(partial(serve_gateway_http, shared_streams=shared_streams), engine, http,
                                    config.http, config.storage.snapshot_memory_mb << 20, metrics,
                                    AdminApi(engine, lambda: by_protocol, prepared.access, tracer))
            prepared.run_file.serving()  # gone before `ready` is logged, for whoever reads that line
            log.info("ready")
            task_status.started(engine)
            async for signum in signals:
                log.info("received %s, stopping: closing %d connections", signal.Signals(signum).name,
                         sum(service.connections() for service in services))
                in_flight = _in_flight(engine)
                for service in services:
                    await service.stop()
                nursery.cancel_scope.cancel()
                break
    for bound in prepared.bound:
        if bound.zmq is not None:
            bound.zmq.close()  # what the adapters left open, and the ZeroMQ context
    # Sessions are closed and their in-flight messages returned: write and fdatasync it all.
    if link is not None:
        log.info("stopped: %d in-flight messages given back to the JetStream cluster", in_flight)
    elif committer is not None and isinstance(storage, DiskStorage):
        await committer.flush()
        storage.close()
        log.info("stopped: %d in-flight messages returned to their queues; %d messages in %d topics and %d queues "
                 "written and synced in %s", in_flight, _stored(engine), len(engine.topics), len(engine.queues),
                 config.storage.data_dir.absolute())
    else:
        log.info("stopped: %d messages in memory dropped (--in-memory)", _stored(engine))


def _fail(message: str, error: BaseException, debug: bool, run_file: RunFile) -> None:
    log.error("%s", message, exc_info=error if debug else None)
    run_file.failed(message)  # for `polymq wait`, which says it instead of waiting on
    if not debug and not isinstance(error, StartupError):
        log.error("run with --debug for the traceback")
    sys.exit(1)


def _innermost(error: BaseException) -> BaseException:
    while isinstance(error, BaseExceptionGroup) and len(error.exceptions) == 1:
        error = error.exceptions[0]
    return error


@click.command()
@click_options
@click.option("--debug", is_flag=True, envvar="POLYMQ_DEBUG", help="Show the traceback of a start-up failure.")
@click.pass_context
def command(ctx: click.Context, debug: bool, **values: object) -> None:
    """Run the gateway: every protocol on its default ports, on loopback by default.

    Stored durably under --data-dir. Every protocol has a --NAME/--no-NAME switch and a flag per
    port (-1 turns a listener off). Every option is also a POLYMQ_* variable and a key of the
    --config file (`polymq config --show` prints them all).
    """
    config = from_command_line(ctx, values)
    logs.configure(config.log.level, config.log.format)
    run_file = RunFile.of_gateway(config.http.bind, config.http.port)
    run_file.starting()
    try:
        prepared = prepare(config)
    except StartupError as error:
        _fail(str(error), error, debug, run_file)
        return
    except Exception as error:  # a failure no check foresaw: one line, the traceback with --debug
        _fail(f"start-up failed: {type(error).__name__}: {error}", error, debug, run_file)
        return
    prepared.run_file = run_file
    try:
        if config.loop == LOOP_EPOLL:
            HostLoop(spin_s=config.loop_spin_s).run(run_gateway, prepared)
        else:
            trio.run(run_gateway, prepared)
    except BaseException as error:
        with contextlib.suppress(Exception):
            prepared.close()
        cause = _innermost(error)
        if isinstance(cause, KeyboardInterrupt | SystemExit):
            raise
        if isinstance(cause, StartupError):
            _fail(str(cause), cause, debug, run_file)
        _fail(f"stopped by an unexpected error: {type(cause).__name__}: {cause}", error, debug, run_file)


@click.command()
@click_options
@click.option("--show", is_flag=True, default=True, help="Print the effective config as TOML (the default).")
@click.pass_context
def config_command(ctx: click.Context, show: bool, **values: object) -> None:
    """Print the effective config (defaults, --config file, POLYMQ_* variables, flags) as TOML."""
    click.echo(to_toml(from_command_line(ctx, values)), nl=False)
