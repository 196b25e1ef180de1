"""ZeroMQ sockets inside trio, without threads: one pump task per socket, driven by its `zmq.FD`.

`zmq.FD` is edge-triggered: it becomes readable when the socket's state *changed*, not while a
message waits. So the pump reads `zmq.EVENTS` before it receives or sends, takes what is ready
until the socket says `Again`, and reads `EVENTS` again (a send can consume the edge that announced
incoming messages). Only when `EVENTS` shows neither direction can progress does it wait for the
descriptor, or for `send` to queue more.

Incoming messages go to the `on_messages` callback as a list (all that were waiting), on the
loop, synchronously, so a protocol adapter handles a burst as one batch. What the pump does not
do: interpret frames (that is the codec's job) or decide what to send (the adapter's).

A delivery whose record the store has not written yet is queued with `send_delivery`: before the
pump next sends anything it calls its `barrier` (the store's `write_now`), so the delivery never
leaves before its attempt record. What is queued leaves in the order it was queued.
"""

from __future__ import annotations

import contextlib
import types
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, Final

import trio
import zmq
import zmq.backend

from polymq.adapters import host_loop
from polymq.adapters.host_loop import HostLoop
from polymq.native import zmq_loops

Frames = list[bytes]

# Plain ints: pyzmq's enum constants cost an enum operation at every use on the hot path.
_NOBLOCK: Final = int(zmq.NOBLOCK)
_EVENTS: Final = int(zmq.EVENTS)
_POLLIN: Final = int(zmq.POLLIN)
_POLLOUT: Final = int(zmq.POLLOUT)
_SNDMORE: Final = int(zmq.SNDMORE)
# EVENTS saying ready while nothing moves: after this many turns, pause this long between tries.
SPIN_TURNS: Final = 3
SPIN_PAUSE_S: Final = 0.001
# Messages taken off the socket before the pump lets other tasks run (one client must not own
# the loop) and hands them to `on_messages` as one batch.
RECEIVE_BATCH: Final = 1024


def _int_option(sock: zmq.Socket[Any], option: int) -> int:
    """An integer socket option (pyzmq types every option as int or bytes)."""
    value = sock.getsockopt(option)
    assert isinstance(value, int)
    return value


def _frame_sender(sock: zmq.Socket[Any]) -> Callable[[bytes, int], object]:
    """The socket's `send` of one frame. For a plain pyzmq socket the backend's, bound to it: pyzmq's
    own (`zmq.Socket.send`) adds a Python call per frame to look at arguments a byte string never
    uses (routing ids, groups): a 7-frame message took 1.6-1.9 µs instead of 2.2-4.3 in a
    microbenchmark. Anything else that stands for a socket (a subclass, a wrapper) is called as
    it is."""
    if type(sock).send is zmq.Socket.send:
        return types.MethodType(zmq.backend.Socket.send, sock)
    return sock.send


class ZmqPump:
    def __init__(self, sock: zmq.Socket[Any], on_messages: Callable[[list[Frames]], None],
                 barrier: Callable[[], None] | None = None) -> None:
        self.sock = sock
        self.fd: int = _int_option(sock, zmq.FD)
        self._send_frame = _frame_sender(sock)
        # The frame loops in C where they can run (native/zmq_loops.py), else the ones below.
        loops = zmq_loops.native_loops(sock)
        self._native_receive: zmq_loops.Receive | None = loops[0] if loops is not None else None
        self._native_send: zmq_loops.Send | None = loops[1] if loops is not None else None
        self._handle: int = sock.underlying if loops is not None else 0
        self.on_messages = on_messages
        self.outgoing: deque[Sequence[bytes]] = deque()
        # Called before queued deliveries leave (`send_delivery`): the store writes their records.
        self.barrier = barrier
        self.unstored = False  # a delivery is queued whose record may not be written yet
        self._waiting: trio.CancelScope | None = None
        # While the service handles a burst (of any of its pumps) sends only mark the pump; the
        # burst's end flushes it and calls `settle` once.
        self.held = False
        self.settle_due = False
        self.closed = False
        self.received = 0
        self.sent = 0
        self.unroutable = 0  # messages for a peer that had gone (ROUTER_MANDATORY, or mid-message)
        # Under a host loop (adapters/host_loop.py) the loop's pass runs the pump's turns, on the
        # descriptor's edge or when asked (`_turn_soon`); the task only pauses a spin and ends.
        self._host: HostLoop | None = None
        self._host_turn = self._turn_on_host
        self._turn_queued = False
        self._idle_turns = 0
        self._task_needed = trio.Event()
        self._host_error: BaseException | None = None

    def send(self, frames: Sequence[bytes]) -> None:
        """Send a multipart message now if the socket takes it, else queue it; the pump sends what
        is queued as soon as the socket takes it (in order)."""
        if self.outgoing or self.closed or not self._send_one(frames):
            self.outgoing.append(frames)
        self._changed()

    def send_delivery(self, frames: Sequence[bytes]) -> None:
        """Queue a delivery that may leave only after the `barrier` (its record written): it goes,
        behind what is queued, at the next `flush` or the pump's next turn."""
        self.outgoing.append(frames)
        self.unstored = True
        self._changed()

    def _changed(self) -> None:
        """After a send or a queued delivery from outside the pump's task: the pump, if it waits,
        may have to run (a send can take the edge that announced a receive)."""
        if self._waiting is None and self._host is None:
            return  # it runs, or will: its loop reads EVENTS before it waits
        if self.held:
            self.settle_due = True  # the burst's end flushes and settles (`ZmqService`)
            return
        self.settle()

    def settle(self) -> None:
        """Wake the waiting pump only if it has something to do: a delivery waiting for the barrier,
        or what EVENTS says is ready. Else its wait stays right: this EVENTS took every change so
        far, and the next one signals the descriptor again. A wake-up (a cancelled wait, a turn of
        the pump) costs more than the whole send of a small message."""
        self.settle_due = False
        if self._host is not None:
            if not self.closed and not self._turn_queued and (
                    (self.outgoing and self.unstored) or self._has_work(_int_option(self.sock, _EVENTS))):
                self._turn_soon(self._host)
            return
        waiting = self._waiting
        if waiting is None or self.closed:
            return
        outgoing = self.outgoing
        if outgoing and self.unstored:
            waiting.cancel()  # outside a burst nobody else flushes: the pump sends it on its turn
            return
        if self._has_work(_int_option(self.sock, _EVENTS)):
            waiting.cancel()

    def flush(self) -> None:
        """Send what is queued now (the barrier first), as far as the socket takes it without waiting.

        As `send` does, without reading EVENTS first (right after a burst the socket takes it); what
        it does not take waits for the pump, which `settle` wakes when EVENTS says it can send."""
        outgoing = self.outgoing
        if not outgoing or self.closed:
            return
        if self.unstored:
            self._pass_barrier()
        send_one = self._send_one
        while outgoing and send_one(outgoing[0]):
            outgoing.popleft()

    def _send_one(self, frames: Sequence[bytes]) -> bool:
        """One message, frame by frame with int flags (pyzmq's send_multipart pays enum operations
        per frame); False if the socket cannot take it now. A later frame says Again only when the
        peer a DEALER chose went away in the middle of the message: libzmq dropped it, and there is
        nobody to tell (a PZQ delivery comes back at its ACK timeout)."""
        native_send = self._native_send
        if native_send is not None:
            outcome = native_send(self.sock, self._handle, frames)
            if outcome == zmq_loops.SENT:
                self.sent += 1
            elif outcome == zmq_loops.UNROUTABLE:
                self.unroutable += 1
            return outcome != zmq_loops.NOT_TAKEN
        send = self._send_frame
        try:
            send(frames[0], _NOBLOCK | _SNDMORE if len(frames) > 1 else _NOBLOCK)
        except zmq.Again:
            return False
        except zmq.ZMQError as error:
            if error.errno != zmq.EHOSTUNREACH:
                raise
            self.unroutable += 1  # a ROUTER_MANDATORY socket's peer is gone: nobody to tell
            return True
        last = len(frames) - 1
        index = 1
        try:
            for index in range(1, last + 1):
                send(frames[index], _NOBLOCK | _SNDMORE if index < last else _NOBLOCK)
        except zmq.Again:
            # libzmq dropped the message and now drops frames up to the message's end (lb.cpp's
            # dropping mode): send them, or it would drop the next message instead.
            for rest in range(index + 1, last + 1):
                send(frames[rest], _NOBLOCK | _SNDMORE if rest < last else _NOBLOCK)
            self.unroutable += 1
            return True
        except TypeError:
            # A frame that is not a buffer (a caller's bug): end the message libzmq holds open, or
            # the next message sent would complete this one.
            send(b"", _NOBLOCK)
            raise
        self.sent += 1
        return True

    def _receive(self) -> bool:
        sock = self.sock
        native_receive = self._native_receive
        if native_receive is not None:
            batch = native_receive(sock, self._handle, RECEIVE_BATCH)
            if batch:
                self.received += len(batch)
                self.on_messages(batch)
            return bool(batch)
        batch = []
        # EVENTS first, then every message waiting until Again (not EVENTS per message: each pyzmq
        # call costs a getpid), then EVENTS again; EVENTS saying POLLIN with nothing to take is no reason
        # to spin.
        while len(batch) < RECEIVE_BATCH and _int_option(sock, _EVENTS) & _POLLIN:
            taken = len(batch)
            recv = sock.recv
            while len(batch) < RECEIVE_BATCH:
                # Frames, not bytes: `frame.more` is one C call where getsockopt(RCVMORE) builds
                # an enum per frame; `.bytes` then copies once, as recv(copy=True) would. `copy`
                # passed by position: pyzmq parses a keyword argument at a cost (~8 % of a small
                # frame's receive in a microbenchmark).
                try:
                    frame = recv(_NOBLOCK, False)
                except zmq.Again:
                    break
                frames = [frame.bytes]
                while frame.more:  # the rest of a multipart message is there already
                    frame = recv(_NOBLOCK, False)
                    frames.append(frame.bytes)
                batch.append(frames)
            if len(batch) == taken:
                break
        if batch:
            self.received += len(batch)
            self.on_messages(batch)
        return bool(batch)

    def _pass_barrier(self) -> None:
        self.unstored = False
        if self.barrier is not None:
            self.barrier()

    def _send(self) -> bool:
        if self.unstored:
            self._pass_barrier()
        sock = self.sock
        outgoing = self.outgoing
        sent = 0
        send_one = self._send_one
        while outgoing and _int_option(sock, _EVENTS) & _POLLOUT:
            before = sent
            while outgoing:
                if not send_one(outgoing[0]):
                    break
                outgoing.popleft()
                sent += 1
            if sent == before:
                break  # POLLOUT, yet Again: wait for the descriptor rather than spin
        return bool(sent)

    def _has_work(self, events: int) -> bool:
        return bool(events & _POLLIN or (self.outgoing and events & _POLLOUT))

    def _turn_soon(self, host: HostLoop) -> None:
        self._turn_queued = True
        host.read_again(self._host_turn)

    async def run(self) -> None:
        """Forever (until closed): receive, send, and wait only when neither can progress."""
        host = host_loop.current()
        if host is not None:
            await self._run_on_host(host)
            return
        sock = self.sock
        idle_turns = 0
        while not self.closed:  # `close` may come while this task waits at a checkpoint
            progressed = self._receive() | self._send()
            if self.closed:
                return  # closed by what it received
            # The last word before waiting is EVENTS: a receive or send that just said Again may
            # itself have consumed the edge that announced what is now ready.
            if self._has_work(_int_option(sock, _EVENTS)):
                if progressed:
                    idle_turns = 0
                    await trio.lowlevel.checkpoint()  # let the rest of the loop run between bursts
                    continue
                # Ready, yet nothing moved this turn: try again after the others ran (a moment later
                # if it keeps happening, rather than spin).
                idle_turns += 1
                await (trio.sleep(SPIN_PAUSE_S) if idle_turns > SPIN_TURNS else trio.lowlevel.checkpoint())
                continue
            # Nothing more: wait at once (the wait lets the others run; a checkpoint before it, and
            # another turn that finds nothing, would cost a pass of the loop per burst).
            idle_turns = 0
            with trio.CancelScope() as self._waiting:
                try:
                    await trio.lowlevel.wait_readable(self.fd)
                except trio.ClosedResourceError:
                    return  # `close`
            self._waiting = None

    async def _run_on_host(self, host: HostLoop) -> None:
        """The pump's turns run on the host loop's pass; this task pauses a turn that spins, raises
        what a turn raised, and returns once the pump is closed."""
        self._host = host
        host.add_reader(self.fd, self._host_turn)
        self._turn_soon(host)  # what came before the descriptor was registered
        try:
            while not self.closed:
                await self._task_needed.wait()
                self._task_needed = trio.Event()
                if self._host_error is not None:
                    error, self._host_error = self._host_error, None
                    raise error
                if not self.closed:
                    await trio.sleep(SPIN_PAUSE_S)
                    self._turn_soon(host)
        finally:
            host.remove_reader(self.fd)
            self._host = None

    def _turn_on_host(self, _events: int = 0) -> None:
        """One turn, from the host loop's pass: receive and send what is ready; the next turn comes with
        the descriptor's next edge, or in the next pass if EVENTS still says there is work."""
        self._turn_queued = False
        host = self._host
        if host is None or self.closed:
            return
        try:
            progressed = self._receive() | self._send()
            if self.closed:
                self._task_needed.set()
                return
            if not self._has_work(_int_option(self.sock, _EVENTS)):
                self._idle_turns = 0
                return  # the descriptor's next edge brings the next turn
        except BaseException as error:  # raised in the task, as its own turn would
            host.remove_reader(self.fd)
            self._host_error = error
            self._task_needed.set()
            return
        if progressed:
            self._idle_turns = 0
        else:
            self._idle_turns += 1
            if self._idle_turns > SPIN_TURNS:
                self._idle_turns = 0
                self._task_needed.set()  # ready, yet nothing moves: the task pauses, then turns again
                return
        if not self._turn_queued:
            self._turn_soon(host)  # let the others run between bursts

    def close(self, linger_ms: int = 0) -> None:
        """Close the socket (the pump ends). What is queued goes to ZeroMQ first, as far as it takes
        it without waiting; ZeroMQ keeps trying to send what it holds for `linger_ms`."""
        if self.closed:
            return
        if linger_ms and self.outgoing:
            with contextlib.suppress(zmq.ZMQError):  # closing anyway
                self._send()
        self.closed = True
        if self._host is not None:
            self._host.remove_reader(self.fd)
            self._task_needed.set()  # the task ends
        trio.lowlevel.notify_closing(self.fd)
        self.sock.close(linger=linger_ms)
