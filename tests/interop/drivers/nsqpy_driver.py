"""Interop driver for nsq-py 0.1.12 (plain sockets + select; imports as `nsq`). Runs in .interop/nsqpy.

Offered by nsq-py's API and exercised: Client.pub / mpub (TCP), nsq.http.nsqd.Client.pub / mpub
(binary mode, its default), Reader with FIN / REQ / TOUCH, msg_timeout (any IDENTIFY key can be
passed as a keyword), #ephemeral channels. nsq-py still sends the pre-1.0 IDENTIFY keys
`short_id` / `long_id`, which nsqd ignores.
Not offered: DPUB (no deferred publish in the API); deflate and snappy (nsq/sockets/deflate.py and
snappy.py just `raise ImportError`, and Connection then refuses `deflate=True` / `snappy=True`
with UnsupportedException).
"""

from __future__ import annotations

import collections
import time

from driver_common import Recorder, SyncAdapter, capture_logs, load_request, run_sync
from nsq.client import Client
from nsq.http.nsqd import Client as HttpClient
from nsq.reader import Reader
from nsq.response import Error, Message


class NsqpyAdapter(SyncAdapter):
    def __init__(self, request: dict, rec: Recorder) -> None:
        self.request = request
        self.rec = rec
        self.client: Client | None = None
        self.reader: Reader | None = None
        self.pending: collections.deque = collections.deque()

    def _note_errors(self, responses) -> None:
        for response in responses:
            if isinstance(response, Error):
                self.rec.error(f"nsq-py got error frame: {response.data!r}")

    def publish(self, kind, topic, bodies, *, defer_ms=None, compression=None):
        if kind == "dpub":
            raise NotImplementedError("nsq-py has no deferred publish")
        if self.client is None:
            self.client = Client(nsqd_tcp_addresses=[self.request["tcp"]])
        topic_b = topic.encode()
        if kind == "mpub":
            answers = [self.client.mpub(topic_b, *bodies)]
        else:
            answers = [self.client.pub(topic_b, body) for body in bodies]
        flat = [response for answer in answers for response in answer]
        self._note_errors(flat)
        if len(flat) != len(answers) or any(response.data != b"OK" for response in flat):
            raise RuntimeError(f"{kind} answered {[str(r) for r in flat]!r}")

    def publish_http(self, kind, topic, bodies):
        http = HttpClient(f"http://{self.request['http']}/")
        if kind == "mpub":
            answers = [http.mpub(topic, list(bodies), binary=True)]
        else:
            answers = [http.pub(topic, body) for body in bodies]
        if any(answer != b"OK" for answer in answers):
            raise RuntimeError(f"http {kind} answered {answers!r}")

    def subscribe(self, topic, channel, *, compression, msg_timeout_ms):
        identify = {}
        if msg_timeout_ms is not None:
            identify["msg_timeout"] = msg_timeout_ms
        self.reader = Reader(topic.encode(), channel.encode(), nsqd_tcp_addresses=[self.request["tcp"]],
                             max_in_flight=1, **identify)
        if not [conn for conn in self.reader.connections() if conn.alive()]:
            raise RuntimeError("nsq-py Reader could not connect")

    def next_message(self, timeout):
        end = time.monotonic() + timeout
        while not self.pending:
            responses = self.reader.read()
            self._note_errors(responses)
            self.pending.extend(r for r in responses if isinstance(r, Message))
            if not self.pending and time.monotonic() >= end:
                return None
        return self.pending.popleft()

    def fields(self, message):
        return message.body, message.attempts, message.id

    def _flush(self) -> None:
        for conn in self.reader.connections():
            while conn.alive() and conn.pending():
                conn.flush()

    def fin(self, message):
        message.fin()
        self._flush()

    def req(self, message):
        message.req(0)
        self._flush()

    def touch(self, message):
        message.touch()
        self._flush()

    def compression_in_use(self):
        return {}

    def close(self):
        for client in (self.reader, self.client):
            if client is not None:
                for conn in client.connections():
                    conn.close()


def main() -> None:
    request = load_request()
    rec = Recorder(request["deadline_s"])
    capture_logs(rec)
    adapter = NsqpyAdapter(request, rec)
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
