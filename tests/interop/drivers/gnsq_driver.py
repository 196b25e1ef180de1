"""Interop driver for gnsq 1.0.2 (gevent). Runs in .interop/gnsq.

Offered by gnsq's API and exercised: Producer.publish / multipublish / publish(defer=) (DPUB),
NsqdHTTPClient.publish / multipublish(binary=True), Consumer with FIN / REQ / TOUCH, deflate,
snappy, #ephemeral channels.
Not offered: gnsq 1.0.2 has no msg_timeout setting (NsqdTCPClient's IDENTIFY never sends
`msg_timeout`), so the `timeout` scenario is not run for it, and `touch` / `fin` run against the
server's default 60 s message timeout (TOUCH must be accepted and the message must stay ours, but
a moved deadline cannot be observed in a short test).
"""

from __future__ import annotations

import gevent
import gevent.queue
import gnsq
from driver_common import Recorder, SyncAdapter, capture_logs, host_port, load_request, run_sync


def _conn_kwargs(compression: str | None) -> dict:
    if compression == "deflate":
        return {"deflate": True, "deflate_level": 6}
    if compression == "snappy":
        return {"snappy": True}
    return {}


def _socket_name(conn) -> str | None:
    stream = getattr(conn, "stream", None)
    if stream is None or stream.socket is None:
        return None
    # gnsq wraps the socket in DefalteSocket (sic) / SnappySocket once compression is negotiated.
    return type(stream.socket).__name__


class GnsqAdapter(SyncAdapter):
    def __init__(self, request: dict, rec: Recorder) -> None:
        self.request = request
        self.rec = rec
        self.producer: gnsq.Producer | None = None
        self.raw_producer: gnsq.NsqdTCPClient | None = None
        self.consumer: gnsq.Consumer | None = None
        self.queue: gevent.queue.Queue = gevent.queue.Queue()

    def publish(self, kind, topic, bodies, *, defer_ms=None, compression=None):
        if compression is not None:
            # gnsq's Producer cannot negotiate compression: the compressed `OK` that follows the
            # IDENTIFY reply reaches Producer.handle_response before the connection has a response
            # queue (KeyError in gnsq/producer.py, with any nsqd). Its lower-level NsqdTCPClient
            # can, so compressed publishing goes through that.
            self._publish_raw(topic, bodies, compression)
            return
        if self.producer is None:
            self.producer = gnsq.Producer([self.request["tcp"]], **_conn_kwargs(compression))
            self.producer.start()
        if kind == "mpub":
            answers = [self.producer.multipublish(topic, list(bodies), timeout=self.rec.remaining())]
        elif kind == "dpub":
            answers = [self.producer.publish(topic, body, defer=defer_ms, timeout=self.rec.remaining())
                       for body in bodies]
        else:
            answers = [self.producer.publish(topic, body, timeout=self.rec.remaining()) for body in bodies]
        if any(answer != b"OK" for answer in answers):
            raise RuntimeError(f"{kind} answered {answers!r}")

    def _publish_raw(self, topic, bodies, compression):
        host, port = host_port(self.request["tcp"])
        conn = gnsq.NsqdTCPClient(host, port, **_conn_kwargs(compression))
        conn.connect()
        conn.identify()
        self.raw_producer = conn
        answers = []
        for body in bodies:
            conn.publish(topic, body)
            answers.append(conn.read_response())
        if any(answer != (0, b"OK") for answer in answers):
            raise RuntimeError(f"PUB answered {answers!r}")

    def publish_http(self, kind, topic, bodies):
        host, port = host_port(self.request["http"])
        http = gnsq.NsqdHTTPClient(host, port)
        if kind == "mpub":
            answers = [http.multipublish(topic, list(bodies), binary=True)]
        else:
            answers = [http.publish(topic, body) for body in bodies]
        if any(answer != b"OK" for answer in answers):
            raise RuntimeError(f"http {kind} answered {answers!r}")

    def subscribe(self, topic, channel, *, compression, msg_timeout_ms):
        # msg_timeout_ms cannot be honoured: gnsq has no such option (see the module docstring).
        self.consumer = gnsq.Consumer(
            topic, channel, [self.request["tcp"]], max_in_flight=1, max_tries=0,
            backoff_on_requeue=False, **_conn_kwargs(compression),
        )

        def handler(consumer, message):
            message.enable_async()
            self.queue.put(message)

        def on_error(consumer, error):
            self.rec.error(f"gnsq on_error: {error!r}")

        # blinker holds weak references by default: a local function would vanish (and gnsq would
        # then FIN every message itself).
        self.consumer.on_message.connect(handler, weak=False)
        self.consumer.on_error.connect(on_error, weak=False)
        self.consumer.start(block=False)

    def next_message(self, timeout):
        try:
            return self.queue.get(timeout=timeout)
        except gevent.queue.Empty:
            return None

    def fields(self, message):
        return message.body, message.attempts, message.id

    def fin(self, message):
        message.finish()

    def req(self, message):
        message.requeue(0, backoff=False)

    def touch(self, message):
        message.touch()

    def compression_in_use(self):
        consumer = producer = None
        if self.consumer is not None and self.consumer._connections:
            consumer = _socket_name(next(iter(self.consumer._connections)))
        if self.raw_producer is not None:
            producer = _socket_name(self.raw_producer)
        return {"producer": producer, "consumer": consumer}

    def pause(self, seconds):
        gevent.sleep(seconds)

    def close(self):
        if self.consumer is not None:
            self.consumer.close()
        if self.producer is not None:
            self.producer.close()
        if self.raw_producer is not None:
            self.raw_producer.close_stream()
        gevent.sleep(0.05)


def main() -> None:
    request = load_request()
    rec = Recorder(request["deadline_s"])
    capture_logs(rec)
    adapter = GnsqAdapter(request, rec)
    try:
        run_sync(adapter, request, rec)
    except Exception:
        rec.exception()
    finally:
        rec.closing = True
        try:
            adapter.close()
        except Exception:
            rec.exception()
        rec.emit()


if __name__ == "__main__":
    main()
