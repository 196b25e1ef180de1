"""A blocking PHPMQ client: messages are the codec's (`polymq.codecs.phpmq`), deliveries (003, the
only thing a server ever sends) come back within a deadline.

PHPMQ answers nothing else, so "the server has handled what this connection sent" is proven with
`barrier()`: this connection sends a message to a fresh queue that a watcher connection consumes;
once the watcher has it, everything sent before it was handled (a connection is read in order).

    with Connection(("127.0.0.1", 9100)) as conn:
        conn.consume("jobs", 10)
        [delivery] = conn.deliveries(1)      # TimeoutError when it does not come in time
        conn.ack("jobs", delivery.message_id)
"""

from __future__ import annotations

import uuid

from polymq.clients import tcp
from polymq.codecs import phpmq

DEFAULT_TIMEOUT_S = 3.0


class BadDelivery(Exception):
    """The server sent bytes that are not a PHPMQ delivery (the reason says how)."""


class Connection(tcp.Connection):
    def __init__(self, address: tuple[str, int] | str, timeout: float = DEFAULT_TIMEOUT_S) -> None:
        super().__init__(address, timeout)
        self.raw = bytearray()  # every byte received, for exact-bytes checks
        self.received: list[phpmq.Delivery] = []  # read, not taken yet
        self._codec = phpmq.ClientConnection()

    # -- output --------------------------------------------------------------------------------

    def publish(self, queue: str, content: bytes, ttl: int | None = None) -> None:
        self.send(phpmq.send(queue.encode(), content, ttl))

    def consume(self, queue: str, count: int) -> None:
        self.send(phpmq.consume(queue.encode(), count))

    def ack(self, queue: str, message_id: bytes) -> None:
        self.send(phpmq.ack(queue.encode(), message_id))

    def requeue(self, queue: str, message_id: bytes, ttl: int) -> None:
        self.send(phpmq.requeue(queue.encode(), message_id, ttl))

    def dead_letter(self, queue: str, message_id: bytes) -> None:
        self.send(phpmq.dead_letter(queue.encode(), message_id))

    # -- input ---------------------------------------------------------------------------------

    def read_deliveries(self, deadline: float) -> bool:
        """One read, its deliveries added to `received`; False when the deadline passed first.
        Raises tcp.Closed, BadDelivery."""
        data = self.receive(deadline)
        if data is None:
            return False
        self.raw += data
        self._codec.receive_data(data)
        while (event := self._codec.next_event()) is not phpmq.NEED_DATA:
            if not isinstance(event, phpmq.Delivery):
                raise BadDelivery(event.reason if isinstance(event, phpmq.ProtocolError) else repr(event))
            self.received.append(event)
        return True

    def deliveries(self, count: int, timeout: float | None = None) -> list[phpmq.Delivery]:
        """The next `count` deliveries; TimeoutError when they do not all come within `timeout`
        (the connection's when not given)."""
        deadline = self.deadline(timeout)
        while len(self.received) < count:
            if not self.read_deliveries(deadline):
                raise TimeoutError(f"{len(self.received)} of {count} deliveries came")
        taken, self.received = self.received[:count], self.received[count:]
        return taken

    def quiet(self, seconds: float) -> bool:
        """True when no delivery comes within `seconds` (one that came stays in `received`)."""
        deadline = self.deadline(seconds)
        while not self.received and self.read_deliveries(deadline):
            pass
        return not self.received

    def closed_by_server(self, timeout: float | None = None) -> bool:
        """Waits for the server to close the connection (by EOF or a reset): True if it did, False
        if it was still open after `timeout` (the connection's when not given)."""
        deadline = self.deadline(timeout)
        try:
            while (data := self.receive(deadline)) is not None:
                self.raw += data
        except tcp.Closed:
            return True
        return False

    def barrier(self, queue: str | None = None, watcher: Connection | None = None) -> None:
        """Returns once the server has handled everything this connection sent so far. The watcher
        is a new connection unless the caller gives one (it is closed at the end); the queue a fresh
        one unless given. Raises TimeoutError, tcp.Closed."""
        queue = queue or f"barrier-{uuid.uuid4().hex}"
        with watcher or Connection(self.address, self.timeout) as watcher:
            watcher.consume(queue, 1)
            self.publish(queue, b"barrier")
            [marker] = watcher.deliveries(1)
            # Read in order: the server handles this ack before it sees the watcher go.
            watcher.ack(queue, marker.message_id)
