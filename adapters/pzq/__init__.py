"""PZQ over ZeroMQ (`service.py`): the receive, send and monitor sockets.

docs/protocols/pzq.md describes what polymq does on the wire and how it differs from the original.
"""

from __future__ import annotations

import click
import zmq

from polymq.adapters.protocol import PORT, Context, Endpoint, Protocol, ServersService, Setting
from polymq.adapters.pzq.service import (
    DEFAULT_ACK_TIMEOUT_S,
    DEFAULT_MAX_MESSAGE,
    DEFAULT_WINDOW,
    MONITOR_MAX_MESSAGE,
    PZQLimits,
    PZQServer,
    shown_id,
)
from polymq.adapters.zmq_sockets import SocketSpec

# The ports PZQ deployments use for its receive, send and monitor sockets.
DEFAULT_PZQ_RECEIVE_PORT = 11131
DEFAULT_PZQ_SEND_PORT = 11132
DEFAULT_PZQ_MONITOR_PORT = 11133

SETTINGS = (
    Setting("receive_port", "--pzq-receive-port", PORT, DEFAULT_PZQ_RECEIVE_PORT,
           "PZQ receive socket (producers' DEALERs connect) TCP port (0 = any free, -1 = off)."),
    Setting("send_port", "--pzq-send-port", PORT, DEFAULT_PZQ_SEND_PORT,
           "PZQ send socket (consumers' ROUTERs connect) TCP port (0 = any free, -1 = off)."),
    Setting("monitor_port", "--pzq-monitor-port", PORT, DEFAULT_PZQ_MONITOR_PORT,
           "PZQ monitor socket (REQ clients ask MONITOR) TCP port (0 = any free, -1 = off)."),
    Setting("queue", "--pzq-queue", click.STRING, "pzq",
           "The queue (and topic) PZQ producers publish to and PZQ consumers read."),
    Setting("ack_timeout_ms", "--pzq-ack-timeout", click.IntRange(min=1), int(DEFAULT_ACK_TIMEOUT_S * 1000),
           "Time a PZQ consumer has to ACK a delivery before it is sent again, in ms (the original's "
           "--ack-timeout, 5 s)."),
    Setting("window", "--pzq-window", click.IntRange(min=1), DEFAULT_WINDOW,
           "Deliveries each connected PZQ consumer may hold unacknowledged."),
    Setting("max_message", "--pzq-max-message", click.IntRange(min=1), DEFAULT_MAX_MESSAGE,
           "Largest producer message (all its frames) in bytes; ZeroMQ drops a larger one as it arrives."),
)


def start(context: Context) -> ServersService:
    options = context.options
    if context.zmq is None:
        return ServersService()
    return ServersService(PZQServer(context.engine, context.zmq, PZQLimits(
        queue=options.queue, ack_timeout=options.ack_timeout_ms / 1000, window=options.window,
        max_message=options.max_message)))


PROTOCOL = Protocol(
    name="pzq",
    title="PZQ (ZeroMQ)",
    settings=SETTINGS,
    endpoints=(
        # ROUTER_MANDATORY: an ACK waits at a full pipe, never dropped.
        Endpoint("pzq-receive", "receive_port",
                 zmq=lambda options: SocketSpec(zmq.ROUTER, None, options.max_message, mandatory=True)),
        # Its connection events count the consumers.
        Endpoint("pzq-send", "send_port",
                 zmq=lambda options: SocketSpec(zmq.DEALER, None, options.max_message, watch_peers=True)),
        Endpoint("pzq-monitor", "monitor_port",
                 zmq=lambda options: SocketSpec(zmq.ROUTER, None, MONITOR_MAX_MESSAGE, mandatory=True)),
    ),
    start=start,
    conformance="polymq.conformance.pzq:command",
    shown_id=shown_id,
    bench="polymq.bench.pzq:command",
)
