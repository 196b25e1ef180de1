"""MQKS: the line protocol on TCP (`session.py`) and the original's stats expressions (`stats.py`).

docs/protocols/mqks.md describes what polymq does on the wire and how it differs from the original.
"""

from __future__ import annotations

import attrs
import click

from polymq.adapters.mqks.session import MQKSLimits, MQKSServer, shown_id
from polymq.adapters.protocol import PORT, Context, Endpoint, Protocol, Setting
from polymq.adapters.session import TcpService
from polymq.codecs.mqks import MAX_LINE_LENGTH as MQKS_MAX_LINE_LENGTH

# The original MQKS's first worker: a one-worker deployment listens on 25000.
DEFAULT_MQKS_PORT = 25000

SETTINGS = (
    Setting("port", "--mqks-port", PORT, DEFAULT_MQKS_PORT, "MQKS TCP port (0 = any free, -1 = off)."),
    Setting("max_connections", "--mqks-max-connections", click.IntRange(min=0), 0,
           "MQKS clients connected at once; one more gets an error line (`None error …`) and is closed "
           "(0 = no limit)."),
    Setting("max_line", "--mqks-max-line", click.IntRange(min=64), MQKS_MAX_LINE_LENGTH,
           "Longest MQKS request line in bytes; a longer one is answered with an error and skipped."),
    Setting("consumer_window", "--mqks-consumer-window", click.IntRange(min=1), MQKSLimits().consumer_window,
           "Deliveries an MQKS consumer may hold: unacknowledged (manual-ack) or not yet written (auto-ack)."),
    Setting("keep_unconsumed", "--mqks-keep-unconsumed", click.BOOL, False,
           "Keep events published to a queue bound only by rebind that no one has consumed yet "
           "(the original MQKS drops them)."),
)


def start(context: Context) -> TcpService:
    options = context.options
    server = MQKSServer(context.engine, attrs.evolve(
        MQKSLimits(), max_line_length=options.max_line, consumer_window=options.consumer_window,
        keep_unconsumed_rebound=options.keep_unconsumed))
    sock = context.listeners.get("mqks")
    if sock is None:
        return TcpService([])
    server.host, server.port = sock.getsockname()[:2]
    server.max_connections = options.max_connections
    return TcpService([(sock, server)], context.gateway.output_limit)


PROTOCOL = Protocol(
    name="mqks",
    title="MQKS",
    settings=SETTINGS,
    endpoints=(Endpoint("mqks", "port"),),
    start=start,
    conformance="polymq.conformance.mqks:command",
    bench="polymq.bench.mqks:command",
    shown_id=shown_id,
)
