"""Interop driver for asyncnsq 1.2.1 (asyncio). Runs in .interop/asyncnsq.

Offered by asyncnsq's API and exercised: create_writer → pub / mpub / dpub, NsqdHttpWriter.pub /
mpub (text mode), create_reader with FIN / REQ / TOUCH, deflate and snappy, #ephemeral channels.
asyncnsq's Reader/Writer have no msg_timeout option; the scenarios that need one (fin, touch,
timeout) consume through asyncnsq's lower-level `asyncnsq.tcp.connection.create_connection`, whose
`identify(**config)` sends any IDENTIFY key, then SUB and RDY 1 through `execute`.
"""

from __future__ import annotations

import asyncio

from asyncnsq import create_reader, create_writer
from asyncnsq.http import NsqdHttpWriter
from asyncnsq.tcp.connection import create_connection
from driver_common import AsyncAdapter, Recorder, capture_logs, host_port, load_request, run_async


def _compression_kwargs(compression: str | None) -> dict:
    if compression == "deflate":
        return {"deflate": True, "deflate_level": 6}
    if compression == "snappy":
        return {"snappy": True}
    return {}


def _parser_name(conn) -> str:
    # asyncnsq swaps the connection's frame parser for DeflateReader / SnappyReader on upgrade.
    return type(conn._parser).__name__


class AsyncnsqAdapter(AsyncAdapter):
    def __init__(self, request: dict, rec: Recorder) -> None:
        self.request = request
        self.rec = rec
        self.writer = None
        self.reader = None
        self.conn = None
        self.pump: asyncio.Task | None = None

    async def publish(self, kind, topic, bodies, *, defer_ms=None, compression=None):
        if self.writer is None:
            host, port = host_port(self.request["tcp"])
            self.writer = await create_writer(host=host, port=port, **_compression_kwargs(compression))
        if kind == "mpub":
            answers = [await self.writer.mpub(topic, *bodies)]
        elif kind == "dpub":
            answers = [await self.writer.dpub(topic, defer_ms, body) for body in bodies]
        else:
            answers = [await self.writer.pub(topic, body) for body in bodies]
        if any(answer != b"OK" for answer in answers):
            raise RuntimeError(f"{kind} answered {answers!r}")

    async def publish_http(self, kind, topic, bodies):
        host, port = host_port(self.request["http"])
        http = NsqdHttpWriter(host, port, loop=asyncio.get_running_loop())
        try:
            if kind == "mpub":
                answers = [await http.mpub(topic, *bodies)]
            else:
                answers = [await http.pub(topic, body) for body in bodies]
        finally:
            await http.close()
        if any(answer != "OK" for answer in answers):
            raise RuntimeError(f"http {kind} answered {answers!r}")

    async def subscribe(self, topic, channel, *, compression, msg_timeout_ms):
        queue: asyncio.Queue = asyncio.Queue()
        if msg_timeout_ms is None:
            self.reader = await create_reader(
                nsqd_tcp_addresses=[self.request["tcp"]], max_in_flight=1,
                **_compression_kwargs(compression),
            )
            await self.reader.subscribe(topic, channel)

            async def pump() -> None:
                async for message in self.reader.messages():
                    queue.put_nowait(message)

            self.pump = asyncio.ensure_future(pump())
        else:
            host, port = host_port(self.request["tcp"])
            self.conn = await create_connection(host, port, queue=queue)
            await self.conn.identify(feature_negotiation=True, heartbeat_interval=30000,
                                     msg_timeout=msg_timeout_ms, **_compression_kwargs(compression))
            answer = await self.conn.execute(b"SUB", topic, channel)
            if answer != b"OK":
                raise RuntimeError(f"SUB answered {answer!r}")
            await self.conn.execute(b"RDY", 1)
        return queue

    def fields(self, message):
        return message.body, message.attempts, message.message_id

    async def fin(self, message):
        await message.fin()

    async def req(self, message):
        await message.req(0)

    async def touch(self, message):
        await message.touch()

    def compression_in_use(self):
        consumer = None
        if self.reader is not None and self.reader._connections:
            consumer = _parser_name(next(iter(self.reader._connections.values())))
        elif self.conn is not None:
            consumer = _parser_name(self.conn)
        producer = _parser_name(self.writer._conn) if self.writer is not None else None
        return {"producer": producer, "consumer": consumer}

    async def close(self):
        if self.pump is not None:
            self.pump.cancel()
        if self.reader is not None:
            self.reader.close()
        if self.conn is not None:
            self.conn.close()
        if self.writer is not None:
            self.writer.close()
        await asyncio.sleep(0.05)


async def main() -> None:
    request = load_request()
    rec = Recorder(request["deadline_s"])
    capture_logs(rec)
    adapter = AsyncnsqAdapter(request, rec)
    try:
        await run_async(adapter, request, rec)
    except Exception:
        rec.exception()
    finally:
        rec.closing = True
        try:
            await asyncio.wait_for(adapter.close(), 5)
        except Exception:
            rec.exception()
        rec.emit()


if __name__ == "__main__":
    asyncio.run(main())
