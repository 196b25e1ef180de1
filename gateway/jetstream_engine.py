"""`polymq serve --jetstream …`: the engine whose topics and queues live in a JetStream cluster
(`polymq.jetstream`), made from the `[jetstream]` options (docs/cluster.md)."""

from __future__ import annotations

import ssl
from typing import Any

import trio

from polymq.core.clock import Clock
from polymq.core.shared import SharedEngine
from polymq.jetstream.backend import JetStreamLink, JetStreamSettings, open_shared_engine
from polymq.jetstream.nats_connection import NatsError, NatsOptions
from polymq.jetstream.streams import JetStreamStreams


class JetStreamStartError(Exception):
    """The cluster could not be used at start-up: one line saying which servers and why."""


def server_urls(options: Any) -> list[str]:
    """Every server the options name: `--jetstream` values, each maybe a comma-separated list."""
    return [url.strip() for value in options.servers for url in str(value).split(",") if url.strip()]


def tls_context(options: Any) -> ssl.SSLContext | None:
    if options.tls_ca is None and options.tls_cert is None:
        return None
    try:
        context = ssl.create_default_context(cafile=str(options.tls_ca) if options.tls_ca is not None else None)
        if options.tls_cert is not None:
            context.load_cert_chain(str(options.tls_cert), str(options.tls_key) if options.tls_key else None)
    except (OSError, ssl.SSLError) as error:
        raise JetStreamStartError(f"cannot use the JetStream TLS files: {error}; check --jetstream-tls-ca, "
                                  "--jetstream-tls-cert and --jetstream-tls-key") from error
    return context


def settings(options: Any) -> JetStreamSettings:
    nats = NatsOptions(servers=server_urls(options), name="polymq", user=options.user, password=options.password,
                       token=options.token, tls=tls_context(options))
    return JetStreamSettings(nats, replicas=options.replicas, ack_wait_s=options.ack_wait_s)


async def open_engine(options: Any, nursery: trio.Nursery, clock: Clock) -> tuple[SharedEngine, JetStreamLink]:
    chosen = settings(options)
    try:
        return await open_shared_engine(chosen, nursery, clock=clock)
    except NatsError as error:
        raise JetStreamStartError(f"cannot use the JetStream cluster at {', '.join(chosen.nats.servers)}: {error}; "
                                  "check --jetstream and that the servers run with JetStream on") from error


def describe(link: JetStreamLink) -> str:
    """The start-up line's words: backend, servers, replicas."""
    return (f"JetStream at {link.connection.connected_url} (servers {', '.join(link.settings.nats.servers)}), "
            f"replicas per topic: {link.settings.replicas}, node {link.engine.node if link.engine else '?'}")


def shared_streams(link: JetStreamLink) -> JetStreamStreams:
    """The stream API's streams on this node: the cluster's (the same positions on every node)."""
    assert link.engine is not None
    streams = JetStreamStreams(link, link.engine)
    link.engine.barrier.keeper = streams.keep  # publish de-duplication kept in the cluster, for every node
    return streams
