"""`polymq serve`: run the gateway in one trio run.

Start-up is in two steps. `prepare` binds every listener first, then opens the store: a port in
use or an unusable data dir fails before anything is created, as one clear log line naming the
listener and address or the path and the pid holding it (`StartupError`, exit status 1; the
traceback only with `--debug`). `run_gateway` then serves. It logs `listening <name> <host>:<port>`
for each listener and then `ready` (tests and scripts start it with port 0 and read those lines).
SIGTERM and SIGINT stop it cleanly with exit status 0, after a last line saying what was written.
See docs/operations.md.
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
import ssl
import sys
from pathlib import Path

import attrs
import click
import trio
import zmq

import polymq
from polymq.adapters import emqp as emqp_adapter
from polymq.adapters import emqp_pubsub
from polymq.adapters import pzq as pzq_adapter
from polymq.adapters.emqp import EMQPBroker
from polymq.adapters.emqp_pubsub import EMQPPubSub
from polymq.adapters.mqks import MQKSServer
from polymq.adapters.nsq import NSQServer
from polymq.adapters.phpmq import PHPMQServer
from polymq.adapters.phpmq_console import ConsoleServer
from polymq.adapters.pzq import PZQServer
from polymq.adapters.transport import serve_tcp, stop_listening
from polymq.adapters.zmq_sockets import SocketSpec, ZmqSockets
from polymq.core.clock import SystemClock
from polymq.core.disk_storage import DiskStorage
from polymq.core.engine import Engine
from polymq.core.storage import DataDirInUse, MemoryStorage
from polymq.gateway import logs
from polymq.gateway.committer import Committer
from polymq.gateway.config import Config, click_options, from_command_line, to_toml
from polymq.gateway.nsq_http import serve_nsq_http

log = logging.getLogger("polymq")

# The listen backlog; the original MQKS used 256, nsqd the OS default.
LISTEN_BACKLOG = 1024
# Each listener's name in the log lines and the flag that moves it.
LISTENERS = {"nsq-tcp": "--nsq-tcp-port", "nsq-http": "--nsq-http-port", "mqks": "--mqks-port",
             "phpmq": "--phpmq-port", "phpmq-console": "--phpmq-console-port"}
# PZQ's ZeroMQ sockets: bound by ZeroMQ, not as TCP listeners of ours.
ZMQ_LISTENERS = {"pzq-receive": "--pzq-receive-port", "pzq-send": "--pzq-send-port",
                 "pzq-monitor": "--pzq-monitor-port", "emqp-backend": "--emqp-backend-port",
                 "emqp-frontend": "--emqp-frontend-port", "emqp-admin": "--emqp-admin-port",
                 "emqp-pubsub-in": "--emqp-pubsub-in-port", "emqp-pubsub-out": "--emqp-pubsub-out-port"}


# eMQP's broker sockets (its pub/sub device's are apart).
BROKER_SOCKETS = ("emqp-backend", "emqp-frontend", "emqp-admin")


class StartupError(Exception):
    """A start-up failure a user can fix: the message names the thing and what to do."""


@attrs.define
class Prepared:
    """What start-up made before serving: bound listeners, the opened store."""

    config: Config
    sockets: dict[str, socket.socket]
    storage: DiskStorage | MemoryStorage
    committer: Committer | None
    ssl_context: ssl.SSLContext | None
    zmq: ZmqSockets | None = None

    def close(self) -> None:
        for sock in self.sockets.values():
            sock.close()
        if self.zmq is not None:
            self.zmq.close()
        if isinstance(self.storage, DiskStorage):
            self.storage.close()


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


def listening_socket(name: str, host: str, port: int) -> socket.socket:
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
        flag = LISTENERS[name]
        if isinstance(error, OSError) and error.errno == errno.EADDRINUSE:
            hint = f"stop the process using it, or choose another port with {flag} (-1 turns {name} off)"
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


def open_storage(config: Config) -> tuple[DiskStorage | MemoryStorage, Committer | None]:
    clock = SystemClock()
    if config.storage.in_memory:
        return MemoryStorage(), None
    data_dir = config.storage.data_dir.absolute()
    created = _missing_ancestor(data_dir)
    try:
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


def _ssl_context(config: Config) -> ssl.SSLContext | None:
    nsq = config.nsq
    if nsq.tls_cert is None:
        if nsq.tls_required:
            raise StartupError("--tls-required needs a certificate: give --tls-cert (and --tls-key)")
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        context.load_cert_chain(str(nsq.tls_cert), str(nsq.tls_key) if nsq.tls_key else None)
    except (OSError, ssl.SSLError) as error:
        raise StartupError(f"cannot load the TLS certificate {nsq.tls_cert} (key {nsq.tls_key or 'in the same file'}): "
                           f"{getattr(error, 'reason', None) or error}") from error
    return context


def prepare(config: Config) -> Prepared:
    """Binds every listener, then opens the store; on failure closes what it made and raises StartupError."""
    ssl_context = _ssl_context(config)
    sockets: dict[str, socket.socket] = {}
    zmq_made: ZmqSockets | None = None
    try:
        for name in LISTENERS:
            port = config.port(name)
            if port is not None:
                sockets[name] = listening_socket(name, config.host(name), port)
        specs = zmq_specs(config)
        if any(spec.port is not None for spec in specs.values()):
            zmq_made = zmq_sockets(config.bind, specs)
        storage, committer = open_storage(config)
    except BaseException:
        for sock in sockets.values():
            sock.close()
        if zmq_made is not None:
            zmq_made.close()
        raise
    return Prepared(config, sockets, storage, committer, ssl_context, zmq_made)


def zmq_specs(config: Config) -> dict[str, SocketSpec]:
    """The ZeroMQ sockets of every ZeroMQ protocol, each at its configured port (None: off)."""
    ports = {name: config.port(name) for name in ZMQ_LISTENERS}
    return (pzq_adapter.socket_specs(ports, config.pzq.max_message)
            | emqp_adapter.socket_specs(ports, config.emqp.max_message, config.host("emqp-admin"))
            | emqp_pubsub.socket_specs(ports, config.emqp.max_message))


def zmq_sockets(host: str, specs: dict[str, SocketSpec]) -> ZmqSockets:
    try:
        return ZmqSockets.bind(host, specs)
    except zmq.ZMQError as error:
        name = getattr(error, "listener", "pzq")
        port = specs[name].port if name in specs else None
        host = (specs[name].host if name in specs else None) or host
        address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        flag = ZMQ_LISTENERS.get(name, "--pzq-receive-port")
        why = os.strerror(error.errno).lower() if error.errno else str(error)
        if error.errno == errno.EADDRINUSE:
            hint = f"stop the process using it, or choose another port with {flag} (-1 turns {name} off)"
        else:
            hint = f"check --bind and {flag}"
        raise StartupError(f"cannot listen for {name} on {address}: {why}; {hint}") from error


def _stop_self() -> None:
    """A clean stop asked for through a protocol (eMQP's admin DISCONNECT): as a SIGTERM would."""
    os.kill(os.getpid(), signal.SIGTERM)


def _in_flight(engine: Engine) -> int:
    return sum(len(queue.in_flight) for queue in engine.queues.values())


def _stored(engine: Engine) -> int:
    return (sum(queue.depth + len(queue.deferred) for queue in engine.queues.values())
            + sum(topic.depth for topic in engine.topics.values()))


async def run_gateway(
    prepared: Prepared, *, task_status: trio.TaskStatus[Engine] = trio.TASK_STATUS_IGNORED
) -> None:
    config, storage, committer = prepared.config, prepared.storage, prepared.committer
    clock = SystemClock()
    engine = Engine(clock=clock, storage=storage)
    engine.dedup.window_s = config.storage.dedup_window_s  # before the restore, which forgets the expired
    log.info("polymq %s, hot modules %s", polymq.__version__,
             "compiled (mypyc)" if polymq.COMPILED else "pure Python")
    started = clock.now()
    engine.restore()
    if committer is None:
        log.warning("storage in memory only: nothing is written, a restart starts empty")
    else:
        log.info("storage %s, fsync %s (%s): restored %d topics, %d queues, %d messages in %.2f s",
                 config.storage.data_dir.absolute(), config.storage.fsync, committer.driver.name, len(engine.topics),
                 len(engine.queues), _stored(engine), clock.now() - started)
    timer_task = TimerTask(engine)
    nsq = NSQServer(engine, config.nsq.limits(), ssl_context=prepared.ssl_context,
                    auth_http_address=config.nsq.auth_http_address)
    mqks = MQKSServer(engine, config.mqks.limits())
    phpmq = PHPMQServer(engine, config.phpmq.limits())
    console = ConsoleServer(engine, destructive=config.phpmq.console_destructive)
    zmq_made = prepared.zmq
    pzq = (PZQServer(engine, zmq_made, config.pzq.limits())
           if zmq_made is not None and any(name.startswith("pzq-") for name in zmq_made.sockets) else None)
    emqp = (EMQPBroker(engine, zmq_made, config.emqp.limits(), stop_gateway=_stop_self)
            if zmq_made is not None and any(name in zmq_made.sockets for name in BROKER_SOCKETS) else None)
    pubsub = (EMQPPubSub(engine, zmq_made)
              if zmq_made is not None and any(name.startswith("emqp-pubsub") for name in zmq_made.sockets) else None)
    sockets = prepared.sockets
    in_flight = 0
    # Installed before any listener serves, so a signal at any moment after start-up is a clean stop.
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(timer_task.run)
            if committer is not None:
                nursery.start_soon(committer.run)
            for name, sock in sockets.items():
                host, port = sock.getsockname()[:2]
                log.info("listening %s %s:%d", name, host, port)
                if name == "nsq-tcp":
                    nsq.tcp_port = port
                    await nursery.start(serve_tcp, nsq.handle_connection, sock)
                elif name == "nsq-http":
                    nsq.http_port = port
                    await nursery.start(serve_nsq_http, engine, nsq, sock, config.storage.snapshot_memory_mb << 20)
                elif name == "mqks":
                    mqks.host, mqks.port = host, port
                    await nursery.start(serve_tcp, mqks.handle_connection, sock)
                elif name == "phpmq":
                    await nursery.start(serve_tcp, phpmq.handle_connection, sock)
                else:
                    await nursery.start(serve_tcp, console.handle_connection, sock)
            if zmq_made is not None:
                for name, address in zmq_made.addresses.items():
                    log.info("listening %s %s", name, address)
            if pzq is not None:
                nursery.start_soon(pzq.run)
            if emqp is not None:
                nursery.start_soon(emqp.run)
            if pubsub is not None:
                nursery.start_soon(pubsub.run)
            log.info("ready")
            task_status.started(engine)
            async for signum in signals:
                log.info("received %s, stopping: closing %d connections", signal.Signals(signum).name,
                         len(nsq.sessions) + len(mqks.sessions) + len(phpmq.sessions))
                for name, sock in sockets.items():
                    if name != "nsq-http":  # hypercorn stops its own with the nursery
                        stop_listening(sock)
                in_flight = _in_flight(engine)
                await nsq.shutdown()
                await mqks.shutdown()
                await phpmq.shutdown()
                await console.shutdown()
                if pzq is not None:
                    pzq.shutdown()  # its in-flight deliveries go back to the queue; its sockets close
                if emqp is not None:
                    emqp.shutdown()  # KBYE to its peers; the jobs its workers held go back to their queues
                if pubsub is not None:
                    pubsub.shutdown()
                nursery.cancel_scope.cancel()
                break
    if zmq_made is not None:
        zmq_made.close()  # what the adapters left open, and the ZeroMQ context
    # Sessions are closed and their in-flight messages returned: write and fdatasync it all.
    if committer is not None and isinstance(storage, DiskStorage):
        await committer.flush()
        storage.close()
        log.info("stopped: %d in-flight messages returned to their queues; %d messages in %d topics and %d queues "
                 "written and synced in %s", in_flight, _stored(engine), len(engine.topics), len(engine.queues),
                 config.storage.data_dir.absolute())
    else:
        log.info("stopped: %d messages in memory dropped (--in-memory)", _stored(engine))


def _fail(message: str, error: BaseException, debug: bool) -> None:
    log.error("%s", message, exc_info=error if debug else None)
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
    """Run the gateway with every protocol built so far, on loopback by default.

    NSQ V2 on TCP 4150, the nsqd HTTP API on 4151, MQKS on TCP 25000, PHPMQ on TCP 9100 and its
    maintenance console on 9101, PZQ on 11131-11133, eMQP on 47290, 47291, 47293 and its pub/sub
    on 47298-47299, stored durably under --data-dir. Every option is also a POLYMQ_*
    variable and a key of the --config file (`polymq config --show` prints them all).
    """
    config = from_command_line(ctx, values)
    logs.configure(config.log.level, config.log.format)
    try:
        prepared = prepare(config)
    except StartupError as error:
        _fail(str(error), error, debug)
        return
    except Exception as error:  # a failure no check foresaw: one line, the traceback with --debug
        _fail(f"start-up failed: {type(error).__name__}: {error}", error, debug)
        return
    try:
        trio.run(run_gateway, prepared)
    except BaseException as error:
        with contextlib.suppress(Exception):
            prepared.close()
        cause = _innermost(error)
        if isinstance(cause, KeyboardInterrupt | SystemExit):
            raise
        _fail(f"stopped by an unexpected error: {type(cause).__name__}: {cause}", error, debug)


@click.command()
@click_options
@click.option("--show", is_flag=True, default=True, help="Print the effective config as TOML (the default).")
@click.pass_context
def config_command(ctx: click.Context, show: bool, **values: object) -> None:
    """Print the effective config (defaults, --config file, POLYMQ_* variables, flags) as TOML."""
    click.echo(to_toml(from_command_line(ctx, values)), nl=False)
