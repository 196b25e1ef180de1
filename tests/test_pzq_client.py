"""The project's trio PZQ client (clients/pzq.py) against a real gateway: pipelined produces
each waiting for its ACK, refusals, a consumer handler that answers 1 or 0, the monitor."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

from polymq.clients.pzq import PZQConsumer, PZQMessage, PZQMonitor, PZQProducer, PZQRefused

from support.gateway import running_gateway


async def test_produce_consume_refuse_and_monitor(tmp_path: Path) -> None:
    with running_gateway(data_dir=tmp_path) as gateway:
        receive, send, monitor_address = (gateway.addresses[name] for name in ("pzq-receive", "pzq-send",
                                                                                 "pzq-monitor"))
        async with PZQProducer(receive) as producer, PZQMonitor(monitor_address) as monitor:
            async with trio.open_nursery() as nursery:  # 200 produces waiting at once
                for number in range(200):
                    nursery.start_soon(producer.produce, b"job %d" % number, b"second frame")
            with pytest.raises(PZQRefused, match="Trying to save empty message"):
                await producer.produce()
            assert (await monitor.stats())["messages"] == 200

            got: list[list[bytes]] = []
            nacked: list[bytes] = []
            keys_of_7: list[bytes] = []
            all_in = trio.Event()

            async def handle(message: PZQMessage) -> bool:
                if message.bodies[0] == b"job 7":
                    keys_of_7.append(message.key)
                if message.bodies[0] == b"job 7" and not nacked:
                    nacked.append(message.key)
                    return False  # sent again at once, under the same key
                got.append(message.bodies)
                if len(got) == 200:
                    all_in.set()
                return True

            async with PZQConsumer(send, handle):
                with trio.fail_after(10):
                    await all_in.wait()
            assert sorted(bodies[0] for bodies in got) == sorted(b"job %d" % n for n in range(200))
            assert all(bodies[1] == b"second frame" for bodies in got)
            assert nacked and keys_of_7 == [nacked[0], nacked[0]]
            with trio.fail_after(20):  # the last ACKs went out as the consumer closed
                while (await monitor.stats())["messages"]:
                    await trio.sleep(0.02)


async def test_a_produce_without_a_server_times_out() -> None:
    async with PZQProducer("127.0.0.1:9", timeout=0.2) as producer:
        with pytest.raises(TimeoutError, match="no answer"):
            await producer.produce(b"lost")
