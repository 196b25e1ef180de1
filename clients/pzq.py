"""A PZQ client for trio programs: a producer that waits for its ACKs, a consumer that answers for
its handler, a monitor. Each socket is driven by a task of its own through its `zmq.FD`
(`clients/trio_zmq.py`), so it needs no thread. The blocking clients are `polymq.clients.pzq_blocking`.

    async with PZQProducer("127.0.0.1:11131") as producer:
        await producer.produce(b"hello", b"world")          # returns once the server stored it

    async def handle(message: PZQMessage) -> bool:          # True: ACK 1; False: 0, send it again
        ...
    async with PZQConsumer("127.0.0.1:11132", handle):
        ...

It behaves as the reference PHP client does (docs/protocols/pzq.md): producer ids are its own, a
`0` answer raises `PZQRefused` with the server's text, a delivery whose ACK timeout already passed
is dropped unanswered by default (the server sends it again).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Awaitable, Callable
from types import TracebackType

import attrs
import trio
import zmq

from polymq.clients import zmq_socket
from polymq.clients.trio_zmq import Frames, SocketPump
from polymq.codecs import pzq

# How long `produce` waits for the server's answer (the reference client's default).
DEFAULT_PRODUCE_TIMEOUT_S = 5.0
# At the end of an `async with`, how long what is still queued (a consumer's last ACKs) may take to go out.
CLOSE_FLUSH_S = 1.0


class PZQRefused(Exception):
    """The server answered `0`: the message was not stored; the text says why."""


@attrs.frozen(slots=True)
class PZQMessage:
    key: bytes
    sent_us: int
    ack_timeout_us: int
    bodies: list[bytes]

    @property
    def expired(self) -> bool:
        """The server has (or will have) sent it again: its ACK timeout passed."""
        return time.time_ns() // 1000 > self.sent_us + self.ack_timeout_us


class _Client:
    """One socket and its pump, run in a nursery for the `async with` block."""

    def __init__(self, kind: int, address: str) -> None:
        self._context = zmq.Context.instance()
        sock = self._context.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(zmq_socket.endpoint(address))
        self.pump = SocketPump(sock, self._received)
        self._nursery_manager = trio.open_nursery()
        self._nursery: trio.Nursery | None = None

    def _received(self, frames: Frames) -> None:
        raise NotImplementedError

    async def __aenter__(self) -> _Client:
        self._nursery = await self._nursery_manager.__aenter__()
        self._nursery.start_soon(self.pump.run)
        return self

    async def __aexit__(self, kind: type[BaseException] | None, error: BaseException | None,
                        traceback: TracebackType | None) -> bool | None:
        assert self._nursery is not None
        with trio.move_on_after(CLOSE_FLUSH_S):  # answers (a consumer's last ACKs) still queued go out first
            while self.pump.outgoing:
                await trio.sleep(0.005)
        self._nursery.cancel_scope.cancel()  # the pump, the consumer's handler task
        try:
            return await self._nursery_manager.__aexit__(kind, error, traceback)
        finally:
            self.pump.close(linger_ms=int(CLOSE_FLUSH_S * 1000))


class PZQProducer(_Client):
    def __init__(self, address: str, *, timeout: float = DEFAULT_PRODUCE_TIMEOUT_S) -> None:
        super().__init__(zmq.DEALER, address)
        self.timeout = timeout
        self._ids = itertools.count()
        self._waiting: dict[bytes, tuple[trio.Event, list[list[bytes]]]] = {}

    async def __aenter__(self) -> PZQProducer:
        await super().__aenter__()
        return self

    async def produce(self, *bodies: bytes) -> None:
        """Send one message (its body frames) and return once the server says it is stored.

        Several calls may wait at once (pipelining). Raises PZQRefused for a `0`, TimeoutError when no
        answer came in time (the message may or may not be stored: produce it again)."""
        producer_id = b"%d" % next(self._ids)
        arrived = trio.Event()
        answer: list[list[bytes]] = []
        self._waiting[producer_id] = (arrived, answer)
        self.pump.send([producer_id, pzq.DELIMITER, *bodies])
        try:
            with trio.fail_after(self.timeout):
                await arrived.wait()
        except trio.TooSlowError:
            raise TimeoutError(f"no answer to message {producer_id.decode()} in {self.timeout} s") from None
        finally:
            self._waiting.pop(producer_id, None)
        frames = answer[0]
        if frames[1:2] != [pzq.ACK_OK]:
            raise PZQRefused((frames[3] if len(frames) > 3 else b"").decode("utf-8", "replace"))

    def _received(self, frames: Frames) -> None:
        waiting = self._waiting.get(frames[0]) if frames else None
        if waiting is not None:
            waiting[1].append(frames)
            waiting[0].set()


class PZQConsumer(_Client):
    def __init__(self, address: str, handler: Callable[[PZQMessage], Awaitable[bool]], *,
                 drop_expired: bool = True) -> None:
        super().__init__(zmq.ROUTER, address)
        self.handler = handler
        self.drop_expired = drop_expired
        self._deliveries: trio.MemorySendChannel[tuple[bytes, PZQMessage]]
        self._deliveries, self._incoming = trio.open_memory_channel(float("inf"))

    async def __aenter__(self) -> PZQConsumer:
        await super().__aenter__()
        assert self._nursery is not None
        self._nursery.start_soon(self._handle)
        return self

    def _received(self, frames: Frames) -> None:
        if len(frames) < 5 or frames[4] != pzq.DELIMITER or not frames[2].isdigit() or not frames[3].isdigit():
            return  # not a PZQ delivery
        message = PZQMessage(frames[1], int(frames[2]), int(frames[3]), frames[5:])
        self._deliveries.send_nowait((frames[0], message))

    async def _handle(self) -> None:
        async for peer, message in self._incoming:
            if self.drop_expired and message.expired:
                continue  # the server sends it again anyway
            done = await self.handler(message)
            self.pump.send([peer, message.key, pzq.ACK_OK if done else pzq.ACK_FAILED])


class PZQMonitor(_Client):
    def __init__(self, address: str, *, timeout: float = DEFAULT_PRODUCE_TIMEOUT_S) -> None:
        super().__init__(zmq.DEALER, address)
        self.timeout = timeout
        self._answers: trio.MemorySendChannel[list[bytes]]
        self._answers, self._received_answers = trio.open_memory_channel(float("inf"))

    async def __aenter__(self) -> PZQMonitor:
        await super().__aenter__()
        return self

    async def stats(self) -> dict[str, int]:
        """The server's monitor values, by key."""
        self.pump.send([pzq.DELIMITER, pzq.MONITOR])
        with trio.fail_after(self.timeout):
            frames = await self._received_answers.receive()
        return pzq.parse_monitor_text(frames[-1])

    def _received(self, frames: Frames) -> None:
        self._answers.send_nowait(frames)
