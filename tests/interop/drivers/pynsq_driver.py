"""Interop driver for pynsq 0.9.1 (tornado; imports as `nsq`). Runs in .interop/pynsq.

Offered by pynsq's API and exercised: Writer.pub / mpub / dpub, Reader with FIN / REQ / TOUCH,
msg_timeout (seconds, sent as IDENTIFY msg_timeout in ms), deflate, snappy, #ephemeral channels.
Not offered: pynsq 0.9.1 has no HTTP publisher (http_pub / http_mpub are not run for it).
"""

from __future__ import annotations

import asyncio

import nsq
import tornado.ioloop
from driver_common import AsyncAdapter, Recorder, ScenarioTimeout, capture_logs, load_request, run_async


def _conn_kwargs(compression: str | None, msg_timeout_ms: int | None) -> dict:
    kwargs: dict = {"heartbeat_interval": 30}
    if compression == "deflate":
        kwargs.update(deflate=True, deflate_level=6)
    elif compression == "snappy":
        kwargs["snappy"] = True
    if msg_timeout_ms is not None:
        kwargs["msg_timeout"] = msg_timeout_ms / 1000.0
    return kwargs


def _encoder_name(client) -> str | None:
    conns = list(client.conns.values())
    return type(conns[0].encoder).__name__ if conns else None


class PynsqAdapter(AsyncAdapter):
    def __init__(self, request: dict, rec: Recorder) -> None:
        self.request = request
        self.rec = rec
        self.writer: nsq.Writer | None = None
        self.reader: nsq.Reader | None = None

    async def _wait(self, predicate, what: str) -> None:
        while not predicate():
            if self.rec.remaining() <= 0:
                raise ScenarioTimeout(f"timed out waiting for {what}")
            await asyncio.sleep(0.005)

    async def _writer(self, compression: str | None) -> nsq.Writer:
        if self.writer is None:
            self.writer = nsq.Writer([self.request["tcp"]], **_conn_kwargs(compression, None))
            await self._wait(lambda: self.writer.conns, "the Writer connection")
        return self.writer

    async def publish(self, kind, topic, bodies, *, defer_ms=None, compression=None):
        writer = await self._writer(compression)
        loop = asyncio.get_running_loop()

        async def one(send) -> None:
            done: asyncio.Future = loop.create_future()

            def callback(conn, data):
                if not done.done():
                    done.set_result(data)

            send(callback)
            data = await asyncio.wait_for(done, self.rec.remaining())
            if isinstance(data, Exception):
                raise RuntimeError(f"{kind} failed: {data!r}")
            if data != b"OK":
                raise RuntimeError(f"{kind} answered {data!r}")

        if kind == "mpub":
            await one(lambda cb: writer.mpub(topic, list(bodies), callback=cb))
        elif kind == "dpub":
            for body in bodies:
                await one(lambda cb, body=body: writer.dpub(topic, defer_ms, body, callback=cb))
        else:
            for body in bodies:
                await one(lambda cb, body=body: writer.pub(topic, body, callback=cb))

    async def subscribe(self, topic, channel, *, compression, msg_timeout_ms):
        queue: asyncio.Queue = asyncio.Queue()

        def handler(message):
            message.enable_async()
            queue.put_nowait(message)

        self.reader = nsq.Reader(
            topic=topic, channel=channel, message_handler=handler,
            nsqd_tcp_addresses=[self.request["tcp"]], max_in_flight=1, max_tries=0,
            **_conn_kwargs(compression, msg_timeout_ms),
        )
        await self._wait(lambda: self.reader.conns, "the Reader to subscribe")
        return queue

    def fields(self, message):
        return message.body, message.attempts, message.id

    async def fin(self, message):
        message.finish()

    async def req(self, message):
        message.requeue(backoff=False, delay=0)

    async def touch(self, message):
        message.touch()

    def compression_in_use(self):
        return {
            "producer": _encoder_name(self.writer) if self.writer else None,
            "consumer": _encoder_name(self.reader) if self.reader else None,
        }

    async def close(self):
        if self.reader is not None:
            self.reader.close()
        if self.writer is not None:
            for conn in list(self.writer.conns.values()):
                conn.close()
        await asyncio.sleep(0.05)


async def main() -> None:
    request = load_request()
    rec = Recorder(request["deadline_s"])
    capture_logs(rec)
    # pynsq's Reader/Writer take tornado's current IOLoop, i.e. this asyncio loop.
    tornado.ioloop.IOLoop.current()
    adapter = PynsqAdapter(request, rec)
    try:
        await run_async(adapter, request, rec)
    except Exception:
        rec.exception()
    finally:
        rec.closing = True
        try:
            await adapter.close()
        except Exception:
            rec.exception()
        rec.emit()


if __name__ == "__main__":
    asyncio.run(main())
