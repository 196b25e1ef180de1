"""NSQ V2: the TCP protocol (`tcp.py`) and the nsqd HTTP API (`http.py`, `http_api.py`) on one engine.

docs/protocols/nsq.md describes what polymq does on the wire and how it differs from nsqd 1.3.0.
"""

from __future__ import annotations

import socket
import ssl
from pathlib import Path
from typing import Any

import click
import trio

from polymq.adapters.nsq.http import serve_nsq_http
from polymq.adapters.nsq.lookupd import LookupdRegistrar, NodeIdentity
from polymq.adapters.nsq.tcp import NSQServer, shown_id
from polymq.adapters.protocol import PORT, Context, Endpoint, Protocol, ServiceError, Setting
from polymq.adapters.session import TcpService
from polymq.codecs.nsq import ServerLimits

# nsqd's default ports.
DEFAULT_NSQ_TCP_PORT = 4150
DEFAULT_NSQ_HTTP_PORT = 4151
NSQ_DEFAULTS = ServerLimits()


class AddressType(click.ParamType):
    name = "host:port"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> str:
        text = str(value)
        host, sep, port = text.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            self.fail(f"must be host:port, not {text!r}", param, ctx)
        return text


SETTINGS = (
    Setting("tcp_port", "--nsq-tcp-port", PORT, DEFAULT_NSQ_TCP_PORT, "NSQ V2 TCP port (0 = any free, -1 = off)."),
    Setting("http_port", "--nsq-http-port", PORT, DEFAULT_NSQ_HTTP_PORT,
           "nsqd HTTP API port (0 = any free, -1 = off)."),
    Setting("max_connections", "--nsq-max-connections", click.IntRange(min=0), 0,
           "NSQ TCP clients connected at once; one more gets E_TOO_MANY_CONNECTIONS and is closed "
           "(0 = no limit, as nsqd)."),
    Setting("msg_timeout_ms", "--msg-timeout", click.IntRange(min=1), NSQ_DEFAULTS.msg_timeout_ms,
           "Default time a consumer has to FIN a message, in ms (nsqd's --msg-timeout)."),
    Setting("max_msg_timeout_ms", "--max-msg-timeout", click.IntRange(min=1), NSQ_DEFAULTS.max_msg_timeout_ms,
           "Longest msg_timeout a client may ask for in IDENTIFY, in ms (nsqd's --max-msg-timeout)."),
    Setting("max_req_timeout_ms", "--max-req-timeout", click.IntRange(min=0), NSQ_DEFAULTS.max_req_timeout_ms,
           "Longest REQ and DPUB delay, in ms (nsqd's --max-req-timeout)."),
    Setting("max_msg_size", "--max-msg-size", click.IntRange(min=1), NSQ_DEFAULTS.max_msg_size,
           "Largest message body in bytes (nsqd's --max-msg-size)."),
    Setting("max_body_size", "--max-body-size", click.IntRange(min=1), NSQ_DEFAULTS.max_body_size,
           "Largest MPUB body in bytes (nsqd's --max-body-size)."),
    Setting("max_rdy_count", "--max-rdy-count", click.IntRange(min=1), NSQ_DEFAULTS.max_rdy_count,
           "Largest RDY a client may send (nsqd's --max-rdy-count)."),
    Setting("max_heartbeat_interval_ms", "--max-heartbeat-interval", click.IntRange(min=1000),
           NSQ_DEFAULTS.max_heartbeat_interval_ms,
           "Longest heartbeat_interval a client may ask for, in ms (nsqd's --max-heartbeat-interval)."),
    Setting("max_output_buffer_size", "--max-output-buffer-size", click.IntRange(min=64),
           NSQ_DEFAULTS.max_output_buffer_size,
           "Largest output_buffer_size a client may ask for, in bytes (nsqd's --max-output-buffer-size)."),
    Setting("min_output_buffer_timeout_ms", "--min-output-buffer-timeout", click.IntRange(min=1),
           NSQ_DEFAULTS.min_output_buffer_timeout_ms,
           "Shortest output_buffer_timeout a client may ask for, in ms (nsqd's --min-output-buffer-timeout)."),
    Setting("max_output_buffer_timeout_ms", "--max-output-buffer-timeout", click.IntRange(min=1),
           NSQ_DEFAULTS.max_output_buffer_timeout_ms,
           "Longest output_buffer_timeout a client may ask for, in ms (nsqd's --max-output-buffer-timeout)."),
    Setting("deflate", "--deflate/--no-deflate", click.BOOL, NSQ_DEFAULTS.deflate_enabled,
           "Offer deflate compression in IDENTIFY (nsqd's --deflate)."),
    Setting("max_deflate_level", "--max-deflate-level", click.IntRange(min=1, max=9),
           NSQ_DEFAULTS.max_deflate_level, "Highest deflate level a client may ask for (nsqd's --max-deflate-level)."),
    Setting("snappy", "--snappy/--no-snappy", click.BOOL, NSQ_DEFAULTS.snappy_enabled,
           "Offer snappy compression in IDENTIFY (nsqd's --snappy)."),
    Setting("tls_cert", "--tls-cert", click.Path(exists=True, dir_okay=False, path_type=Path), None,
           "PEM certificate: enables the NSQ tls_v1 upgrade."),
    Setting("tls_key", "--tls-key", click.Path(exists=True, dir_okay=False, path_type=Path), None,
           "PEM private key of --tls-cert (if not in the certificate's file)."),
    Setting("tls_required", "--tls-required", click.BOOL, False,
           "Refuse every NSQ command but IDENTIFY before TLS (needs --tls-cert)."),
    Setting("auth_http_address", "--auth-http-address", AddressType(), None,
           "host:port of an nsqd-style auth server: enables AUTH."),
    Setting("lookupd_tcp_addresses", "--lookupd-tcp-address", AddressType(), (),
           "host:port of an nsqlookupd's TCP listener to register with (repeatable; nsqd's --lookupd-tcp-address).",
           multiple=True),
    Setting("broadcast_address", "--broadcast-address", click.STRING, None,
           "Address registered with nsqlookupd, which consumers connect to (default: this machine's host name, "
           "as nsqd's --broadcast-address)."),
    Setting("broadcast_tcp_port", "--broadcast-tcp-port", click.IntRange(min=0, max=65535), 0,
           "TCP port registered with nsqlookupd (0 = the NSQ TCP port this node listens on; nsqd's flag)."),
    Setting("broadcast_http_port", "--broadcast-http-port", click.IntRange(min=0, max=65535), 0,
           "HTTP port registered with nsqlookupd (0 = the nsqd HTTP API port this node listens on; nsqd's flag)."),
)


def limits(options: Any) -> ServerLimits:
    """The codec's limits from the options."""
    return ServerLimits(
        max_msg_size=options.max_msg_size, max_body_size=options.max_body_size, max_rdy_count=options.max_rdy_count,
        msg_timeout_ms=options.msg_timeout_ms, max_msg_timeout_ms=options.max_msg_timeout_ms,
        max_req_timeout_ms=options.max_req_timeout_ms, max_heartbeat_interval_ms=options.max_heartbeat_interval_ms,
        max_output_buffer_size=options.max_output_buffer_size,
        min_output_buffer_timeout_ms=options.min_output_buffer_timeout_ms,
        max_output_buffer_timeout_ms=options.max_output_buffer_timeout_ms,
        deflate_enabled=options.deflate, max_deflate_level=options.max_deflate_level, snappy_enabled=options.snappy,
        tls_available=options.tls_cert is not None, tls_required=options.tls_required,
        auth_enabled=options.auth_http_address is not None,
    )


def check(options: Any) -> ssl.SSLContext | None:
    """What must hold before anything is bound: the lookupds get both ports; the TLS context loads."""
    if options.lookupd_tcp_addresses:
        for port, setting, flag in ((options.tcp_port, options.broadcast_tcp_port, "--nsq-tcp-port"),
                                    (options.http_port, options.broadcast_http_port, "--nsq-http-port")):
            if port < 0 and not setting:
                raise ServiceError(f"--lookupd-tcp-address registers this node's NSQ TCP and HTTP ports, but {flag} "
                                   "is -1 (off): turn it on, or name the port to register with "
                                   f"--broadcast-{flag.rsplit('-', 2)[1]}-port")
    return ssl_context(options)


def ssl_context(options: Any) -> ssl.SSLContext | None:
    """The TLS context of the tls_v1 upgrade, loaded before anything is bound."""
    if options.tls_cert is None:
        if options.tls_required:
            raise ServiceError("--tls-required needs a certificate: give --tls-cert (and --tls-key)")
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        context.load_cert_chain(str(options.tls_cert), str(options.tls_key) if options.tls_key else None)
    except (OSError, ssl.SSLError) as error:
        key = options.tls_key or "in the same file"
        raise ServiceError(f"cannot load the TLS certificate {options.tls_cert} (key {key}): "
                           f"{getattr(error, 'reason', None) or error}") from error
    return context


class NSQService(TcpService):
    """The TCP listener on the session skeleton, and the HTTP API beside it."""

    def __init__(self, context: Context) -> None:
        options = context.options
        self.engine = context.engine
        self.server = NSQServer(context.engine, limits(options), ssl_context=context.checked,
                                auth_http_address=options.auth_http_address)
        self.tcp = context.listeners.get("nsq-tcp")
        self.http = context.listeners.get("nsq-http")
        if self.tcp is not None:
            self.server.tcp_port = self.tcp.getsockname()[1]
        if self.http is not None:
            self.server.http_port = self.http.getsockname()[1]
        address = context.gateway.http_address
        self.info_extra = {"polymq_http_address": address} if address else {}
        # nsqd registers its broadcast address and, unless told others, the ports it listens on.
        self.server.broadcast_address = options.broadcast_address or socket.gethostname()
        self.server.broadcast_tcp_port = options.broadcast_tcp_port or self.server.tcp_port
        self.server.broadcast_http_port = options.broadcast_http_port or self.server.http_port
        identity = NodeIdentity(self.server.broadcast_address, self.server.broadcast_tcp_port,
                                self.server.broadcast_http_port, self.server.limits.version, self.server.hostname)
        self.lookupd = LookupdRegistrar(self.engine, identity, options.lookupd_tcp_addresses,
                                        max_response=options.max_body_size)
        self.server.max_connections = options.max_connections
        super().__init__([(self.tcp, self.server)] if self.tcp is not None else [], context.gateway.output_limit)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            await nursery.start(super().run)
            http = self.http
            if http is not None:
                await nursery.start(lambda task_status: serve_nsq_http(
                    self.engine, self.server, http, info_extra=self.info_extra, lookupd=self.lookupd,
                    task_status=task_status))
            # Registered once both listeners serve, so a consumer told of this node can connect.
            await nursery.start(self.lookupd.run)
            task_status.started()

    async def stop(self) -> None:
        # Out of every lookupd's lists first, so that no consumer is sent to a node that is closing.
        await self.lookupd.stop()
        await super().stop()


PROTOCOL = Protocol(
    name="nsq",
    title="NSQ V2 (TCP and the nsqd HTTP API)",
    settings=SETTINGS,
    endpoints=(Endpoint("nsq-tcp", "tcp_port"), Endpoint("nsq-http", "http_port")),
    check=check,
    start=NSQService,
    conformance="polymq.conformance.nsq:command",
    bench="polymq.bench.nsq:command",
    shown_id=shown_id,
)
