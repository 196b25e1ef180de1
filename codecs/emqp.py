"""eMQP/1.0 (EventMQ) wire codec, sans-IO: ZeroMQ multipart frames in, typed messages out, and back.

Every message is `['', 'eMQP/1.0', COMMAND, msgid, *body]`; on a ROUTER the peer's identity comes
first. Frames are bytes throughout: the original decodes them as UTF-8 and dies on anything else;
here an identity or a frame may be any bytes. The body layouts follow what EventMQ 0.3.13's router
and its real peers send (docs/protocols/emqp.md), not its older protocol page:

- INFORM `[queues_json, peer_type]`: a JSON list of `[weight, name]`, `''` meaning `[[10, "default"]]`;
  peer type `worker` (on the backend) or `scheduler` (on the frontend).
- REQUEST `[queue, headers_csv, json]`; a worker's REPLY `[result, original_msgid]` (the msgid last);
  SCHEDULE and UNSCHEDULE `[queue, headers_csv, interval_secs, json, cron]`; PUBLISH `[topic, json]`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Final

import attrs

VERSION: Final = b"eMQP/1.0"
EMPTY: Final = b""
# Commands (matched exactly; the original lower-cases them on the backend only).
INFORM: Final = b"INFORM"
ACK: Final = b"ACK"
READY: Final = b"READY"
REQUEST: Final = b"REQUEST"
REPLY: Final = b"REPLY"
HEARTBEAT: Final = b"HEARTBEAT"
KBYE: Final = b"KBYE"
KBAI: Final = b"KBAI"  # the protocol page's name for KBYE: accepted, never sent
DISCONNECT: Final = b"DISCONNECT"
SCHEDULE: Final = b"SCHEDULE"
UNSCHEDULE: Final = b"UNSCHEDULE"
PUBLISH: Final = b"PUBLISH"
# Admin socket commands.
STATUS: Final = b"STATUS"
ROUTER_SHOW_WORKERS: Final = b"ROUTER_SHOW_WORKERS"
ROUTER_SHOW_SCHEDULERS: Final = b"ROUTER_SHOW_SCHEDULERS"
WORKER: Final = b"worker"
SCHEDULER: Final = b"scheduler"
# A jobmanager that INFORMs `''` serves this queue at this weight (the original's default).
DEFAULT_QUEUE: Final = b"default"
DEFAULT_WEIGHT: Final = 10
# Headers (one CSV frame).
REPLY_REQUESTED: Final = "reply-requested"
NOHASTE: Final = "nohaste"
RUN_COUNT: Final = "run_count"
TIMEOUT: Final = "timeout"
# What identifies a scheduled job (EventMQ's scheduler hashes these fields of the job).
SCHEDULE_KEY_FIELDS: Final = ("args", "kwargs", "class_args", "class_kwargs", "path", "callable")
# The longest queue or topic name taken. The original has no limit; polymq's names stay within
# this in every protocol (PHPMQ's bound).
MAX_QUEUE_NAME: Final = 1024
# What a refusal's text starts with (a REPLY the original never sends: it drops silently).
ERROR_PREFIX: Final = b"ERROR: "


# What every request brings (its message, a REQUEST, a worker's REPLY) is a dataclass with an
# `__init__` of its own: mypyc compiles those as native classes, built and read without a lookup,
# where an attrs class stays an interpreted one (measured: 133 ns to build one against 29 ns).


@dataclasses.dataclass(init=False)
class Message:
    """One eMQP message: who sent it (the ROUTER's identity frame), its command, msgid and body frames."""

    identity: bytes
    command: bytes
    msgid: bytes
    body: list[bytes]

    def __init__(self, identity: bytes, command: bytes, msgid: bytes, body: list[bytes]) -> None:
        self.identity = identity
        self.command = command
        self.msgid = msgid
        self.body = body


@attrs.define(slots=True)
class Invalid:
    """Frames that are not an eMQP message, or a body the command cannot carry; the adapter logs it."""

    reason: str


@attrs.define(slots=True)
class Inform:
    queues: list[tuple[int, bytes]]  # (weight, queue name) in the order sent
    peer_type: bytes


@dataclasses.dataclass(init=False)
class Request:
    queue: bytes
    headers: bytes  # the CSV frame, passed on unchanged
    payload: bytes  # the JSON frame, passed on unchanged

    def __init__(self, queue: bytes, headers: bytes, payload: bytes) -> None:
        self.queue = queue
        self.headers = headers
        self.payload = payload


@dataclasses.dataclass(init=False)
class WorkerReply:
    result: bytes
    original_msgid: bytes

    def __init__(self, result: bytes, original_msgid: bytes) -> None:
        self.result = result
        self.original_msgid = original_msgid


@attrs.define(slots=True)
class Schedule:
    queue: bytes
    headers: bytes
    interval: int | None  # seconds; None: the cron expression runs it
    payload: bytes
    cron: bytes


@attrs.define(slots=True)
class Publish:
    topic: bytes
    payload: bytes


def parse(frames: list[bytes]) -> Message | Invalid:
    """A message as a ROUTER reads it: `[identity, '', version, COMMAND, msgid, *body]`.

    Fewer than four frames after the identity is no message. The original never looks at the empty
    frame or the version; every real peer sends them right, so anything else is refused here
    rather than guessed at."""
    if len(frames) < 5:
        return Invalid(f"{len(frames)} frames: an eMQP message has an identity and at least 4 more")
    if frames[1]:
        return Invalid("the frame after the identity is not the empty delimiter")
    if frames[2] != VERSION:
        return Invalid(f"protocol version {frames[2][:40]!r}; this broker speaks eMQP/1.0")
    return Message(frames[0], frames[3], frames[4], frames[5:])


def queue_name(raw: bytes) -> str | Invalid:
    """A queue (or topic) name as the engine names it: UTF-8 text of 1 to MAX_QUEUE_NAME bytes."""
    if not raw or len(raw) > MAX_QUEUE_NAME:
        return Invalid(f"a queue name of {len(raw)} bytes (1 to {MAX_QUEUE_NAME})")
    try:
        return raw.decode()
    except UnicodeDecodeError:
        return Invalid("a queue name that is not UTF-8")


def parse_inform(body: list[bytes]) -> Inform | Invalid:
    if len(body) < 2:
        return Invalid(f"INFORM with {len(body)} body frames (queues, peer type)")
    raw, peer_type = body[0], body[1]
    if not raw:
        return Inform([(DEFAULT_WEIGHT, DEFAULT_QUEUE)], peer_type)
    try:
        listed = json.loads(raw)
        queues = [(int(weight), str(name).encode()) for weight, name in listed]
    except (ValueError, TypeError, UnicodeDecodeError) as error:
        return Invalid(f"INFORM queues are not a JSON list of [weight, name]: {error}")
    if any(isinstance(item, bool) for pair in listed for item in pair):
        return Invalid("INFORM queues are not a JSON list of [weight, name]: a boolean")
    return Inform(queues, peer_type)


def parse_request(body: list[bytes]) -> Request | Invalid:
    if len(body) < 3:
        return Invalid(f"REQUEST with {len(body)} body frames (queue, headers, message)")
    return Request(body[0], body[1], body[2])


def parse_worker_reply(body: list[bytes]) -> WorkerReply | Invalid:
    """A jobmanager's result: `[result, original_msgid]`; the msgid is the last frame."""
    if len(body) < 2:
        return Invalid(f"REPLY with {len(body)} body frames (result, msgid)")
    return WorkerReply(body[0], body[-1])


def parse_schedule(body: list[bytes]) -> Schedule | Invalid:
    if len(body) < 5:
        return Invalid(f"SCHEDULE with {len(body)} body frames (queue, headers, interval, message, cron)")
    queue, headers, raw_interval, payload, cron = body[:5]
    text = raw_interval.strip()
    try:
        interval = int(float(text)) if text else -1
    except ValueError:
        return Invalid(f"SCHEDULE interval {raw_interval[:40]!r} is not a number")
    if interval < 0 and not cron.strip():
        return Invalid("SCHEDULE without an interval or a cron expression")
    return Schedule(queue, headers, interval if interval >= 0 else None, payload, cron)


def schedule_key(payload: bytes) -> str | Invalid:
    """A scheduled job's identity as EventMQ's scheduler computes it: the sha1 (hex) of the JSON,
    keys sorted, of the job's args, kwargs, class_args, class_kwargs, path and callable (a key the
    job lacks counts as null). SCHEDULE replaces, and UNSCHEDULE removes, the job of that identity."""
    try:
        job = json.loads(payload)[1]
        identity = json.dumps({key: job.get(key) for key in SCHEDULE_KEY_FIELDS}, sort_keys=True)
    except (ValueError, TypeError, KeyError, IndexError, AttributeError, UnicodeDecodeError) as error:
        return Invalid(f"the scheduled message is not ['run', {{job}}]: {error}")
    return hashlib.sha1(identity.encode()).hexdigest()


def parse_publish(body: list[bytes]) -> Publish | Invalid:
    if len(body) < 2:
        return Invalid(f"PUBLISH with {len(body)} body frames (topic, message)")
    return Publish(body[0], body[1])


def parse_headers(raw: bytes) -> dict[str, str]:
    """`reply-requested,timeout:30` → {"reply-requested": "", "timeout": "30"} (bytes that are not UTF-8 replaced)."""
    headers: dict[str, str] = {}
    for item in raw.decode("utf-8", "replace").split(","):
        name, _, value = item.strip().partition(":")
        if name:
            headers[name] = value
    return headers


# -- writing -------------------------------------------------------------------------------------


def envelope(identity: bytes, command: bytes, msgid: bytes, *body: bytes) -> list[bytes]:
    """A message a ROUTER sends to `identity`."""
    return [identity, EMPTY, VERSION, command, msgid, *body]


def ack(identity: bytes, msgid: bytes, acked_msgid: bytes) -> list[bytes]:
    return envelope(identity, ACK, msgid, acked_msgid)


def reply(identity: bytes, msgid: bytes, *body: bytes) -> list[bytes]:
    """The router's REPLY: "dispatched" (`body` = the client's msgid) or an admin answer (JSON)."""
    return envelope(identity, REPLY, msgid, *body)


def refusal(identity: bytes, msgid: bytes, refused_msgid: bytes, reason: str) -> list[bytes]:
    """A REPLY naming the refused message and why: `[refused_msgid, 'ERROR: <reason>']`."""
    return envelope(identity, REPLY, msgid, refused_msgid, ERROR_PREFIX + reason.encode())


def disconnect(identity: bytes, msgid: bytes, reason: str) -> list[bytes]:
    """DISCONNECT with the reason as a body frame: the one answer besides ACK a peer waiting for
    its ACK acts on (it stops instead of waiting forever)."""
    return envelope(identity, DISCONNECT, msgid, reason.encode())


def heartbeat(identity: bytes, msgid: bytes, unix_time: float) -> list[bytes]:
    return envelope(identity, HEARTBEAT, msgid, repr(unix_time).encode())


def kbye(identity: bytes, msgid: bytes) -> list[bytes]:
    return envelope(identity, KBYE, msgid)


def forward(identity: bytes, message: Message) -> list[bytes]:
    """A message passed on as it came (the sender's msgid kept): a REQUEST to a worker, a SCHEDULE to a scheduler."""
    return envelope(identity, message.command, message.msgid, *message.body)


def request(identity: bytes, msgid: bytes, queue: bytes, headers: bytes, payload: bytes) -> list[bytes]:
    return envelope(identity, REQUEST, msgid, queue, headers, payload)


def client_message(command: bytes, msgid: bytes, *body: bytes) -> list[bytes]:
    """What a peer's DEALER sends (no identity frame: its socket adds none)."""
    return [EMPTY, VERSION, command, msgid, *body]


def published(topic: bytes, payload: bytes) -> list[bytes]:
    """The pub/sub device's output on its PUB socket: `[topic, body]`, no envelope."""
    return [topic, payload]
