"""A message copy: the one object the engine, the adapters and the storage layer share."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Final

if TYPE_CHECKING:
    from polymq.core.engine import Consumer

# The header that carries a publisher's own id for a message (an MQKS `msg_id`, a Spark row's id):
# protocols that show a publisher's id show this one.
PUBLISHER_ID_HEADER: Final = "msg_id"


class Message:
    """One copy of a message in one queue (or in a topic's backlog).

    Copies of one publish share id, body, timestamp and headers; each has its own attempts and
    delivery state.
    """

    __slots__ = ("attempts", "body", "deadline", "delivered_at", "due", "expires_at", "headers", "id",
                 "origin", "owner", "pos", "publisher_id", "timestamp_ns", "topic")

    def __init__(
        self,
        id: int,
        body: bytes,
        timestamp_ns: int,
        headers: Mapping[str, Any] | None = None,
        expires_at: float | None = None,
        attempts: int = 0,
        topic: str | None = None,
        origin: str | None = None,
        publisher_id: bytes | None = None,
    ) -> None:
        self.id = id
        self.body = body
        self.timestamp_ns = timestamp_ns
        self.headers = headers
        self.expires_at = expires_at
        self.attempts = attempts
        self.owner: Consumer | None = None
        self.deadline: float | None = None
        self.delivered_at = 0.0
        self.due: float | None = None
        self.pos = -1  # where its durable record is (`OwnerLog`); -1 = not stored
        # The topic it was published to (MQKS shows it as `event=`); stored with it (ADD records).
        self.topic = topic
        # The protocol it came in by ("nsq", "mqks", …; None when not known); stored with it.
        self.origin = origin
        # The id its publisher chose (an MQKS msg_id), kept apart from `headers` so that publishing,
        # storing and reading it back build no dict and no JSON; readers see it as the
        # PUBLISHER_ID_HEADER of `shown_headers`. Stored with it.
        self.publisher_id = publisher_id

    def copy(self) -> Message:
        return Message(self.id, self.body, self.timestamp_ns, self.headers, self.expires_at, self.attempts,
                       self.topic, self.origin, self.publisher_id)

    def __repr__(self) -> str:
        return f"Message(id={self.id}, attempts={self.attempts}, body={self.body[:32]!r})"


def shown_headers(message: Message) -> Mapping[str, Any] | None:
    """A message's headers as readers and other nodes see them: `headers`, with the publisher's id
    under PUBLISHER_ID_HEADER when the message keeps it apart (`publisher_id`)."""
    publisher_id = message.publisher_id
    if publisher_id is None:
        return message.headers
    headers = dict(message.headers) if message.headers else {}
    headers[PUBLISHER_ID_HEADER] = publisher_id.decode("utf-8", "replace")
    return headers
