"""The seven endpoints of the cross-protocol matrix (tests/test_matrix.py), each as a publisher and
as a consumer, on the project's clients: every publisher sends bodies its protocol's way and returns
what it sent (with the id it chose, where its protocol lets it choose one); every consumer is bound
before anything is published and returns what it received as its protocol shows it.

Names: a cell `P→C` publishes to its own topic, `matrix-P-C`, except where PZQ takes part: a PZQ
producer always publishes to the topic of the gateway's PZQ queue (`--pzq-queue`, `pzq`) and a PZQ
consumer always reads that queue, so those cells use the topic `pzq`, and the other side's queue is
named after the cell (NSQ channel `pzq/matrix-P-C`, MQKS queue `matrix-P-C`, stream `matrix-P-C`).
"""

from __future__ import annotations

import contextlib
import http.client
import json
import time
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

import attrs
import zmq

from polymq.adapters.emqp.broker import DEFAULT_WORKER_PROCESSES
from polymq.clients import emqp as emqp_client
from polymq.clients import mqks_blocking, phpmq, pzq_blocking
from polymq.clients import nsq as nsq_blocking
from polymq.clients.stream import StreamClient, StreamClientError
from polymq.clients.tcp import split_address
from polymq.codecs import mqks_client, nsq_client, stream_rows
from polymq.codecs.nsq import OK
from polymq.codecs.pzq import ACK_OK

from support.gateway import GatewayProcess

# A 1 MiB body through a loaded 2-core machine, written to disk and synced: generous.
TIMEOUT_S = 30.0
# The gateway's PZQ queue (and topic): `--pzq-queue`'s default.
PZQ_QUEUE = "pzq"
# What the PHPMQ publisher gives each message as TTL, in seconds (a PHPMQ consumer of the current
# generation is shown what is left of it).
PHPMQ_TTL_S = 3600
# The delay of the NSQ publishers' deferred message (DPUB, /pub?defer=), in ms: short, as a cell
# waits for it.
NSQ_DEFER_MS = 10
# The headers the eMQP publisher sends with each REQUEST (they do nothing in a jobmanager).
EMQP_HEADERS = b"guarantee"


@attrs.frozen(slots=True)
class Cell:
    publisher: str
    consumer: str

    @property
    def name(self) -> str:
        return f"matrix-{self.publisher}-{self.consumer}"

    @property
    def topic(self) -> str:
        return PZQ_QUEUE if PZQ_QUEUE in (self.publisher, self.consumer) else self.name


@attrs.frozen(slots=True)
class Sent:
    body: bytes
    publisher_id: str | None = None  # the id the publisher chose, where its protocol lets it


@attrs.frozen(slots=True)
class Received:
    """One delivery as the consumer's protocol shows it (None: the protocol shows no such thing)."""

    body: bytes
    shown_id: str  # the id as the protocol shows it (text)
    attempts: int | None = None  # NSQ attempts, MQKS retry, stream attempts
    ttl: int | None = None  # PHPMQ's remaining TTL (current generation)
    headers: dict[str, Any] | bytes | None = None  # stream rows' headers; eMQP's headers frame
    origin: str | None = None  # stream rows: the protocol it came in by
    topic: str | None = None  # the topic (MQKS event, eMQP queue, stream row topic)
    timestamp_ns: int | None = None  # when it was published (NSQ messages, stream rows)
    wire: bytes | None = None  # MQKS: the data as the line carried it, before decoding
    frames: list[bytes] | None = None  # PZQ: the body frames


def wait_until(condition: Callable[[], bool], what: str, timeout: float = TIMEOUT_S) -> None:
    """Polls `condition` until it holds; AssertionError naming `what` after `timeout`."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout} s")
        time.sleep(0.02)


# -- the gateway's admin API: state and clean-up ----------------------------------------------------

def admin(gateway: GatewayProcess, action: str, **params: str) -> dict[str, Any] | None:
    """POST /api/<action> on the gateway's listener; None when the topic or queue does not exist."""
    with StreamClient(gateway.http, timeout=TIMEOUT_S) as client:
        try:
            return json.loads(client.request("POST", f"/api/{action}", params.items()))  # type: ignore[no-any-return]
        except StreamClientError as error:
            if error.status == 404:
                return None
            raise


def state_of(gateway: GatewayProcess, kind: str, name: str) -> dict[str, Any] | None:
    """A topic's or a queue's entry (`kind`: "topics", "queues") in /api/state; None when it does not exist."""
    with StreamClient(gateway.http, timeout=TIMEOUT_S) as client:
        state = json.loads(client.request("GET", "/api/state"))
    return next((item for item in state[kind] if item["name"] == name), None)


# -- publishers ---------------------------------------------------------------------------------------

class Publisher:
    name: ClassVar[str]

    def __init__(self, gateway: GatewayProcess, cell: Cell, context: zmq.Context) -> None:
        self.gateway = gateway
        self.cell = cell
        self.context = context

    def publish(self, bodies: list[bytes]) -> list[Sent]:
        raise NotImplementedError

    def close(self) -> None:
        pass


class NSQTCPPublisher(Publisher):
    """The first two bodies in one MPUB, the others by PUB but the last (the largest), which goes by
    DPUB with a short delay: every publish command, one `OK` each."""

    name = "nsq-tcp"

    def publish(self, bodies: list[bytes]) -> list[Sent]:
        topic = self.cell.topic
        commands = [nsq_client.mpub(topic, bodies[:2]), *(nsq_client.pub(topic, body) for body in bodies[2:-1]),
                    nsq_client.dpub(topic, NSQ_DEFER_MS, bodies[-1])]
        with nsq_blocking.Connection(self.gateway.nsq_tcp, TIMEOUT_S) as conn:
            for command in commands:
                conn.send(command)
                frame = conn.next_frame()
                assert frame is not None and frame.is_response and frame.data == OK, frame
        return [Sent(body) for body in bodies]


class NSQHTTPPublisher(Publisher):
    """The first two bodies (no newline in them) in a text /mpub, the next ones but two in a binary
    /mpub, the last but one by /pub, the last (the largest) by /pub with a short `defer`."""

    name = "nsq-http"

    def publish(self, bodies: list[bytes]) -> list[Sent]:
        topic = self.cell.topic
        assert len(bodies) >= 5 and not any(b"\n" in body for body in bodies[:2])
        for path, body in ((f"/mpub?topic={topic}", b"\n".join(bodies[:2])),
                           (f"/mpub?topic={topic}&binary=true", nsq_client.mpub_body(bodies[2:-2])),
                           (f"/pub?topic={topic}", bodies[-2]),
                           (f"/pub?topic={topic}&defer={NSQ_DEFER_MS}", bodies[-1])):
            assert nsq_http_post(self.gateway, path, body) == (200, b"OK")
        return [Sent(body) for body in bodies]


def nsq_http_post(gateway: GatewayProcess, path: str, body: bytes) -> tuple[int, bytes]:
    """POST to the nsqd HTTP API: the answer's status and body."""
    host, port = split_address(gateway.nsq_http)
    conn = http.client.HTTPConnection(host, port, timeout=TIMEOUT_S)
    try:
        conn.request("POST", path, body=body)
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


class MQKSPublisher(Publisher):
    """`publish --confirm`, the request id being the message's msg_id."""

    name = "mqks"

    def publish(self, bodies: list[bytes]) -> list[Sent]:
        sent: list[Sent] = []
        with mqks_blocking.Connection(self.gateway.host_port("mqks"), TIMEOUT_S) as conn:
            for number, body in enumerate(bodies):
                request_id = mqks_request_id(self.cell, number)
                conn.request(request_id, "publish", self.cell.topic.encode() + b" " + mqks_client.publish_data(body),
                             confirm=True)
                assert conn.next_line() == f"{request_id} ok ".encode()
                sent.append(Sent(body, request_id))
        return sent


def mqks_request_id(cell: Cell, number: int) -> str:
    """The id of the MQKS publisher's `number`th request in `cell` (each message's msg_id)."""
    return f"{cell.name}-{number}"


class PHPMQPublisher(Publisher):
    """001 with a TTL (the current generation's 3 packets). PHPMQ answers nothing: the consumer's
    wait is the proof."""

    name = "phpmq"

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.conn = phpmq.Connection(self.gateway.host_port("phpmq"), TIMEOUT_S)

    def publish(self, bodies: list[bytes]) -> list[Sent]:
        for body in bodies:
            self.conn.publish(self.cell.topic, body, ttl=PHPMQ_TTL_S)
        return [Sent(body) for body in bodies]

    def close(self) -> None:
        self.conn.close()


class PZQPublisher(Publisher):
    name = "pzq"

    def publish(self, bodies: list[bytes]) -> list[Sent]:
        with pzq_blocking.Producer(self.context, self.gateway.addresses["pzq-receive"], TIMEOUT_S) as producer:
            for number, body in enumerate(bodies):
                producer_id = b"%s-%d" % (self.cell.name.encode(), number)
                assert producer.produce(body, producer_id=producer_id) == [producer_id, ACK_OK, b""]
        return [Sent(body) for body in bodies]


class EMQPPublisher(Publisher):
    """REQUESTs with headers and the client's msgids; the socket stays open until the cell ends (a
    request that waits for a worker is not answered)."""

    name = "emqp"

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.client = emqp_client.Client(self.context, self.gateway.addresses["emqp-frontend"], timeout=TIMEOUT_S,
                                         linger_ms=int(TIMEOUT_S * 1000))

    def publish(self, bodies: list[bytes]) -> list[Sent]:
        return [Sent(body, self.client.request(self.cell.topic, body, EMQP_HEADERS).decode()) for body in bodies]

    def close(self) -> None:
        self.client.close()


class StreamPublisher(Publisher):
    """One batch to /stream/publish, each row with an id and a header."""

    name = "stream"

    def publish(self, bodies: list[bytes]) -> list[Sent]:
        ids = [f"{self.cell.name}-{number}" for number in range(len(bodies))]
        rows = [stream_rows.encode_publish_row(body, message_id=row_id, headers={"matrix-cell": self.cell.name})
                for body, row_id in zip(bodies, ids, strict=True)]
        with StreamClient(self.gateway.http, timeout=TIMEOUT_S) as client:
            assert client.publish(rows, self.cell.topic) == {"published": len(bodies), "duplicates": 0}
        return [Sent(body, row_id) for body, row_id in zip(bodies, ids, strict=True)]


# -- consumers ----------------------------------------------------------------------------------------

class Consumer:
    name: ClassVar[str]

    def __init__(self, gateway: GatewayProcess, cell: Cell, context: zmq.Context) -> None:
        self.gateway = gateway
        self.cell = cell
        self.context = context

    @property
    def queue(self) -> str:
        """The engine queue it reads."""
        return self.cell.topic

    def receive(self, count: int) -> list[Received]:
        """The next `count` deliveries, each finished as the protocol finishes them."""
        raise NotImplementedError

    def close(self) -> None:
        pass


class NSQTCPConsumer(Consumer):
    name = "nsq-tcp"

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.conn = nsq_blocking.Connection(self.gateway.nsq_tcp, TIMEOUT_S)
        self.conn.send(nsq_client.sub(self.cell.topic, self.cell.name))
        self.conn.wait_for_ok("SUB")
        self.conn.send(nsq_client.rdy(100))

    @property
    def queue(self) -> str:
        return f"{self.cell.topic}/{self.cell.name}"

    def receive(self, count: int) -> list[Received]:
        received: list[Received] = []
        while len(received) < count:
            frame = self.conn.next_frame()
            assert frame is not None, f"{len(received)} of {count} messages came"
            assert frame.is_message, frame
            message = nsq_client.decode_message(frame.data)
            self.conn.send(nsq_client.fin(message.msg_id))
            received.append(Received(message.body, message.msg_id.decode(), attempts=message.attempts,
                                     timestamp_ns=message.timestamp_ns))
        return received

    def close(self) -> None:
        self.conn.close()


class MQKSConsumer(Consumer):
    """An auto-ack consumer of a queue of its own, bound to the topic as an event."""

    name = "mqks"

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.conn = mqks_blocking.Connection(self.gateway.host_port("mqks"), TIMEOUT_S)
        self.conn.request("c1", "consume", f"{self.cell.name} {self.cell.topic}", confirm=True)
        assert self.conn.next_line() == b"c1 ok "

    @property
    def queue(self) -> str:
        return self.cell.name

    def receive(self, count: int) -> list[Received]:
        received: list[Received] = []
        while len(received) < count:
            line = self.conn.next_line()
            assert line is not None, f"{len(received)} of {count} messages came"
            response = mqks_client.parse_response(line)
            assert (response.request_id, response.ok) == ("c1", True), line[:200]
            delivery = mqks_client.parse_delivery(response.data)  # the reversible encoding decoded
            received.append(Received(delivery.body, delivery.msg_id, attempts=delivery.retry, topic=delivery.event,
                                     wire=response.data.split(b" ", 2)[2]))
        return received

    def close(self) -> None:
        self.conn.close()


class PHPMQConsumer(Consumer):
    """A window on the queue of the topic's name (the gateway runs with `--phpmq-generation current`,
    so deliveries carry the remaining TTL)."""

    name = "phpmq"

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.conn = phpmq.Connection(self.gateway.host_port("phpmq"), TIMEOUT_S)
        self.conn.consume(self.cell.topic, 100)
        self.conn.barrier()

    def receive(self, count: int) -> list[Received]:
        received: list[Received] = []
        for delivery in self.conn.deliveries(count):
            assert delivery.queue == self.cell.topic
            self.conn.ack(self.cell.topic, delivery.message_id)
            received.append(Received(delivery.content, delivery.message_id.decode(), ttl=delivery.ttl))
        return received

    def close(self) -> None:
        self.conn.close()


class PZQConsumer(Consumer):
    name = "pzq"

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.peer = pzq_blocking.Consumer(self.context, self.gateway.addresses["pzq-send"], TIMEOUT_S)

    def receive(self, count: int) -> list[Received]:
        received: list[Received] = []
        for _ in range(count):
            delivery = self.peer.receive()
            self.peer.ack(delivery)
            _, key, _, _, delimiter, *frames = delivery
            assert delimiter == b"", delivery[:5]
            received.append(Received(frames[0] if len(frames) == 1 else b"", key.decode(), frames=frames))
        return received

    def close(self) -> None:
        self.peer.close()


class EMQPConsumer(Consumer):
    """A worker of the queue of the topic's name, as a jobmanager with the gateway's default count of
    processes: a READY as each starts, then one after each job."""

    name = "emqp"

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.worker = emqp_client.Worker(self.context, self.gateway.addresses["emqp-backend"], timeout=TIMEOUT_S,
                                         linger_ms=int(TIMEOUT_S * 1000))
        self.worker.inform([(10, self.cell.topic)])
        self.worker.ready(DEFAULT_WORKER_PROCESSES)

    def receive(self, count: int) -> list[Received]:
        received: list[Received] = []
        for _ in range(count):
            job = self.worker.job()
            _, _, _, msgid, queue, headers, payload = job
            received.append(Received(payload, msgid.decode("latin-1"), headers=headers, topic=queue.decode()))
            self.worker.ready()  # the job is done: its READY ends it and frees the slot
        return received

    def close(self) -> None:
        self.worker.leave()
        self.worker.close()


class StreamConsumer(Consumer):
    """A stream of its own bound to the topic, read from its start until the rows are there, then
    committed."""

    name = "stream"

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.client = StreamClient(self.gateway.http, timeout=TIMEOUT_S)
        self.next = self.client.open(self.cell.name, [self.cell.topic])["end"]

    @property
    def queue(self) -> str:
        return self.cell.name

    def receive(self, count: int) -> list[Received]:
        rows: list[stream_rows.ReadRow] = []

        def read_more() -> bool:
            end = self.client.offsets(self.cell.name)["end"]
            if end > self.next:
                rows.extend(self.client.read(self.cell.name, self.next, end))
                self.next = end
            return len(rows) >= count

        wait_until(read_more, f"{count} rows in stream {self.cell.name}")
        self.client.commit(self.cell.name, self.next)
        return [Received(row.body, f"{row.id:016x}", attempts=row.attempts,
                         headers=json.loads(row.headers) if row.headers else None, origin=row.origin,
                         topic=row.topic, timestamp_ns=row.timestamp_ns) for row in rows]

    def close(self) -> None:
        self.client.close()


PUBLISHERS: dict[str, type[Publisher]] = {kind.name: kind for kind in (
    NSQTCPPublisher, NSQHTTPPublisher, MQKSPublisher, PHPMQPublisher, PZQPublisher, EMQPPublisher, StreamPublisher)}
CONSUMERS: dict[str, type[Consumer]] = {kind.name: kind for kind in (
    NSQTCPConsumer, MQKSConsumer, PHPMQConsumer, PZQConsumer, EMQPConsumer, StreamConsumer)}


@contextlib.contextmanager
def endpoints(gateway: GatewayProcess, cell: Cell, context: zmq.Context,
              publisher_gateway: GatewayProcess | None = None) -> Iterator[tuple[Publisher, Consumer]]:
    """The cell's consumer, bound, and its publisher (on `publisher_gateway`, another node sharing the
    queues, when given); afterwards both closed and what the cell made taken away (its topic with the
    queues it owns, its consumer's queue; the PZQ queue emptied)."""
    if cell.topic == PZQ_QUEUE:
        admin(gateway, "queue/empty", queue=PZQ_QUEUE)  # what an earlier cell's topic `pzq` left
    consumer = CONSUMERS[cell.consumer](gateway, cell, context)
    try:
        publisher = PUBLISHERS[cell.publisher](publisher_gateway or gateway, cell, context)
        try:
            yield publisher, consumer
        finally:
            publisher.close()
    finally:
        consumer.close()
    if cell.topic == PZQ_QUEUE:
        admin(gateway, "queue/empty", queue=PZQ_QUEUE)
    else:
        admin(gateway, "topic/delete", topic=cell.topic)
    for queue in {consumer.queue, cell.topic} - {PZQ_QUEUE}:
        admin(gateway, "queue/delete", queue=queue)
