"""The trio MQKS client (`polymq.clients.mqks`) against a real `polymq serve`.

Requests and deliveries, manual ack and reject, rebind with `--update`, ping and `_eval`, errors,
callbacks that raise, batched writes; and the original client's reconnect (docs/protocols/mqks.md): the
connection is cut by a proxy between client and gateway, or the gateway is restarted on the same
port, and every consumer comes back under a new id with its latest `--update`d consume line.
Every wait is on an event, bounded by `WAIT_S`; absences are proven with a ping on the same
connection (the gateway answers it after everything the earlier requests caused).
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import signal
import string
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import trio
from trio.testing import wait_all_tasks_blocked

from polymq.clients import mqks as mqks_client
from polymq.clients.mqks import Message, MQKSClient, MQKSConnectionLost, MQKSError, new_id
from polymq.clients.ports import restartable_port
from polymq.codecs.mqks import ID_LENGTH

from support.gateway import GatewayProcess, running_gateway

# Upper bound for anything a test waits for; the usual wait is milliseconds.
WAIT_S = 10.0
# Short reconnect delay and keep-alive interval for the tests (the original's are 1 s and 15 s).
FAST_RECONNECT_S = 0.05
FAST_PING_S = 0.2
BASE62 = set(string.digits + string.ascii_letters)


def unique(kind: str) -> str:
    return f"{kind}-{uuid.uuid4().hex[:8]}"


class Inbox:
    """An on_msg callback that keeps what it gets; `await inbox.wait(n)` until n messages came."""

    def __init__(self) -> None:
        self.messages: list[Message] = []
        self._changed = trio.Event()

    def __call__(self, message: Message) -> None:
        self.messages.append(message)
        self._changed.set()
        self._changed = trio.Event()

    async def wait(self, count: int) -> list[Message]:
        with trio.fail_after(WAIT_S):
            while len(self.messages) < count:
                await self._changed.wait()
        return self.messages

    @property
    def bodies(self) -> list[bytes]:
        return [m.body for m in self.messages]


class Recorder:
    """A callback that records its arguments and sets an event on each call."""

    def __init__(self) -> None:
        self.calls: list[tuple[object, ...]] = []
        self.called = trio.Event()

    def __call__(self, *args: object) -> None:
        self.calls.append(args)
        self.called.set()

    async def wait(self) -> None:
        with trio.fail_after(WAIT_S):
            await self.called.wait()
        self.called = trio.Event()


@contextlib.asynccontextmanager
async def client_for(address: tuple[str, int], **kwargs: object) -> AsyncIterator[MQKSClient]:
    kwargs.setdefault("reconnect_delay_s", FAST_RECONNECT_S)
    async with MQKSClient(*address, **kwargs) as client:  # type: ignore[arg-type]
        yield client


def mqks(gateway: GatewayProcess) -> tuple[str, int]:
    return gateway.host_port("mqks")


# --- a proxy that can cut or freeze connections -------------------------------------------


class _Pipe:
    def __init__(self) -> None:
        self.scope = trio.CancelScope()
        self.frozen = False


class Proxy:
    """Forwards 127.0.0.1:port to the gateway; `cut()` closes every connection (the client sees
    the server go away), `freeze()` silently drops everything on the current connections."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.pipes: list[_Pipe] = []
        self.port = 0

    async def start(self, nursery: trio.Nursery) -> None:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        self.port = listeners[0].socket.getsockname()[1]
        nursery.start_soon(trio.serve_listeners, self._handle, listeners)

    @property
    def address(self) -> tuple[str, int]:
        return ("127.0.0.1", self.port)

    async def _handle(self, downstream: trio.SocketStream) -> None:
        pipe = _Pipe()
        self.pipes.append(pipe)
        async with downstream:
            with pipe.scope:
                upstream = await trio.open_tcp_stream(*self.target)
                async with upstream, trio.open_nursery() as nursery:
                    nursery.start_soon(self._forward, pipe, downstream, upstream)
                    nursery.start_soon(self._forward, pipe, upstream, downstream)

    @staticmethod
    async def _forward(pipe: _Pipe, source: trio.SocketStream, sink: trio.SocketStream) -> None:
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            async for chunk in source:
                if not pipe.frozen:
                    await sink.send_all(chunk)
        pipe.scope.cancel()  # one side closed: close the other

    def cut(self) -> None:
        for pipe in self.pipes:
            pipe.scope.cancel()

    def freeze(self) -> None:
        for pipe in self.pipes:
            pipe.frozen = True


@contextlib.asynccontextmanager
async def proxy_for(gateway: GatewayProcess) -> AsyncIterator[Proxy]:
    proxy = Proxy(mqks(gateway))
    async with trio.open_nursery() as nursery:
        await proxy.start(nursery)
        yield proxy
        nursery.cancel_scope.cancel()


# --- ids -------------------------------------------------------------------------------------


def test_ids_have_the_shape_of_the_original() -> None:
    ids = {new_id() for _ in range(1000)}
    assert len(ids) == 1000
    sample = next(iter(ids))
    assert len(sample) == ID_LENGTH
    stamp = datetime.datetime.strptime(sample[:20], "%Y%m%d%H%M%S%f").replace(tzinfo=datetime.UTC)
    assert abs((datetime.datetime.now(datetime.UTC) - stamp).total_seconds()) < 60
    assert set(sample[20:]) <= BASE62


def test_consume_line_is_built_like_the_original() -> None:
    assert mqks_client.consume_line("q", ["a", "b"]) == "q a b"
    assert mqks_client.consume_line("q", (), ["c"], True, True) == "q --add c --delete-queue-when-unused --manual-ack"
    assert mqks_client.consume_line("q", ["a"], delete_queue_when_unused=5) == "q a --delete-queue-when-unused=5"
    assert mqks_client.consume_line("q", delete_queue_when_unused=False) == "q"
    for bad in ("", "two words", "tab\there", "--add"):
        with pytest.raises(ValueError):
            mqks_client.consume_line(bad)


# --- requests ---------------------------------------------------------------------------------


async def test_publish_and_consume_with_bodies_any_line_can_carry(module_gateway: GatewayProcess) -> None:
    queue, event = unique("q"), unique("e")
    inbox = Inbox()
    bodies = [b"hello world", b"two\nlines\tand \x00 trailing ", b"", b"\xff\xfe not utf-8"]
    async with client_for(mqks(module_gateway)) as client:
        consumer_id = await client.consume(queue, [event], on_msg=inbox, confirm=True)
        assert len(consumer_id) == ID_LENGTH
        msg_ids = [await client.publish(event, body) for body in bodies[:-1]]
        msg_ids.append(await client.publish(event, bodies[-1], confirm=True))
        messages = await inbox.wait(len(bodies))
    assert [m.body for m in messages] == bodies
    assert [m.id for m in messages] == msg_ids
    assert {(m.consumer_id, m.event, m.retry) for m in messages} == {(consumer_id, event, 0)}


async def test_reject_comes_back_with_retry_and_ack_is_final(module_gateway: GatewayProcess) -> None:
    queue, event = unique("q"), unique("e")
    inbox = Inbox()

    def on_msg(message: Message) -> None:
        inbox(message)
        (message.reject if message.retry == 0 else message.ack)()  # sync callbacks may ack/reject

    async with client_for(mqks(module_gateway)) as client:
        consumer_id = await client.consume(queue, [event], on_msg=on_msg, manual_ack=True, confirm=True)
        await client.publish(event, b"job")
        first, second = await inbox.wait(2)
        assert (first.id, first.retry, second.id, second.retry) == (first.id, 0, first.id, 1)
        # Acked: deleting the consumer returns nothing to the queue, so a new consumer gets nothing.
        await client.ping()
        await client.delete_consumer(consumer_id, confirm=True)
        late = Inbox()
        await client.consume(queue, on_msg=late, confirm=True)
        await client.ping()
        assert late.messages == []
        assert len(inbox.messages) == 2


async def test_ack_and_reject_all(module_gateway: GatewayProcess) -> None:
    queue, event = unique("q"), unique("e")
    inbox = Inbox()
    async with client_for(mqks(module_gateway)) as client:
        consumer_id = await client.consume(queue, [event], on_msg=inbox, manual_ack=True, confirm=True)
        await client.publish(event, b"one")
        await client.publish(event, b"two")
        await inbox.wait(2)
        await client.reject(consumer_id, None, confirm=True)
        messages = await inbox.wait(4)
        assert [(m.body, m.retry) for m in messages[2:]] == [(b"one", 1), (b"two", 1)]
        await client.ack(consumer_id, None, confirm=True)
        await client.delete_consumer(consumer_id, confirm=True)
        late = Inbox()
        await client.consume(queue, on_msg=late, confirm=True)
        await client.ping()
        assert late.messages == []


async def test_rebind_updates_the_consume_line_kept_for_reconnect(module_gateway: GatewayProcess) -> None:
    queue = unique("q")
    e1, e2 = unique("e1"), unique("e2")
    inbox = Inbox()
    async with client_for(mqks(module_gateway)) as client:
        consumer_id = await client.consume(queue, [e1], on_msg=inbox, delete_queue_when_unused=5, confirm=True)
        assert client.consumers == {consumer_id: f"{queue} {e1} --delete-queue-when-unused=5"}
        await client.rebind(queue, replace=[e1, f"{e2}.x.y", f"{e2}.z"], confirm=True)
        await client.rebind(queue, remove=[e1], remove_mask=[f"{e2}.*.y"], add=["e4." + e2], confirm=True)
        # The `--update` lines came before the confirms (same connection): the line is current.
        events = sorted([f"{e2}.z", "e4." + e2])
        assert client.consumers == {consumer_id: f"{queue} {' '.join(events)} --delete-queue-when-unused=5.0"}
        for event in (e1, f"{e2}.x.y", f"{e2}.z", "e4." + e2):
            await client.publish(event, event.encode())
        await client.ping()
        assert sorted(inbox.bodies) == sorted(e.encode() for e in events)
        with pytest.raises(ValueError):
            await client.rebind(queue)


async def test_consume_with_add_keeps_existing_bindings(module_gateway: GatewayProcess) -> None:
    queue, e1, e2 = unique("q"), unique("e1"), unique("e2")
    first, second = Inbox(), Inbox()
    async with client_for(mqks(module_gateway)) as client:
        await client.consume(queue, [e1], on_msg=first, confirm=True)
        second_id = await client.consume(queue, add=[e2], on_msg=second, confirm=True)
        # With --add the issuer gets the --update too (docs/protocols/mqks.md).
        assert client.consumers[second_id] == f"{queue} {' '.join(sorted([e1, e2]))}"
        await client.publish(e1, b"1")
        await client.publish(e2, b"2")
        await client.ping()
        assert sorted(first.bodies + second.bodies) == [b"1", b"2"]


async def test_delete_queue_stops_deliveries(module_gateway: GatewayProcess) -> None:
    queue, event = unique("q"), unique("e")
    inbox = Inbox()
    async with client_for(mqks(module_gateway)) as client:
        consumer_id = await client.consume(queue, [event], on_msg=inbox, confirm=True)
        await client.delete_queue(queue, confirm=True)
        assert client.consumers[consumer_id] == queue  # its --update: no events left
        await client.publish(event, b"lost")
        await client.ping()
        assert inbox.messages == []


async def test_ping_and_eval(module_gateway: GatewayProcess) -> None:
    async with client_for(mqks(module_gateway)) as client:
        assert await client.ping("hello there") == b"hello there"
        assert await client.ping() == b"mqks.client"
        await client.consume(unique("q"), [unique("e")], on_msg=Inbox(), confirm=True)
        assert int(await client.eval("len(state.queues)")) >= 1
        assert int(await client.eval("len(state.queues)", worker=0)) >= 1
        with pytest.raises(MQKSError) as refused:
            await client.eval("__import__('os').getpid()")
        assert len(refused.value.error_id) == ID_LENGTH


async def test_refused_consume_raises_with_confirm_and_is_only_logged_without(
        module_gateway: GatewayProcess, caplog: pytest.LogCaptureFixture) -> None:
    async with client_for(mqks(module_gateway)) as client:
        with pytest.raises(MQKSError):
            await client.consume(unique("q"), on_msg=Inbox(), delete_queue_when_unused="soon", confirm=True)  # type: ignore[arg-type]
        assert client.consumers == {}  # refused: not re-created on reconnect
        with caplog.at_level(logging.ERROR, logger="polymq.mqks_client"):
            consumer_id = await client.consume(unique("q"), on_msg=Inbox(), delete_queue_when_unused="soon")  # type: ignore[arg-type]
            await client.ping()
        assert any(consumer_id in record.getMessage() and "error" in record.getMessage()
                   for record in caplog.records)
        assert await client.ping("still fine") == b"still fine"


async def test_a_raising_callback_is_logged_and_delivery_goes_on(
        module_gateway: GatewayProcess, caplog: pytest.LogCaptureFixture) -> None:
    queue, event = unique("q"), unique("e")
    inbox = Inbox()
    async_got: list[bytes] = []
    async_done = trio.Event()

    def on_msg(message: Message) -> None:
        inbox(message)
        if message.body == b"boom":
            raise RuntimeError("callback bug")

    async def on_msg_async(message: Message) -> None:
        await trio.sleep(0)
        async_got.append(message.body)
        if len(async_got) == 2:
            async_done.set()
        if message.body == b"boom":
            raise RuntimeError("async callback bug")

    with caplog.at_level(logging.ERROR, logger="polymq.mqks_client"):
        async with client_for(mqks(module_gateway)) as client:
            await client.consume(queue, [event], on_msg=on_msg, confirm=True)
            await client.consume(unique("q"), [event], on_msg=on_msg_async, confirm=True)
            await client.publish(event, b"boom")
            await client.publish(event, b"after")
            await inbox.wait(2)
            with trio.fail_after(WAIT_S):
                await async_done.wait()
    assert inbox.bodies == [b"boom", b"after"]
    assert sorted(async_got) == [b"after", b"boom"]  # each its own task, like the original's greenlets
    failures = [r for r in caplog.records if "callback" in r.getMessage() and r.exc_info]
    assert len(failures) == 2


async def test_requests_of_one_turn_leave_in_one_write(module_gateway: GatewayProcess) -> None:
    queue, event = unique("q"), unique("e")
    inbox = Inbox()
    async with client_for(mqks(module_gateway)) as client:
        await client.consume(queue, [event], on_msg=inbox, confirm=True)
        transport = client._transport
        assert transport is not None
        writes: list[int] = []
        original = transport.send_all

        async def counting_send_all(data: bytes) -> None:
            writes.append(data.count(b"\n"))
            await original(data)

        transport.send_all = counting_send_all  # type: ignore[method-assign]
        for n in range(100):
            client.publish_nowait(event, b"%d" % n)
        await inbox.wait(100)
    assert writes[0] == 100
    assert inbox.bodies == [b"%d" % n for n in range(100)]


async def test_aclose_flushes_what_is_queued(module_gateway: GatewayProcess) -> None:
    queue, event = unique("q"), unique("e")
    inbox = Inbox()
    async with client_for(mqks(module_gateway)) as consumer:
        await consumer.consume(queue, [event], on_msg=inbox, confirm=True)
        publisher = MQKSClient(*mqks(module_gateway))
        await publisher.connect()
        publisher.publish_nowait(event, b"last words")
        await publisher.aclose()
        await inbox.wait(1)
        with pytest.raises(trio.ClosedResourceError):
            publisher.publish_nowait(event, b"too late")


async def test_the_body_of_async_with_may_raise_or_be_cancelled(module_gateway: GatewayProcess) -> None:
    with pytest.raises(KeyError):  # not wrapped in an ExceptionGroup by the client's nursery
        async with client_for(mqks(module_gateway)):
            raise KeyError("body")
    queue, event = unique("q"), unique("e")
    inbox = Inbox()
    async with client_for(mqks(module_gateway)) as consumer:
        await consumer.consume(queue, [event], on_msg=inbox, confirm=True)
        with trio.CancelScope() as scope:
            async with client_for(mqks(module_gateway)) as client:
                client.publish_nowait(event, b"queued before the cancel")
                scope.cancel()
                await trio.sleep_forever()
        assert scope.cancelled_caught
        await inbox.wait(1)  # flushed on the way out


# --- reconnect ---------------------------------------------------------------------------


async def test_reconnect_recreates_consumers_with_new_ids_and_the_updated_line(module_gateway: GatewayProcess) -> None:
    queue, e1, e2 = unique("q"), unique("e1"), unique("e2")
    inbox = Inbox()
    reconnected, per_consumer, disconnected = Recorder(), Recorder(), Recorder()
    async with proxy_for(module_gateway) as proxy, \
            client_for(proxy.address, on_reconnect=reconnected, reconnect_delay_s=0.3) as client:
        old_id = await client.consume(queue, [e1], on_msg=inbox, manual_ack=True, confirm=True,
                                      on_reconnect=per_consumer, on_disconnect=disconnected)
        await client.rebind(queue, add=[e2], confirm=True)
        assert client.consumers == {old_id: f"{queue} {' '.join(sorted([e1, e2]))} --manual-ack"}
        await client.publish(e1, b"unacked")
        (held,) = await inbox.wait(1)

        proxy.cut()
        await disconnected.wait()
        assert not client.connected
        client.publish_nowait(e2, b"queued while away")  # sent after the consume on reconnect
        await reconnected.wait()

        ((old, new),) = reconnected.calls
        assert per_consumer.calls == [(old, new)]
        assert old == old_id and new != old_id and len(new) == ID_LENGTH
        assert list(client.consumers) == [new]
        assert client.connections == 2
        # The unacked message came back (the server rejects on disconnect) to the new consumer;
        # e2, known only from the --update, is bound again.
        messages = await inbox.wait(3)
        returned = {m.body: m for m in messages[1:]}
        assert set(returned) == {b"unacked", b"queued while away"}
        assert (returned[b"unacked"].id, returned[b"unacked"].retry) == (held.id, 1)
        assert {m.consumer_id for m in messages[1:]} == {new}
        returned[b"unacked"].ack()
        await client.publish(e2, b"flowing again")
        await inbox.wait(4)
        assert inbox.messages[3].body == b"flowing again"


async def test_answer_lost_with_the_connection_raises(module_gateway: GatewayProcess) -> None:
    reconnected = Recorder()
    async with proxy_for(module_gateway) as proxy, \
            client_for(proxy.address, on_reconnect=reconnected, ping_interval_s=None) as client:
        await client.consume(unique("q"), [unique("e")], on_msg=Inbox(), confirm=True)
        proxy.freeze()
        outcome: list[BaseException] = []

        async def ping() -> None:
            try:
                await client.ping()
            except MQKSConnectionLost as exc:
                outcome.append(exc)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(ping)
            await wait_all_tasks_blocked()  # the ping went out, into the frozen proxy
            proxy.cut()
        assert len(outcome) == 1
        await reconnected.wait()
        assert await client.ping("back") == b"back"


async def test_unanswered_keepalive_reconnects(module_gateway: GatewayProcess) -> None:
    reconnected = Recorder()
    async with proxy_for(module_gateway) as proxy, \
            client_for(proxy.address, on_reconnect=reconnected, ping_interval_s=FAST_PING_S) as client:
        inbox = Inbox()
        queue, event = unique("q"), unique("e")
        await client.consume(queue, [event], on_msg=inbox, confirm=True)
        proxy.freeze()  # a half-dead connection: nothing gets through, nothing closes
        await reconnected.wait()
        await client.publish(event, b"over the new connection")
        await inbox.wait(1)


async def test_reconnect_after_a_gateway_restart_on_the_same_port(tmp_path: Path) -> None:
    queue, event = unique("q"), unique("e")
    inbox = Inbox()
    reconnected = Recorder()
    with contextlib.ExitStack() as stack:
        # The second gateway takes the first one's port: one nothing else is handed meanwhile.
        port = restartable_port()
        first = stack.enter_context(running_gateway("--mqks-port", str(port), data_dir=tmp_path))
        host, port = mqks(first)
        async with client_for((host, port), on_reconnect=reconnected) as client:
            old_id = await client.consume(queue, [event], on_msg=inbox, confirm=True)
            await trio.to_thread.run_sync(first.stop, signal.SIGTERM)
            # The last --mqks-port wins over running_gateway's own `0`.
            second = await trio.to_thread.run_sync(
                stack.enter_context, running_gateway("--mqks-port", str(port), data_dir=tmp_path))
            assert mqks(second) == (host, port)
            await reconnected.wait()
            ((old, new),) = reconnected.calls
            assert old == old_id and new != old_id
            await client.publish(event, b"after restart")
            (message,) = await inbox.wait(1)
            assert (message.consumer_id, message.body) == (new, b"after restart"), (message, old_id, new)
