"""polymq's stream endpoints on the gateway's own HTTP listener (docs/spark.md), request in, response out.

A reader (the Spark data source) opens a stream (a queue read by position, core/streams.py) bound
to topics, asks for offsets, splits a range into partitions, reads ranges as binary row batches
(codecs/stream_rows.py) as often as it needs, and commits. Answers that hand out positions wait for
the store's sync (`after_sync`), so every position below an `end` a reader was told is on disk.
Errors are nsqd's shape, `{"message": "CODE"}`, plus a `reason` a reader can show.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import attrs

from polymq.adapters.http import JSON_TYPE, Later, NeedBody, QueryError, Request, Response, go_json, parse_query
from polymq.adapters.traffic import Traffic
from polymq.codecs import stream_rows
from polymq.core import streams
from polymq.core.engine import Engine, Queue
from polymq.core.message import PUBLISHER_ID_HEADER, Message, shown_headers
from polymq.jetstream.nats_connection import NatsError

# The origin the engine keeps with rows published here (a Spark job's, mostly): polymq's own HTTP.
ORIGIN = "http"
# Rows and bytes one read answers at most: a reader asks again from the next position.
MAX_READ_ROWS = 100_000
MAX_READ_BYTES = 32 * 1024 * 1024
# Partitions one split may ask for (Spark's default parallelism of a big cluster is far below).
MAX_PARTS = 4096
# Topic and stream names: any UTF-8 text up to this many bytes, no control characters (the
# longest name any protocol allows, eMQP's queue names).
MAX_NAME_BYTES = 1024

# Snapshots (batch reads of any queue) held at once, and how long one is kept after its last read:
# Spark tells a source nothing when a batch read ends.
MAX_SNAPSHOTS = 16
SNAPSHOT_IDLE_S = 600.0
# Memory the snapshots held at once may take for the messages they read back from disk (those
# still in memory cost them only references); `--snapshot-memory` sets it.
DEFAULT_SNAPSHOT_MEMORY = 1024 * 1024 * 1024
# The largest row and the largest publish batch, by default nsqd's --max-msg-size and
# --max-body-size (`--stream-max-row-size`, `--stream-max-batch-size`).
DEFAULT_MAX_ROW = 1024 * 1024
DEFAULT_MAX_BATCH = 5 * 1024 * 1024

Handler = Callable[[Request, str], Response | NeedBody | Later]


@attrs.define
class Snapshot:
    """The messages a queue held when a batch read began (references: nothing is taken from it)."""

    queue: str
    messages: list[Message]
    used: float  # monotonic seconds of the last read
    read_back: int  # bytes of memory its copies read back from disk take
Params = dict[bytes, list[bytes]]


# A publish that a full queue refuses (--max-queue-depth with --queue-overflow reject): 507 Insufficient
# Storage (RFC 4918), the request may succeed once the queue's consumers have taken some; 503 stays the
# failing store's, as nsqd's HTTP API answers it.
QUEUE_FULL_STATUS = 507


def failure(status: int, code: str, reason: str) -> Response:
    return Response(status, go_json({"message": code, "reason": reason}), JSON_TYPE)


class BadRequest(Exception):
    def __init__(self, response: Response) -> None:
        self.response = response


class StreamHttpApi:
    def __init__(self, engine: Engine, *, max_row: int = DEFAULT_MAX_ROW, max_batch: int = DEFAULT_MAX_BATCH,
                 snapshot_memory: int = DEFAULT_SNAPSHOT_MEMORY, shared: streams.SharedStreams | None = None) -> None:
        self.engine = engine
        self.shared = shared  # streams a shared engine keeps (JetStream): the same on every node
        self.max_row = max_row
        self.max_batch = max_batch
        self.snapshot_memory = snapshot_memory
        self._topic_bytes: dict[str, bytes] = {}
        self._snapshots: dict[str, Snapshot] = {}  # by id, oldest first
        self.traffic = Traffic()  # rows published and read, for the metrics (the listener counts errors)

    def routes(self) -> dict[str, dict[str, Handler]]:
        # Streams read by position: the node's own queues, or a shared engine's (its answers come later).
        positioned = (("/stream/open", "POST", self._open, self._shared_open),
                      ("/stream/offsets", "GET", self._offsets, self._shared_offsets),
                      ("/stream/split", "GET", self._split, self._shared_split),
                      ("/stream/read", "GET", self._read, self._shared_read),
                      ("/stream/commit", "POST", self._commit, self._shared_commit))
        return {
            **{path: {method: self._guarded(own) if self.shared is None else self._guarded_later(shared)}
               for path, method, own, shared in positioned},
            "/stream/publish": {"POST": self._guarded(self._publish)},
            "/stream/snapshot": {"POST": self._guarded(self._snapshot) if self.shared is None
                                 else self._guarded_later(self._shared_snapshot)},
            "/stream/snapshot/read": {"GET": self._guarded(self._snapshot_read)},
            "/stream/snapshot/close": {"POST": self._guarded(self._snapshot_close)},
        }

    @staticmethod
    def _guarded(handler: Callable[[Params], Response | NeedBody | Later]) -> Handler:
        def handle(request: Request, _: str) -> Response | NeedBody | Later:
            try:
                params = parse_query(request.query)
            except QueryError:
                return failure(400, "INVALID_REQUEST", "the query string cannot be parsed")
            try:
                return handler(params)
            except BadRequest as bad:
                return bad.response
            except streams.StreamError as error:
                return failure(404 if str(error).startswith("no stream") else 409, "STREAM_ERROR", str(error))

        return handle

    @staticmethod
    def _guarded_later(handler: Callable[[Params], Awaitable[Response]]) -> Handler:
        """`handler` run once the shared engine answers; its refusals in the stream API's shape."""

        def handle(request: Request, _: str) -> Response | NeedBody | Later:
            try:
                params = parse_query(request.query)
            except QueryError:
                return failure(400, "INVALID_REQUEST", "the query string cannot be parsed")

            async def run() -> Response:
                try:
                    return await handler(params)
                except BadRequest as bad:
                    return bad.response
                except streams.PositionsGone as gone:
                    return failure(410, "OFFSET_GONE", str(gone))
                except streams.StreamError as error:
                    return failure(404 if str(error).startswith("no stream") else 409, "STREAM_ERROR", str(error))
                except NatsError as error:
                    return failure(503, "SHARED_ENGINE_UNAVAILABLE", f"the JetStream cluster did not answer: {error}")

            return Later(run)

        return handle

    # -- parameters ----------------------------------------------------------------------------

    @staticmethod
    def _name(params: Params, key: bytes) -> str:
        values = params.get(key)
        if not values:
            raise BadRequest(failure(400, f"MISSING_ARG_{key.decode().upper()}", f"{key.decode()} is required"))
        return _valid_name(values[0], key.decode())

    @staticmethod
    def _int(params: Params, key: bytes, default: int | None = None, minimum: int = 0) -> int:
        values = params.get(key)
        if not values:
            if default is None:
                raise BadRequest(failure(400, f"MISSING_ARG_{key.decode().upper()}", f"{key.decode()} is required"))
            return default
        try:
            value = int(values[0])
        except ValueError:
            value = None
        if value is None or value < minimum:
            raise BadRequest(failure(400, f"INVALID_ARG_{key.decode().upper()}",
                                     f"{key.decode()} must be an integer >= {minimum}"))
        return value

    def _stream(self, params: Params) -> Queue:
        return streams.stream(self.engine, self._name(params, b"stream"))

    def _positions(self, queue: Queue) -> dict[str, Any]:
        return {"stream": queue.name, "topics": list(queue.topics), "start": streams.start(queue),
                "end": streams.end(queue), "committed": streams.committed(queue)}

    # -- endpoints -----------------------------------------------------------------------------

    def _open(self, params: Params) -> Response:
        name = self._name(params, b"stream")
        topics = [_valid_name(raw, "topic") for raw in params.get(b"topic", [])]
        if self.engine.storage.failure is not None:
            return failure(503, "EXITING", f"the store failed: {self.engine.storage.failure}")
        queue = streams.open_stream(self.engine, name, topics, ORIGIN)
        return _json(self._positions(queue))

    def _offsets(self, params: Params) -> Response:
        queue = self._stream(params)
        answer = self._positions(queue)
        rows = params.get(b"rows")
        if rows is not None:
            begin = self._int(params, b"from", answer["start"])
            answer["end"], answer["rows"] = streams.range_after(queue, max(begin, answer["committed"]),
                                                                 self._int(params, b"rows"))
        return _json(answer)

    def _split(self, params: Params) -> Response:
        queue = self._stream(params)
        begin, until = self._int(params, b"from"), self._int(params, b"to")
        parts = self._int(params, b"parts", 1, minimum=1)
        if parts > MAX_PARTS:
            raise BadRequest(failure(400, "INVALID_ARG_PARTS", f"parts must be at most {MAX_PARTS}"))
        positions = [message.pos for message in streams.read(queue, begin, until)]
        bounds = [begin]
        for part in range(1, parts):
            index = len(positions) * part // parts
            if index < len(positions) and positions[index] > bounds[-1]:
                bounds.append(positions[index])
        bounds.append(max(until, begin))
        return _json({"bounds": bounds, "rows": len(positions)})

    def _read(self, params: Params) -> Response:
        queue = self._stream(params)
        begin, until = self._int(params, b"from"), self._int(params, b"to")
        limit = min(self._int(params, b"limit", MAX_READ_ROWS, minimum=1), MAX_READ_ROWS)
        floor = streams.committed(queue)
        if begin < floor:
            return failure(410, "OFFSET_GONE", f"positions below {floor} of stream {queue.name} were committed "
                                               f"(asked from {begin})")
        messages = streams.read(queue, begin, until, limit)
        return self._rows(messages, [message.pos for message in messages], queue.name, self._columns(params))

    @staticmethod
    def _columns(params: Params) -> bool:
        """The layout a read asks for: `rows` (the default) or `columns`."""
        layout = params.get(b"layout", [b"rows"])[0]
        if layout not in (b"rows", b"columns"):
            raise BadRequest(failure(400, "INVALID_ARG_LAYOUT", "layout must be rows or columns"))
        return layout == b"columns"

    def _rows(self, messages: list[Message], positions: Iterable[int], queue_name: str, columns: bool) -> Response:
        """A read batch: each message under its position, up to MAX_READ_BYTES (at least one row)."""
        topic_bytes = self._topic_bytes
        if columns:
            writer = stream_rows.ColumnsWriter()
            writer.add_messages(messages, positions, queue_name, topic_bytes, MAX_READ_BYTES)
            self.traffic.messages_out += len(writer.positions)
            return Response(200, writer.encode(), stream_rows.COLUMNS_CONTENT_TYPE)
        encode = stream_rows.encode_read_row
        parts: list[bytes] = []
        size = 0
        for message, position in zip(messages, positions, strict=False):
            topic = message.topic or queue_name
            raw_topic = topic_bytes.get(topic)
            if raw_topic is None:
                raw_topic = topic_bytes[topic] = topic.encode("utf-8", "surrogateescape")
            headers = shown_headers(message)
            origin = message.origin
            raw_headers = json.dumps(headers, separators=(",", ":")).encode() if headers else b""
            raw_origin = origin.encode("ascii", "replace") if origin else b""
            row = encode(position, message.id, message.timestamp_ns, message.attempts, raw_topic, raw_headers,
                         message.body, raw_origin)
            size += len(row)
            if size > MAX_READ_BYTES and parts:
                break
            parts.append(row)
        self.traffic.messages_out += len(parts)
        return Response(200, b"".join(parts), stream_rows.CONTENT_TYPE)

    # -- the same on a shared engine (JetStream): positions are the cluster's ----------------------

    def _shared_streams(self) -> streams.SharedStreams:
        assert self.shared is not None
        return self.shared

    async def _shared_open(self, params: Params) -> Response:
        name = self._name(params, b"stream")
        topics = [_valid_name(raw, "topic") for raw in params.get(b"topic", [])]
        return _json_now(await self._shared_streams().open(name, topics))

    async def _shared_offsets(self, params: Params) -> Response:
        name = self._name(params, b"stream")
        if params.get(b"rows") is None:
            return _json_now(await self._shared_streams().positions(name))
        begin, rows = self._int(params, b"from", 0), self._int(params, b"rows")
        answer, end, count = await self._shared_streams().range_after(name, begin, rows)
        return _json_now({**answer, "end": end, "rows": count})

    async def _shared_split(self, params: Params) -> Response:
        name = self._name(params, b"stream")
        begin, until = self._int(params, b"from"), self._int(params, b"to")
        parts = self._int(params, b"parts", 1, minimum=1)
        if parts > MAX_PARTS:
            raise BadRequest(failure(400, "INVALID_ARG_PARTS", f"parts must be at most {MAX_PARTS}"))
        bounds, rows = await self._shared_streams().split(name, begin, until, parts)
        return _json_now({"bounds": bounds, "rows": rows})

    async def _shared_read(self, params: Params) -> Response:
        name = self._name(params, b"stream")
        begin, until = self._int(params, b"from"), self._int(params, b"to")
        limit = min(self._int(params, b"limit", MAX_READ_ROWS, minimum=1), MAX_READ_ROWS)
        columns = self._columns(params)
        topic, messages, positions = await self._shared_streams().read(name, begin, until, limit)
        return self._rows(messages, positions, topic, columns)

    async def _shared_commit(self, params: Params) -> Response:
        name = self._name(params, b"stream")
        answer, finished = await self._shared_streams().commit(name, self._int(params, b"to"))
        return _json_now({**answer, "finished": finished})

    # -- snapshots of any queue (batch reads) ---------------------------------------------------

    def _snapshot(self, params: Params) -> Response:
        name = self._name(params, b"queue")
        if self.engine.streams_refused is not None:
            raise streams.StreamError(self.engine.streams_refused)
        queue = self.engine.queue(name)
        if queue is None:
            raise streams.StreamError(f"no stream or queue {name}")
        self._expire_snapshots()
        try:
            messages, read_back = streams.snapshot(queue, self._snapshot_room())
        except streams.SnapshotTooLarge as error:
            raise self._too_large(error) from error
        return self._keep_snapshot(name, messages, read_back)

    async def _shared_snapshot(self, params: Params) -> Response:
        """The same of a queue (or a stream) of the shared engine: whichever node holds its messages."""
        name = self._name(params, b"queue")
        self._expire_snapshots()
        try:
            messages, read_back, shared = await self._shared_streams().snapshot(name, self._snapshot_room())
        except streams.SnapshotTooLarge as error:
            raise self._too_large(error) from error
        return self._keep_snapshot(name, messages, read_back, shared)

    def _snapshot_room(self) -> int:
        """What a new snapshot may read back, the oldest open ones making room as needed."""
        while len(self._snapshots) >= MAX_SNAPSHOTS:
            self._snapshots.pop(next(iter(self._snapshots)))  # the oldest goes
        return self.snapshot_memory - sum(taken.read_back for taken in self._snapshots.values())

    def _too_large(self, error: streams.SnapshotTooLarge) -> BadRequest:
        held = self.snapshot_memory - self._snapshot_room()
        return BadRequest(failure(413, "SNAPSHOT_TOO_LARGE", f"{error} (--snapshot-memory "
                                  f"{self.snapshot_memory >> 20} MiB, {held >> 20} MiB held by open snapshots): "
                                  "read it as a stream, or close other snapshots"))

    def _keep_snapshot(self, name: str, messages: list[Message], read_back: int, shared: str | None = None) -> Response:
        """Kept for its reads; `shared`, the key every node of a cluster answers for the same queue (one reader
        reads it once)."""
        taken = Snapshot(name, messages, time.monotonic(), read_back)
        snapshot_id = secrets.token_hex(8)
        self._snapshots[snapshot_id] = taken
        answer: dict[str, Any] = {"snapshot": snapshot_id, "queue": name, "rows": len(taken.messages)}
        if shared is not None:
            answer["shared"] = shared
        return Response(200, go_json(answer), JSON_TYPE)

    def _taken(self, params: Params) -> tuple[str, Snapshot]:
        raw = params.get(b"snapshot")
        if not raw:
            raise BadRequest(failure(400, "MISSING_ARG_SNAPSHOT", "snapshot is required"))
        snapshot_id = raw[0].decode("ascii", "replace")
        self._expire_snapshots()
        taken = self._snapshots.get(snapshot_id)
        if taken is None:
            raise BadRequest(failure(410, "SNAPSHOT_GONE", f"no snapshot {snapshot_id[:40]} (closed, or idle for "
                                                           f"{SNAPSHOT_IDLE_S:g} s)"))
        taken.used = time.monotonic()
        return snapshot_id, taken

    def _snapshot_read(self, params: Params) -> Response:
        _, taken = self._taken(params)
        begin, until = self._int(params, b"from"), self._int(params, b"to")
        limit = min(self._int(params, b"limit", MAX_READ_ROWS, minimum=1), MAX_READ_ROWS)
        until = min(until, len(taken.messages), begin + limit)
        return self._rows(taken.messages[begin:until], range(begin, until), taken.queue, self._columns(params))

    def _snapshot_close(self, params: Params) -> Response:
        snapshot_id, _ = self._taken(params)
        del self._snapshots[snapshot_id]
        return Response(200, go_json({"closed": snapshot_id}), JSON_TYPE)

    def _expire_snapshots(self) -> None:
        limit = time.monotonic() - SNAPSHOT_IDLE_S
        for snapshot_id in [key for key, taken in self._snapshots.items() if taken.used < limit]:
            del self._snapshots[snapshot_id]

    def _commit(self, params: Params) -> Response:
        queue = self._stream(params)
        until = self._int(params, b"to")
        finished = streams.commit(self.engine, queue, until)
        answer = self._positions(queue)
        answer["finished"] = finished
        return _json(answer)


    def _publish(self, params: Params) -> Response | NeedBody | Later:
        """Rows (codecs/stream_rows.py) to `topic` (or each row's own). With `dedup=GROUP`, row `n`
        of the batch is `first + n` of that group: what the group has had is not published again,
        and its record is stored once the rows are on disk."""
        default_topic = _valid_name(params[b"topic"][0], "topic") if params.get(b"topic") else None
        raw_group = params.get(b"dedup")
        group = _valid_name(raw_group[0], "dedup") if raw_group else None
        first = self._int(params, b"first", 0)
        max_row, max_batch = self.max_row, self.max_batch

        def complete(body: bytes) -> Response | Later:
            shared = self.shared
            if group is None or shared is None:
                return decide(body)
            known_group = group

            async def after_loading() -> Response:  # what other nodes published under the group counts too
                try:
                    await shared.load_dedup(known_group)
                except NatsError as error:
                    return failure(503, "SHARED_ENGINE_UNAVAILABLE", f"the JetStream cluster did not answer: {error}")
                return decide(body)

            return Later(after_loading)

        def decide(body: bytes) -> Response:
            if len(body) > max_batch:
                return failure(413, "BODY_TOO_BIG", f"a batch is at most {max_batch} bytes")
            batch = stream_rows.decode_publish_rows(body, max_row)
            if isinstance(batch, stream_rows.Invalid):
                return failure(400, "BAD_ROW", f"row {batch.row}: {batch.reason}")
            count = len(batch.bodies)
            try:
                own_topics = {number: _valid_name(extra.topic.encode(), "topic")
                              for number, extra in batch.extras.items() if extra.topic}
            except BadRequest as bad:
                return bad.response
            if default_topic is None and len(own_topics) < count:
                return failure(400, "MISSING_ARG_TOPIC", "a row without a topic needs the topic parameter")
            if self.engine.storage.failure is not None:
                return failure(503, "EXITING", f"the store failed: {self.engine.storage.failure}")
            dedup = self.engine.dedup
            wanted = dedup.unseen(group, first, first + count) if group is not None else [(first, first + count)]
            refusal = self._full_queue(wanted, first, own_topics, default_topic)
            if refusal is not None:
                return failure(QUEUE_FULL_STATUS, "QUEUE_FULL", refusal)
            published = 0
            for start, end in wanted:
                published += self._publish_rows(batch, own_topics, default_topic, start - first, end - first)
            self.traffic.messages_in += published
            answer = go_json({"published": published, "duplicates": count - published})
            if group is None:
                return Response(200, answer, JSON_TYPE, after_sync=True)
            dedup.remember(group, wanted, store=False)  # at once: a concurrent replay is held back too
            return Response(200, answer, JSON_TYPE, after_sync=True, then=lambda: dedup.store_group(group))

        return NeedBody(max_batch + 1, complete)

    def _full_queue(self, wanted: list[tuple[int, int]], first: int, own_topics: dict[int, str],
                    default_topic: str | None) -> str | None:
        """Why the rows about to be published must be refused: a queue bound to one of their topics that
        the depth policy (--max-queue-depth, reject) keeps full; None when they may all go."""
        counts: dict[str, int] = {}
        for start, end in wanted:
            if not own_topics:
                assert default_topic is not None
                counts[default_topic] = counts.get(default_topic, 0) + end - start
                continue
            for number in range(start - first, end - first):
                topic = own_topics.get(number, default_topic)
                assert topic is not None
                counts[topic] = counts.get(topic, 0) + 1
        for topic, rows in counts.items():
            refusal = self.engine.publish_refusal(topic, rows)
            if refusal is not None:
                return refusal
        return None

    def _publish_rows(self, batch: stream_rows.PublishBatch, own_topics: dict[int, str], default_topic: str | None,
                      start: int, end: int) -> int:
        """Publish rows `start` to `end` of `batch` in order, one engine batch per run of rows with the
        same topic; returns how many. Rows without extras carry no headers (the store's fastest record)."""
        bodies, extras = batch.bodies, batch.extras
        if not extras:
            assert default_topic is not None
            self.engine.publish_many(default_topic, bodies[start:end], origin=ORIGIN)
            return end - start
        run = start
        while run < end:
            topic = own_topics.get(run, default_topic)
            stop = run + 1
            while stop < end and own_topics.get(stop, default_topic) == topic:
                stop += 1
            each_headers: list[Any] = []
            for number in range(run, stop):
                extra = extras.get(number)
                headers: dict[str, Any] | None = None
                if extra is not None and (extra.headers or extra.id is not None):
                    headers = dict(extra.headers) if extra.headers else {}
                    if extra.id is not None:
                        headers[PUBLISHER_ID_HEADER] = extra.id  # the publisher's own id (MQKS deliveries show it)
                each_headers.append(headers)
            assert topic is not None
            self.engine.publish_many(topic, bodies[run:stop], each_headers=each_headers, origin=ORIGIN)
            run = stop
        return end - start


def _json(value: dict[str, Any]) -> Response:
    # After the sync: the positions handed out, the stream made and the commit are on disk.
    return Response(200, go_json(value), JSON_TYPE, after_sync=True)


def _json_now(value: dict[str, Any]) -> Response:
    # A shared engine answered: what it was told is kept there already.
    return Response(200, go_json(value), JSON_TYPE)


def _valid_name(raw: bytes, what: str) -> str:
    try:
        name = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise BadRequest(failure(400, f"INVALID_{what.upper()}", f"{what} is not UTF-8")) from None
    if not name or len(raw) > MAX_NAME_BYTES or any(ord(char) < 0x20 or char == "\x7f" for char in name):
        raise BadRequest(failure(400, f"INVALID_{what.upper()}",
                                 f"{what} must be 1 to {MAX_NAME_BYTES} bytes without control characters"))
    return name

