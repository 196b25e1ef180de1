"""Blocking pyzmq peers of the eMQP broker for integration tests, as EventMQ's own peers connect:
DEALER sockets with an explicit identity, every receive with a deadline."""

from __future__ import annotations

import itertools
import json
import uuid

import zmq

from polymq.codecs import emqp

DEFAULT_TIMEOUT_MS = 3000
_ids = itertools.count()


def msgid() -> bytes:
    return b"m%d" % next(_ids)


class Peer:
    """A DEALER with its own identity (a uuid4 text unless given bytes)."""

    def __init__(self, context: zmq.Context, address: str, identity: bytes | None = None,
                 timeout_ms: int = DEFAULT_TIMEOUT_MS) -> None:
        self.identity = identity if identity is not None else str(uuid.uuid4()).encode()
        self.sock = context.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.IDENTITY, self.identity)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RCVTIMEO, timeout_ms)
        self.sock.setsockopt(zmq.SNDTIMEO, timeout_ms)
        self.sock.connect(f"tcp://{address}")

    def send(self, command: bytes, *body: bytes, message_id: bytes | None = None) -> bytes:
        """Send `['', 'eMQP/1.0', command, msgid, *body]`; returns the msgid."""
        message_id = message_id if message_id is not None else msgid()
        self.sock.send_multipart(emqp.client_message(command, message_id, *body))
        return message_id

    def receive(self, *, skip_heartbeats: bool = True) -> list[bytes]:
        """`['', 'eMQP/1.0', COMMAND, msgid, *body]`."""
        while True:
            frames = self.sock.recv_multipart()
            if not skip_heartbeats or frames[2] != emqp.HEARTBEAT:
                return frames

    def nothing_within(self, ms: int) -> bool:
        """True when no message but heartbeats comes within `ms`."""
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        while poller.poll(ms):
            if self.sock.recv_multipart()[2] != emqp.HEARTBEAT:
                return False
        return True

    def close(self) -> None:
        self.sock.close(linger=0)

    def __enter__(self) -> Peer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Worker(Peer):
    """A jobmanager as the broker sees it: INFORM with weighted queues, READY per free slot."""

    def inform(self, queues: list[tuple[int, str]] | None = None) -> list[bytes]:
        """INFORM and wait for the ACK; returns it."""
        raw = b"" if queues is None else json.dumps([[weight, name] for weight, name in queues]).encode()
        sent = self.send(emqp.INFORM, raw, emqp.WORKER)
        ack = self.receive()
        assert ack[2:] == [emqp.ACK, ack[3], sent], ack
        return ack

    def ready(self, count: int = 1) -> None:
        for _ in range(count):
            self.send(emqp.READY)

    def job(self) -> list[bytes]:
        """The next REQUEST: `['', 'eMQP/1.0', 'REQUEST', client_msgid, queue, headers, payload]`."""
        frames = self.receive()
        assert frames[2] == emqp.REQUEST, frames
        return frames

    def reply(self, job: list[bytes], result: bytes = b'{"value": true}') -> None:
        self.send(emqp.REPLY, result, job[3])


class Client(Peer):
    def request(self, queue: str, payload: bytes, headers: bytes = b"", message_id: bytes | None = None) -> bytes:
        return self.send(emqp.REQUEST, queue.encode(), headers, payload, message_id=message_id)


def admin(context: zmq.Context, address: str, command: bytes) -> list[bytes]:
    """One admin command, as emq-cli sends it; the REPLY's frames."""
    with Peer(context, address) as peer:
        peer.send(command, message_id=b"admin:" + msgid())
        return peer.receive()


def admin_json(context: zmq.Context, address: str, command: bytes) -> dict[str, object]:
    frames = admin(context, address, command)
    assert frames[2] == emqp.REPLY, frames
    return json.loads(frames[4])
