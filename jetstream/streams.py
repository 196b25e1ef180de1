"""Streams (queues read by position: the Spark source, docs/spark.md) on JetStream, the same on every node.

On the embedded store a stream is a queue of one node, its positions that node's. On JetStream every
node must hand out the same positions and read the same rows at them, whichever node published them:

- A stream reads one topic, and its positions are the sequences of the topic's JetStream stream. The
  rows of `[begin, until)` are the messages on the topic's subject with those sequences, read with
  JetStream's batched direct gets. Any replica may answer one; a replica that has not applied the
  range's tail yet answers short, so when a read ends early the stream's leader is asked whether a row
  lies beyond it, and the read goes on until it has them all.
- The stream holds its rows with a durable consumer of the topic's stream that nothing reads from,
  `polymq-stream__<name>__<start>`: the topic's stream keeps what some consumer still wants (interest
  retention), and that consumer wants everything from `start` on.
- A commit to `until` makes the consumer that starts at `until`, then deletes the older ones; JetStream
  then drops what no queue wants any more. The committed end is the lowest start, so a node that died
  between the two steps leaves the range readable, as an uncommitted range must be.
- Which topic a stream reads is kept in the key-value bucket `POLYMQ_STREAMS` (`nats kv` reads it),
  so any node serves a stream another node opened.

Positions are not dense (the topic's stream holds its queues' put-back copies too), as on the embedded
store after a restart: only counts say whether a range holds rows.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import attrs
import trio

from polymq.core.dedup import KEPT_DEDUP
from polymq.core.message import Message
from polymq.core.shared import Stored
from polymq.core.streams import MESSAGE_OVERHEAD, PositionsGone, SnapshotTooLarge, StreamError
from polymq.jetstream import api, kv
from polymq.jetstream.nats_connection import Msg, NatsConnection, NatsError, RequestTimeout

if TYPE_CHECKING:
    from polymq.core.shared import SharedEngine
    from polymq.jetstream.backend import JetStreamLink

BUCKET = "POLYMQ_STREAMS"
# Publish de-duplication (rows written by a Spark job, `core/dedup.py`), a key per group, kept for the
# node's de-duplication window: any node knows what a replayed group already published.
DEDUP_BUCKET = "POLYMQ_DEDUP"
CONSUMER_PREFIX = "polymq-stream__"
# Messages one direct get asks for: a page of a reader's batch (nats-server answers each as a message).
DIRECT_BATCH = 1000
# A read a replica answered short is asked again this often until the stream's leader agrees it is
# whole (within the API deadline): replicas apply a quorum's writes within milliseconds.
LAGGING_RETRY_S = 0.02
# Status lines of a direct get's answers (nats-server): the end of a batch, and nothing at or after `seq`.
END_OF_BATCH = 204
NOT_FOUND = 404


@attrs.frozen(slots=True)
class Found:
    """The first message on the topic's subject at or after a sequence, and how many follow it."""

    seq: int
    pending: int


class JetStreamStreams:
    """The stream API's calls on a node on JetStream (each one awaits the cluster)."""

    def __init__(self, link: JetStreamLink, engine: SharedEngine) -> None:
        self.link = link
        self.connection = link.connection
        self.engine = engine
        self.topics: dict[str, str] = {}  # stream -> its topic, as kept in the bucket
        self._buckets: set[str] = set()  # key-value buckets made (or found) by this node
        self._direct_ready: set[str] = set()  # topics whose stream answers direct gets

    # -- the calls ------------------------------------------------------------------------------

    async def open(self, name: str, topics: Iterable[str]) -> dict[str, Any]:
        """The stream `name` of one topic, made if missing: from the topic's backlog if no queue took it
        yet (as a queue would), else from what comes next."""
        kept = await self._kept_topic(name)
        wanted = list(dict.fromkeys(topics))
        if kept is None and len(wanted) != 1:
            raise StreamError(f"stream {name}: a stream on JetStream reads exactly one topic; name it when the "
                              f"stream is opened (got {len(wanted)})")
        topic = kept if kept is not None else wanted[0]
        if wanted and wanted != [topic]:
            raise StreamError(f"stream {name} reads topic {topic}: on JetStream a stream reads one topic")
        consumer_name(name, 0)  # refused before anything is made when too long
        self.engine.ensure_topic(topic)  # on this node too: nsqlookupd lists it here
        await self.link.stream_made(topic)
        info = await self._stream_info(topic)
        if not await self._starts(name, topic):
            names = await api.consumer_names(self.connection, topic)
            backlog = api.BACKLOG_CONSUMER in names
            state = info.get("state") or {}
            last = int(state.get("last_seq", 0))
            start = max(int(state.get("first_seq") or 1), 1) if backlog and state.get("messages") else last + 1
            await self._make_consumer(name, topic, start)
            if backlog:  # this stream took the backlog over, as a first queue does
                await api.delete_consumer(self.connection, topic, api.BACKLOG_CONSUMER)
        if kept is None:
            await self._keep_topic(name, topic)
        return await self.positions(name)

    async def positions(self, name: str) -> dict[str, Any]:
        topic = await self._topic_of(name)
        starts = await self._starts(name, topic)
        if not starts:
            raise StreamError(f"no stream {name}")
        info = await self._stream_info(topic)
        committed = starts[0]
        end = max(int((info.get("state") or {}).get("last_seq", 0)) + 1, committed)
        cluster = (info.get("cluster") or {}).get("name", "")
        return {"stream": name, "topics": [topic], "start": committed, "end": end, "committed": committed,
                # Every node of one cluster answers the same: a reader reads the stream once, on any of them.
                "shared": f"jetstream:{cluster}:{info.get('created', '')}"}

    async def range_after(self, name: str, begin: int, rows: int | None) -> tuple[dict[str, Any], int, int]:
        """The positions, the end of a range from `begin` holding at most `rows` rows (None: every row there
        is, not counted: -1), and how many it holds."""
        positions = await self.positions(name)
        latest, topic = positions["end"], positions["topics"][0]
        begin = max(begin, positions["committed"])
        if rows is None:
            return positions, latest, -1
        first = await self._first_at(topic, begin)
        if first is None or first.seq >= latest:
            return positions, latest, 0
        total = first.pending + 1  # rows from `begin` on
        held = total - await self._rows_from(topic, latest)
        if held <= rows:
            return positions, latest, held
        low, high = first.seq + 1, latest  # the smallest end whose range holds `rows` rows
        while low < high:
            middle = (low + high) // 2
            if total - await self._rows_from(topic, middle) >= rows:
                high = middle
            else:
                low = middle + 1
        return positions, low, rows

    async def split(self, name: str, begin: int, until: int, parts: int) -> tuple[list[int], int]:
        """Bounds cutting `[begin, until)` into `parts` ranges of positions, and the rows it holds."""
        positions = await self.positions(name)
        topic = positions["topics"][0]
        rows = await self._rows_from(topic, begin) - await self._rows_from(topic, until) if until > begin else 0
        bounds = [begin]
        for part in range(1, parts):
            bound = begin + (until - begin) * part // parts
            if bound > bounds[-1]:
                bounds.append(bound)
        bounds.append(max(until, begin))
        return bounds, rows

    async def read(self, name: str, begin: int, until: int, limit: int) -> tuple[str, list[Message], list[int]]:
        """The stream's topic, and the rows with `begin <= position < until` in order (at most `limit`)
        with their positions."""
        topic = await self._topic_of(name)
        starts = await self._starts(name, topic)
        if not starts:
            raise StreamError(f"no stream {name}")
        if begin < starts[0]:
            raise PositionsGone(starts[0], f"positions below {starts[0]} of stream {name} were committed "
                                           f"(asked from {begin})")
        if topic not in self._direct_ready:
            await self._stream_info(topic)  # answers direct gets from now on
        messages: list[Message] = []
        positions: list[int] = []
        seq = begin
        with trio.move_on_after(api.API_DEADLINE_S):
            while True:
                while len(messages) < limit and seq < until:
                    wanted = min(DIRECT_BATCH, limit - len(messages), until - seq)
                    page = await self._direct(topic, {"seq": seq, "next_by_subj": api.topic_subject(topic),
                                                      "batch": wanted})
                    for msg, position in page:
                        if position >= until:
                            break
                        messages.append(self._message(topic, msg, position))
                        positions.append(position)
                    if len(page) < wanted or (page and page[-1][1] >= until):
                        seq = page[-1][1] + 1 if page else seq
                        break
                    seq = page[-1][1] + 1
                if len(messages) >= limit or seq >= until:
                    return topic, messages, positions
                beyond = await leader_first_at(self.connection, api.topic_stream(topic), api.topic_subject(topic), seq)
                if beyond is None or beyond >= until:
                    return topic, messages, positions
                await trio.sleep(LAGGING_RETRY_S)  # the replica that answered has not applied it yet
        raise RequestTimeout(f"JetStream's replicas did not serve positions {seq} to {until} of stream {name} "
                             f"within {api.API_DEADLINE_S:.0f} s")

    async def commit(self, name: str, until: int) -> tuple[dict[str, Any], int]:
        """Everything below `until` is done with: the positions after, and how many rows that finished."""
        positions = await self.positions(name)
        topic, committed = positions["topics"][0], positions["committed"]
        until = min(until, positions["end"])
        if until <= committed:
            return positions, 0
        finished = await self._rows_from(topic, committed) - await self._rows_from(topic, until)
        starts = await self._starts(name, topic)
        if until not in starts:
            await self._make_consumer(name, topic, until)
        for start in starts:
            if start < until:
                await api.delete_consumer(self.connection, topic, consumer_name(name, start))
        return await self.positions(name), finished

    # -- publish de-duplication, shared ---------------------------------------------------------------

    async def snapshot(self, name: str, max_read_back: int) -> tuple[list[Message], int, str]:
        """A queue's messages, wherever they are (`jetstream/snapshots.py`); a stream's rows from its start to
        its end."""
        if await self._kept_topic(name) is None:
            return await self.link.snapshots.take(name, max_read_back)
        positions = await self.positions(name)
        messages: list[Message] = []
        begin, read_back = positions["start"], 0
        while begin < positions["end"]:
            _, page, at = await self.read(name, begin, positions["end"], DIRECT_BATCH)
            if not page:
                break
            read_back += sum(len(message.body) + MESSAGE_OVERHEAD for message in page)
            if read_back > max_read_back:
                raise SnapshotTooLarge(f"a snapshot of {name} would read back more than {max_read_back >> 20} MiB")
            messages += page
            begin = at[-1] + 1
        return messages, read_back, positions["shared"]

    async def load_dedup(self, group: str) -> None:
        """What any node published under `group`, known to this node's de-duplication before it decides."""
        await self._make_bucket(DEDUP_BUCKET, max_age_s=self.engine.dedup.window_s)
        record = await self._kv_get(DEDUP_BUCKET, group)
        if record is None:
            return
        known = self.engine.dedup.groups.get(group)
        if known is None or known[1] < float(record.get("at", 0.0)):
            self.engine.dedup.restore([record])

    def keep(self, kind: str, key: str, record: Mapping[str, Any], stored: Stored) -> None:
        """A record kept by key (the engine's store hook): a group's de-duplication goes to the bucket."""
        if kind != KEPT_DEDUP:
            stored(None)
            return
        kv.put_nowait(self.connection, DEDUP_BUCKET, key, json.dumps(record).encode(), stored,
                      timeout=self.link.settings.publish_timeout_s)

    # -- the stream's consumers ---------------------------------------------------------------------

    async def _starts(self, name: str, topic: str) -> list[int]:
        """The starts of the stream's consumers, lowest (the committed end) first."""
        prefix = consumer_name(name, 0)[:-1]
        starts = []
        for consumer in await api.consumer_names(self.connection, topic):
            if consumer.startswith(prefix) and consumer[len(prefix):].isdigit():
                starts.append(int(consumer[len(prefix):]))
        return sorted(starts)

    async def _make_consumer(self, name: str, topic: str, start: int) -> None:
        consumer = consumer_name(name, start)
        config = {
            "durable_name": consumer,
            "filter_subject": api.topic_subject(topic),
            "ack_policy": "explicit",
            "deliver_policy": "by_start_sequence",
            "opt_start_seq": max(start, 1),
            "max_ack_pending": -1,
            "metadata": {"polymq_stream": name},
        }
        await api.ensure_consumer(self.connection, topic, consumer, config)

    # -- which topic a stream reads -------------------------------------------------------------------

    async def _topic_of(self, name: str) -> str:
        topic = await self._kept_topic(name)
        if topic is None:
            raise StreamError(f"no stream {name}")
        return topic

    async def _kept_topic(self, name: str) -> str | None:
        topic = self.topics.get(name)
        if topic is not None:
            return topic
        await self._make_bucket(BUCKET)
        record = await self._kv_get(BUCKET, name)
        topic = record.get("topic") if record is not None else None
        if not isinstance(topic, str):
            return None
        self.topics[name] = topic
        return topic

    async def _keep_topic(self, name: str, topic: str) -> None:
        reply = await self.connection.request(kv.kv_subject(BUCKET, api.token(name)),
                                              json.dumps({"stream": name, "topic": topic}).encode(),
                                              timeout=api.API_DEADLINE_S)
        api.parse_publish_ack(reply.payload)
        self.topics[name] = topic

    async def _kv_get(self, bucket: str, key: str) -> dict[str, Any] | None:
        """The JSON record of `key` in `bucket`; None when there is none."""
        data = await kv.get(self.connection, bucket, kv.kv_subject(bucket, api.token(key)))
        try:
            record = json.loads(data) if data else None
        except ValueError:
            return None
        return record if isinstance(record, dict) else None

    async def _make_bucket(self, bucket: str, *, max_age_s: float = 0.0) -> None:
        if bucket not in self._buckets:
            await kv.ensure_bucket(self.connection,
                                   kv.bucket_config(bucket, self.link.settings.replicas, max_age_s=max_age_s))
            self._buckets.add(bucket)

    # -- reading the topic's stream -------------------------------------------------------------------

    async def _stream_info(self, topic: str) -> dict[str, Any]:
        """The topic's stream as its leader sees it, answering direct gets."""
        stream = api.topic_stream(topic)
        if topic in self._direct_ready:
            return await api.api(self.connection, f"STREAM.INFO.{stream}")
        info = await allow_direct(self.connection, stream)
        self._direct_ready.add(topic)
        return info

    async def _rows_from(self, topic: str, seq: int) -> int:
        """How many rows the topic's stream holds at or after `seq`."""
        found = await self._first_at(topic, seq)
        return 0 if found is None else found.pending + 1

    async def _first_at(self, topic: str, seq: int) -> Found | None:
        page = await self._direct(topic, {"seq": max(seq, 1), "next_by_subj": api.topic_subject(topic), "batch": 1})
        if not page:
            return None
        msg, position = page[0]
        return Found(position, int((msg.headers or {}).get("Nats-Num-Pending", 0)))

    async def _direct(self, topic: str, request: dict[str, Any]) -> list[tuple[Msg, int]]:
        return await direct_get(self.connection, api.topic_stream(topic), request, f"topic {topic}")

    def _message(self, topic: str, msg: Msg, position: int) -> Message:
        return self.link.message_of(topic, msg, attempts=0, fallback_id=position, fallback_timestamp=0)


async def direct_get(connection: NatsConnection, stream: str, request: dict[str, Any],
                     what: str) -> list[tuple[Msg, int]]:
    """One batched direct get of JetStream stream `stream` (`what` it holds, for errors): its messages with their
    sequences, up to the end of the batch."""
    inbox = connection.new_inbox()
    got: list[tuple[Msg, int]] = []
    done = trio.Event()
    failure: list[str] = []

    def on_message(msg: Msg) -> None:
        if msg.status is None:
            got.append((msg, int((msg.headers or {}).get("Nats-Sequence", 0))))
            return
        if msg.status not in (END_OF_BATCH, NOT_FOUND):
            failure.append(f"{msg.status} {msg.description}")
        done.set()

    sid = connection.subscribe(inbox, on_message)
    try:
        with trio.move_on_after(api.API_ATTEMPT_S * 5) as waited:
            connection.publish(f"$JS.API.DIRECT.GET.{stream}", json.dumps(request).encode(), reply=inbox)
            await done.wait()
    finally:
        connection.unsubscribe(sid)
    if waited.cancelled_caught:
        raise RequestTimeout(f"JetStream did not answer a read of {what}")
    if failure:
        raise NatsError(f"JetStream refused a read of {what}: {failure[0]}")
    return got


async def leader_first_at(connection: NatsConnection, stream: str, subject: str, seq: int) -> int | None:
    """The sequence of the first message on `subject` at or after `seq` as the stream's leader has it (a replica
    answering a direct get may not have applied the tail yet)."""
    try:
        answer = await api.api(connection, f"STREAM.MSG.GET.{stream}", {"seq": max(seq, 1), "next_by_subj": subject})
    except api.JetStreamError as error:
        if error.err_code == api.ERR_NO_MESSAGE_FOUND:
            return None
        raise
    return int((answer.get("message") or {}).get("seq", 0))


async def allow_direct(connection: NatsConnection, stream: str) -> dict[str, Any]:
    """The stream's info as its leader has it; made to answer direct gets first if it did not (a stream an
    older release made)."""
    info = await api.api(connection, f"STREAM.INFO.{stream}")
    config = dict(info.get("config") or {})
    if not config.get("allow_direct"):
        config["allow_direct"] = True
        await api.api(connection, f"STREAM.UPDATE.{stream}", config)
    return info


def consumer_name(stream: str, start: int) -> str:
    name = f"{CONSUMER_PREFIX}{api.token(stream)}__{start}"
    if len(name) > api.MAX_NAME_LENGTH - 20:  # room for any start
        raise StreamError(f"stream name too long for JetStream ({len(stream)} characters)")
    return name

