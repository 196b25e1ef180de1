"""Registration with nsqlookupd: what this node holds, told to every lookupd as nsqd 1.3.0 tells it.

One `LookupPeer` per `--lookupd-tcp-address` keeps a connection open (nsqd's lookup.go and
lookup_peer.go): `  V1`, IDENTIFY with the node's broadcast address, ports, version and host name,
then a REGISTER for every channel of every topic (a topic without channels registers alone), then
the changes as they happen, and a PING every 15 s. A lost connection is made again, with a growing
pause, and everything is registered anew: nsqlookupd forgets a node whose connection closes, which
is also how a stopping node leaves its lists. The addresses can change at run time
(`PUT /config/nsqlookupd_tcp_addresses`).

Every engine topic registers, whichever protocol made it, and every queue bound to it as a
channel: NSQ channel `c` of topic `t` is the queue `t/c`; another protocol's queue `q` bound to `t`
is channel `q`. A name nsqlookupd would refuse (not `[.a-zA-Z0-9_-]`, 1 to 64 bytes, optionally
`#ephemeral`) is left out, since nsqlookupd closes the connection of a node that sends one
(docs/cluster.md). The engine's observers drive it: nothing here runs on a publish or a delivery.
"""

from __future__ import annotations

import json
import logging
import math
from collections import deque
from collections.abc import Iterable
from typing import Any

import attrs
import trio

from polymq.codecs import nsq_lookup
from polymq.codecs.nsq import is_valid_name
from polymq.core.engine import Engine, Queue, Topic

log = logging.getLogger("polymq.lookupd")

# nsqd's lookupLoop sends a PING to every lookupd on a 15 s ticker (nsqlookupd forgets a node it
# has not heard from in --inactive-producer-timeout, 300 s).
PING_INTERVAL_S = 15.0
# nsqd's lookupPeer dials with a 1 s timeout.
DIAL_TIMEOUT_S = 1.0
# nsqd gives each read and write to a lookupd 1 s; polymq allows 5 s, so that a busy machine's
# late answer costs a wait, not a reconnection and a second round of registrations.
IO_TIMEOUT_S = 5.0
# nsqd tries a lost lookupd again at its next command, at the latest at the next PING (15 s);
# polymq tries after 1 s, doubling the pause up to that same 15 s while the lookupd stays away.
RECONNECT_FIRST_S = 1.0
RECONNECT_MAX_S = PING_INTERVAL_S
# Commands written at once before their answers are read (nsqlookupd reads them in order); a
# batch's commands and answers fit in the sockets' buffers, so neither side waits on the other.
BATCH = 128


@attrs.frozen
class NodeIdentity:
    """What IDENTIFY tells a lookupd, and what consumers are then told to connect to."""

    broadcast_address: str
    tcp_port: int
    http_port: int
    version: str
    hostname: str


class LookupdError(Exception):
    """A lookupd refused a command or answered what nsqd would not read."""


def _valid(name: str) -> bool:
    return name.isascii() and is_valid_name(name.encode())


def channel_of(topic: str, queue: str) -> str | None:
    """The NSQ channel a queue bound to `topic` registers as, or None when lookupd would refuse it."""
    prefix = topic + "/"
    channel = queue[len(prefix):] if queue.startswith(prefix) else queue
    return channel if _valid(topic) and _valid(channel) else None


def registrations(engine: Engine) -> list[tuple[str, str]]:
    """(topic, channel) pairs as nsqd's connectCallback registers them: a topic's channels, or the
    topic alone ("") when it has none that registers."""
    found: list[tuple[str, str]] = []
    for topic in list(engine.topics.values()):
        if not _valid(topic.name):
            continue
        channels = [channel for queue in topic.queues if (channel := channel_of(topic.name, queue.name))]
        if channels:
            found.extend((topic.name, channel) for channel in channels)
        else:
            found.append((topic.name, ""))
    return found


class LookupPeer:
    """One lookupd: its connection, re-made whenever it is lost, and the commands waiting for it."""

    def __init__(self, address: str, registrar: LookupdRegistrar) -> None:
        self.address = address
        self.registrar = registrar
        self.pending: deque[bytes] = deque()
        self.connected = False  # IDENTIFY answered: changes are queued, else the next connection sends them
        self.info: dict[str, Any] = {}  # the lookupd's answer to IDENTIFY
        self.cancel_scope = trio.CancelScope()
        self.done = trio.Event()
        self._wake = trio.Event()

    def send(self, command: bytes) -> None:
        if self.connected:
            self.pending.append(command)
            self._wake.set()

    async def run(self) -> None:
        pause = RECONNECT_FIRST_S
        try:
            with self.cancel_scope:
                while True:
                    # `except*`: the connection's nursery wraps its tasks' errors in an ExceptionGroup.
                    try:
                        await self._connection()
                    except* LOST as group:
                        error = _first(group)
                        if self.info:  # it had answered IDENTIFY: try again soon
                            pause = RECONNECT_FIRST_S
                        log.warning("lookupd %s: %s; trying again in %g s", self.address,
                                    str(error) or type(error).__name__, pause)
                    finally:
                        self.connected = False
                        self.info = {}
                    await trio.sleep(pause)
                    pause = min(pause * 2, RECONNECT_MAX_S)
        finally:
            self.done.set()

    async def _connection(self) -> None:
        host, _, port = self.address.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise LookupdError("not a host:port address")
        with trio.fail_after(DIAL_TIMEOUT_S):
            stream = await trio.open_tcp_stream(host.strip("[]"), int(port))
        async with stream:
            answers_in, answers = trio.open_memory_channel[bytes](math.inf)
            async with trio.open_nursery() as nursery:
                # Reading all the time, not only for an answer, so a lookupd that goes away is noticed
                # at once (nsqd notices at its next command, or PING).
                nursery.start_soon(self._read, stream, answers_in)
                identity = self.registrar.identity
                answer = await self._exchange(stream, answers, [nsq_lookup.MAGIC_V1 + nsq_lookup.identify(
                    identity.broadcast_address, identity.tcp_port, identity.http_port, identity.version,
                    identity.hostname)])
                try:
                    info = json.loads(answer[0])
                except ValueError:
                    info = None
                if not isinstance(info, dict):
                    raise LookupdError(f"IDENTIFY answered {_shown(answer[0])}")
                self.info = info
                # Everything held now, then every change after it, in order (the engine is synchronous:
                # no change falls between the snapshot and `connected`).
                self.pending = deque(
                    nsq_lookup.register(topic, channel) for topic, channel in registrations(self.registrar.engine))
                self.connected = True
                log.info("lookupd %s: connected (lookupd %s at %s), registering %d topics and channels",
                         self.address, info.get("version"), info.get("broadcast_address"), len(self.pending))
                await self._serve(stream, answers)

    async def _read(self, stream: trio.SocketStream, answers: trio.MemorySendChannel[bytes]) -> None:
        reader = nsq_lookup.ResponseReader(self.registrar.max_response)
        while data := await stream.receive_some():
            for response in reader.receive_data(data):
                answers.send_nowait(response)
        raise LookupdError("connection closed by lookupd")

    async def _serve(self, stream: trio.SocketStream, answers: trio.MemoryReceiveChannel[bytes]) -> None:
        next_ping = trio.current_time() + PING_INTERVAL_S
        while True:
            if not self.pending:
                with trio.move_on_at(next_ping):
                    await self._wake.wait()
                self._wake = trio.Event()
            if self.pending:
                batch = [self.pending.popleft() for _ in range(min(BATCH, len(self.pending)))]
                for sent, response in zip(batch, await self._exchange(stream, answers, batch), strict=True):
                    log.debug("lookupd %s: %s -> %s", self.address, _shown(sent.rstrip(b"\n")), _shown(response))
            if trio.current_time() >= next_ping:
                await self._exchange(stream, answers, [nsq_lookup.ping()])
                next_ping = trio.current_time() + PING_INTERVAL_S

    async def _exchange(self, stream: trio.SocketStream, answers: trio.MemoryReceiveChannel[bytes],
                        commands: list[bytes]) -> list[bytes]:
        """Writes the commands, reads one answer each; an error answer ends the connection."""
        with trio.fail_after(IO_TIMEOUT_S):
            await stream.send_all(b"".join(commands))
        responses: list[bytes] = []
        for sent in commands:
            with trio.fail_after(IO_TIMEOUT_S):
                response = await answers.receive()
            if nsq_lookup.is_error(response):
                name = sent.removeprefix(nsq_lookup.MAGIC_V1).split(b"\n", 1)[0]
                raise LookupdError(f"{_shown(name)} refused: {_shown(response)}")
            responses.append(response)
        return responses


# What ends a connection to a lookupd, to be made again after a pause.
LOST = (OSError, trio.BrokenResourceError, trio.ClosedResourceError, trio.TooSlowError, LookupdError,
        nsq_lookup.LookupProtocolError)


def _first(group: BaseExceptionGroup[Any]) -> BaseException:
    error: BaseException = group
    while isinstance(error, BaseExceptionGroup):
        error = error.exceptions[0]
    return error


def _shown(data: bytes) -> str:
    return data.decode("utf-8", "replace")


class LookupdRegistrar:
    """Every lookupd this node registers with, kept in step with the engine by its observers."""

    def __init__(self, engine: Engine, identity: NodeIdentity, addresses: Iterable[str], *,
                 max_response: int) -> None:
        self.engine = engine
        self.identity = identity
        self.max_response = max_response  # nsqd bounds a lookupd's answer by its --max-body-size
        self.addresses: list[str] | None = list(addresses)  # as set, as nsqd shows them (null after PUT null)
        self.peers: dict[str, LookupPeer] = {}
        self._nursery: trio.Nursery | None = None

    # -- the lookupds ------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        engine = self.engine
        engine.on_topic_created.append(self._topic_created)
        engine.on_topic_deleted.append(self._topic_deleted)
        engine.on_bound.append(self._bound)
        engine.on_unbound.append(self._unbound)
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                self._connect()
                task_status.started()
                await trio.sleep_forever()
        finally:
            self._nursery = None
            engine.on_topic_created.remove(self._topic_created)
            engine.on_topic_deleted.remove(self._topic_deleted)
            engine.on_bound.remove(self._bound)
            engine.on_unbound.remove(self._unbound)

    def set_addresses(self, addresses: list[str] | None) -> None:
        """The lookupds to register with from now on (nsqd: removed ones are closed, new ones added)."""
        self.addresses = addresses
        wanted = set(addresses or ())
        for address in [address for address in self.peers if address not in wanted]:
            log.info("lookupd %s: removed", address)
            self.peers.pop(address).cancel_scope.cancel()
        self._connect()

    def _connect(self) -> None:
        if self._nursery is None:
            return
        for address in self.addresses or ():
            if address not in self.peers:
                log.info("lookupd %s: added", address)
                peer = self.peers[address] = LookupPeer(address, self)
                self._nursery.start_soon(peer.run)

    async def stop(self) -> None:
        """Closes every lookupd connection, so each lookupd forgets this node (nsqd on exit)."""
        self._nursery = None  # and a PUT of the addresses while the node stops connects none
        peers = list(self.peers.values())
        self.peers.clear()
        for peer in peers:
            peer.cancel_scope.cancel()
        for peer in peers:
            await peer.done.wait()

    # -- the engine's observers ------------------------------------------------------------------

    def _send(self, command: bytes) -> None:
        for peer in self.peers.values():
            peer.send(command)

    def _topic_created(self, topic: Topic) -> None:
        if _valid(topic.name):
            self._send(nsq_lookup.register(topic.name))

    def _topic_deleted(self, name: str) -> None:
        if _valid(name):
            self._send(nsq_lookup.unregister(name))

    def _bound(self, queue: Queue, topic: str) -> None:
        channel = channel_of(topic, queue.name)
        if channel is not None:
            self._send(nsq_lookup.register(topic, channel))

    def _unbound(self, queue: Queue, topic: str) -> None:
        channel = channel_of(topic, queue.name)
        if channel is not None:
            self._send(nsq_lookup.unregister(topic, channel))
