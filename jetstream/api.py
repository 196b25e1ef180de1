"""JetStream's API on a NATS connection: names, streams, consumers, publish acks, pulls and acks.

JetStream is driven by plain NATS messages: requests on `$JS.API.*` with JSON bodies, publishes to
a stream's subjects answered with a JSON publish ack, pull requests on
`$JS.API.CONSUMER.MSG.NEXT.<stream>.<consumer>` whose messages carry an ack subject, and acks
published to that subject (`+ACK`, `-NAK`, `+WPI`, `+TERM`). This module says those in Python; the
backend (`backend.py`) decides what polymq's queues make of them.
"""

from __future__ import annotations

import datetime
import functools
import json
import re
import time
from collections.abc import Callable, Mapping
from typing import Any

import attrs
import trio

from polymq.jetstream.nats_connection import (
    ConnectionLost,
    Msg,
    NatsConnection,
    NatsError,
    NoResponders,
    RequestTimeout,
)

# Subjects and names polymq uses in the cluster; every node of one deployment shares them.
SUBJECT_PREFIX = "polymq.t."
REQUEUE_PREFIX = "polymq.r."  # `polymq.r.<topic>.<queue>`: a copy put back at one queue's tail
STREAM_PREFIX = "POLYMQ_T_"
# The consumer that keeps a topic's messages while no queue is bound to it (nsqd's topic backlog):
# a stream with interest retention keeps nothing nobody is interested in.
BACKLOG_CONSUMER = "polymq-backlog"
# JetStream's limit on stream and consumer names (nats-server's JSMaxNameLen).
MAX_NAME_LENGTH = 255
# The stream nodes draw their number from (message ids unique across nodes).
NODES_STREAM = "POLYMQ_NODES"
NODES_SUBJECT = "polymq.nodes"

# A JetStream API request is asked again until this long has gone by (a leader's election took 5-9 s
# after a kill -9), each try waiting this long for its answer, with this pause between tries.
API_DEADLINE_S = 30.0
API_ATTEMPT_S = 2.0
API_RETRY_S = 0.1

# Headers polymq writes beside a body (NATS header values are text).
HEADER_MSG_ID = "Nats-Msg-Id"  # JetStream's de-duplication key: the engine id, so a retry is dropped
HEADER_TTL = "Nats-TTL"  # per-message TTL (nats-server 2.11+, a stream with allow_msg_ttl)
HEADER_POLYMQ_ID = "Polymq-Id"  # the message's id, where the Nats-Msg-Id is another's (a copy put back, requeued)
HEADER_POLYMQ_TIMESTAMP = "Polymq-Timestamp"  # its own time, where not when the cluster stored it
HEADER_POLYMQ_ORIGIN = "Polymq-Origin"
HEADER_POLYMQ_HEADERS = "Polymq-Headers"  # the engine's headers of the message, as JSON
# The id its publisher chose, when the message has no other engine headers and the id is plain printable ASCII
# (an MQKS request's id): as it is, not as JSON, which cost a node an encoding a publish and a decoding a delivery.
HEADER_POLYMQ_PUBLISHER = "Polymq-Publisher-Id"
HEADER_POLYMQ_EXPIRES = "Polymq-Expires"  # wall-clock ns after which the copy is not delivered
HEADER_POLYMQ_ATTEMPTS = "Polymq-Attempts"  # deliveries a copy put back at a queue's tail had before
HEADER_TIME_STAMP = "Nats-Time-Stamp"  # when JetStream stored a message, in a direct get's answer
# An atomic batch's headers, which JetStream keeps with each message it stores.
HEADER_BATCH_ID = "Nats-Batch-Id"
HEADER_BATCH_SEQUENCE = "Nats-Batch-Sequence"
# In a batch's id, before the first message's id and origin: the messages of it that carry no id of their own
# have the first one's id plus their place in it, and its origin (jetstream/batches.py).
BATCH_FIRST_MARK = "-id"

# Acks, as nats-server reads them from a delivery's reply subject.
ACK = b"+ACK"
NAK = b"-NAK"
PROGRESS = b"+WPI"
TERM = b"+TERM"

_SAFE = re.compile(rb"[A-Za-z0-9-]")


class JetStreamError(NatsError):
    """An API call JetStream answered with an error (its code, err_code and description)."""

    def __init__(self, code: int, err_code: int, description: str) -> None:
        super().__init__(f"JetStream error {code}/{err_code}: {description}")
        self.code = code
        self.err_code = err_code
        self.description = description


# err_codes of nats-server (server/errors.json) the backend tells apart.
ERR_STREAM_NOT_FOUND = 10059
ERR_CONSUMER_NOT_FOUND = 10014
ERR_STREAM_NAME_IN_USE = 10058
ERR_NO_MESSAGE_FOUND = 10037
# "no suitable peers for placement": a server of a cluster just started (or restarting) is not known to the
# meta leader yet; asked again, as a request nobody answered.
ERR_NO_SUITABLE_PEERS = 10005
# "JetStream system temporarily unavailable": the cluster has no meta leader for the moment (a server
# was just killed or restarted); asked again too.
ERR_JETSTREAM_UNAVAILABLE = 10008
# "invalid reset: not allowed": a consumer started with "new" cannot be reset to a sequence.
ERR_RESET_NOT_ALLOWED = 10204
# The refusals that last only while a cluster forms or elects its leaders.
PASSING_REFUSALS = frozenset((ERR_NO_SUITABLE_PEERS, ERR_JETSTREAM_UNAVAILABLE))
# Names whose tokens are kept: every publish and delivery names its topic's subject, and a byte-by-byte escape
# each time cost a node more than a tenth of its CPU under many small publishes.
TOKENS_KEPT = 4096


@functools.lru_cache(maxsize=TOKENS_KEPT)
def token(name: str) -> str:
    """`name` as one NATS subject token and stream or consumer name: letters, digits and `-` stay,
    every other byte of its UTF-8 is `_` and two hex digits (so `.`, `*`, `>`, spaces and `_` itself
    can never split or widen a subject, and two names never share a token)."""
    out = []
    for byte in name.encode():
        char = bytes((byte,))
        out.append(char.decode() if _SAFE.fullmatch(char) else f"_{byte:02X}")
    return "".join(out)


def untoken(token_: str) -> str:
    """The name `token` made: `_XX` back to its byte (ValueError for what `token` never makes)."""
    out = bytearray()
    index = 0
    while index < len(token_):
        char = token_[index]
        if char == "_":
            digits = token_[index + 1:index + 3]
            if len(digits) != 2 or digits.upper() != digits:
                raise ValueError(f"not a token of a name: {token_!r}")
            out.append(int(digits, 16))
            index += 3
        elif _SAFE.fullmatch(char.encode()):
            out += char.encode()
            index += 1
        else:
            raise ValueError(f"not a token of a name: {token_!r}")
    return out.decode()


def topic_of_stream(stream: str) -> str | None:
    """The topic whose stream this is, or None for another stream (polymq's buckets, other clients')."""
    if not stream.startswith(STREAM_PREFIX):
        return None
    try:
        return untoken(stream[len(STREAM_PREFIX):])
    except (ValueError, UnicodeDecodeError):
        return None


def topic_subject(topic: str) -> str:
    return SUBJECT_PREFIX + token(topic)


def topic_stream(topic: str) -> str:
    return STREAM_PREFIX + token(topic)


def queue_consumer(queue: str) -> str:
    return token(queue)


def _answer(payload: bytes) -> dict[str, Any]:
    """An API answer's JSON, or its error raised."""
    data = json.loads(payload)
    error = data.get("error")
    if error:
        raise JetStreamError(int(error.get("code", 0)), int(error.get("err_code", 0)),
                             str(error.get("description", "")))
    return data


async def api(connection: NatsConnection, subject: str, body: Mapping[str, Any] | None = None,
              *, timeout: float = API_DEADLINE_S) -> dict[str, Any]:
    """One `$JS.API.` request; its answer, or `JetStreamError`. Asked again while nobody answers within
    `timeout` in all: a stream or consumer electing its leader leaves requests it should answer unanswered,
    a request whose server went away is asked again of the next one, a cluster still forming may
    have no peers to place a stream on yet, and one that lost a server may have no meta leader for a
    moment."""
    payload = b"" if body is None else json.dumps(body).encode()
    last: RequestTimeout | NoResponders | ConnectionLost | JetStreamError = RequestTimeout("no try")
    with trio.move_on_after(timeout):
        while True:
            try:
                reply = await connection.request("$JS.API." + subject, payload, timeout=API_ATTEMPT_S)
                return _answer(reply.payload)
            except (RequestTimeout, NoResponders, ConnectionLost) as error:
                last = error
            except JetStreamError as error:
                if error.err_code not in PASSING_REFUSALS:
                    raise
                last = error
            await trio.sleep(API_RETRY_S)
    if isinstance(last, JetStreamError):
        raise last
    raise type(last)(f"JetStream did not answer $JS.API.{subject} within {timeout:.0f} s")


@attrs.frozen(slots=True)
class StreamSettings:
    """What every topic stream of a deployment shares."""

    replicas: int = 3
    # Seconds JetStream remembers a Nats-Msg-Id: a publish retried within it is stored once.
    duplicate_window_s: float = 120.0  # nats-server's default
    max_msg_size: int = -1


def stream_config(topic: str, settings: StreamSettings) -> dict[str, Any]:
    return {
        "name": topic_stream(topic),
        "subjects": [topic_subject(topic), f"{REQUEUE_PREFIX}{token(topic)}.*"],
        "retention": "interest",  # a message stays until every queue bound to its topic has it done
        "storage": "file",
        "num_replicas": settings.replicas,
        "discard": "old",
        "duplicate_window": int(settings.duplicate_window_s * 1e9),
        "max_msg_size": settings.max_msg_size,
        "allow_msg_ttl": True,
        "allow_direct": True,  # a stream read by position (jetstream/streams.py) is read with direct gets
        "allow_atomic": True,  # several messages published at once are stored all or none (jetstream/batches.py)
        "metadata": {"polymq_topic": topic},
    }


async def ensure_stream(connection: NatsConnection, topic: str, settings: StreamSettings) -> None:
    """Make the topic's stream unless it exists. A create of an existing stream with the same settings
    succeeds, and the meta leader answers it: no stream leader has to be up (an info request needs one). One
    made with other settings (another release, a changed `--jetstream-replicas`) is used as it is, made to
    take atomic batches and direct gets if it did not."""
    config = stream_config(topic, settings)
    try:
        await api(connection, f"STREAM.CREATE.{config['name']}", config)
    except JetStreamError as error:
        if error.err_code != ERR_STREAM_NAME_IN_USE:  # made with other settings (another release): use it
            raise
        info = await api(connection, f"STREAM.INFO.{config['name']}")
        found = dict(info.get("config") or {})
        if not (found.get("allow_atomic") and found.get("allow_direct")):  # what this release needs of it
            found.update(allow_atomic=True, allow_direct=True)
            await api(connection, f"STREAM.UPDATE.{config['name']}", found)


async def delete_stream(connection: NatsConnection, topic: str) -> bool:
    try:
        await api(connection, f"STREAM.DELETE.{topic_stream(topic)}")
    except JetStreamError as error:
        if error.err_code == ERR_STREAM_NOT_FOUND:
            return False
        raise
    return True


def requeue_subject(topic: str, queue: str) -> str:
    """Where a copy put back at the tail of one queue goes: a subject of the topic's stream only that
    queue's consumer reads (PHPMQ's 005)."""
    return f"{REQUEUE_PREFIX}{token(topic)}.{token(queue)}"


# Consumer metadata: the queue a consumer is (its name as given; the consumer's name is its token), the
# queue's settings as JSON (`Engine._queue_options`: what another node needs to make the same queue), and
# "1" for an NSQ ephemeral channel's consumer (in memory, gone once no node reads it).
QUEUE_METADATA = "polymq_queue"
OPTIONS_METADATA = "polymq_options"
EPHEMERAL_METADATA = "polymq_ephemeral"
# An ephemeral channel's consumer that no node has asked anything of for this long is deleted by the
# servers (a node that died with its clients leaves none behind). A node whose last client of it leaves
# deletes it at once when no other node reads it.
EPHEMERAL_INACTIVE_S = 30.0


def consumer_config(name: str, *, topic: str, ack_wait_s: float, start_seq: int,
                    queue: str | None = None, options: str | None = None, ephemeral: bool = False) -> dict[str, Any]:
    """A queue's consumer reads the topic's subject and its own requeue subject; the backlog's (no `queue`)
    the topic's subject only. It starts at the stream's first message (`start_seq` 0) or at `start_seq`
    (the stream's next one, `next_sequence`: JetStream's "new", but one a reset may move forward, as
    an emptied queue's is). An ephemeral channel's keeps its state in memory (its replicas must be the
    stream's: JetStream refuses fewer on a stream with interest retention)."""
    filters = [topic_subject(topic)] if queue is None else [topic_subject(topic), requeue_subject(topic, queue)]
    metadata = {QUEUE_METADATA: queue if queue is not None else ""}
    if options is not None:
        metadata[OPTIONS_METADATA] = options
    config: dict[str, Any] = {
        "durable_name": name,
        "filter_subjects": filters,
        "ack_policy": "explicit",
        "ack_wait": int(ack_wait_s * 1e9),
        "max_deliver": -1,  # polymq counts attempts itself and dead-letters (then +TERM)
        "deliver_policy": "by_start_sequence" if start_seq else "all",
        "replay_policy": "instant",
        "max_ack_pending": -1,
        "max_waiting": 512,  # pull requests waiting at once (nats-server's default)
        "metadata": metadata,
    }
    if start_seq:
        config["opt_start_seq"] = start_seq
    if ephemeral:
        metadata[EPHEMERAL_METADATA] = "1"
        config["mem_storage"] = True
        config["inactive_threshold"] = int(EPHEMERAL_INACTIVE_S * 1e9)
    return config


async def _paged(connection: NatsConnection, subject: str, field: str, body: Mapping[str, Any]) -> list[Any]:
    """Every item of a listing JetStream answers page by page (`offset`, `total`)."""
    items: list[Any] = []
    while True:
        answer = await api(connection, subject, {**body, "offset": len(items)})
        page = list(answer.get(field) or [])
        items += page
        if not page or len(items) >= int(answer.get("total", 0)):
            return items


async def consumer_names(connection: NatsConnection, topic: str) -> list[str]:
    """The consumers of the topic's stream, as the meta leader knows them (no consumer leader needed)."""
    try:
        return await _paged(connection, f"CONSUMER.NAMES.{topic_stream(topic)}", "consumers", {})
    except JetStreamError as error:
        if error.err_code == ERR_STREAM_NOT_FOUND:
            return []
        raise


async def stream_names(connection: NatsConnection, subject: str) -> list[str]:
    """Every stream that takes messages on `subject` (wildcards allowed)."""
    return await _paged(connection, "STREAM.NAMES", "streams", {"subject": subject})


@attrs.frozen(slots=True)
class ConsumerListing:
    """A stream's consumers as CONSUMER.LIST gave them: their infos, and the names of those whose leaders did
    not answer in time or are offline (in a cluster under load the list leaves them out: they exist)."""

    infos: list[dict[str, Any]]
    unread: frozenset[str]


async def consumer_list(connection: NatsConnection, topic: str) -> ConsumerListing | None:
    """Every consumer of the topic's stream with its settings and counts (num_pending: messages it has not
    been given), page by page; None when the stream does not exist."""
    consumers: list[dict[str, Any]] = []
    unread: set[str] = set()
    while True:
        try:
            answer = await api(connection, f"CONSUMER.LIST.{topic_stream(topic)}", {"offset": len(consumers)})
        except JetStreamError as error:
            if error.err_code == ERR_STREAM_NOT_FOUND:
                return None
            raise
        page = list(answer.get("consumers") or [])
        consumers += page
        unread.update(answer.get("missing") or ())
        unread.update(answer.get("offline") or {})
        if not page or len(consumers) + len(unread) >= int(answer.get("total", 0)):
            break
    if not consumers and not unread:  # JetStream lists no consumers, without an error, for a missing stream
        try:
            await api(connection, f"STREAM.INFO.{topic_stream(topic)}")
        except JetStreamError as error:
            if error.err_code == ERR_STREAM_NOT_FOUND:
                return None
            raise
    return ConsumerListing(consumers, frozenset(unread))


async def ensure_consumer(connection: NatsConnection, topic: str, name: str, config: Mapping[str, Any]) -> None:
    """Make the durable consumer `name` of the topic's stream unless it exists (with these settings or others:
    its start can no longer change)."""
    stream = topic_stream(topic)
    try:
        await api(connection, f"CONSUMER.CREATE.{stream}.{name}", {"stream_name": stream, "config": dict(config)})
    except JetStreamError:
        if name not in await consumer_names(connection, topic):
            raise


async def delete_consumer(connection: NatsConnection, topic: str, name: str) -> bool:
    try:
        await api(connection, f"CONSUMER.DELETE.{topic_stream(topic)}.{name}")
    except JetStreamError as error:
        if error.err_code in (ERR_CONSUMER_NOT_FOUND, ERR_STREAM_NOT_FOUND):
            return False
        raise
    return True


async def consumer_info(connection: NatsConnection, topic: str, name: str) -> dict[str, Any]:
    return await api(connection, f"CONSUMER.INFO.{topic_stream(topic)}.{name}")


# Consumer metadata: stream sequences up to this one were emptied from the queue (`empty_consumer`).
FLOOR_METADATA = "polymq_floor"




# Consumer metadata: "1" while the queue is paused (`set_metadata`).
PAUSED_METADATA = "polymq_paused"
# A paused queue's consumer is paused in JetStream (nats-server 2.11+) until unpaused: a pause needs a
# deadline, this far ahead (Go's durations end at 292 years).
PAUSE_FOR_S = 100 * 365 * 86400


# A clustered server answers a pause once the meta leader proposed it, before the consumer's leader holds
# it (nats-server 2.15: 14 of 30 pull requests sent right after the answer were served); the consumer's
# info, which its leader answers, says when it does. Asked this often, for this long at most.
PAUSE_CHECK_S = 0.02
PAUSE_SETTLE_S = API_DEADLINE_S


async def pause_consumer(connection: NatsConnection, topic: str, name: str, paused: bool) -> None:
    """The cluster's own pause: no node is given the consumer's messages while it holds (pull requests
    wait), from the return on."""
    body: dict[str, Any] = {}
    if paused:
        until = time.time() + PAUSE_FOR_S
        body["pause_until"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(until))
    await api(connection, f"CONSUMER.PAUSE.{topic_stream(topic)}.{name}", body)
    with trio.move_on_after(PAUSE_SETTLE_S):
        while bool((await consumer_info(connection, topic, name)).get("paused")) != paused:
            await trio.sleep(PAUSE_CHECK_S)
        return
    raise RequestTimeout(f"the consumer {name} of {topic_stream(topic)} was not "
                         f"{'paused' if paused else 'unpaused'} within {PAUSE_SETTLE_S:.0f} s")


async def metadata(connection: NatsConnection, topic: str, name: str) -> dict[str, str]:
    info = await consumer_info(connection, topic, name)
    return dict(info.get("config", {}).get("metadata") or {})


async def set_metadata(connection: NatsConnection, topic: str, name: str, values: Mapping[str, str]) -> None:
    """Keep `values` in the consumer's metadata (the rest of its settings unchanged)."""
    stream = topic_stream(topic)
    config = dict((await consumer_info(connection, topic, name))["config"])
    config["metadata"] = {**(config.get("metadata") or {}), **values}
    await api(connection, f"CONSUMER.CREATE.{stream}.{name}",
              {"stream_name": stream, "config": config, "action": "update"})


async def next_sequence(connection: NatsConnection, topic: str) -> int:
    """The sequence the topic's stream gives its next message."""
    state = (await api(connection, f"STREAM.INFO.{topic_stream(topic)}")).get("state", {})
    return int(state.get("last_seq", 0)) + 1


async def empty_consumer(connection: NatsConnection, topic: str, name: str) -> int:
    """Empty the queue of what its consumer holds: JetStream's reset of the consumer to the stream's next
    message (nats-server 2.14+: answered once its leader holds it, copies given out dropped from its
    pending ones), and the stream's last sequence kept as the queue's floor (its metadata), for the nodes
    holding copies given out before. Returns the floor. A consumer made by an older polymq (which started
    it with "new", which JetStream does not reset) keeps only the floor."""
    stream = topic_stream(topic)
    start = await next_sequence(connection, topic)
    try:
        await api(connection, f"CONSUMER.RESET.{stream}.{name}", {"seq": start})
    except JetStreamError as error:
        if error.err_code != ERR_RESET_NOT_ALLOWED:
            raise
    await set_metadata(connection, topic, name, {FLOOR_METADATA: str(start - 1)})
    return start - 1


def pull_subject(topic: str, consumer: str) -> str:
    return f"$JS.API.CONSUMER.MSG.NEXT.{topic_stream(topic)}.{consumer}"


def pull_request(batch: int, expires_s: float, heartbeat_s: float = 0.0) -> bytes:
    body: dict[str, Any] = {"batch": batch, "expires": int(expires_s * 1e9)}
    if heartbeat_s:
        body["idle_heartbeat"] = int(heartbeat_s * 1e9)
    return json.dumps(body).encode()


def nak(delay_s: float) -> bytes:
    """`-NAK`, redelivered after `delay_s` seconds (at once when 0)."""
    if delay_s <= 0:
        return NAK
    return NAK + b" " + json.dumps({"delay": int(delay_s * 1e9)}).encode()


@attrs.frozen(slots=True)
class Delivery:
    """What a delivery's ack subject says: `$JS.ACK.<stream>.<consumer>.<delivered>.<stream seq>.<consumer
    seq>.<ns>.<pending>`, or the form with a domain and an account hash before the stream and a token after."""

    stream: str
    consumer: str
    delivered: int  # how many times JetStream has delivered it: the attempt count
    stream_seq: int
    consumer_seq: int
    timestamp_ns: int
    pending: int  # messages of the consumer still waiting behind this one


def parse_ack_subject(subject: str) -> Delivery:
    parts = subject.split(".")
    if len(parts) == 9 and parts[0] == "$JS" and parts[1] == "ACK":
        fields = parts[2:]
    elif len(parts) >= 11 and parts[0] == "$JS" and parts[1] == "ACK":
        fields = parts[4:11]
    else:
        raise ValueError(f"not a JetStream ack subject: {subject!r}")
    stream, consumer, delivered, stream_seq, consumer_seq, timestamp, pending = fields
    return Delivery(stream, consumer, int(delivered), int(stream_seq), int(consumer_seq), int(timestamp),
                    int(pending))


def parse_publish_ack(payload: bytes) -> tuple[str, int, bool]:
    """(stream, sequence, duplicate) of a publish ack, or its error raised."""
    data = _answer(payload)
    return str(data["stream"]), int(data["seq"]), bool(data.get("duplicate", False))


def parse_batch_ack(payload: bytes) -> int:
    """How many messages an atomic batch's commit stored (its ack's `count`), or its error raised."""
    return int(_answer(payload)["count"])


def publish_failure(reply: Msg | NatsError) -> Exception | None:
    """Why a publish to a stream was not stored (the request failed, or JetStream refused it); None if it was."""
    if isinstance(reply, NatsError):
        return reply
    try:
        parse_publish_ack(reply.payload)
    except (JetStreamError, ValueError, KeyError) as failure:
        return failure
    return None


PublishAck = Callable[[Exception | None], None]


def is_number(text: str) -> bool:
    """Digits int() reads (str.isdigit alone takes "²", which it does not)."""
    return text.isascii() and text.isdigit()


def batch_tag(first_id: int, origin: str | None) -> str:
    """What a batch's id says of its messages that carry no headers of their own (`batch_member`)."""
    return f"{BATCH_FIRST_MARK}{first_id}" + ("" if origin is None else f"-{origin}")


def batch_member(headers: Mapping[str, str]) -> tuple[int, str | None] | None:
    """The id and origin of a message stored in a batch tagged by `batch_tag` without an id of its own: the
    batch's first id plus its place in the batch (its `Nats-Batch-Sequence`, from 1); None if it is none."""
    batch = headers.get(HEADER_BATCH_ID)
    if batch is None:
        return None
    _, mark, tag = batch.partition(BATCH_FIRST_MARK)
    first, _, origin = tag.partition("-")
    place = headers.get(HEADER_BATCH_SEQUENCE, "")
    if not mark or not is_number(first) or not is_number(place):
        return None
    return int(first) + int(place) - 1, origin or None


def stored_at(stamp: str) -> int:
    """Nanoseconds of JetStream's RFC 3339 time stamp."""
    if not stamp:
        return 0
    whole, _, fraction = stamp.rstrip("Z").partition(".")
    try:
        seconds = datetime.datetime.fromisoformat(whole).replace(tzinfo=datetime.UTC).timestamp()
    except ValueError:
        return 0
    return int(seconds) * 1_000_000_000 + int((fraction or "0")[:9].ljust(9, "0"))
