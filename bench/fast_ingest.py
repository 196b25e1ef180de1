"""A JetStream fast-ingest batch publisher (nats-server 2.14+, streams with `allow_batched`), for
`polymq bench jetstream`'s direct client: the cluster's third way of taking many messages, beside plain
publishes and atomic batches.

Each message of a fast batch is a plain publish whose reply subject says what it is:
`<inbox>.<batch id>.<flow>.<gap mode>.<batch sequence>.<operation>.$FI` (operation 0 starts the batch, 1 adds
to it, 2 commits it with its last message). The server answers on that inbox: a flow ack
(`{"type": "ack", "seq", "msgs"}`: every message up to `seq` is stored, the next comes after `msgs` more) once
the batch starts and every `msgs` stored messages, and at the commit a publish ack with the batch's `count`.
`flow` is the most messages a flow ack may cover (the server starts lower when the stream has other fast
batches, and moves within it); the publisher sends until OUTSTANDING flow acks' worth of messages are
unanswered, then waits. Gap mode `fail`: a message lost on the way ends the batch (its publish ack says how
many were stored), so a flow ack covers every message before it.
"""

from __future__ import annotations

import json
import secrets
from typing import Any

import trio

from polymq.jetstream import api
from polymq.jetstream.nats_connection import Msg, NatsConnection

SUFFIX = "$FI"
OP_START, OP_APPEND, OP_COMMIT = 0, 1, 2
# The most messages one flow ack covers, as nats-server caps it (`fastBatchInit`: min(500, the client's)).
FLOW_MAX = 500
# Flow acks' worth of messages unanswered before the publisher waits: ADR-50's advice (the server works on
# one group while the next arrives).
OUTSTANDING = 2
ANSWER_TIMEOUT_S = 30.0


class FastIngestError(Exception):
    """The server refused the batch, ended it early, or did not answer."""


class FastBatch:
    """One fast-ingest batch to `subject` on `connection` (see the module's text)."""

    def __init__(self, connection: NatsConnection, subject: str, *, flow: int = FLOW_MAX,
                 outstanding: int = OUTSTANDING) -> None:
        self.connection = connection
        self.subject = subject
        self.outstanding = outstanding
        self._reply = f"{connection.new_inbox()}.{secrets.token_hex(8)}.{flow}.fail."
        self.sent = 0  # the batch sequence of the last message sent
        self.stored = 0  # every message up to this one is stored (the last flow ack's seq)
        self.every = 0  # the server's last word on how many messages a flow ack covers; 0 until it spoke
        self.ack: dict[str, Any] | None = None  # the publish ack ending the batch
        self.trouble: dict[str, Any] | None = None  # the server's last word of a gap or an error
        self._changed = trio.Event()
        self._sid = connection.subscribe(self._reply.rsplit(".", 4)[0] + ".>", self._on_answer)

    def _on_answer(self, msg: Msg) -> None:
        answer = json.loads(msg.payload)
        kind = answer.get("type")
        if kind == "ack":
            self.stored = max(self.stored, int(answer["seq"]))
            self.every = int(answer["msgs"])
        elif kind in ("gap", "err"):  # told only: in gap mode `fail` the publish ack ending the batch follows
            self.trouble = answer
        else:
            self.ack = answer
        self._changed.set()

    async def _changes(self) -> None:
        with trio.move_on_after(ANSWER_TIMEOUT_S) as waited:
            await self._changed.wait()
        if waited.cancelled_caught:
            raise FastIngestError(f"no answer within {ANSWER_TIMEOUT_S:.0f} s (sent {self.sent}, stored "
                                  f"{self.stored})")
        self._changed = trio.Event()

    async def add(self, body: bytes, *, commit: bool = False) -> None:
        """Send one message of the batch; waits while the server is OUTSTANDING flow acks behind."""
        self.sent += 1
        operation = OP_COMMIT if commit else OP_START if self.sent == 1 else OP_APPEND
        self.connection.publish(self.subject, body, reply=f"{self._reply}{self.sent}.{operation}.{SUFFIX}")
        if commit:
            return
        while self.ack is None and (self.every == 0 or self.stored + self.every * self.outstanding <= self.sent):
            await self._changes()
        if self.ack is not None:
            raise FastIngestError(f"the batch ended at message {self.sent}: {self.ack} ({self.trouble})")

    async def commit(self, body: bytes) -> int:
        """Send the batch's last message; how many the batch stored, once the server says."""
        await self.add(body, commit=True)
        while self.ack is None:
            await self._changes()
        self.connection.unsubscribe(self._sid)
        if "error" in self.ack or "batch" not in self.ack:
            raise FastIngestError(f"the batch was refused: {self.ack} ({self.trouble})")
        return int(self.ack["count"])


async def allow(connection: NatsConnection, topic: str) -> None:
    """Let the topic's stream take fast-ingest batches (`allow_batched`; a topic's stream is made without)."""
    name = api.topic_stream(topic)
    config = (await api.api(connection, f"STREAM.INFO.{name}"))["config"]
    await api.api(connection, f"STREAM.UPDATE.{name}", {**config, "allow_batched": True})


async def publish(connection: NatsConnection, topic: str, body: bytes, messages: int, *,
                  flow: int = FLOW_MAX) -> None:
    """`messages` copies of `body` to `topic`'s stream as one fast batch; FastIngestError unless all stored."""
    batch = FastBatch(connection, api.topic_subject(topic), flow=flow)
    for _ in range(messages - 1):
        await batch.add(body)
    stored = await batch.commit(body)
    if stored != messages:
        raise FastIngestError(f"the batch stored {stored} of {messages}")
