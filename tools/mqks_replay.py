"""CPU per MQKS message without the loop and the sockets: `python tools/mqks_replay.py [--manual-ack]`.

Replays `polymq bench mqks`'s traffic in this process: one publisher's reads of 200 publish lines
over four events go through `MQKSSession.handle` on an in-memory engine, four consumers' sessions
take the deliveries (and with `--manual-ack` ack each read's in one read of their own, as the
bench's consumers do), and their output is taken as a write would take it. What it prints is the
process's CPU time per message: the codec, the session, the engine, nothing of trio or the kernel,
so two builds compare within a few percent where the end-to-end bench swings by tens
(docs/performance.md). `POLYMQ_PURE_PYTHON=1` measures the pure-Python modules.
"""

from __future__ import annotations

import time

import click

import polymq
from polymq.adapters.mqks.session import MQKSServer, MQKSSession
from polymq.adapters.transport import StreamTransport
from polymq.core.engine import Engine

# The bench's shape (polymq/bench/mqks.py): 4 queues, each bound to its own event, a publisher's
# chunk of 200 lines per send, 32-byte bodies starting with a 19-digit timestamp.
CONSUMERS = 4
CHUNK = 200
BODY = b"1764140000000000000" + b"x" * 13


def null_transport() -> StreamTransport:
    """A peer whose output the replay takes itself (the transport sends nothing on its own, as a TLS
    stream's; the compiled sessions take only the compiled transports)."""
    return StreamTransport(None, "replay:0")  # type: ignore[arg-type]  # never read or written


def replay(messages: int, manual_ack: bool) -> float:
    """CPU seconds per message."""
    server = MQKSServer(Engine())
    publisher = MQKSSession(server, null_transport())
    consumers = [MQKSSession(server, null_transport()) for _ in range(CONSUMERS)]
    flag = b" --manual-ack" if manual_ack else b""
    for number, session in enumerate(consumers):
        session.handle(b"c%d consume q%d e%d%s\n" % (number, number, number, flag))
    reads = b"".join(b"m%010d publish e%d %s\n" % (n, n % CONSUMERS, BODY) for n in range(CHUNK))
    acks = [b"".join(b"a ack c%d m%010d\n" % (number, n) for n in range(number, CHUNK, CONSUMERS))
            for number in range(CONSUMERS)]
    start = time.process_time()
    for _ in range(max(1, messages // CHUNK)):
        publisher.handle(reads)
        for number, session in enumerate(consumers):
            if manual_ack:
                session.handle(acks[number])
            # What the writer does around a write: the deliveries go, auto-ack credit comes back.
            token = session.before_send()
            session.out = []
            session.after_send(token)
    spent = time.process_time() - start
    # Every message went to its consumer (and with manual acks, was acknowledged): nothing is left.
    left = {name: (queue.depth, len(queue.in_flight)) for name, queue in server.engine.queues.items()
            if queue.depth or (manual_ack and queue.in_flight)}
    if left:
        raise click.ClickException(f"messages left in queues (depth, in flight): {left}")
    return spent / (max(1, messages // CHUNK) * CHUNK)


@click.command()
@click.option("--messages", type=int, default=200_000, show_default=True, help="Messages to publish.")
@click.option("--manual-ack", is_flag=True, help="Manual-ack consumers that ack every message.")
def main(messages: int, manual_ack: bool) -> None:
    """Replay MQKS publishes (and acks) in this process and print the CPU time per message."""
    per_message = replay(messages, manual_ack)
    modules = "compiled" if polymq.COMPILED else "pure Python"
    click.echo(f"{'manual' if manual_ack else 'auto'}-ack, {modules}: {per_message * 1e6:.2f} us per message")


if __name__ == "__main__":
    main()
