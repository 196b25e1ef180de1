"""eMQP (EventMQ) over ZeroMQ: the broker (`broker.py`: backend, frontend and admin sockets) and
the pub/sub device (`pubsub.py`).

docs/protocols/emqp.md describes what polymq does on the wire and how it differs from the original.
"""

from __future__ import annotations

import click
import zmq

from polymq.adapters.emqp.broker import (
    ADMIN_MAX_MESSAGE,
    DEFAULT_MAX_ATTEMPTS,
    DEFAULT_MAX_MESSAGE,
    DEFAULT_WORKER_PROCESSES,
    FORGET_EMPTY_AFTER_S,
    HEARTBEAT_INTERVAL_S,
    HEARTBEAT_TIMEOUT_S,
    EMQPBroker,
    EMQPLimits,
    shown_id,
)
from polymq.adapters.emqp.pubsub import EMQPPubSub
from polymq.adapters.named_queue import forget_their_topics
from polymq.adapters.protocol import PORT, Context, Endpoint, Protocol, ServersService, Setting
from polymq.adapters.zmq_sockets import SocketSpec

# EventMQ's ports (its conf.py): jobmanagers, clients and schedulers, emq-cli.
DEFAULT_EMQP_BACKEND_PORT = 47290
DEFAULT_EMQP_FRONTEND_PORT = 47291
DEFAULT_EMQP_ADMIN_PORT = 47293
# emq-pubsub's: publishers in, subscribers out.
DEFAULT_EMQP_PUBSUB_IN_PORT = 47298
DEFAULT_EMQP_PUBSUB_OUT_PORT = 47299
# The admin socket binds loopback whatever --bind says: DISCONNECT can stop the gateway.
DEFAULT_ADMIN_BIND = "127.0.0.1"
# The broker's sockets (the pub/sub device's are apart).
BROKER_SOCKETS = ("emqp-backend", "emqp-frontend", "emqp-admin")
PUBSUB_SOCKETS = ("emqp-pubsub-in", "emqp-pubsub-out")

SETTINGS = (
    Setting("backend_port", "--emqp-backend-port", PORT, DEFAULT_EMQP_BACKEND_PORT,
           "eMQP backend socket (jobmanagers connect) TCP port (0 = any free, -1 = off)."),
    Setting("frontend_port", "--emqp-frontend-port", PORT, DEFAULT_EMQP_FRONTEND_PORT,
           "eMQP frontend socket (clients and schedulers connect) TCP port (0 = any free, -1 = off)."),
    Setting("admin_port", "--emqp-admin-port", PORT, DEFAULT_EMQP_ADMIN_PORT,
           "eMQP admin socket (emq-cli connects) TCP port (0 = any free, -1 = off)."),
    Setting("pubsub_in_port", "--emqp-pubsub-in-port", PORT, DEFAULT_EMQP_PUBSUB_IN_PORT,
           "eMQP pub/sub input socket (PUBLISH senders connect) TCP port (0 = any free, -1 = off)."),
    Setting("pubsub_out_port", "--emqp-pubsub-out-port", PORT, DEFAULT_EMQP_PUBSUB_OUT_PORT,
           "eMQP pub/sub output socket (ZeroMQ SUBs connect) TCP port (0 = any free, -1 = off)."),
    Setting("admin_bind", "--emqp-admin-bind", click.STRING, DEFAULT_ADMIN_BIND,
           "Address the eMQP admin socket binds to, whatever --bind says (loopback by default)."),
    Setting("admin_disconnect", "--emqp-admin-disconnect/--no-emqp-admin-disconnect", click.BOOL, False,
           "Let DISCONNECT on the admin socket stop the gateway (no other peer's DISCONNECT ever does)."),
    Setting("heartbeat_interval_ms", "--emqp-heartbeat-interval", click.IntRange(min=1),
           int(HEARTBEAT_INTERVAL_S * 1000),
           "Time between the broker's HEARTBEATs to each worker and scheduler, in ms (the original's 3 s)."),
    Setting("heartbeat_timeout_ms", "--emqp-heartbeat-timeout", click.IntRange(min=1),
           int(HEARTBEAT_TIMEOUT_S * 1000),
           "Silence after which a worker or scheduler is gone and its jobs go to other workers, in ms "
           "(the original's 5 s)."),
    Setting("max_depth", "--emqp-max-depth", click.IntRange(min=0), 0,
           "Requests a queue may hold waiting for a worker; more are refused with a REPLY (0 = no limit)."),
    Setting("reroute_unknown", "--emqp-reroute-unknown/--no-emqp-reroute-unknown", click.BOOL, False,
           "Send a request for a queue nobody consumes to 'default' (the original's rule) instead of "
           "keeping it in its own queue."),
    Setting("max_attempts", "--emqp-max-attempts", click.IntRange(min=0), DEFAULT_MAX_ATTEMPTS,
           "Deliveries after which a job whose worker went is moved to <queue>.dead instead of being handed "
           "out again (0 = no limit); set on the queues eMQP creates."),
    Setting("forget_empty_after_s", "--emqp-forget-empty", click.FloatRange(min=-1), FORGET_EMPTY_AFTER_S,
           "Seconds after its last worker left that an empty queue eMQP created is deleted, with its topic "
           "when nothing else uses it (the original keeps no queue objects; -1 = keep them)."),
    Setting("worker_processes", "--emqp-worker-processes", click.IntRange(min=1), DEFAULT_WORKER_PROCESSES,
           "Worker processes a jobmanager runs (its CONCURRENT_JOBS): each sends a READY as it starts, so a "
           "worker's first this many READYs end none of its jobs. Fewer than a jobmanager runs can lose the "
           "jobs of one that goes; more hands back jobs it finished."),
    Setting("max_message", "--emqp-max-message", click.IntRange(min=1), DEFAULT_MAX_MESSAGE,
           "Largest eMQP message (all its frames) in bytes; ZeroMQ drops a larger one as it arrives."),
)


def _router(options: object, max_message: int | None = None) -> SocketSpec:
    """The broker's ROUTERs are ROUTER_MANDATORY as the original's: a message for a peer that is
    gone is counted, never queued for nobody."""
    return SocketSpec(zmq.ROUTER, None, max_message or options.max_message, mandatory=True)  # type: ignore[attr-defined]


def start(context: Context) -> ServersService:
    options, sockets = context.options, context.zmq
    if sockets is None:
        return ServersService()
    servers: list[object] = []
    if any(name in sockets.sockets for name in BROKER_SOCKETS):
        forget_their_topics(context.engine)  # the forgotten queues' topics go with them (restored ones too)
        servers.append(EMQPBroker(context.engine, sockets, EMQPLimits(
            heartbeat_interval=options.heartbeat_interval_ms / 1000,
            heartbeat_timeout=options.heartbeat_timeout_ms / 1000, max_message=options.max_message,
            max_depth=options.max_depth, reroute_unknown=options.reroute_unknown,
            admin_disconnect=options.admin_disconnect, max_attempts=options.max_attempts,
            worker_processes=options.worker_processes,
            forget_empty_after=None if options.forget_empty_after_s < 0 else options.forget_empty_after_s),
            stop_gateway=context.gateway.stop))
    if any(name in sockets.sockets for name in PUBSUB_SOCKETS):
        servers.append(EMQPPubSub(context.engine, sockets))
    return ServersService(*servers)


PROTOCOL = Protocol(
    name="emqp",
    title="eMQP (EventMQ, ZeroMQ)",
    settings=SETTINGS,
    endpoints=(
        Endpoint("emqp-backend", "backend_port", zmq=_router),
        Endpoint("emqp-frontend", "frontend_port", zmq=_router),
        Endpoint("emqp-admin", "admin_port", host="admin_bind",
                 zmq=lambda options: _router(options, ADMIN_MAX_MESSAGE)),
        Endpoint("emqp-pubsub-in", "pubsub_in_port",
                 zmq=lambda options: SocketSpec(zmq.ROUTER, None, options.max_message)),
        Endpoint("emqp-pubsub-out", "pubsub_out_port",
                 zmq=lambda options: SocketSpec(zmq.PUB, None, options.max_message)),
    ),
    start=start,
    conformance="polymq.conformance.emqp:command",
    bench="polymq.bench.emqp:command",
    shown_id=shown_id,
)
