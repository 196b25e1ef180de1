"""`polymq conformance phpmq`: black-box checks of any PHPMQ server (one TCP port).

The checks are written from how the original php-mq server behaves on the wire (docs/protocols/
phpmq.md). Their names say which group they belong to:

- `core …`: what the original does (the pinned protocol generation); a conformant server passes
  them all.
- `current-generation …`: TTLs, 005 requeue and 006 dead letters of the protocol library's current
  generation, and an ack from another connection freeing the holder's window slot. The original
  does not implement them (it exits on them; it leaves the slot taken).
- `robustness …`: bad input from one client closes that client only. The original exits.

PHPMQ never answers anything but deliveries, so "the server has handled what a connection sent"
is proven with a barrier: that connection sends a message to a fresh queue which another
connection consumes; once it arrives, everything sent before it was handled (a connection is read
in order). "Nothing more arrives" waits `--quiet` seconds (the original sleeps 200 ms per loop, so
its default is generous). Every message a check sends is consumed and acknowledged before it ends.
Only `polymq.clients`, `polymq.codecs` and the shared runner are imported (docs/architecture.md).
"""

from __future__ import annotations

import contextlib
import secrets
import time
from collections.abc import Callable
from contextlib import AbstractContextManager

import click

from polymq.clients import phpmq as phpmq_client
from polymq.clients.tcp import Closed
from polymq.codecs import phpmq
from polymq.conformance import runner
from polymq.conformance.runner import CheckFailed, Registry, expect_equal

# The original's message-queue port (its config/phpmq.default.xml).
DEFAULT_ADDRESS = "127.0.0.1:9100"
# Watching for "nothing arrives": the original adds up to ~0.4 s per loop turn (docs/protocols/phpmq.md).
DEFAULT_QUIET_S = 0.8
# A large content, to check that contents of any length pass whole.
LARGE_CONTENT = 1024 * 1024


class Conn(runner.CheckedConnection, phpmq_client.Connection):
    """The blocking PHPMQ client, its failures told as CheckFailed."""

    shows_sent = False

    def __init__(self, address: tuple[str, int], timeout: float, label: str) -> None:
        self.label = label
        super().__init__(address, timeout)

    def read_deliveries(self, deadline: float) -> bool:
        try:
            return super().read_deliveries(deadline)
        except Closed as exc:
            raise CheckFailed(f"{self.label}: the server closed the connection") from exc
        except OSError as exc:
            raise CheckFailed(f"{self.label}: the connection failed", got=str(exc)) from exc
        except phpmq_client.BadDelivery as exc:
            raise CheckFailed(f"{self.label}: a delivery that is not PHPMQ", got=str(exc)) from exc

    def expect_deliveries(self, count: int, what: str) -> list[phpmq.Delivery]:
        try:
            return self.deliveries(count)
        except TimeoutError:
            raise CheckFailed(f"{what}: deliveries", f"{count}", f"{len(self.received)}") from None

    def take(self, queue: bytes, window: int, what: str, count: int | None = None) -> list[phpmq.Delivery]:
        """Consume `queue` with a window of `window` and take `count` deliveries (the window's when not given)."""
        self.send(phpmq.consume(queue, window))
        return self.expect_deliveries(window if count is None else count, what)

    def expect_quiet(self, seconds: float, what: str) -> None:
        """Nothing arrives within `seconds`."""
        if not self.quiet(seconds):
            raise CheckFailed(f"{what}: nothing more", "no delivery", self.received[0].content[:60])


class Target:
    """A check's view of the server: named connections, unique queue names, cleanup."""

    def __init__(self, address: tuple[str, int], timeout: float, quiet: float, run_id: str) -> None:
        self.address = address
        self.timeout = timeout
        self.quiet_s = quiet
        self.run_id = run_id
        self._conns: list[Conn] = []
        self._queues = 0

    def conn(self, label: str) -> Conn:
        conn = Conn(self.address, self.timeout, label)
        self._conns.append(conn)
        return conn

    def queue(self, purpose: str) -> str:
        self._queues += 1
        return f"conformance-{self.run_id}-{purpose}-{self._queues}"

    def barrier(self, conn: Conn) -> None:
        """Returns once the server has handled everything `conn` sent so far."""
        watcher = self.conn("barrier watcher")
        try:
            conn.barrier(self.queue("barrier"), watcher)
        except TimeoutError:
            raise CheckFailed("barrier: deliveries", "1", f"{len(watcher.received)}") from None

    def held(self, purpose: str, content: bytes, holder: str, what: str) -> tuple[bytes, Conn, Conn, phpmq.Delivery]:
        """A producer sends `content` to a fresh queue and a holder, consuming it with a window of 1,
        takes it (`what`): (queue, producer, holder, delivery)."""
        queue = self.queue(purpose).encode()
        producer, holding = self.conn("producer"), self.conn(holder)
        producer.send(phpmq.send(queue, content))
        [delivery] = holding.take(queue, 1, what)
        return queue, producer, holding, delivery

    def stored_and_taken(self, purpose: str, content: bytes, ttl: int,
                         what: str) -> tuple[Conn, bytes, phpmq.Delivery]:
        """A current-generation client sends `content` with a TTL to a fresh queue and takes it back
        (`what`): (client, queue, delivery)."""
        queue = self.queue(purpose).encode()
        client = self.conn("current client")
        client.send(phpmq.send(queue, content, ttl))
        [delivery] = client.take(queue, 1, what)
        return client, queue, delivery

    def done(self, conn: Conn, queue: bytes, *deliveries: phpmq.Delivery) -> None:
        """`conn` acknowledges what the check took and the server handles it: the check's queues end empty."""
        conn.send(b"".join(phpmq.ack(queue, delivery.message_id) for delivery in deliveries))
        self.barrier(conn)

    def close(self) -> None:
        for conn in self._conns:
            with contextlib.suppress(OSError):
                conn.close()


checks: Registry[Target] = Registry(original_fails={
    "current-generation": "a newer protocol revision (TTL, 005, 006) the original php-mq lacks, and it keeps a "
                          "window slot taken after another connection's ack",
    "robustness": "the original exits on bad input from one client"})


# -- core: the original's behaviour -------------------------------------------------------------


@checks.check("core send then consume delivers a 3-packet 003 with a 32-hex id")
def _send_consume(t: Target) -> None:
    queue = t.queue("basic").encode()
    producer, consumer = t.conn("producer"), t.conn("consumer")
    producer.send(phpmq.send(queue, b"Hello World"))
    [delivery] = consumer.take(queue, 5, "003", 1)
    expect_equal("003 header", b"H0100303", bytes(consumer.raw[:8]))
    expect_equal("queue and content", (queue.decode(), b"Hello World"), (delivery.queue, delivery.content))
    expect_equal("id is 32 lowercase hex", True, phpmq.parse_message_id(delivery.message_id) is not None)
    expect_equal("the whole 003", phpmq.delivery(queue, b"Hello World", delivery.message_id, None), bytes(consumer.raw))
    t.done(consumer, queue, delivery)


@checks.check("core a window of N holds N unacknowledged and each ack lets one more flow")
def _window(t: Target) -> None:
    queue = t.queue("window").encode()
    producer, consumer = t.conn("producer"), t.conn("consumer")
    for body in (b"1", b"2", b"3"):
        producer.send(phpmq.send(queue, body))
    t.barrier(producer)
    first, second = consumer.take(queue, 2, "window of 2")
    expect_equal("oldest first", [b"1", b"2"], [first.content, second.content])
    consumer.expect_quiet(t.quiet_s, "window of 2, 2 unacknowledged")
    consumer.send(phpmq.ack(queue, first.message_id))
    [third] = consumer.expect_deliveries(1, "after one ack")
    expect_equal("after one ack", b"3", third.content)
    t.done(consumer, queue, second, third)


@checks.check("core contents are raw bytes of any length")
def _binary(t: Target) -> None:
    queue = t.queue("binary").encode()
    contents = [bytes(range(256)) * 4, b"H0100102P01", b"x" * LARGE_CONTENT]
    producer, consumer = t.conn("producer"), t.conn("consumer")
    for content in contents:
        producer.send(phpmq.send(queue, content))
    consumer.send(phpmq.consume(queue, len(contents)))
    got = consumer.expect_deliveries(len(contents), "binary contents")
    expect_equal("contents byte for byte", [len(c) for c in contents], [len(d.content) for d in got])
    expect_equal("contents byte for byte", True, [d.content for d in got] == contents)
    t.done(consumer, queue, *got)


@checks.check("core a disconnect returns unacknowledged messages with the same id and content")
def _disconnect(t: Target) -> None:
    queue, _, leaving, held = t.held("disconnect", b"held", "leaving consumer", "before the disconnect")
    leaving.close()
    next_one = t.conn("next consumer")
    [again] = next_one.take(queue, 1, "after the disconnect")
    expect_equal("same id and content", (held.message_id, b"held"), (again.message_id, again.content))
    t.done(next_one, queue, again)


@checks.check("core a new consume replaces the window and releases what it held")
def _replace(t: Target) -> None:
    queue, _, consumer, held = t.held("replace", b"released", "consumer", "first window")
    consumer.send(phpmq.consume(t.queue("replace-other").encode(), 1))
    t.barrier(consumer)
    rival = t.conn("rival")
    [again] = rival.take(queue, 1, "released by the new window")
    expect_equal("same message", held.message_id, again.message_id)
    t.done(rival, queue, again)


@checks.check("core an ack from another connection finishes the message")
def _ack_elsewhere(t: Target) -> None:
    queue, producer, holder, delivery = t.held("ack-elsewhere", b"x", "holder", "delivery")
    t.done(producer, queue, delivery)
    holder.close()  # it is finished: nobody gets it again
    watcher = t.conn("watcher")
    watcher.send(phpmq.consume(queue, 1))
    watcher.expect_quiet(t.quiet_s, "an acknowledged message after its holder left")


@checks.check("core consumers of one queue compete: each message goes to one")
def _compete(t: Target) -> None:
    queue = t.queue("compete").encode()
    producer, a, b = t.conn("producer"), t.conn("consumer a"), t.conn("consumer b")
    a.send(phpmq.consume(queue, 10))
    b.send(phpmq.consume(queue, 10))
    t.barrier(a)
    t.barrier(b)
    bodies = [b"%d" % number for number in range(10)]
    for body in bodies:
        producer.send(phpmq.send(queue, body))
    got: list[phpmq.Delivery] = []
    deadline = time.monotonic() + t.timeout
    while len(got) < len(bodies) and time.monotonic() < deadline:
        for conn in (a, b):
            conn.read_deliveries(time.monotonic() + 0.05)
            got += conn.received
            for delivery in conn.received:
                conn.send(phpmq.ack(queue, delivery.message_id))
            conn.received = []
    expect_equal("every message once", sorted(bodies), sorted(d.content for d in got))
    t.barrier(a)
    t.barrier(b)


# -- the current generation ---------------------------------------------------------------------


@checks.check("current-generation a 001 with a TTL packet is stored and its 003 carries the TTL left")
def _ttl_packet(t: Target) -> None:
    client, queue, delivery = t.stored_and_taken("ttl", b"with ttl", 3600, "003 with TTL")
    expect_equal("003 header", b"H0100304", bytes(client.raw[:8]))
    expect_equal("TTL left", True, delivery.ttl is not None and 3590 <= delivery.ttl <= 3600)
    t.done(client, queue, delivery)


@checks.check("current-generation a TTL that ran out is never delivered")
def _ttl_expiry(t: Target) -> None:
    queue = t.queue("expiry").encode()
    client = t.conn("current client")
    client.send(phpmq.send(queue, b"too late", 1))
    t.barrier(client)
    time.sleep(1.1)  # TTLs are whole seconds
    client.send(phpmq.consume(queue, 1))
    client.expect_quiet(t.quiet_s, "an expired message")


@checks.check("current-generation 005 puts the message at the tail with its new TTL")
def _requeue(t: Target) -> None:
    queue = t.queue("requeue").encode()
    client = t.conn("current client")
    client.send(phpmq.send(queue, b"a", 60) + phpmq.send(queue, b"b", 60))
    [a] = client.take(queue, 1, "first")
    client.send(phpmq.requeue(queue, a.message_id, 900))
    [b] = client.expect_deliveries(1, "behind it")
    expect_equal("next", b"b", b.content)
    client.send(phpmq.ack(queue, b.message_id))
    [again] = client.expect_deliveries(1, "requeued")
    expect_equal("requeued at the tail with its new TTL", (b"a", a.message_id, 900),
                 (again.content, again.message_id, again.ttl))
    t.done(client, queue, again)


@checks.check("current-generation 006 moves the message to <queue>.dead")
def _dead_letter(t: Target) -> None:
    client, queue, poison = t.stored_and_taken("dead", b"poison", 60, "delivery")
    client.send(phpmq.dead_letter(queue, poison.message_id))
    t.barrier(client)
    reader = t.conn("dead-letter reader")
    [letter] = reader.take(queue + b".dead", 1, "dead letter")
    expect_equal("the same message", (b"poison", poison.message_id), (letter.content, letter.message_id))
    t.done(reader, queue + b".dead", letter)


@checks.check("current-generation an ack from another connection frees the holder's window slot")
def _slot_freed(t: Target) -> None:
    queue = t.queue("slot").encode()
    producer, holder = t.conn("producer"), t.conn("holder")
    producer.send(phpmq.send(queue, b"1") + phpmq.send(queue, b"2"))
    [first] = holder.take(queue, 1, "first")
    producer.send(phpmq.ack(queue, first.message_id))
    [second] = holder.expect_deliveries(1, "the slot freed by another connection's ack")
    expect_equal("next", b"2", second.content)
    t.done(holder, queue, second)


# -- robustness ---------------------------------------------------------------------------------

BAD_INPUT = {
    "a header that is not H": b"X0100102",
    "an unknown message type": b"H0100902",
    "a client-sent 003": phpmq.delivery(b"q", b"x", b"0" * phpmq.MESSAGE_ID_SIZE, None),
    "a packet header that is not P": b"H0100102Q0100000000000000000000000000001q",
    "a length of 10^28 bytes": b"H0100102P0100000000000000000000000000001qP02" + b"9" * phpmq.LENGTH_DIGITS,
}


def _robustness(description: str, data: bytes) -> Callable[[Target], None]:
    def check(t: Target) -> None:
        queue = t.queue("robust").encode()
        bystander, culprit = t.conn("bystander"), t.conn("culprit")
        bystander.send(phpmq.send(queue, b"kept"))
        t.barrier(bystander)
        culprit.send(data)
        if not culprit.closed_by_server():
            raise CheckFailed(f"after {description}", "the connection closed", "still open")
        [kept] = bystander.take(queue, 1, "another client's message after the bad input")
        expect_equal("kept", b"kept", kept.content)
        t.done(bystander, queue, kept)

    return check


for _description, _data in BAD_INPUT.items():
    checks.check(f"robustness {_description} closes that connection only")(_robustness(_description, _data))


# ---------------------------------------------------------------------------------------------


def make_context_factory(address: tuple[str, int], timeout: float,
                         quiet: float) -> Callable[[str], AbstractContextManager[Target]]:
    run_id = secrets.token_hex(4)
    return runner.contexts(lambda _: Target(address, timeout, quiet, run_id), Target.close)


@click.command()
@click.option("--addr", "address", default=DEFAULT_ADDRESS, show_default=True, help="PHPMQ server address HOST:PORT")
@runner.selection_options("core")
@runner.timeout_option("delivery")
@click.option("--quiet", default=DEFAULT_QUIET_S, show_default=True, type=float,
              help="seconds to watch for a delivery that must not come")
def command(address: str, timeout: float, quiet: float) -> None:
    """Check that a PHPMQ server behaves like the original php-mq server.

    Groups: `core` (the original's behaviour), `current-generation` (TTL, 005, 006) and
    `robustness` (bad input closes one connection), which the original fails. Prints `PASS name`
    or `FAIL name: reason` per check, then `N passed, M failed`; exits 0 only if every check passed.
    """
    runner.run_command(checks, make_context_factory(runner.parse_address(address), timeout, quiet),
                       address=("--addr", address))
