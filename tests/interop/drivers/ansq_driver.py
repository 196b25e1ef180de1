"""Interop driver for ansq 0.3.0 (asyncio). Runs in .interop/ansq.

Offered by ansq's API and exercised: Writer.pub / mpub / dpub, NSQDHTTPWriter.pub / mpub (text
mode: bodies joined by newlines), Reader with FIN / REQ / TOUCH, ConnectionFeatures.msg_timeout,
#ephemeral channels.
Not offered: deflate and snappy. ansq 0.3.0 sends `deflate`/`snappy` in IDENTIFY when asked but its
`_upgrade_to_deflate` / `_upgrade_to_snappy` raise NotImplementedError, so those scenarios are
not run for it.
"""

from __future__ import annotations

import asyncio

import ansq
from ansq.http import NSQDHTTPWriter
from ansq.tcp.types import ConnectionFeatures, ConnectionOptions
from driver_common import AsyncAdapter, Recorder, capture_logs, host_port, load_request, run_async


class AnsqAdapter(AsyncAdapter):
    def __init__(self, request: dict, rec: Recorder) -> None:
        self.request = request
        self.rec = rec
        self.writer = None
        self.reader = None

    def _options(self, msg_timeout_ms: int | None) -> ConnectionOptions:
        features = ConnectionFeatures()
        if msg_timeout_ms is not None:
            features = ConnectionFeatures(msg_timeout=msg_timeout_ms)
        return ConnectionOptions(
            features=features,
            auto_reconnect=False,
            on_exception=lambda exc: self.rec.error(f"ansq on_exception: {exc!r}"),
        )

    @staticmethod
    def _check(kind: str, response) -> None:
        if response is None or not getattr(response, "is_ok", False):
            raise RuntimeError(f"{kind} answered {response!r}")

    async def publish(self, kind, topic, bodies, *, defer_ms=None, compression=None):
        if self.writer is None:
            self.writer = await ansq.create_writer(
                nsqd_tcp_addresses=[self.request["tcp"]], connection_options=self._options(None)
            )
        if kind == "mpub":
            self._check(kind, await self.writer.mpub(topic, *bodies))
        elif kind == "dpub":
            for body in bodies:
                self._check(kind, await self.writer.dpub(topic, body, defer_ms))
        else:
            for body in bodies:
                self._check(kind, await self.writer.pub(topic, body))

    async def publish_http(self, kind, topic, bodies):
        host, port = host_port(self.request["http"])
        http = NSQDHTTPWriter(host, port)
        try:
            if kind == "mpub":
                answer = await http.mpub(topic, *bodies)
            else:
                for body in bodies:
                    answer = await http.pub(topic, body)
                    if answer != "OK":
                        break
            if answer != "OK":
                raise RuntimeError(f"http {kind} answered {answer!r}")
        finally:
            await http.close()

    async def subscribe(self, topic, channel, *, compression, msg_timeout_ms):
        self.reader = await ansq.create_reader(
            topic=topic, channel=channel, nsqd_tcp_addresses=[self.request["tcp"]],
            connection_options=self._options(msg_timeout_ms),
        )
        return self.reader.message_queue

    def fields(self, message):
        return message.body, message.attempts, message.id

    async def fin(self, message):
        await message.fin()

    async def req(self, message):
        await message.req(0)

    async def touch(self, message):
        await message.touch()

    async def close(self):
        for client in (self.reader, self.writer):
            if client is not None:
                await client.close()


async def main() -> None:
    request = load_request()
    rec = Recorder(request["deadline_s"])
    capture_logs(rec)
    adapter = AnsqAdapter(request, rec)
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
