"""PHPMQ: the packet protocol on TCP (`session.py`) and its maintenance console (`console.py`).

docs/protocols/phpmq.md describes what polymq does on the wire and how it differs from the original.
"""

from __future__ import annotations

import click

from polymq.adapters.named_queue import forget_their_topics
from polymq.adapters.phpmq.console import ConsoleServer
from polymq.adapters.phpmq.session import FORGET_EMPTY_AFTER_S, PHPMQLimits, PHPMQServer, shown_id
from polymq.adapters.protocol import PORT, Context, Endpoint, Protocol, Setting
from polymq.adapters.session import TcpService
from polymq.codecs.phpmq import MAX_CONTENT as PHPMQ_MAX_CONTENT

# The original PHPMQ server's message-queue port and maintenance console (its config/phpmq.default.xml).
DEFAULT_PHPMQ_PORT = 9100
DEFAULT_PHPMQ_CONSOLE_PORT = 9101
# The console binds loopback whatever --bind says: its flush commands delete messages.
DEFAULT_CONSOLE_BIND = "127.0.0.1"

SETTINGS = (
    Setting("port", "--phpmq-port", PORT, DEFAULT_PHPMQ_PORT, "PHPMQ TCP port (0 = any free, -1 = off)."),
    Setting("max_connections", "--phpmq-max-connections", click.IntRange(min=0), 0,
           "PHPMQ clients connected at once; one more is closed (PHPMQ has no error packet; 0 = no limit)."),
    Setting("max_content", "--phpmq-max-content", click.IntRange(min=1), PHPMQ_MAX_CONTENT,
           "Largest packet content in bytes (a message's body, its queue name); a larger one closes the "
           "connection before anything is allocated for it."),
    Setting("max_window", "--phpmq-max-window", click.IntRange(min=1), PHPMQLimits().max_window,
           "Largest consume window (002's count) honoured; a larger one is taken as this."),
    Setting("generation", "--phpmq-generation", click.Choice(["pinned", "current"]), "pinned",
           "pinned: deliveries (003) without the TTL packet, as the published client expects, except to "
           "connections that sent a TTL, 005 or 006; current: every 003 carries the remaining TTL."),
    Setting("ack_timeout_ms", "--phpmq-ack-timeout", click.IntRange(min=0), 0,
           "Time a PHPMQ delivery may stay unacknowledged before it goes back to its queue, in ms "
           "(0 = never, as the original)."),
    Setting("max_attempts", "--phpmq-max-attempts", click.IntRange(min=0), 0,
           "Deliveries after which a message that comes back again goes to the dead-letter queue "
           "<queue>.dead (0 = no limit); set on the queues PHPMQ creates."),
    Setting("forget_empty_after_s", "--phpmq-forget-empty", click.FloatRange(min=-1),
           FORGET_EMPTY_AFTER_S,
           "Seconds after its last consumer left that an empty queue PHPMQ created is deleted, with its "
           "topic when nothing else uses it (the original keeps no empty queue; -1 = keep them)."),
    Setting("console_port", "--phpmq-console-port", PORT, DEFAULT_PHPMQ_CONSOLE_PORT,
           "PHPMQ maintenance console TCP port (0 = any free, -1 = off)."),
    Setting("console_bind", "--phpmq-console-bind", click.STRING, DEFAULT_CONSOLE_BIND,
           "Address the maintenance console binds to, whatever --bind says (loopback by default: its "
           "flush commands delete messages)."),
    Setting("console_destructive", "--phpmq-console-destructive/--no-phpmq-console-destructive", click.BOOL,
           True, "Allow the console's flush and flushall (each asks for a yes first)."),
)


def start(context: Context) -> TcpService:
    options, engine = context.options, context.engine
    forget_their_topics(engine)  # the forgotten queues' topics go with them (restored ones too)
    served = []
    sock = context.listeners.get("phpmq")
    if sock is not None:
        server = PHPMQServer(engine, PHPMQLimits(
            max_content=options.max_content, max_window=options.max_window,
            current_generation=options.generation == "current",
            ack_timeout=options.ack_timeout_ms / 1000 if options.ack_timeout_ms else None,
            max_attempts=options.max_attempts,
            forget_empty_after=None if options.forget_empty_after_s < 0 else options.forget_empty_after_s))
        server.max_connections = options.max_connections
        served.append((sock, server))
    console = context.listeners.get("phpmq-console")
    if console is not None:
        served.append((console, ConsoleServer(engine, destructive=options.console_destructive)))
    return TcpService(served, context.gateway.output_limit)


PROTOCOL = Protocol(
    name="phpmq",
    title="PHPMQ (and its maintenance console)",
    settings=SETTINGS,
    endpoints=(Endpoint("phpmq", "port"), Endpoint("phpmq-console", "console_port", host="console_bind")),
    start=start,
    conformance="polymq.conformance.phpmq:command",
    bench="polymq.bench.phpmq:command",
    shown_id=shown_id,
)
