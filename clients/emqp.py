"""Blocking eMQP (EventMQ) peers, as EventMQ's own connect: DEALER sockets with an identity of
their own, messages `['', 'eMQP/1.0', COMMAND, msgid, *body]` from the codec (`polymq.codecs.emqp`),
every receive within a deadline, HEARTBEATs skipped unless asked for.

    with Worker(context, "127.0.0.1:47290") as worker:
        worker.inform([(10, "default")])
        worker.ready()
        job = worker.job()                           # the next REQUEST
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Self

import zmq

from polymq.clients import zmq_socket
from polymq.codecs import emqp

DEFAULT_TIMEOUT_S = 3.0
# What a worker answers a job with when the caller says nothing (an EventMQ job's JSON result).
DEFAULT_RESULT = b'{"value": true}'


class Unexpected(Exception):
    """The broker sent another message than the one waited for: `expected` and `got` say how."""

    def __init__(self, expected: object, got: object) -> None:
        super().__init__(f"expected {expected!r}, got {got!r}")
        self.expected = expected
        self.got = got


def new_msgid() -> bytes:
    """A message id as EventMQ's peers make them: a uuid4's text."""
    return str(uuid.uuid4()).encode()


class Peer:
    """A DEALER with its own identity (a uuid4's text unless given)."""

    def __init__(self, context: zmq.Context, address: str, identity: bytes | None = None,
                 timeout: float = DEFAULT_TIMEOUT_S, *, linger_ms: int = 0) -> None:
        self.identity = identity if identity is not None else new_msgid()
        self.sock = zmq_socket.open_socket(context, zmq.DEALER, address, timeout=timeout, identity=self.identity,
                                           linger_ms=linger_ms)
        self.timeout = timeout

    def send(self, command: bytes, *body: bytes, message_id: bytes | None = None) -> bytes:
        """Send `['', 'eMQP/1.0', command, msgid, *body]`; returns the msgid."""
        message_id = message_id if message_id is not None else new_msgid()
        zmq_socket.send(self.sock, emqp.client_message(command, message_id, *body))
        return message_id

    def next_message(self, timeout: float | None = None, *, heartbeats: bool = False) -> list[bytes] | None:
        """The next message within `timeout` (the peer's when not given), or None."""
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        while (frames := zmq_socket.receive_before(self.sock, deadline)) is not None:
            if heartbeats or frames[2:3] != [emqp.HEARTBEAT]:
                return frames
        return None

    def receive(self, timeout: float | None = None, *, heartbeats: bool = False) -> list[bytes]:
        """`['', 'eMQP/1.0', COMMAND, msgid, *body]`; TimeoutError when none comes in time."""
        frames = self.next_message(timeout, heartbeats=heartbeats)
        if frames is None:
            raise TimeoutError(f"nothing within {self.timeout if timeout is None else timeout} s")
        return frames

    def close(self) -> None:
        """Close; what is still queued gets the socket's linger to go out (none by default)."""
        self.sock.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Worker(Peer):
    """A jobmanager as the broker sees it: INFORM with weighted queues, READY per free slot."""

    def inform(self, queues: list[tuple[int, str]] | None = None) -> list[bytes]:
        """INFORM (no queue list: the broker's default) and wait for its ACK; returns the ACK.
        Raises Unexpected for another answer, TimeoutError for none."""
        raw = b"" if queues is None else json.dumps([[weight, name] for weight, name in queues]).encode()
        sent = self.send(emqp.INFORM, raw, emqp.WORKER)
        ack = self.receive()
        if [*ack[:3], ack[-1]] != [emqp.EMPTY, emqp.VERSION, emqp.ACK, sent]:
            raise Unexpected([emqp.EMPTY, emqp.VERSION, emqp.ACK, sent], [*ack[:3], ack[-1]])
        return ack

    def ready(self, count: int = 1) -> None:
        for _ in range(count):
            self.send(emqp.READY)

    def job(self, timeout: float | None = None) -> list[bytes]:
        """The next REQUEST: `['', 'eMQP/1.0', 'REQUEST', client_msgid, queue, headers, payload]`.
        Raises Unexpected for another message, TimeoutError for none."""
        frames = self.receive(timeout)
        if frames[2:3] != [emqp.REQUEST] or len(frames) != 7:
            raise Unexpected("['', 'eMQP/1.0', 'REQUEST', msgid, queue, headers, message]", frames)
        return frames

    def reply(self, job: list[bytes], result: bytes = DEFAULT_RESULT) -> None:
        self.send(emqp.REPLY, result, job[3])

    def leave(self) -> None:
        """KBYE: the broker forgets the worker at once (its free slots with it) instead of waiting
        for its heartbeats to stop."""
        self.send(emqp.KBYE)


class Client(Peer):
    def request(self, queue: str | bytes, payload: bytes, headers: bytes = b"",
                message_id: bytes | None = None) -> bytes:
        """Send a REQUEST; returns its msgid."""
        name = queue.encode() if isinstance(queue, str) else queue
        return self.send(emqp.REQUEST, name, headers, payload, message_id=message_id)


def admin(context: zmq.Context, address: str, command: bytes, timeout: float = DEFAULT_TIMEOUT_S) -> list[bytes]:
    """One admin command, as emq-cli sends it; the answer's frames."""
    with Peer(context, address, timeout=timeout) as peer:
        peer.send(command, message_id=b"admin:" + new_msgid())
        return peer.receive()
