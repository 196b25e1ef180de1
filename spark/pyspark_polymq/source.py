"""The PySpark data source `polymq` (docs/spark.md): streams and batches read from a gateway's
stream endpoints, rows written through its publish endpoint.

Spark's Python workers import this module by name (the partitions and the reader objects are
pickled by reference), so it imports pyspark only and talks to the gateway over HTTP
(clients/stream.py): nothing of the engine runs in Spark.

Replay contract: an offset is `{"positions": {gateway: N, …}}`, a position per gateway (a
checkpoint's older `{"position": N}` is the first gateway's), and `"starts": {gateway: N, …}` for
gateways first read in that micro-batch (where their range begins). A micro-batch is a position range per
gateway that each serves again, with the same rows, until Spark commits its end; only the commit
(after Spark's own commit log) finishes the copies. Writes name each row by a group (writer, batch,
partition) and its number in the partition, and a task always writes to the same gateway, so a
replayed batch publishes only what the gateway did not have.

A cluster is read and written as a whole: `gateway` may name several gateways, or `lookupd` the
nsqlookupd HTTP addresses that list the nodes (clients/lookupd.py): a stream is read on every node
they list, looked up again at each micro-batch, and rows are written to every node they list. Nodes
sharing a JetStream cluster hold one stream between them, read once (`StreamReader`).
"""

from __future__ import annotations

import array
import itertools
import json
import uuid
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from pyspark import TaskContext
from pyspark.sql.datasource import (
    DataSource,
    DataSourceReader,
    DataSourceStreamReader,
    DataSourceStreamWriter,
    DataSourceWriter,
    InputPartition,
    WriterCommitMessage,
)
from pyspark.sql.streaming.datasource import ReadLimit, ReadMaxRows, SupportsTriggerAvailableNow
from pyspark.sql.types import StructType

from polymq.clients import lookupd
from polymq.clients.stream import StreamClient, StreamClientError
from polymq.codecs import stream_rows

NAME = "polymq"
DEFAULT_GATEWAY = "127.0.0.1:4181"  # the gateway's own HTTP listener (--admin-port)
DEFAULT_PARTITIONS = 2
# Rows a micro-batch reads at most unless maxRowsPerTrigger says otherwise: a batch's rows are in
# the gateway's memory until Spark commits it, so a backlog is read a bounded part at a time; and
# each micro-batch costs Spark about 0.17 s of its own, which 100,000 rows left a third of the time.
DEFAULT_MAX_ROWS = 250_000
# Rows a reader task asks for per request: small enough that the gateway serves the next while
# Spark takes this one, large enough that a request's overhead is spread thin.
READ_CHUNK_ROWS = 25_000
ID_HEX_DIGITS = 16  # a message id as the protocols show it: 16 hex digits
# Rows (and bytes) a writer task sends per request: well under the gateway's batch limit (nsqd's
# --max-body-size, 5 MiB), large enough that a request's overhead is spread thin.
WRITE_BATCH_ROWS = 10_000
WRITE_BATCH_BYTES = 4 * 1024 * 1024
# The local properties Spark sets on a micro-batch's jobs: which batch a writer task belongs to, and
# the query's id, which its checkpoint keeps across restarts.
BATCH_ID_PROPERTY = "streaming.sql.batchId"
QUERY_ID_PROPERTY = "sql.streaming.queryId"

SCHEMA = ("position long, topic string, id string, body binary, attempts int, timestamp timestamp, "
          "headers map<string,string>, protocol string")
COLUMNS = ["position", "topic", "id", "body", "attempts", "timestamp", "headers", "protocol"]


class PolymqSourceError(Exception):
    """A misconfigured source or a gateway that refused: the message says which and why."""


@dataclass
class PositionRange(InputPartition):
    """Positions `[start, end)` of one stream on one gateway: what one Spark task reads."""

    gateway: str
    start: int
    end: int
    others: tuple[str, ...]  # gateways of the same cluster that serve the same positions, in turn

    def __init__(self, gateway: str, start: int, end: int, others: tuple[str, ...] = ()) -> None:
        self.gateway, self.start, self.end, self.others = gateway, start, end, others  # InputPartition's takes a value


class DefaultSource(DataSource):
    """`spark.read / readStream / write / writeStream .format("polymq")`."""

    @classmethod
    def name(cls) -> str:
        return NAME

    def schema(self) -> str:
        return SCHEMA

    def reader(self, schema: StructType) -> DataSourceReader:
        return BatchReader(Options.of(self.options))

    def streamReader(self, schema: StructType) -> DataSourceStreamReader:
        return StreamReader(Options.of(self.options))

    def writer(self, schema: StructType, overwrite: bool) -> DataSourceWriter:
        return BatchWriter(Options.of(self.options), f"spark-write-{uuid.uuid4()}", _fields(schema))

    def streamWriter(self, schema: StructType, overwrite: bool) -> DataSourceStreamWriter:
        return StreamWriter(Options.of(self.options), _fields(schema))


def _addresses(raw: str | None) -> tuple[str, ...]:
    return tuple(address.strip() for address in (raw or "").split(",") if address.strip())


@dataclass(frozen=True)
class Options:
    gateways: tuple[str, ...]
    lookupds: tuple[str, ...]
    spread_writes: bool
    stream: str | None
    queue: str | None
    topics: tuple[str, ...]
    topic: str | None
    partitions: int
    max_rows: int
    fail_on_data_loss: bool
    timeout: float
    writer_id: str | None
    batch_rows: int
    token: str | None = None  # the gateway's token (--admin-token), sent as Authorization: Bearer

    @classmethod
    def of(cls, options: Any) -> Options:
        def number(key: str, default: int | None, minimum: int = 1) -> int | None:
            raw = options.get(key)
            if raw is None:
                return default
            try:
                value = int(raw)
            except ValueError:
                value = minimum - 1
            if value < minimum:
                raise PolymqSourceError(f"option {key} must be an integer >= {minimum}, not {raw!r}")
            return value

        topics = tuple(topic.strip() for topic in (options.get("topics") or "").split(",") if topic.strip())
        def switch(key: str, default: str) -> bool:
            value = str(options.get(key, default)).lower()
            if value not in ("true", "false"):
                raise PolymqSourceError(f"option {key} must be true or false, not {value!r}")
            return value == "true"

        gateways, lookupds = _addresses(options.get("gateway")), _addresses(options.get("lookupd"))
        if gateways and lookupds:
            raise PolymqSourceError("options gateway and lookupd exclude each other: name the gateways, or the "
                                    "lookupds that list them")
        return cls(
            gateways=gateways or (() if lookupds else (DEFAULT_GATEWAY,)),
            lookupds=lookupds,
            spread_writes=switch("spreadWrites", "true"),
            stream=options.get("stream"),
            queue=options.get("queue"),
            topics=topics,
            topic=options.get("topic"),
            partitions=number("partitions", DEFAULT_PARTITIONS) or DEFAULT_PARTITIONS,
            max_rows=number("maxRowsPerTrigger", DEFAULT_MAX_ROWS),
            fail_on_data_loss=switch("failOnDataLoss", "true"),
            timeout=float(options.get("timeout", 30)),
            writer_id=options.get("writerId"),
            batch_rows=number("batchRows", WRITE_BATCH_ROWS) or WRITE_BATCH_ROWS,
            token=options.get("token") or None,
        )

    def client(self, gateway: str) -> StreamClient:
        return StreamClient(gateway, self.timeout, token=self.token)

    def lookup(self, topics: Sequence[str]) -> list[str]:
        """The polymq nodes the lookupds list for `topics` (every node with none), sorted; maybe none."""
        try:
            return lookupd.gateways(self.lookupds, topics, self.timeout)
        except lookupd.DiscoveryError as error:
            raise PolymqSourceError(str(error)) from None

    def nodes(self, topics: Sequence[str]) -> list[str]:
        """The gateways a batch read reads: those named, or those the lookupds list for `topics`
        (every node they know when no topic is given), sorted."""
        if not self.lookupds:
            return sorted(self.gateways)
        found = self.lookup(topics)
        if not found:
            raise PolymqSourceError(f"no polymq gateway listed by lookupd {', '.join(self.lookupds)} holds "
                                    f"{', '.join(topics) or 'anything'} yet")
        return found

    def every_node(self) -> list[str]:
        """The gateways a stream is read from and rows are written to: those named, or every polymq
        node the lookupds list (nsqlookupd's /nodes), whether it holds the topics yet or not, sorted."""
        if not self.lookupds:
            return sorted(self.gateways)
        found = self.lookup(())
        if not found:
            raise PolymqSourceError(f"no polymq gateway is registered with lookupd {', '.join(self.lookupds)}")
        return found

    def stream_name(self) -> str:
        if not self.stream:
            raise PolymqSourceError("option stream is required: the name of the stream (a queue read by position) "
                                    "this query reads")
        return self.stream


# -- reading -------------------------------------------------------------------------------------


def _fetch(options: Options, client: StreamClient, partition: PositionRange | SnapshotRange, begin: int) -> bytes:
    if isinstance(partition, SnapshotRange):
        return client.snapshot_rows(partition.snapshot, begin, partition.end, READ_CHUNK_ROWS, "columns")
    return client.read_batch(options.stream_name(), begin, partition.end, READ_CHUNK_ROWS, "columns")


def _rows(options: Options, partition: PositionRange | SnapshotRange) -> Iterator[Any]:
    """The partition's rows as Arrow record batches, one per read request. A gateway that cannot be
    reached hands over to the next of its cluster (`others`, the same positions), from the next row."""
    gateways = [partition.gateway, *getattr(partition, "others", ())]
    begin = partition.start
    for number, gateway in enumerate(gateways):
        try:
            for buffers in _batches(options, gateway, partition, begin):
                begin = buffers.last_position + 1
                yield _record_batch(buffers, gateway)
            return
        except StreamClientError as error:
            if error.status is not None or number == len(gateways) - 1:
                raise PolymqSourceError(str(error)) from None


def _batches(options: Options, gateway: str, partition: PositionRange | SnapshotRange,
             begin: int) -> Iterator[stream_rows.ColumnBuffers]:
    """The rows of `partition` from `begin` read from `gateway`, each column one buffer of its answer;
    the next answer is fetched while Spark takes this one."""
    with options.client(gateway) as client, ThreadPoolExecutor(1) as ahead:
        pending: Future[bytes] | None = ahead.submit(_fetch, options, client, partition, begin)
        while pending is not None:
            raw = pending.result()
            pending = None
            try:
                buffers = stream_rows.decode_read_column_buffers(raw)
            except ValueError as error:
                raise PolymqSourceError(f"polymq gateway at {gateway}: a broken read answer: {error}") from None
            if not buffers.rows:
                return
            following = buffers.last_position + 1
            if following < partition.end:
                pending = ahead.submit(_fetch, options, client, partition, following)
            yield buffers


def _record_batch(columns: stream_rows.ColumnBuffers, gateway: str) -> Any:
    import pyarrow as pa

    rows, buffer = columns.rows, pa.py_buffer
    ids = array.array("Q")
    ids.frombytes(columns.ids)
    ids.byteswap()  # each id's bytes most significant first: the whole column's hex is every id's
    hex_ids = ids.tobytes().hex().encode("ascii")
    id_ends = array.array("i", range(0, ID_HEX_DIGITS * rows + 1, ID_HEX_DIGITS))
    topics = pa.array([topic.decode("utf-8", "replace") for topic in columns.topics], pa.string())
    origins = pa.array([None, *(origin.decode("ascii", "replace") for origin in columns.origins)], pa.string())
    try:
        batch = pa.RecordBatch.from_arrays([
            pa.Array.from_buffers(pa.int64(), rows, [None, buffer(columns.positions)]),
            topics.take(pa.Array.from_buffers(pa.uint16(), rows, [None, buffer(columns.topic_numbers)])),
            pa.Array.from_buffers(pa.string(), rows, [None, buffer(id_ends), buffer(hex_ids)]),
            pa.Array.from_buffers(pa.binary(), rows, [None, buffer(columns.body_offsets), buffer(columns.bodies)]),
            pa.Array.from_buffers(pa.int32(), rows, [None, buffer(columns.attempts)]),
            pa.Array.from_buffers(pa.timestamp("ns", tz="UTC"), rows, [None, buffer(columns.timestamps_ns)])
              .cast(pa.timestamp("us", tz="UTC"), safe=False),
            _headers_column(columns),
            origins.take(pa.Array.from_buffers(pa.uint8(), rows, [None, buffer(columns.origin_numbers)])),
        ], names=COLUMNS)
        batch.validate(full=True)  # offsets and numbers that do not add up are an error, not a crash
    except (pa.ArrowInvalid, pa.ArrowIndexError) as error:
        raise PolymqSourceError(f"polymq gateway at {gateway}: a broken read answer: {error}") from None
    return batch


def _headers_column(columns: stream_rows.ColumnBuffers) -> Any:
    import pyarrow as pa

    kind = pa.map_(pa.string(), pa.string())
    if not len(columns.headers):  # the common batch: no row has headers
        return pa.nulls(columns.rows, kind)
    ends = array.array("i")
    ends.frombytes(columns.headers_offsets)
    raw = bytes(columns.headers)
    return pa.array([_headers(raw[low:high]) for low, high in itertools.pairwise(ends)], kind)


def _headers(raw: bytes) -> list[tuple[str, str]] | None:
    if not raw:
        return None
    return [(key, value if isinstance(value, str) else json.dumps(value)) for key, value in json.loads(raw).items()]


def _ranges(client: StreamClient, gateway: str, stream: str, start: int, end: int,
            parts: int, others: tuple[str, ...] = ()) -> list[PositionRange]:
    if start >= end:
        return []
    bounds = client.split(stream, start, end, parts)
    return [PositionRange(gateway, low, high, others) for low, high in itertools.pairwise(bounds) if low < high]


def _call(options: Options, gateway: str, action: Any) -> Any:
    """Run `action(client)` on the driver; a gateway's refusal becomes a source error naming it."""
    with options.client(gateway) as client:
        try:
            return action(client)
        except StreamClientError as error:
            raise PolymqSourceError(str(error)) from None


Positions = dict[str, int]


class StreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """One stream of the same name on every gateway, each read by its own positions.

    Gateways sharing one JetStream cluster answer `open` with the same `shared` key: their stream is one,
    with the same positions on each, so it is read once, under that key, through whichever of them
    answers. An offset's positions are by gateway, or by that key.

    With `lookupd` the nodes are looked up again at each micro-batch: the stream is opened on a node
    the first time it is listed, and the first offset that reads it names where it starts there
    (`starts`), so a replay of that micro-batch reads the same range. Positions are not dense (a
    restarted gateway starts a new segment), so a node's position moves only when its range holds
    rows: a restart with nothing new makes no micro-batch."""

    def __init__(self, options: Options) -> None:
        self.options = options
        self.stream = options.stream_name()
        self.target: Positions | None = None  # Trigger.AvailableNow: nothing past this
        self.opened: Positions = {}  # the stream's start on each gateway (or cluster) when this reader opened it
        self.key_of: dict[str, str] = {}  # a gateway -> the key its positions go by: itself, or its cluster's
        self.via: dict[str, list[str]] = {}  # a key -> the gateways that serve it, those listed last first
        self.listed = self._opened_on(options.every_node())
        self.first = self.listed[0]  # an older checkpoint's single position is this gateway's

    def _opened_on(self, nodes: list[str]) -> list[str]:
        """The keys of `nodes`, the stream opened (made and bound to the topics) on those this reader has
        not seen."""
        unreachable: StreamClientError | None = None
        for node in nodes:
            if node not in self.key_of:
                with self.options.client(node) as client:
                    try:
                        answer = client.open(self.stream, self.options.topics)
                    except StreamClientError as error:
                        if error.status is not None:
                            raise PolymqSourceError(str(error)) from None
                        unreachable = error  # down now: read from when it answers, as a node lookupd lists later
                        continue
                key = self.key_of[node] = str(answer.get("shared") or node)
                self.opened.setdefault(key, int(answer["start"]))
        keys = list(dict.fromkeys(self.key_of[node] for node in nodes if node in self.key_of))
        if not keys:
            raise PolymqSourceError(str(unreachable))
        for key in keys:
            serving = [node for node, known in self.key_of.items() if known == key]
            self.via[key] = sorted(serving, key=lambda node: node not in nodes)  # those listed now first
        return keys

    def _call(self, key: str, action: Any) -> Any:
        """Run `action(client, gateway)` on a gateway that serves `key`: the first that answers (the
        gateways of one cluster stand in for each other); a gateway's refusal is a source error."""
        unreachable: StreamClientError | None = None
        for gateway in self.via.get(key) or [key]:
            with self.options.client(gateway) as client:
                try:
                    return action(client, gateway)
                except StreamClientError as error:
                    if error.status is not None:
                        raise PolymqSourceError(str(error)) from None
                    unreachable = error
        raise PolymqSourceError(str(unreachable))

    def _end(self, key: str) -> int:
        return int(self._call(key, lambda client, _: client.offsets(self.stream))["end"])

    def _nodes_now(self) -> list[str]:
        """The keys a micro-batch reads: named gateways' as ever; with lookupd, those of the nodes it
        lists now (a node restarting is not listed, and keeps its position), or the last ones when no
        lookupd answers; with Trigger.AvailableNow, those known when the query started."""
        if self.target is not None:
            return sorted(self.target)
        if not self.options.lookupds:
            self.listed = self._opened_on(self.options.every_node())  # a named gateway down at the start: now?
            return self.listed
        try:
            listed = self.options.lookup(())
        except PolymqSourceError:
            return self.listed  # the lookupds are away: the nodes found last are read meanwhile
        self.listed = self._opened_on(listed)
        return self.listed

    def _positions(self, offset: dict[str, Any]) -> Positions:
        if "position" in offset:  # a checkpoint of a single gateway's query
            return {self.first: int(offset["position"])}
        return {node: int(position) for node, position in offset["positions"].items()}

    def _end_after(self, key: str, low: int, rows: int | None) -> tuple[int, bool]:
        """Where a range of `key` from `low` ends (at most `rows` rows), and whether a micro-batch
        must read it: it holds rows, or part of it was committed already (which `partitions` reports)."""
        if rows is None:
            end = self._end(key)
            return end, end > low
        answer = self._call(key, lambda client, _: client.offsets(self.stream, low, rows=rows))
        # The count is of what lies above the committed end; a gateway that does not count (older
        # than the count) is taken at its end.
        holds_rows = int(answer.get("rows", 1)) > 0 or int(answer["committed"]) > low
        return int(answer["end"]), holds_rows

    def initialOffset(self) -> dict[str, Any]:
        return {"positions": dict(self.opened)}

    def getDefaultReadLimit(self) -> ReadLimit:
        return ReadMaxRows(self.options.max_rows)

    def prepareForTriggerAvailableNow(self) -> None:
        self.target = {key: self._end(key) for key in self._nodes_now()}

    def latestOffset(self, start: dict[str, Any], limit: ReadLimit) -> dict[str, Any]:
        begin = self._positions(start)
        nodes = self._nodes_now()
        # A micro-batch's row budget is shared by the gateways.
        rows = -(-limit.max_rows // len(nodes)) if isinstance(limit, ReadMaxRows) and nodes else None
        merged = dict(begin)  # a gateway of the checkpoint not listed now keeps its position
        starts: Positions = {}
        for node in nodes:
            low = begin.get(node, self.opened[node])
            end, holds_rows = self._end_after(node, low, rows)
            if self.target is not None and end > self.target[node]:
                end, holds_rows = self.target[node], self.target[node] > low
            if not holds_rows or end <= low:
                continue
            merged[node] = end
            if node not in begin:
                starts[node] = low  # a node new to the query: its rows from the stream's start there
        if merged == begin:
            return start  # nothing new: the offset Spark has, so it plans no micro-batch
        return {"positions": merged, "starts": starts} if starts else {"positions": merged}

    def reportLatestOffset(self) -> dict[str, Any]:
        return {"positions": {key: self._end(key) for key in self.listed}}

    def partitions(self, start: dict[str, Any], end: dict[str, Any]) -> Sequence[InputPartition]:
        begin, until = self._positions(start), self._positions(end)
        starts = {node: int(position) for node, position in end.get("starts", {}).items()}
        planned: list[PositionRange] = []
        for node, high in until.items():
            low = begin.get(node, starts.get(node, high))
            if low >= high:
                continue

            def plan(client: StreamClient, gateway: str, node: str = node, low: int = low,
                     high: int = high) -> list[PositionRange]:
                committed = int(client.offsets(self.stream)["committed"])
                if low < committed:
                    if self.options.fail_on_data_loss:
                        raise PolymqSourceError(
                            f"stream {self.stream} at {node}: positions {low} to {committed} were committed and "
                            f"are gone (set failOnDataLoss to false to read on from {committed})")
                    low = committed
                others = tuple(other for other in self.via.get(node, ()) if other != gateway)
                return _ranges(client, gateway, self.stream, low, high, self.options.partitions, others)

            planned += self._call(node, plan)
        return planned

    def read(self, partition: InputPartition) -> Iterator[tuple[Any, ...]]:
        assert isinstance(partition, PositionRange)
        return _rows(self.options, partition)

    def commit(self, end: dict[str, Any]) -> None:
        # A node not listed now (restarting) is committed with a later micro-batch: a commit finishes
        # everything below its end.
        for node, position in self._positions(end).items():
            if node in self.listed:
                self._call(node, lambda client, _, position=position: client.commit(self.stream, position))


@dataclass
class SnapshotRange(InputPartition):
    """Rows `[start, end)` of a snapshot of a queue on one gateway: what one Spark task of a batch
    read reads."""

    gateway: str
    snapshot: str
    start: int
    end: int

    def __init__(self, gateway: str, snapshot: str, start: int, end: int) -> None:
        self.gateway, self.snapshot, self.start, self.end = gateway, snapshot, start, end


class BatchReader(DataSourceReader):
    """With `stream`: what the stream holds now, from its start to its end. With `queue` (any
    queue, a stream too): a snapshot of every message it holds, taken as the read is planned. Either
    way nothing is consumed or committed."""

    def __init__(self, options: Options) -> None:
        self.options = options
        if not options.stream and not options.queue:
            raise PolymqSourceError("option stream or queue is required: what the batch read reads")

    def partitions(self) -> Sequence[InputPartition]:
        options = self.options
        planned: list[InputPartition] = []
        # Gateways of one JetStream cluster answer with the same `shared` key: what they hold is one, read once.
        seen: set[str] = set()
        if options.queue:
            for node in options.nodes(()):
                def take(client: StreamClient, node: str = node) -> list[SnapshotRange]:
                    taken = client.snapshot(str(options.queue))
                    if taken.get("shared") in seen:
                        client.snapshot_close(taken["snapshot"])
                        return []
                    seen.add(str(taken.get("shared") or node))
                    rows, parts = int(taken["rows"]), options.partitions
                    bounds = sorted({rows * part // parts for part in range(parts + 1)})
                    return [SnapshotRange(node, taken["snapshot"], low, high)
                            for low, high in itertools.pairwise(bounds) if low < high]

                planned += _call(options, node, take)
            return planned
        stream = options.stream_name()
        for node in options.nodes(options.topics):
            def plan(client: StreamClient, node: str = node) -> list[PositionRange]:
                offsets = client.offsets(stream)
                if offsets.get("shared") in seen:
                    return []
                seen.add(str(offsets.get("shared") or node))
                return _ranges(client, node, stream, int(offsets["start"]), int(offsets["end"]), options.partitions)

            planned += _call(options, node, plan)
        return planned

    def read(self, partition: InputPartition) -> Iterator[Any]:
        assert isinstance(partition, PositionRange | SnapshotRange)
        return _rows(self.options, partition)


# -- writing -------------------------------------------------------------------------------------


@dataclass
class Written(WriterCommitMessage):
    published: int
    duplicates: int


def _fields(schema: StructType) -> tuple[str, ...]:
    names = tuple(field.name for field in schema.fields)
    if "body" not in names:
        raise PolymqSourceError(f"a polymq write needs a body column (binary or string); the columns are {names}")
    return names


def _gateway_of_task(options: Options, nodes: Sequence[str], partition: int) -> str:
    """The gateway a task writes to: the same one for every try of the task (its replays are
    de-duplicated there); tasks take the gateways in turn, or all the first with spreadWrites false."""
    return nodes[partition % len(nodes)] if options.spread_writes else nodes[0]


def _publish(options: Options, nodes: Sequence[str], fields: tuple[str, ...], rows: Iterator[Any], group: str,
             partition: int) -> Written:
    """Publish a task's rows in batches; row n of the task is number n of `group`."""
    if options.topic is None and "topic" not in fields:
        raise PolymqSourceError("option topic (or a topic column) is required: where the rows are published")
    at = {name: index for index, name in enumerate(fields)}
    body_at, topic_at, id_at, headers_at = at["body"], at.get("topic"), at.get("id"), at.get("headers")
    published = duplicates = 0
    with options.client(_gateway_of_task(options, nodes, partition)) as client:
        batch: list[bytes] = []
        size = first = number = 0

        def flush() -> None:
            nonlocal published, duplicates, batch, size, first
            if batch:
                try:
                    answer = client.publish(batch, options.topic, group, first)
                except StreamClientError as error:
                    raise PolymqSourceError(str(error)) from None
                published += int(answer["published"])
                duplicates += int(answer["duplicates"])
            batch, size, first = [], 0, number

        for row in rows:
            body = row[body_at]
            if body is None:
                raise PolymqSourceError(f"row {number} of {group} has no body (null)")
            if isinstance(body, str):
                body = body.encode()
            headers = row[headers_at] if headers_at is not None else None
            encoded = stream_rows.encode_publish_row(
                bytes(body), message_id=row[id_at] if id_at is not None else None,
                topic=row[topic_at] if topic_at is not None else None, headers=dict(headers) if headers else None)
            batch.append(encoded)
            size += len(encoded)
            number += 1
            if len(batch) >= options.batch_rows or size >= WRITE_BATCH_BYTES:
                flush()
        flush()
    return Written(published, duplicates)


class BatchWriter(DataSourceWriter):
    def __init__(self, options: Options, write_id: str, fields: tuple[str, ...]) -> None:
        self.options, self.write_id, self.fields = options, write_id, fields
        # Looked up once, on the driver: every try of a task finds the same list, so the same node.
        self.nodes = options.every_node()

    def write(self, iterator: Iterator[Any]) -> Written:
        context = TaskContext.get()
        partition = context.partitionId() if context is not None else 0
        # A retried task publishes only what its failed try did not.
        return _publish(self.options, self.nodes, self.fields, iterator, f"{self.write_id}/{partition}", partition)


class StreamWriter(DataSourceStreamWriter):
    """Rows of micro-batch B, partition P are numbered in group `<writer>/B/P`, the writer being the
    query's id (kept in its checkpoint) unless option writerId names it."""

    def __init__(self, options: Options, fields: tuple[str, ...]) -> None:
        self.options, self.fields = options, fields
        # Looked up once as the query starts: every try of a micro-batch's tasks finds the same list (a
        # replay after a restart too, while the lookupds list the same nodes).
        self.nodes = options.every_node()

    def write(self, iterator: Iterator[Any]) -> Written:
        context = TaskContext.get()
        if context is None:
            raise PolymqSourceError("a streaming write runs in a Spark task")
        batch_id = context.getLocalProperty(BATCH_ID_PROPERTY)
        writer = self.options.writer_id or context.getLocalProperty(QUERY_ID_PROPERTY)
        if batch_id is None or writer is None:
            raise PolymqSourceError(f"Spark did not say which query and micro-batch this is ({QUERY_ID_PROPERTY}, "
                                    f"{BATCH_ID_PROPERTY})")
        partition = context.partitionId()
        return _publish(self.options, self.nodes, self.fields, iterator,
                        f"spark-stream-{writer}/{batch_id}/{partition}", partition)

    def commit(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        pass  # every row is published and stored by the time its task ends

    def abort(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        pass  # what was published stays; the replay of this batch publishes the rest only
