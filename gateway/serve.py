"""`polymq serve`: run the gateway in one trio run.

Prints `polymq listening <name> <host>:<port>` for each listener and then `polymq ready`
(tests and scripts start it with port 0 and read those lines). SIGTERM and SIGINT stop it
cleanly with exit status 0.
"""

from __future__ import annotations

import logging
import math
import signal
import socket
import sys
from pathlib import Path

import attrs
import click
import trio

import polymq
from polymq.adapters.mqks import MQKSLimits, MQKSServer
from polymq.adapters.nsq import NSQServer
from polymq.adapters.transport import serve_tcp
from polymq.codecs.mqks import MAX_LINE_LENGTH as MQKS_MAX_LINE_LENGTH
from polymq.codecs.nsq import ServerLimits
from polymq.core.clock import SystemClock
from polymq.core.disk_storage import MEM_QUEUE_SIZE, DiskStorage, FsyncPolicy
from polymq.core.engine import Engine
from polymq.core.storage import MemoryStorage
from polymq.gateway.committer import Committer
from polymq.gateway.nsq_http import serve_nsq_http

log = logging.getLogger("polymq")

# nsqd's defaults (nsq-notes §1); polymq binds loopback unless told otherwise.
DEFAULT_BIND = "127.0.0.1"
DEFAULT_NSQ_TCP_PORT = 4150
DEFAULT_NSQ_HTTP_PORT = 4151
# The original MQKS's first worker (mqks-notes §1: a one-worker deployment listens on 25000).
DEFAULT_MQKS_PORT = 25000
# The listen backlog; the original MQKS used 256, nsqd the OS default.
LISTEN_BACKLOG = 1024


@attrs.define
class GatewayConfig:
    bind: str = DEFAULT_BIND
    nsq_tcp_port: int | None = DEFAULT_NSQ_TCP_PORT  # None = protocol off
    nsq_http_port: int | None = DEFAULT_NSQ_HTTP_PORT
    mqks_port: int | None = DEFAULT_MQKS_PORT
    mqks_limits: MQKSLimits = attrs.field(factory=MQKSLimits)
    data_dir: Path = Path("data")
    fsync: FsyncPolicy = attrs.field(factory=FsyncPolicy)
    mem_queue_size: int = MEM_QUEUE_SIZE
    in_memory: bool = False  # MemoryStorage: nothing written, a restart starts empty
    nsq_limits: ServerLimits = attrs.field(factory=ServerLimits)
    tls_cert: Path | None = None
    tls_key: Path | None = None
    auth_http_address: str | None = None


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


def _listening_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(LISTEN_BACKLOG)
    return sock


def announce(name: str, sock: socket.socket) -> None:
    host, port = sock.getsockname()[:2]
    print(f"polymq listening {name} {host}:{port}", flush=True)


async def run_gateway(
    config: GatewayConfig, *, task_status: trio.TaskStatus[Engine] = trio.TASK_STATUS_IGNORED
) -> None:
    clock = SystemClock()
    storage: DiskStorage | MemoryStorage
    committer: Committer | None = None
    if config.in_memory:
        storage = MemoryStorage()
        log.warning("storage in memory only: nothing is written, a restart starts empty")
    else:
        storage = DiskStorage(config.data_dir, clock, policy=config.fsync, mem_queue_size=config.mem_queue_size)
        committer = Committer(storage)
    engine = Engine(clock=clock, storage=storage)
    log.info("hot modules: %s", "compiled (mypyc)" if polymq.COMPILED else "pure Python")
    started = clock.now()
    engine.restore()
    if committer is not None:
        log.info("storage %s (fsync %s): restored %d topics, %d queues, %d messages in %.2f s", config.data_dir,
                 config.fsync, len(engine.topics), len(engine.queues),
                 sum(q.depth + len(q.deferred) for q in engine.queues.values())
                 + sum(t.depth for t in engine.topics.values()), clock.now() - started)
    timer_task = TimerTask(engine)
    limits = config.nsq_limits
    ssl_context = None
    if config.tls_cert is not None:
        import ssl

        ssl_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ssl_context.load_cert_chain(str(config.tls_cert), str(config.tls_key) if config.tls_key else None)
        limits = attrs.evolve(limits, tls_available=True)
    if config.auth_http_address:
        limits = attrs.evolve(limits, auth_enabled=True)
    # Installed before any listener, so a signal at any moment after start-up is a clean stop.
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(timer_task.run)
            if committer is not None:
                nursery.start_soon(committer.run)
            nsq = NSQServer(engine, limits, ssl_context=ssl_context, auth_http_address=config.auth_http_address)
            if config.nsq_tcp_port is not None:
                tcp_sock = _listening_socket(config.bind, config.nsq_tcp_port)
                announce("nsq-tcp", tcp_sock)
                nsq.tcp_port = tcp_sock.getsockname()[1]
                await nursery.start(serve_tcp, nsq.handle_connection, tcp_sock)
            if config.nsq_http_port is not None:
                sock = _listening_socket(config.bind, config.nsq_http_port)
                announce("nsq-http", sock)
                nsq.http_port = sock.getsockname()[1]
                await nursery.start(serve_nsq_http, engine, nsq, sock)
            mqks = MQKSServer(engine, config.mqks_limits)
            if config.mqks_port is not None:
                sock = _listening_socket(config.bind, config.mqks_port)
                announce("mqks", sock)
                mqks.host, mqks.port = sock.getsockname()[:2]
                await nursery.start(serve_tcp, mqks.handle_connection, sock)
            print("polymq ready", flush=True)
            task_status.started(engine)
            async for signum in signals:
                log.info("received %s, shutting down", signal.Signals(signum).name)
                await nsq.shutdown()
                await mqks.shutdown()
                nursery.cancel_scope.cancel()
                break
    # Sessions are closed and their in-flight messages returned: write and fdatasync it all.
    if committer is not None:
        await committer.flush()
        storage.close()


@click.command()
@click.option("--bind", default=DEFAULT_BIND, show_default=True, help="Address every listener binds to.")
@click.option("--nsq-tcp-port", type=int, default=DEFAULT_NSQ_TCP_PORT, show_default=True,
              help="NSQ V2 TCP port (0 = any free port, -1 = off).")
@click.option("--nsq-http-port", type=int, default=DEFAULT_NSQ_HTTP_PORT, show_default=True,
              help="nsqd HTTP API port (0 = any free port, -1 = off).")
@click.option("--mqks-port", type=int, default=DEFAULT_MQKS_PORT, show_default=True,
              help="MQKS TCP port (0 = any free port, -1 = off).")
@click.option("--mqks-max-line", type=click.IntRange(min=64), default=MQKS_MAX_LINE_LENGTH, show_default=True,
              help="Longest MQKS request line in bytes; a longer one is answered with an error and skipped.")
@click.option("--mqks-consumer-window", type=click.IntRange(min=1), default=MQKSLimits().consumer_window,
              show_default=True,
              help="Deliveries an MQKS consumer may hold: unacknowledged (manual-ack) or not yet written (auto-ack).")
@click.option("--data-dir", type=click.Path(path_type=Path), default=Path("data"), show_default=True,
              help="Where the embedded durable store keeps its files.")
@click.option("--fsync", "fsync", default="always", show_default=True,
              help="always: acknowledge after fdatasync (group commit); interval:MS: acknowledge after the write, "
                   "fdatasync every MS (an OS crash or power cut loses at most MS of acknowledged publishes); "
                   "never: leave it to the OS (a process crash loses nothing, an OS crash may).")
@click.option("--mem-queue-size", type=click.IntRange(min=0), default=MEM_QUEUE_SIZE, show_default=True,
              help="Messages per queue and topic kept in memory; the rest are read back from disk (nsqd's flag).")
@click.option("--in-memory", is_flag=True,
              help="Keep nothing on disk (benchmarks, throwaway tests): a restart starts empty.")
@click.option("--tls-cert", type=click.Path(exists=True, path_type=Path), default=None,
              help="PEM certificate: enables the NSQ tls_v1 upgrade.")
@click.option("--tls-key", type=click.Path(exists=True, path_type=Path), default=None, help="PEM private key.")
@click.option("--tls-required", is_flag=True, help="Refuse every NSQ command but IDENTIFY before TLS.")
@click.option("--auth-http-address", default=None, help="host:port of an nsqd-style auth server.")
@click.option("--msg-timeout", type=int, default=60_000, show_default=True, help="NSQ default msg timeout (ms).")
@click.option("--log-level", default="info", show_default=True,
              type=click.Choice(["debug", "info", "warning", "error"]))
def command(bind: str, nsq_tcp_port: int, nsq_http_port: int, mqks_port: int, mqks_max_line: int,
            mqks_consumer_window: int, data_dir: Path, fsync: str, mem_queue_size: int,
            in_memory: bool, tls_cert: Path | None,
            tls_key: Path | None, tls_required: bool, auth_http_address: str | None, msg_timeout: int,
            log_level: str) -> None:
    """Run the gateway with every protocol built so far, on loopback by default.

    NSQ V2 on TCP 4150, the nsqd HTTP API on 4151 and MQKS on TCP 25000, stored durably under --data-dir.
    """
    logging.basicConfig(level=log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    limits = ServerLimits(msg_timeout_ms=msg_timeout, tls_required=tls_required)
    try:
        policy = FsyncPolicy.parse(fsync)
    except ValueError as error:
        raise click.BadParameter(str(error), param_hint="--fsync") from None
    config = GatewayConfig(
        bind=bind,
        nsq_tcp_port=None if nsq_tcp_port < 0 else nsq_tcp_port,
        nsq_http_port=None if nsq_http_port < 0 else nsq_http_port,
        mqks_port=None if mqks_port < 0 else mqks_port,
        mqks_limits=MQKSLimits(max_line_length=mqks_max_line, consumer_window=mqks_consumer_window),
        data_dir=data_dir,
        fsync=policy,
        mem_queue_size=mem_queue_size,
        in_memory=in_memory,
        nsq_limits=limits,
        tls_cert=tls_cert,
        tls_key=tls_key,
        auth_http_address=auth_http_address,
    )
    trio.run(run_gateway, config)
