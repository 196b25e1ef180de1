"""The gateway's options: one table, read from flags, `POLYMQ_*` variables and a TOML file.

Every option has a key in the config file (`[storage] fsync`), a flag (`--fsync`) and an
environment variable named after the flag (`POLYMQ_FSYNC`). A flag wins over a variable, a
variable over the file, the file over the default. Every value, wherever it came from, is checked
by the same click type, and an error names the option and its source (the flag, the variable, or
the file and line). The checked values are structured with cattrs into the attrs classes below.
`polymq config --show` prints the effective config as TOML, each option with its help as a
comment; `polymq.example.toml` is that output for the defaults. See docs/operations.md.
"""

from __future__ import annotations

import re
import tomllib
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import attrs
import cattrs
import click
import tomli_w
from click.core import ParameterSource

from polymq.adapters import emqp as emqp_adapter
from polymq.adapters.emqp import EMQPLimits
from polymq.adapters.mqks import MQKSLimits
from polymq.adapters.phpmq import FORGET_EMPTY_AFTER_S as PHPMQ_FORGET_EMPTY_AFTER_S
from polymq.adapters.phpmq import PHPMQLimits
from polymq.adapters.pzq import DEFAULT_ACK_TIMEOUT_S, DEFAULT_MAX_MESSAGE, DEFAULT_WINDOW, PZQLimits
from polymq.codecs.mqks import MAX_LINE_LENGTH as MQKS_MAX_LINE_LENGTH
from polymq.codecs.nsq import ServerLimits
from polymq.codecs.phpmq import MAX_CONTENT as PHPMQ_MAX_CONTENT
from polymq.core.dedup import DEFAULT_WINDOW_S as DEFAULT_DEDUP_WINDOW_S
from polymq.core.disk_storage import MEM_QUEUE_SIZE, FsyncPolicy
from polymq.gateway.stream_http_api import DEFAULT_SNAPSHOT_MEMORY

# polymq binds loopback unless told otherwise (nsqd binds every interface).
DEFAULT_BIND = "127.0.0.1"
# nsqd's default ports.
DEFAULT_NSQ_TCP_PORT = 4150
DEFAULT_NSQ_HTTP_PORT = 4151
# The original MQKS's first worker: a one-worker deployment listens on 25000.
DEFAULT_MQKS_PORT = 25000
# The original PHPMQ server's message-queue port and maintenance console (its config/phpmq.default.xml).
DEFAULT_PHPMQ_PORT = 9100
DEFAULT_PHPMQ_CONSOLE_PORT = 9101
# The ports PZQ deployments use for its receive, send and monitor sockets.
DEFAULT_PZQ_RECEIVE_PORT = 11131
DEFAULT_PZQ_SEND_PORT = 11132
DEFAULT_PZQ_MONITOR_PORT = 11133
# EventMQ's ports (its conf.py): jobmanagers, clients and schedulers, emq-cli.
DEFAULT_EMQP_BACKEND_PORT = 47290
DEFAULT_EMQP_FRONTEND_PORT = 47291
DEFAULT_EMQP_ADMIN_PORT = 47293
# emq-pubsub's: publishers in, subscribers out.
DEFAULT_EMQP_PUBSUB_IN_PORT = 47298
DEFAULT_EMQP_PUBSUB_OUT_PORT = 47299
# A listener's port: 0 lets the OS choose a free one, -1 turns the listener off.
PORT = click.IntRange(min=-1, max=65535)
ENV_PREFIX = "POLYMQ_"
NSQ_DEFAULTS = ServerLimits()


class FsyncType(click.ParamType):
    name = "always|never|interval:MS"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> FsyncPolicy:
        if isinstance(value, FsyncPolicy):
            return value
        try:
            return FsyncPolicy.parse(str(value))
        except ValueError:
            self.fail(f"must be always, never or interval:MS (MS > 0), not {value!r}", param, ctx)


class AddressType(click.ParamType):
    name = "host:port"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> str:
        text = str(value)
        host, sep, port = text.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            self.fail(f"must be host:port, not {text!r}", param, ctx)
        return text


@attrs.frozen
class Option:
    """One option: its key in the config file, its flag, its type, default and help."""

    key: str  # "section.name", or "name" at the top of the file
    flag: str  # "--fsync", or "--nsq/--no-nsq" for a switch
    type: click.ParamType
    default: Any
    help: str

    @property
    def name(self) -> str:
        """The click parameter's name."""
        return self.key.replace(".", "__")

    @property
    def section(self) -> str:
        return self.key.rpartition(".")[0]

    @property
    def field(self) -> str:
        return self.key.rpartition(".")[2]

    @property
    def envvar(self) -> str:
        return ENV_PREFIX + self.flag.split("/")[0].removeprefix("--").replace("-", "_").upper()

    @property
    def is_switch(self) -> bool:
        return "/" in self.flag or self.type is click.BOOL


OPTIONS: tuple[Option, ...] = (
    Option("bind", "--bind", click.STRING, DEFAULT_BIND, "Address every listener binds to (loopback by default)."),
    # storage
    Option("storage.data_dir", "--data-dir", click.Path(file_okay=False, path_type=Path), Path("data"),
           "Where the embedded durable store keeps its files (created if missing; a relative path in a "
           "config file is relative to that file)."),
    Option("storage.fsync", "--fsync", FsyncType(), FsyncPolicy(),
           "always: acknowledge after fdatasync (group commit); interval:MS: acknowledge after the write, "
           "fdatasync every MS (an OS crash or power cut loses at most MS of acknowledged publishes); "
           "never: leave it to the OS (a process crash loses nothing, an OS crash may)."),
    Option("storage.mem_queue_size", "--mem-queue-size", click.IntRange(min=0), MEM_QUEUE_SIZE,
           "Messages per queue and topic kept in memory; the rest are read back from disk (nsqd's flag)."),
    Option("storage.dedup_window_s", "--dedup-window", click.FloatRange(min=1), DEFAULT_DEDUP_WINDOW_S,
           "Seconds a publishing writer's row groups are remembered (a Spark batch replayed later than this "
           "after its first try may publish its rows again); kept in the store."),
    Option("storage.snapshot_memory_mb", "--snapshot-memory", click.IntRange(min=1), DEFAULT_SNAPSHOT_MEMORY >> 20,
           "MiB the batch-read snapshots of queues held at once may take for the messages they read back "
           "from disk; a snapshot past it is refused (HTTP 413)."),
    Option("storage.in_memory", "--in-memory", click.BOOL, False,
           "Keep nothing on disk (benchmarks, throwaway tests): a restart starts empty."),
    # NSQ
    Option("nsq.enabled", "--nsq/--no-nsq", click.BOOL, True, "Serve NSQ V2 (TCP and the HTTP API)."),
    Option("nsq.tcp_port", "--nsq-tcp-port", PORT, DEFAULT_NSQ_TCP_PORT, "NSQ V2 TCP port (0 = any free, -1 = off)."),
    Option("nsq.http_port", "--nsq-http-port", PORT, DEFAULT_NSQ_HTTP_PORT,
           "nsqd HTTP API port (0 = any free, -1 = off)."),
    Option("nsq.msg_timeout_ms", "--msg-timeout", click.IntRange(min=1), NSQ_DEFAULTS.msg_timeout_ms,
           "Default time a consumer has to FIN a message, in ms (nsqd's --msg-timeout)."),
    Option("nsq.max_msg_timeout_ms", "--max-msg-timeout", click.IntRange(min=1), NSQ_DEFAULTS.max_msg_timeout_ms,
           "Longest msg_timeout a client may ask for in IDENTIFY, in ms (nsqd's --max-msg-timeout)."),
    Option("nsq.max_req_timeout_ms", "--max-req-timeout", click.IntRange(min=0), NSQ_DEFAULTS.max_req_timeout_ms,
           "Longest REQ and DPUB delay, in ms (nsqd's --max-req-timeout)."),
    Option("nsq.max_msg_size", "--max-msg-size", click.IntRange(min=1), NSQ_DEFAULTS.max_msg_size,
           "Largest message body in bytes (nsqd's --max-msg-size)."),
    Option("nsq.max_body_size", "--max-body-size", click.IntRange(min=1), NSQ_DEFAULTS.max_body_size,
           "Largest MPUB body in bytes (nsqd's --max-body-size)."),
    Option("nsq.max_rdy_count", "--max-rdy-count", click.IntRange(min=1), NSQ_DEFAULTS.max_rdy_count,
           "Largest RDY a client may send (nsqd's --max-rdy-count)."),
    Option("nsq.max_heartbeat_interval_ms", "--max-heartbeat-interval", click.IntRange(min=1000),
           NSQ_DEFAULTS.max_heartbeat_interval_ms,
           "Longest heartbeat_interval a client may ask for, in ms (nsqd's --max-heartbeat-interval)."),
    Option("nsq.max_output_buffer_size", "--max-output-buffer-size", click.IntRange(min=64),
           NSQ_DEFAULTS.max_output_buffer_size,
           "Largest output_buffer_size a client may ask for, in bytes (nsqd's --max-output-buffer-size)."),
    Option("nsq.min_output_buffer_timeout_ms", "--min-output-buffer-timeout", click.IntRange(min=1),
           NSQ_DEFAULTS.min_output_buffer_timeout_ms,
           "Shortest output_buffer_timeout a client may ask for, in ms (nsqd's --min-output-buffer-timeout)."),
    Option("nsq.max_output_buffer_timeout_ms", "--max-output-buffer-timeout", click.IntRange(min=1),
           NSQ_DEFAULTS.max_output_buffer_timeout_ms,
           "Longest output_buffer_timeout a client may ask for, in ms (nsqd's --max-output-buffer-timeout)."),
    Option("nsq.deflate", "--deflate/--no-deflate", click.BOOL, NSQ_DEFAULTS.deflate_enabled,
           "Offer deflate compression in IDENTIFY (nsqd's --deflate)."),
    Option("nsq.max_deflate_level", "--max-deflate-level", click.IntRange(min=1, max=9),
           NSQ_DEFAULTS.max_deflate_level, "Highest deflate level a client may ask for (nsqd's --max-deflate-level)."),
    Option("nsq.snappy", "--snappy/--no-snappy", click.BOOL, NSQ_DEFAULTS.snappy_enabled,
           "Offer snappy compression in IDENTIFY (nsqd's --snappy)."),
    Option("nsq.tls_cert", "--tls-cert", click.Path(exists=True, dir_okay=False, path_type=Path), None,
           "PEM certificate: enables the NSQ tls_v1 upgrade."),
    Option("nsq.tls_key", "--tls-key", click.Path(exists=True, dir_okay=False, path_type=Path), None,
           "PEM private key of --tls-cert (if not in the certificate's file)."),
    Option("nsq.tls_required", "--tls-required", click.BOOL, False,
           "Refuse every NSQ command but IDENTIFY before TLS (needs --tls-cert)."),
    Option("nsq.auth_http_address", "--auth-http-address", AddressType(), None,
           "host:port of an nsqd-style auth server: enables AUTH."),
    # MQKS
    Option("mqks.enabled", "--mqks/--no-mqks", click.BOOL, True, "Serve MQKS."),
    Option("mqks.port", "--mqks-port", PORT, DEFAULT_MQKS_PORT, "MQKS TCP port (0 = any free, -1 = off)."),
    Option("mqks.max_line", "--mqks-max-line", click.IntRange(min=64), MQKS_MAX_LINE_LENGTH,
           "Longest MQKS request line in bytes; a longer one is answered with an error and skipped."),
    Option("mqks.consumer_window", "--mqks-consumer-window", click.IntRange(min=1), MQKSLimits().consumer_window,
           "Deliveries an MQKS consumer may hold: unacknowledged (manual-ack) or not yet written (auto-ack)."),
    Option("mqks.keep_unconsumed", "--mqks-keep-unconsumed", click.BOOL, False,
           "Keep events published to a queue bound only by rebind that no one has consumed yet "
           "(the original MQKS drops them)."),
    # PHPMQ
    Option("phpmq.enabled", "--phpmq/--no-phpmq", click.BOOL, True, "Serve PHPMQ."),
    Option("phpmq.port", "--phpmq-port", PORT, DEFAULT_PHPMQ_PORT, "PHPMQ TCP port (0 = any free, -1 = off)."),
    Option("phpmq.max_content", "--phpmq-max-content", click.IntRange(min=1), PHPMQ_MAX_CONTENT,
           "Largest packet content in bytes (a message's body, its queue name); a larger one closes the "
           "connection before anything is allocated for it."),
    Option("phpmq.max_window", "--phpmq-max-window", click.IntRange(min=1), PHPMQLimits().max_window,
           "Largest consume window (002's count) honoured; a larger one is taken as this."),
    Option("phpmq.generation", "--phpmq-generation", click.Choice(["pinned", "current"]), "pinned",
           "pinned: deliveries (003) without the TTL packet, as the published client expects, except to "
           "connections that sent a TTL, 005 or 006; current: every 003 carries the remaining TTL."),
    Option("phpmq.ack_timeout_ms", "--phpmq-ack-timeout", click.IntRange(min=0), 0,
           "Time a PHPMQ delivery may stay unacknowledged before it goes back to its queue, in ms "
           "(0 = never, as the original)."),
    Option("phpmq.max_attempts", "--phpmq-max-attempts", click.IntRange(min=0), 0,
           "Deliveries after which a message that comes back again goes to the dead-letter queue "
           "<queue>.dead (0 = no limit); set on the queues PHPMQ creates."),
    Option("phpmq.forget_empty_after_s", "--phpmq-forget-empty", click.FloatRange(min=-1),
           PHPMQ_FORGET_EMPTY_AFTER_S,
           "Seconds after its last consumer left that an empty queue PHPMQ created is deleted, with its "
           "topic when nothing else uses it (the original keeps no empty queue; -1 = keep them)."),
    Option("phpmq.console_port", "--phpmq-console-port", PORT, DEFAULT_PHPMQ_CONSOLE_PORT,
           "PHPMQ maintenance console TCP port (0 = any free, -1 = off)."),
    Option("phpmq.console_bind", "--phpmq-console-bind", click.STRING, DEFAULT_BIND,
           "Address the maintenance console binds to, whatever --bind says (loopback by default: its "
           "flush commands delete messages)."),
    Option("phpmq.console_destructive", "--phpmq-console-destructive/--no-phpmq-console-destructive", click.BOOL,
           True, "Allow the console's flush and flushall (each asks for a yes first)."),
    # PZQ
    Option("pzq.enabled", "--pzq/--no-pzq", click.BOOL, True, "Serve PZQ (ZeroMQ)."),
    Option("pzq.receive_port", "--pzq-receive-port", PORT, DEFAULT_PZQ_RECEIVE_PORT,
           "PZQ receive socket (producers' DEALERs connect) TCP port (0 = any free, -1 = off)."),
    Option("pzq.send_port", "--pzq-send-port", PORT, DEFAULT_PZQ_SEND_PORT,
           "PZQ send socket (consumers' ROUTERs connect) TCP port (0 = any free, -1 = off)."),
    Option("pzq.monitor_port", "--pzq-monitor-port", PORT, DEFAULT_PZQ_MONITOR_PORT,
           "PZQ monitor socket (REQ clients ask MONITOR) TCP port (0 = any free, -1 = off)."),
    Option("pzq.queue", "--pzq-queue", click.STRING, "pzq",
           "The queue (and topic) PZQ producers publish to and PZQ consumers read."),
    Option("pzq.ack_timeout_ms", "--pzq-ack-timeout", click.IntRange(min=1), int(DEFAULT_ACK_TIMEOUT_S * 1000),
           "Time a PZQ consumer has to ACK a delivery before it is sent again, in ms (the original's "
           "--ack-timeout, 5 s)."),
    Option("pzq.window", "--pzq-window", click.IntRange(min=1), DEFAULT_WINDOW,
           "Deliveries each connected PZQ consumer may hold unacknowledged."),
    Option("pzq.max_message", "--pzq-max-message", click.IntRange(min=1), DEFAULT_MAX_MESSAGE,
           "Largest producer message (all its frames) in bytes; ZeroMQ drops a larger one as it arrives."),
    # eMQP
    Option("emqp.enabled", "--emqp/--no-emqp", click.BOOL, True, "Serve eMQP (EventMQ, ZeroMQ)."),
    Option("emqp.backend_port", "--emqp-backend-port", PORT, DEFAULT_EMQP_BACKEND_PORT,
           "eMQP backend socket (jobmanagers connect) TCP port (0 = any free, -1 = off)."),
    Option("emqp.frontend_port", "--emqp-frontend-port", PORT, DEFAULT_EMQP_FRONTEND_PORT,
           "eMQP frontend socket (clients and schedulers connect) TCP port (0 = any free, -1 = off)."),
    Option("emqp.admin_port", "--emqp-admin-port", PORT, DEFAULT_EMQP_ADMIN_PORT,
           "eMQP admin socket (emq-cli connects) TCP port (0 = any free, -1 = off)."),
    Option("emqp.pubsub_in_port", "--emqp-pubsub-in-port", PORT, DEFAULT_EMQP_PUBSUB_IN_PORT,
           "eMQP pub/sub input socket (PUBLISH senders connect) TCP port (0 = any free, -1 = off)."),
    Option("emqp.pubsub_out_port", "--emqp-pubsub-out-port", PORT, DEFAULT_EMQP_PUBSUB_OUT_PORT,
           "eMQP pub/sub output socket (ZeroMQ SUBs connect) TCP port (0 = any free, -1 = off)."),
    Option("emqp.admin_bind", "--emqp-admin-bind", click.STRING, DEFAULT_BIND,
           "Address the eMQP admin socket binds to, whatever --bind says (loopback by default)."),
    Option("emqp.admin_disconnect", "--emqp-admin-disconnect/--no-emqp-admin-disconnect", click.BOOL, False,
           "Let DISCONNECT on the admin socket stop the gateway (no other peer's DISCONNECT ever does)."),
    Option("emqp.heartbeat_interval_ms", "--emqp-heartbeat-interval", click.IntRange(min=1),
           int(emqp_adapter.HEARTBEAT_INTERVAL_S * 1000),
           "Time between the broker's HEARTBEATs to each worker and scheduler, in ms (the original's 3 s)."),
    Option("emqp.heartbeat_timeout_ms", "--emqp-heartbeat-timeout", click.IntRange(min=1),
           int(emqp_adapter.HEARTBEAT_TIMEOUT_S * 1000),
           "Silence after which a worker or scheduler is gone and its jobs go to other workers, in ms "
           "(the original's 5 s)."),
    Option("emqp.max_depth", "--emqp-max-depth", click.IntRange(min=0), 0,
           "Requests a queue may hold waiting for a worker; more are refused with a REPLY (0 = no limit)."),
    Option("emqp.reroute_unknown", "--emqp-reroute-unknown/--no-emqp-reroute-unknown", click.BOOL, False,
           "Send a request for a queue nobody consumes to 'default' (the original's rule) instead of "
           "keeping it in its own queue."),
    Option("emqp.max_attempts", "--emqp-max-attempts", click.IntRange(min=0), emqp_adapter.DEFAULT_MAX_ATTEMPTS,
           "Deliveries after which a job whose worker went is moved to <queue>.dead instead of being handed "
           "out again (0 = no limit); set on the queues eMQP creates."),
    Option("emqp.max_message", "--emqp-max-message", click.IntRange(min=1), emqp_adapter.DEFAULT_MAX_MESSAGE,
           "Largest eMQP message (all its frames) in bytes; ZeroMQ drops a larger one as it arrives."),
    # logs
    Option("log.level", "--log-level", click.Choice(["debug", "info", "warning", "error"]), "info",
           "Least severe log lines written."),
    Option("log.format", "--log-format", click.Choice(["text", "json"]), "text",
           "text: one line per record for people; json: one JSON object per line for machines."),
)
OPTIONS_BY_KEY = {option.key: option for option in OPTIONS}
SECTIONS = ("", "storage", "nsq", "mqks", "phpmq", "pzq", "emqp", "log")


@attrs.frozen
class StorageConfig:
    data_dir: Path = Path("data")
    fsync: FsyncPolicy = attrs.field(factory=FsyncPolicy)
    mem_queue_size: int = MEM_QUEUE_SIZE
    dedup_window_s: float = DEFAULT_DEDUP_WINDOW_S
    snapshot_memory_mb: int = DEFAULT_SNAPSHOT_MEMORY >> 20
    in_memory: bool = False


@attrs.frozen
class NSQConfig:
    enabled: bool = True
    tcp_port: int = DEFAULT_NSQ_TCP_PORT
    http_port: int = DEFAULT_NSQ_HTTP_PORT
    msg_timeout_ms: int = NSQ_DEFAULTS.msg_timeout_ms
    max_msg_timeout_ms: int = NSQ_DEFAULTS.max_msg_timeout_ms
    max_req_timeout_ms: int = NSQ_DEFAULTS.max_req_timeout_ms
    max_msg_size: int = NSQ_DEFAULTS.max_msg_size
    max_body_size: int = NSQ_DEFAULTS.max_body_size
    max_rdy_count: int = NSQ_DEFAULTS.max_rdy_count
    max_heartbeat_interval_ms: int = NSQ_DEFAULTS.max_heartbeat_interval_ms
    max_output_buffer_size: int = NSQ_DEFAULTS.max_output_buffer_size
    min_output_buffer_timeout_ms: int = NSQ_DEFAULTS.min_output_buffer_timeout_ms
    max_output_buffer_timeout_ms: int = NSQ_DEFAULTS.max_output_buffer_timeout_ms
    deflate: bool = NSQ_DEFAULTS.deflate_enabled
    max_deflate_level: int = NSQ_DEFAULTS.max_deflate_level
    snappy: bool = NSQ_DEFAULTS.snappy_enabled
    tls_cert: Path | None = None
    tls_key: Path | None = None
    tls_required: bool = False
    auth_http_address: str | None = None

    def limits(self) -> ServerLimits:
        return ServerLimits(
            max_msg_size=self.max_msg_size, max_body_size=self.max_body_size, max_rdy_count=self.max_rdy_count,
            msg_timeout_ms=self.msg_timeout_ms, max_msg_timeout_ms=self.max_msg_timeout_ms,
            max_req_timeout_ms=self.max_req_timeout_ms, max_heartbeat_interval_ms=self.max_heartbeat_interval_ms,
            max_output_buffer_size=self.max_output_buffer_size,
            min_output_buffer_timeout_ms=self.min_output_buffer_timeout_ms,
            max_output_buffer_timeout_ms=self.max_output_buffer_timeout_ms,
            deflate_enabled=self.deflate, max_deflate_level=self.max_deflate_level, snappy_enabled=self.snappy,
            tls_available=self.tls_cert is not None, tls_required=self.tls_required,
            auth_enabled=self.auth_http_address is not None,
        )


@attrs.frozen
class MQKSConfig:
    enabled: bool = True
    port: int = DEFAULT_MQKS_PORT
    max_line: int = MQKS_MAX_LINE_LENGTH
    consumer_window: int = MQKSLimits().consumer_window
    keep_unconsumed: bool = False

    def limits(self) -> MQKSLimits:
        return attrs.evolve(MQKSLimits(), max_line_length=self.max_line, consumer_window=self.consumer_window,
                            keep_unconsumed_rebound=self.keep_unconsumed)


@attrs.frozen
class PHPMQConfig:
    enabled: bool = True
    port: int = DEFAULT_PHPMQ_PORT
    max_content: int = PHPMQ_MAX_CONTENT
    max_window: int = PHPMQLimits().max_window
    generation: str = "pinned"
    ack_timeout_ms: int = 0
    max_attempts: int = 0
    forget_empty_after_s: float = PHPMQ_FORGET_EMPTY_AFTER_S
    console_port: int = DEFAULT_PHPMQ_CONSOLE_PORT
    console_bind: str = DEFAULT_BIND
    console_destructive: bool = True

    def limits(self) -> PHPMQLimits:
        return PHPMQLimits(max_content=self.max_content, max_window=self.max_window,
                           current_generation=self.generation == "current",
                           ack_timeout=self.ack_timeout_ms / 1000 if self.ack_timeout_ms else None,
                           max_attempts=self.max_attempts,
                           forget_empty_after=None if self.forget_empty_after_s < 0 else self.forget_empty_after_s)


@attrs.frozen
class PZQConfig:
    enabled: bool = True
    receive_port: int = DEFAULT_PZQ_RECEIVE_PORT
    send_port: int = DEFAULT_PZQ_SEND_PORT
    monitor_port: int = DEFAULT_PZQ_MONITOR_PORT
    queue: str = "pzq"
    ack_timeout_ms: int = int(DEFAULT_ACK_TIMEOUT_S * 1000)
    window: int = DEFAULT_WINDOW
    max_message: int = DEFAULT_MAX_MESSAGE

    def limits(self) -> PZQLimits:
        return PZQLimits(queue=self.queue, ack_timeout=self.ack_timeout_ms / 1000, window=self.window,
                         max_message=self.max_message)


@attrs.frozen
class EMQPConfig:
    enabled: bool = True
    backend_port: int = DEFAULT_EMQP_BACKEND_PORT
    frontend_port: int = DEFAULT_EMQP_FRONTEND_PORT
    admin_port: int = DEFAULT_EMQP_ADMIN_PORT
    pubsub_in_port: int = DEFAULT_EMQP_PUBSUB_IN_PORT
    pubsub_out_port: int = DEFAULT_EMQP_PUBSUB_OUT_PORT
    admin_bind: str = DEFAULT_BIND
    admin_disconnect: bool = False
    heartbeat_interval_ms: int = int(emqp_adapter.HEARTBEAT_INTERVAL_S * 1000)
    heartbeat_timeout_ms: int = int(emqp_adapter.HEARTBEAT_TIMEOUT_S * 1000)
    max_depth: int = 0
    reroute_unknown: bool = False
    max_attempts: int = emqp_adapter.DEFAULT_MAX_ATTEMPTS
    max_message: int = emqp_adapter.DEFAULT_MAX_MESSAGE

    def limits(self) -> EMQPLimits:
        return EMQPLimits(heartbeat_interval=self.heartbeat_interval_ms / 1000,
                          heartbeat_timeout=self.heartbeat_timeout_ms / 1000, max_message=self.max_message,
                          max_depth=self.max_depth, reroute_unknown=self.reroute_unknown,
                          admin_disconnect=self.admin_disconnect, max_attempts=self.max_attempts)


@attrs.frozen
class LogConfig:
    level: str = "info"
    format: str = "text"


@attrs.frozen
class Config:
    bind: str = DEFAULT_BIND
    storage: StorageConfig = attrs.field(factory=StorageConfig)
    nsq: NSQConfig = attrs.field(factory=NSQConfig)
    mqks: MQKSConfig = attrs.field(factory=MQKSConfig)
    phpmq: PHPMQConfig = attrs.field(factory=PHPMQConfig)
    pzq: PZQConfig = attrs.field(factory=PZQConfig)
    emqp: EMQPConfig = attrs.field(factory=EMQPConfig)
    log: LogConfig = attrs.field(factory=LogConfig)

    def port(self, listener: str) -> int | None:
        """The port of a listener (`nsq-tcp`, `mqks`, `pzq-send`, …); None when it is off."""
        port, enabled = {
            "nsq-tcp": (self.nsq.tcp_port, self.nsq.enabled),
            "nsq-http": (self.nsq.http_port, self.nsq.enabled),
            "mqks": (self.mqks.port, self.mqks.enabled),
            "phpmq": (self.phpmq.port, self.phpmq.enabled),
            "phpmq-console": (self.phpmq.console_port, self.phpmq.enabled),
            "pzq-receive": (self.pzq.receive_port, self.pzq.enabled),
            "pzq-send": (self.pzq.send_port, self.pzq.enabled),
            "pzq-monitor": (self.pzq.monitor_port, self.pzq.enabled),
            "emqp-backend": (self.emqp.backend_port, self.emqp.enabled),
            "emqp-frontend": (self.emqp.frontend_port, self.emqp.enabled),
            "emqp-admin": (self.emqp.admin_port, self.emqp.enabled),
            "emqp-pubsub-in": (self.emqp.pubsub_in_port, self.emqp.enabled),
            "emqp-pubsub-out": (self.emqp.pubsub_out_port, self.emqp.enabled),
        }[listener]
        return port if enabled and port >= 0 else None

    def host(self, listener: str) -> str:
        """The address a listener binds to: `bind`, but the admin consoles' own for them."""
        return {"phpmq-console": self.phpmq.console_bind, "emqp-admin": self.emqp.admin_bind}.get(listener, self.bind)


converter = cattrs.Converter()
converter.register_structure_hook(Path, lambda value, _: Path(value))
converter.register_unstructure_hook(Path, str)
converter.register_structure_hook(FsyncPolicy, lambda value, _: FsyncType().convert(value, None, None))
converter.register_unstructure_hook(FsyncPolicy, str)


class ConfigError(click.UsageError):
    """A bad option value from the config file (flags and variables get click's own errors)."""


# -- the config file ---------------------------------------------------------------------------


def _key_lines(text: str) -> dict[str, int]:
    """The line of each `key = …` of a TOML file, by dotted key (for error messages)."""
    lines: dict[str, int] = {}
    section = ""
    for number, line in enumerate(text.splitlines(), start=1):
        stripped = line.strip()
        header = re.fullmatch(r"\[\s*([A-Za-z0-9_.-]+)\s*\]\s*(#.*)?", stripped)
        if header:
            section = header.group(1)
            lines.setdefault(section, number)
            continue
        key = re.match(r"([A-Za-z0-9_-]+)\s*=", stripped)
        if key:
            lines.setdefault(f"{section}.{key.group(1)}" if section else key.group(1), number)
    return lines


def _where(path: Path, lines: Mapping[str, int], key: str) -> str:
    line = lines.get(key)
    return f"{path} line {line}" if line else str(path)


def read_file(path: Path) -> dict[str, tuple[Any, str]]:
    """The options a TOML file sets: dotted key → (checked value, where it was set)."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigError(f"cannot read config file {path}: {getattr(error, 'strerror', None) or error}") from None
    try:
        document = tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(f"{path}: not valid TOML: {error}") from None
    lines = _key_lines(text)
    flat: dict[str, Any] = {}
    for name, value in document.items():
        if isinstance(value, dict) and name in SECTIONS:
            flat.update({f"{name}.{key}": item for key, item in value.items()})
        else:
            flat[name] = value
    found: dict[str, tuple[Any, str]] = {}
    for key, value in flat.items():
        where = _where(path, lines, key)
        option = OPTIONS_BY_KEY.get(key)
        if option is None:
            raise ConfigError(f"{where}: unknown option {key!r} (`polymq config --show` lists them)")
        if isinstance(value, dict | list):
            raise ConfigError(f"{where}: {key} must be a single value")
        if isinstance(option.type, click.Path) and isinstance(value, str) and not Path(value).is_absolute():
            value = str(path.parent / value)
        try:
            checked = option.type.convert(value, None, None)
        except click.BadParameter as error:
            raise ConfigError(f"{where}: {key}: {error.message}") from None
        if option.is_switch and not isinstance(value, bool):
            raise ConfigError(f"{where}: {key} must be true or false, not {value!r}")
        found[key] = (checked, where)
    return found


class SourcedOption(click.Option):
    """An option whose error names where the bad value came from: the flag or the variable."""

    def get_error_hint(self, ctx: click.Context | None) -> str:
        flag = "/".join(f"'{opt}'" for opt in self.opts)
        if ctx is not None and self.name and ctx.get_parameter_source(self.name) is ParameterSource.ENVIRONMENT:
            return f"variable {self.envvar!s}"
        return flag


# -- from the command line to a Config ----------------------------------------------------------

F = TypeVar("F", bound=Callable[..., Any])


def click_options(function: F) -> F:
    """Adds `--config` and every option of the table to a click command."""
    for option in reversed(OPTIONS):
        flag = option.flag
        kwargs: dict[str, Any] = {"cls": SourcedOption, "envvar": option.envvar, "show_envvar": True,
                                  "help": option.help, "default": option.default}
        if "/" in flag:
            declarations = [flag]
        elif option.type is click.BOOL:
            declarations, kwargs["is_flag"] = [flag], True
        else:
            declarations = [flag]
            kwargs["type"] = option.type
            kwargs["show_default"] = option.default is not None and str(option.default)
        function = click.option(*declarations, option.name, **kwargs)(function)
    return click.option(
        "--config", "config_file", type=click.Path(dir_okay=False, path_type=Path), envvar=ENV_PREFIX + "CONFIG",
        show_envvar=True, default=None, help="A TOML config file (`polymq config --show` prints one).",
    )(function)


def from_command_line(ctx: click.Context, values: Mapping[str, Any]) -> Config:
    """The effective config: a flag wins over a variable, a variable over the file, the file over the default."""
    from_file: dict[str, tuple[Any, str]] = {}
    config_file = values.get("config_file")
    if config_file is not None:
        from_file = read_file(config_file)
    chosen: dict[str, Any] = {}
    for option in OPTIONS:
        source = ctx.get_parameter_source(option.name)
        value = values[option.name]
        if source in (ParameterSource.DEFAULT, None) and option.key in from_file:
            value = from_file[option.key][0]
        chosen[option.key] = value
    return build(chosen)


def build(chosen: Mapping[str, Any]) -> Config:
    """A Config from checked values by dotted key (missing keys keep their defaults)."""
    nested: dict[str, Any] = {}
    for key, value in chosen.items():
        section, _, field = key.rpartition(".")
        (nested.setdefault(section, {}) if section else nested)[field] = value
    return converter.structure(nested, Config)


# -- printing a config --------------------------------------------------------------------------


def _wrap(text: str, width: int = 98) -> Iterable[str]:
    line = "#"
    for word in text.split():
        if len(line) + 1 + len(word) > width:
            yield line
            line = "#"
        line += " " + word
    yield line


def to_toml(config: Config) -> str:
    """The config as TOML, every option with its help, flag and variable as a comment."""
    data = converter.unstructure(config)
    out = ["# polymq's configuration: `polymq serve --config FILE`. Flags and POLYMQ_* variables win over",
           "# this file. Printed by `polymq config --show`; every option is described in docs/operations.md."]
    for section in SECTIONS:
        values = data[section] if section else data
        out.append("")
        if section:
            out.append(f"[{section}]")
        for option in OPTIONS:
            if option.section != section:
                continue
            out.extend(_wrap(f"{option.help} ({option.flag.split('/')[0]}, {option.envvar})"))
            value = values[option.field]
            if value is None:
                out.append(f"# {option.field} = (not set)")
            else:
                out.append(tomli_w.dumps({option.field: value}).rstrip("\n"))
    return "\n".join(out) + "\n"
