"""`polymq conformance pzq`: black-box checks of any PZQ server (its receive, send and monitor sockets).

Written from how the original PZQ server behaves on the wire (docs/protocols/pzq.md). Groups, by
the first word of a check's name:

- `core …`: what the original does; a conformant server passes them all. `core no-ack` waits out
  the server's ACK timeout (`--ack-timeout`, 5 s like the original's default; the original may
  take half as long again, for its reaper).
- `restart …`: only with `--restart-command`: stored messages are all sent again after a restart.
- `robustness …`: what the original gets wrong (lost ACKs under pipelining, silence for a
  one-frame message or an unknown monitor request, a `0` of a superseded delivery honoured).

The suite must have the server to itself: a PZQ server has one queue, and every check starts by
taking (and acknowledging) whatever is left in it. "Stored" and "removed" are read from the
monitor's `messages`. Only `polymq.clients`, `polymq.codecs` and the shared runner are imported
(docs/architecture.md).
"""

from __future__ import annotations

import secrets
import shlex
import subprocess
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TypeVar

import click
import zmq

from polymq.clients import pzq_blocking
from polymq.codecs import pzq
from polymq.conformance import runner
from polymq.conformance.runner import CheckFailed, Registry, expect_equal

DEFAULT_RECEIVE = "127.0.0.1:11131"
DEFAULT_SEND = "127.0.0.1:11132"
DEFAULT_MONITOR = "127.0.0.1:11133"
DEFAULT_ACK_TIMEOUT_S = 5.0  # the original's --ack-timeout
# The original's reaper notices a missed ACK up to this long after the timeout (its --reaper-frequency).
REAPER_S = 2.5
# Pipelined producing: the original loses ACKs with 64 in flight (docs/protocols/pzq.md).
PIPELINED = 2000
PIPELINE_DEPTH = 64
# How long a check watches for something that must not come.
QUIET_S = 0.5


PeerT = TypeVar("PeerT", bound=pzq_blocking.Peer)


class Target:
    def __init__(self, receive: str, send: str, monitor: str, timeout: float, ack_timeout: float,
                 restart: str | None, run_id: str) -> None:
        self.receive, self.send, self.monitor_address = receive, send, monitor
        self.timeout, self.ack_timeout, self.restart_command = timeout, ack_timeout, restart
        self.run_id = run_id
        self.context = zmq.Context()
        self._peers: list[pzq_blocking.Peer] = []
        self._ids = 0

    def _peer(self, kind: type[PeerT], address: str) -> PeerT:
        peer = kind(self.context, address, self.timeout)
        self._peers.append(peer)
        return peer

    def producer(self) -> pzq_blocking.Producer:
        return self._peer(pzq_blocking.Producer, self.receive)

    def consumer(self) -> pzq_blocking.Consumer:
        return self._peer(pzq_blocking.Consumer, self.send)

    def monitor(self) -> pzq_blocking.Monitor:
        return self._peer(pzq_blocking.Monitor, self.monitor_address)

    def producer_id(self) -> bytes:
        self._ids += 1
        return f"{self.run_id}-{self._ids}".encode()

    def body(self, text: str) -> bytes:
        return f"conformance {self.run_id} {text}".encode()

    def recv(self, peer: pzq_blocking.Peer, what: str, timeout: float | None = None) -> list[bytes]:
        try:
            return peer.receive(timeout)
        except TimeoutError as error:
            raise CheckFailed(f"{what}: nothing came", got=str(error)) from None

    def produce(self, producer: pzq_blocking.Producer, *bodies: bytes) -> list[bytes]:
        producer_id = self.producer_id()
        producer.send([producer_id, pzq.DELIMITER, *bodies])
        answer = self.recv(producer, "producer ACK")
        if answer[:2] != [producer_id, pzq.ACK_OK]:
            raise CheckFailed("producer ACK", [producer_id, b"1", b""], answer)
        return answer

    def delivery(self, consumer: pzq_blocking.Consumer, what: str, timeout: float | None = None) -> list[bytes]:
        frames = self.recv(consumer, what, timeout)
        if len(frames) < 6 or frames[4] != pzq.DELIMITER:
            raise CheckFailed(f"{what}: frames", "[pzq, key, sent_us, timeout_us, '', body…]", frames[:6])
        return frames

    def one_delivered(self, text: str) -> tuple[pzq_blocking.Consumer, list[bytes]]:
        """The queue emptied, one message produced, and its delivery to a new consumer."""
        self.empty_queue()
        consumer = self.consumer()
        self.produce(self.producer(), self.body(text))
        return consumer, self.delivery(consumer, "delivery")

    def redelivered(self, consumer: pzq_blocking.Consumer) -> list[bytes]:
        """The message of a delivery left unanswered, sent again after the ACK timeout."""
        return self.delivery(consumer, "sent again after the ACK timeout",
                             timeout=self.ack_timeout + REAPER_S + self.timeout)

    def nothing_sent_again(self, consumer: pzq_blocking.Consumer, last: list[bytes], what: str) -> None:
        """No delivery after `last` (of a message now removed), but one its ACK timeout sent: a
        check slowed down past that timeout is not failed for it."""
        deadline_us = int(last[2]) + int(last[3])
        while not consumer.quiet(QUIET_S):
            extra = self.delivery(consumer, f"{what}: an extra delivery")
            if int(extra[2]) < deadline_us:
                raise CheckFailed(f"{what}: sent again", "nothing", extra[5:])
            consumer.ack(extra)
            last, deadline_us = extra, int(extra[2]) + int(extra[3])

    def stats(self) -> dict[str, int]:
        monitor = self.monitor()
        monitor.send([pzq.MONITOR])
        text = self.recv(monitor, "MONITOR")[-1]
        monitor.close()
        self._peers.remove(monitor)
        try:
            return pzq.parse_monitor_text(text)
        except ValueError as error:
            raise CheckFailed("monitor text", "key: value lines", text[:200]) from error

    def wait_messages(self, count: int, what: str) -> None:
        deadline = time.monotonic() + self.timeout
        while (stats := self.stats())["messages"] != count:
            if time.monotonic() > deadline:
                raise CheckFailed(f"{what}: stored messages", count, stats["messages"])
            time.sleep(0.02)

    def empty_queue(self) -> None:
        """Take and acknowledge whatever is left (the suite has the server to itself)."""
        stored = self.stats()["messages"]
        if not stored:
            return
        consumer = self.consumer()
        patience = self.timeout + self.ack_timeout + REAPER_S
        deadline = time.monotonic() + patience
        while True:  # the monitor is asked only when nothing comes: thousands may be left
            if not consumer.quiet(0.1):
                consumer.ack(consumer.receive())
                deadline = time.monotonic() + patience  # a slow server still emptying is not failed
            elif not (stored := self.stats()["messages"]):
                break
            elif time.monotonic() > deadline:
                raise CheckFailed("emptying the queue first: stored messages", 0, stored)
        consumer.close()
        self._peers.remove(consumer)

    def close(self) -> None:
        for peer in self._peers:
            peer.close()
        self.context.term()


checks: Registry[Target] = Registry(original_fails={"robustness": "the original PZQ gets these wrong"})


# -- core -----------------------------------------------------------------------------------------


@checks.check("core a stored message is answered 1 and delivered frame for frame")
def _produce_consume(t: Target) -> None:
    t.empty_queue()
    producer, consumer = t.producer(), t.consumer()
    body = [t.body("first"), b"", t.body("third frame")]
    answer = t.produce(producer, *body)
    expect_equal("producer ACK", [answer[0], b"1", b""], answer)
    delivery = t.delivery(consumer, "delivery")
    expect_equal("body frames", body, delivery[5:])
    expect_equal("sent_us and ack timeout are decimal", True, delivery[2].isdigit() and delivery[3].isdigit())
    expect_equal("sent_us is about now", True, abs(int(delivery[2]) - time.time_ns() // 1000) < 60_000_000)
    consumer.ack(delivery)
    t.wait_messages(0, "after the ACK")


@checks.check("core header frames are dropped")
def _headers(t: Target) -> None:
    t.empty_queue()
    producer, consumer = t.producer(), t.consumer()
    producer.send([t.producer_id(), b"header", pzq.DELIMITER, t.body("body")])
    expect_equal("producer ACK status", pzq.ACK_OK, t.recv(producer, "producer ACK")[1])
    delivery = t.delivery(consumer, "delivery")
    expect_equal("delivered", [t.body("body")], delivery[5:])
    consumer.ack(delivery)
    t.wait_messages(0, "after the ACK")


@checks.check("core a message without a delimiter or without a body is refused with the original's text")
def _refused(t: Target) -> None:
    producer = t.producer()
    for frames, reason in (([b"x", b"no delimiter"], pzq.MALFORMED), ([b"y", pzq.DELIMITER], pzq.EMPTY)):
        producer.send(frames)
        expect_equal(f"answer to {frames!r}", [frames[0], pzq.ACK_FAILED, pzq.DELIMITER, reason],
                     t.recv(producer, "refusal"))


@checks.check("core oldest first")
def _order(t: Target) -> None:
    """Stored messages are delivered oldest first, in the order they were produced."""
    t.empty_queue()
    producer, consumer = t.producer(), t.consumer()
    bodies = [t.body(f"order {number}") for number in range(5)]
    for body in bodies:
        t.produce(producer, body)
    got = []
    for _ in bodies:
        delivery = t.delivery(consumer, "delivery")
        got.append(delivery[5])
        consumer.ack(delivery)
    expect_equal("order", bodies, got)
    t.wait_messages(0, "after the ACKs")


@checks.check("core an ACK other than 1 sends the message again at once")
def _nack(t: Target) -> None:
    consumer, first = t.one_delivered("nack")
    consumer.ack(first, pzq.ACK_FAILED)
    again = t.delivery(consumer, "sent again", timeout=1.0)
    expect_equal("the same body", first[5:], again[5:])
    expect_equal("the same key", first[1], again[1])
    consumer.ack(again)
    t.wait_messages(0, "after the ACK")


@checks.check("core no-ack: without an ACK the message is sent again after the ACK timeout")
def _no_ack(t: Target) -> None:
    consumer, first = t.one_delivered("no ack")
    started = time.monotonic()
    again = t.delivery(consumer, "sent again", timeout=t.ack_timeout + REAPER_S + t.timeout)
    waited = time.monotonic() - started
    expect_equal("the same body", first[5:], again[5:])
    expect_equal("not before the ACK timeout", True, waited >= t.ack_timeout * 0.9)
    consumer.ack(again)
    t.wait_messages(0, "after the ACK")


@checks.check("core a message sent again after the ACK timeout has the key of its first delivery")
def _same_key(t: Target) -> None:
    consumer, first = t.one_delivered("same key")
    again = t.redelivered(consumer)
    expect_equal("the key, byte for byte", first[1], again[1])
    expect_equal("the same body", first[5:], again[5:])
    consumer.ack(again)
    t.wait_messages(0, "after the ACK")


def _two_zeros_after_a_timeout(t: Target, text: str) -> tuple[pzq_blocking.Consumer, list[bytes], list[bytes]]:
    """A delivery left past the ACK timeout, then a 0 for it and a 0 for the delivery that
    superseded it: the consumer, the first delivery and the one the 0s brought (same key)."""
    consumer, first = t.one_delivered(text)
    again = t.redelivered(consumer)
    consumer.ack(first, pzq.ACK_FAILED)
    consumer.ack(again, pzq.ACK_FAILED)
    third = t.delivery(consumer, "sent again", timeout=t.ack_timeout + REAPER_S + t.timeout)
    expect_equal("the same key", first[1], third[1])
    return consumer, first, third


@checks.check("core after a timeout, two 0s in a row send the message again, and a 1 removes it")
def _two_nacks(t: Target) -> None:
    """The first delivery's late 0, then the current one's: the message comes again with its key,
    and goes with a 1.

    The original resends at the first 0; whether it resends once more at the second depends on
    whether that resend went out before the second 0 came (then it is in flight again), so a
    further copy is answered too (the `robustness` check below asks for exactly one)."""
    consumer, first, third = _two_zeros_after_a_timeout(t, "two 0s")
    consumer.ack(third)
    while not consumer.quiet(QUIET_S):
        extra = t.delivery(consumer, "a copy for the second 0")
        expect_equal("the same key", first[1], extra[1])
        consumer.ack(extra)
    t.wait_messages(0, "after the 1")


@checks.check("core the monitor answers MONITOR with six lines in order")
def _monitor(t: Target) -> None:
    monitor = t.monitor()
    monitor.send([pzq.MONITOR])
    text = t.recv(monitor, "MONITOR")[-1]
    keys = [line.split(": ", 1)[0] for line in text.decode(errors="replace").splitlines()]
    expect_equal("keys", list(pzq.MONITOR_KEYS), keys)
    t.empty_queue()
    producer = t.producer()
    t.produce(producer, t.body("counted"))
    t.wait_messages(1, "after one produce")
    t.empty_queue()


# -- restart --------------------------------------------------------------------------------------


@checks.check("restart stored messages are all sent again after a restart")
def _restart(t: Target) -> None:
    if not t.restart_command:
        raise CheckFailed("needs --restart-command (a command that restarts the server and returns once it is up)")
    t.empty_queue()
    producer, consumer = t.producer(), t.consumer()
    bodies = [t.body(f"kept {number}") for number in range(3)]
    for body in bodies:
        t.produce(producer, body)
    first = t.delivery(consumer, "before the restart")
    consumer.ack(first)
    t.delivery(consumer, "in flight at the restart")
    t.wait_messages(2, "before the restart")
    # ZeroMQ would connect these again to the restarted server, which may then hand the stored
    # messages to the old consumer nobody reads (the original does): only `after` may consume.
    for peer in (producer, consumer):
        peer.close()
    done = subprocess.run(shlex.split(t.restart_command), capture_output=True, text=True, timeout=120, check=False)
    if done.returncode != 0:
        raise CheckFailed("the restart command failed", got=(done.stderr or done.stdout).strip()[-200:])
    after = t.consumer()
    got = []
    for _ in range(2):
        delivery = t.delivery(after, "after the restart")
        got.append(delivery[5])
        after.ack(delivery)
    expect_equal("sent again", sorted(bodies[1:]), sorted(got))
    t.wait_messages(0, "after the ACKs")


# -- robustness -----------------------------------------------------------------------------------


@checks.check("robustness a one-frame producer message gets an answer")
def _one_frame(t: Target) -> None:
    producer = t.producer()
    producer.send([b"alone"])
    expect_equal("answer", [b"alone", pzq.ACK_FAILED, pzq.DELIMITER, pzq.MALFORMED], t.recv(producer, "answer"))


@checks.check("robustness every ACK of a pipelined producer comes")
def _pipelined(t: Target) -> None:
    t.empty_queue()
    producer = t.producer()
    sent, answered = 0, set()
    while len(answered) < PIPELINED:
        while sent < PIPELINED and sent - len(answered) < PIPELINE_DEPTH:
            producer.send([b"%s-%d" % (t.run_id.encode(), sent), pzq.DELIMITER, t.body(f"p{sent}")])
            sent += 1
        frames = t.recv(producer, f"ACK {len(answered) + 1} of {PIPELINED}")
        answered.add(frames[0])
    expect_equal("answered", PIPELINED, len(answered))
    t.empty_queue()


@checks.check("robustness a 0 from a delivery superseded after the ACK timeout does not send the message again")
def _stale_nack(t: Target) -> None:
    consumer, first = t.one_delivered("stale 0")
    again = t.redelivered(consumer)
    consumer.ack(first, pzq.ACK_FAILED)  # the first delivery's late 0: the second one holds it now
    consumer.ack(again)
    t.wait_messages(0, "after the 1")
    t.nothing_sent_again(consumer, again, "after the superseded delivery's 0")


@checks.check("robustness after a timeout, two 0s in a row send the message again only once")
def _two_nacks_once(t: Target) -> None:
    """polymq ignores the superseded delivery's 0 and honours the current one's; the original
    resends at the first, and at the second too when its resend was already out."""
    consumer, _, third = _two_zeros_after_a_timeout(t, "two 0s once")
    consumer.ack(third)
    t.wait_messages(0, "after the 1")
    t.nothing_sent_again(consumer, third, "after the 1")


@checks.check("robustness the monitor answers an unknown request")
def _unknown_monitor_request(t: Target) -> None:
    monitor = t.monitor()
    monitor.send([b"STATUS"])
    answer = t.recv(monitor, "an answer", timeout=1.0)
    expect_equal("an answer that is not the stats", False, answer[-1].startswith(b"messages: "))


# ---------------------------------------------------------------------------------------------


def make_context_factory(receive: str, send: str, monitor: str, timeout: float, ack_timeout: float,
                         restart: str | None) -> Callable[[str], AbstractContextManager[Target]]:
    run_id = secrets.token_hex(4)
    return runner.contexts(lambda _: Target(receive, send, monitor, timeout, ack_timeout, restart, run_id),
                           Target.close, (zmq.ZMQError,))


@click.command()
@runner.address_options(("--receive", DEFAULT_RECEIVE, "The receive socket (producers), HOST:PORT."),
                 ("--send", DEFAULT_SEND, "The send socket (consumers), HOST:PORT."),
                 ("--monitor", DEFAULT_MONITOR, "The monitor socket, HOST:PORT or ipc://PATH."))
@runner.selection_options("core")
@runner.timeout_option("answer")
@click.option("--ack-timeout", default=DEFAULT_ACK_TIMEOUT_S, show_default=True, type=float,
              help="the server's ACK timeout in seconds (the no-ack check waits it out)")
@click.option("--restart-command", default=None,
              help="a command that restarts the server and returns once it serves again: runs the restart check")
def command(receive: str, send: str, monitor: str, timeout: float, ack_timeout: float,
            restart_command: str | None) -> None:
    """Check that a PZQ server behaves like the original PZQ.

    Groups: `core` (the original's behaviour), `restart` (needs --restart-command) and `robustness`
    (what the original gets wrong). It needs the server to itself. Prints `PASS name` or
    `FAIL name: reason` per check, then `N passed, M failed`; exits 0 only if every check passed.
    """
    contexts = make_context_factory(receive, send, monitor, timeout, ack_timeout, restart_command)
    runner.run_command(checks, contexts,
                       lambda check: bool(restart_command) or not check.name.startswith("restart "),
                       address=("--receive", receive))
