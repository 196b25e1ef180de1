"""Plumbing shared by the interop drivers.

Each driver runs inside its client's own venv as
`<venv>/bin/python tests/interop/drivers/<client>_driver.py`, reads one JSON request on stdin and
prints one JSON result on stdout. Only the standard library is used here, so this module works in
every venv.

Request keys: scenario, tcp ("host:port"), http ("host:port"), topic, channel, bodies (base64),
defer_ms, msg_timeout_ms, quiet_s, hold_s, touch_every_s, deadline_s.

Result keys: received ([{body (base64), attempts, id, t}] in arrival order, t in seconds since the
driver started), events ([{name, t, ...}]), errors ([str]), info ({...}).
"""

from __future__ import annotations

import base64
import json
import os
import sys
import threading
import time
import traceback

# Scenarios and what they do (the same in every driver):
#   pub        PUB each body (one command per body), consume all, FIN each
#   mpub       MPUB all bodies in one command, consume all, FIN each
#   dpub       DPUB bodies[0] with defer_ms, then PUB bodies[1:], consume all, FIN each
#   http_pub   POST /pub per body through the client's HTTP API, consume all (TCP), FIN each
#   http_mpub  POST /mpub with all bodies through the client's HTTP API, consume all, FIN each
#   fin        PUB, consume with msg_timeout, FIN each, then listen quiet_s for (unwanted) redelivery
#   req        PUB one body, REQ 0 the first delivery, FIN the second
#   touch      PUB one body, consume with msg_timeout, TOUCH every touch_every_s for hold_s (longer
#              than msg_timeout), FIN, then listen quiet_s for (unwanted) redelivery
#   timeout    PUB one body, consume with msg_timeout, do not answer, FIN the redelivery
#   deflate    like pub, with deflate negotiated on both the producer and the consumer connection
#   snappy     like pub, with snappy negotiated on both connections
#   ephemeral  like pub, consuming from an `#ephemeral` channel, then close the consumer
SCENARIOS = (
    "pub", "mpub", "dpub", "http_pub", "http_mpub", "fin", "req", "touch", "timeout",
    "deflate", "snappy", "ephemeral",
)


def b64(data: bytes) -> str:
    return base64.b64encode(bytes(data)).decode("ascii")


def host_port(address: str) -> tuple[str, int]:
    host, port = address.rsplit(":", 1)
    return host, int(port)


def load_request() -> dict:
    request = json.load(sys.stdin)
    request["bodies"] = [base64.b64decode(b) for b in request.get("bodies", [])]
    request.setdefault("deadline_s", 15.0)
    request.setdefault("quiet_s", 1.5)
    request.setdefault("hold_s", 2.0)
    request.setdefault("touch_every_s", 0.3)
    request.setdefault("defer_ms", 500)
    request.setdefault("msg_timeout_ms", 1000)
    if request["scenario"] not in SCENARIOS:
        raise SystemExit(f"unknown scenario {request['scenario']!r}")
    return request


def wants_msg_timeout(scenario: str) -> bool:
    return scenario in ("fin", "touch", "timeout")


def compression_of(scenario: str) -> str | None:
    return scenario if scenario in ("deflate", "snappy") else None


class Recorder:
    """Collects what the client saw; printed exactly once, even on a hang (watchdog)."""

    def __init__(self, deadline_s: float) -> None:
        self.t0 = time.monotonic()
        self.deadline = self.t0 + deadline_s
        self.received: list[dict] = []
        self.events: list[dict] = []
        self.errors: list[str] = []
        self.info: dict = {}
        # Set once the scenario is over: what the client logs while we tear it down is not evidence.
        self.closing = False
        self._lock = threading.Lock()
        self._emitted = False
        # Some clients print() to stdout (asyncnsq does on disconnect); keep stdout for the result.
        self._stdout = sys.stdout
        sys.stdout = sys.stderr
        self._watchdog = threading.Timer(deadline_s + 2.0, self._on_watchdog)
        self._watchdog.daemon = True
        self._watchdog.start()

    def now(self) -> float:
        return round(time.monotonic() - self.t0, 4)

    def remaining(self) -> float:
        return max(0.0, self.deadline - time.monotonic())

    def message(self, body: bytes, attempts: int, msg_id) -> None:
        if isinstance(msg_id, (bytes, bytearray)):
            msg_id = bytes(msg_id).decode("ascii", "replace")
        self.received.append({"body": b64(body), "attempts": int(attempts), "id": str(msg_id), "t": self.now()})

    def event(self, name: str, **fields) -> None:
        self.events.append({"name": name, "t": self.now(), **fields})

    def error(self, text: str) -> None:
        self.errors.append(str(text))

    def exception(self) -> None:
        self.errors.append(traceback.format_exc())

    def emit(self) -> None:
        with self._lock:
            if self._emitted:
                return
            self._emitted = True
            self._watchdog.cancel()
            result = {
                "received": self.received,
                "events": self.events,
                "errors": self.errors,
                "info": self.info,
            }
            self._stdout.write(json.dumps(result) + "\n")
            self._stdout.flush()

    def _on_watchdog(self) -> None:
        self.error("driver watchdog: the scenario did not finish in time (client hung)")
        self.emit()
        os._exit(3)


def capture_logs(rec: Recorder, level_error: int = 40) -> None:
    """Route the client library's log records into the result: ERROR and above become errors,
    WARNING becomes an event (client libraries report server error frames through logging)."""
    import logging

    class Handler(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if rec.closing:
                return
            try:
                text = f"{record.name}: {record.getMessage()}"
            except Exception:
                text = f"{record.name}: {record.msg!r}"
            if record.levelno >= level_error:
                rec.error("client log: " + text)
            else:
                rec.event("client_log", level=record.levelname, text=text)

    root = logging.getLogger()
    root.handlers[:] = [Handler(level=logging.WARNING)]
    root.setLevel(logging.WARNING)


class ScenarioTimeout(Exception):
    """A wait inside a scenario ran past the driver's deadline."""


class AsyncAdapter:
    """What an asyncio-based driver provides to `run_async` (one instance per scenario run)."""

    async def publish(self, kind: str, topic: str, bodies: list[bytes], *, defer_ms: int | None = None,
                      compression: str | None = None) -> None:
        raise NotImplementedError

    async def publish_http(self, kind: str, topic: str, bodies: list[bytes]) -> None:
        raise NotImplementedError

    async def subscribe(self, topic: str, channel: str, *, compression: str | None,
                        msg_timeout_ms: int | None):
        """Connect a consumer; return an asyncio.Queue that receives the client's message objects."""
        raise NotImplementedError

    def fields(self, message) -> tuple[bytes, int, object]:
        """(body, attempts, id) of a client message object."""
        raise NotImplementedError

    async def fin(self, message) -> None:
        raise NotImplementedError

    async def req(self, message) -> None:
        raise NotImplementedError

    async def touch(self, message) -> None:
        raise NotImplementedError

    def compression_in_use(self) -> dict:
        """What the client itself says it negotiated, per connection role."""
        return {}

    async def close(self) -> None:
        raise NotImplementedError


async def run_async(adapter: AsyncAdapter, request: dict, rec: Recorder) -> None:
    import asyncio

    scenario = request["scenario"]
    topic, channel, bodies = request["topic"], request["channel"], request["bodies"]
    compression = compression_of(scenario)
    msg_timeout_ms = request["msg_timeout_ms"] if wants_msg_timeout(scenario) else None

    queue = await adapter.subscribe(topic, channel, compression=compression, msg_timeout_ms=msg_timeout_ms)
    rec.event("subscribed")

    if scenario == "mpub":
        await adapter.publish("mpub", topic, bodies)
    elif scenario == "dpub":
        await adapter.publish("dpub", topic, bodies[:1], defer_ms=request["defer_ms"])
        rec.event("dpub_acked")
        await adapter.publish("pub", topic, bodies[1:])
    elif scenario in ("http_pub", "http_mpub"):
        await adapter.publish_http(scenario[5:], topic, bodies)
    else:
        await adapter.publish("pub", topic, bodies, compression=compression)
    rec.event("published")

    async def next_message(limit: float | None = None):
        budget = rec.remaining() if limit is None else min(limit, rec.remaining())
        try:
            message = await asyncio.wait_for(queue.get(), budget)
        except TimeoutError:
            if limit is None:
                raise ScenarioTimeout(f"no message within the deadline ({len(rec.received)} received)") from None
            return None
        if message is None:
            raise ScenarioTimeout("the client reported its connection closed")
        rec.message(*adapter.fields(message))
        return message

    async def quiet_window() -> None:
        end = time.monotonic() + request["quiet_s"]
        while time.monotonic() < end:
            extra = await next_message(end - time.monotonic())
            if extra is not None:
                rec.event("unexpected_delivery")
                await adapter.fin(extra)

    if scenario == "req":
        first = await next_message()
        await adapter.req(first)
        rec.event("req_sent")
        second = await next_message()
        await adapter.fin(second)
    elif scenario == "timeout":
        await next_message()
        rec.event("holding_without_answer")
        second = await next_message()
        await adapter.fin(second)
    elif scenario == "touch":
        held = await next_message()
        end = time.monotonic() + request["hold_s"]
        while time.monotonic() < end:
            extra = await next_message(min(request["touch_every_s"], end - time.monotonic()))
            if extra is not None:
                rec.event("unexpected_delivery")
            await adapter.touch(held)
            rec.event("touch_sent")
        await adapter.fin(held)
        rec.event("fin_sent")
        await quiet_window()
    else:
        for _ in bodies:
            message = await next_message()
            await adapter.fin(message)
        if scenario == "fin":
            rec.event("fin_sent")
            await quiet_window()

    rec.info["compression"] = adapter.compression_in_use()
    # Let the last FIN/REQ reach the server before the connection goes away.
    await asyncio.sleep(0.05)


class SyncAdapter:
    """What a blocking (gevent or select based) driver provides to `run_sync`."""

    def publish(self, kind: str, topic: str, bodies: list[bytes], *, defer_ms: int | None = None,
                compression: str | None = None) -> None:
        raise NotImplementedError

    def publish_http(self, kind: str, topic: str, bodies: list[bytes]) -> None:
        raise NotImplementedError

    def subscribe(self, topic: str, channel: str, *, compression: str | None,
                  msg_timeout_ms: int | None) -> None:
        raise NotImplementedError

    def next_message(self, timeout: float):
        """The next client message object, or None after `timeout` seconds."""
        raise NotImplementedError

    def fields(self, message) -> tuple[bytes, int, object]:
        raise NotImplementedError

    def fin(self, message) -> None:
        raise NotImplementedError

    def req(self, message) -> None:
        raise NotImplementedError

    def touch(self, message) -> None:
        raise NotImplementedError

    def compression_in_use(self) -> dict:
        return {}

    def pause(self, seconds: float) -> None:
        time.sleep(seconds)

    def close(self) -> None:
        raise NotImplementedError


def run_sync(adapter: SyncAdapter, request: dict, rec: Recorder) -> None:
    """The same scenarios as `run_async`, for blocking clients."""
    scenario = request["scenario"]
    topic, channel, bodies = request["topic"], request["channel"], request["bodies"]
    compression = compression_of(scenario)
    msg_timeout_ms = request["msg_timeout_ms"] if wants_msg_timeout(scenario) else None

    adapter.subscribe(topic, channel, compression=compression, msg_timeout_ms=msg_timeout_ms)
    rec.event("subscribed")

    if scenario == "mpub":
        adapter.publish("mpub", topic, bodies)
    elif scenario == "dpub":
        adapter.publish("dpub", topic, bodies[:1], defer_ms=request["defer_ms"])
        rec.event("dpub_acked")
        adapter.publish("pub", topic, bodies[1:])
    elif scenario in ("http_pub", "http_mpub"):
        adapter.publish_http(scenario[5:], topic, bodies)
    else:
        adapter.publish("pub", topic, bodies, compression=compression)
    rec.event("published")

    def next_message(limit: float | None = None):
        budget = rec.remaining() if limit is None else min(limit, rec.remaining())
        message = adapter.next_message(budget)
        if message is None:
            if limit is None:
                raise ScenarioTimeout(f"no message within the deadline ({len(rec.received)} received)") from None
            return None
        rec.message(*adapter.fields(message))
        return message

    def quiet_window() -> None:
        end = time.monotonic() + request["quiet_s"]
        while time.monotonic() < end:
            extra = next_message(end - time.monotonic())
            if extra is not None:
                rec.event("unexpected_delivery")
                adapter.fin(extra)

    if scenario == "req":
        first = next_message()
        adapter.req(first)
        rec.event("req_sent")
        adapter.fin(next_message())
    elif scenario == "timeout":
        next_message()
        rec.event("holding_without_answer")
        adapter.fin(next_message())
    elif scenario == "touch":
        held = next_message()
        end = time.monotonic() + request["hold_s"]
        while time.monotonic() < end:
            extra = next_message(min(request["touch_every_s"], end - time.monotonic()))
            if extra is not None:
                rec.event("unexpected_delivery")
            adapter.touch(held)
            rec.event("touch_sent")
        adapter.fin(held)
        rec.event("fin_sent")
        quiet_window()
    else:
        for _ in bodies:
            adapter.fin(next_message())
        if scenario == "fin":
            rec.event("fin_sent")
            quiet_window()

    rec.info["compression"] = adapter.compression_in_use()
    adapter.pause(0.05)
