"""JetStream key-value buckets as NATS's own KV clients lay them out (so `nats kv` reads them): the stream
`KV_<bucket>`, a key per subject `$KV.<bucket>.<key>`, the last value per key, deletes as markers.
polymq keeps its schedules, its leases, which topic a stream reads and publish de-duplication there."""

from __future__ import annotations

import base64
from collections.abc import Callable, Mapping
from typing import Any

from polymq.jetstream import api
from polymq.jetstream.nats_connection import Msg, NatsConnection, NatsError

# NATS's KV header of a delete marker.
HEADER_KV_OPERATION = "KV-Operation"
KV_DELETE = "DEL"


def kv_stream(bucket: str) -> str:
    return f"KV_{bucket}"


def kv_subject(bucket: str, key: str) -> str:
    return f"$KV.{bucket}.{key}"


def bucket_config(bucket: str, replicas: int, *, ttl: bool = False, max_age_s: float = 0.0) -> dict[str, Any]:
    """A KV bucket's stream as NATS's KV clients make it; `max_age_s`: keys not written for that long go."""
    config: dict[str, Any] = {
        "name": kv_stream(bucket), "subjects": [kv_subject(bucket, ">")], "retention": "limits",
        "max_msgs_per_subject": 1, "storage": "file", "num_replicas": replicas, "discard": "new",
        "allow_rollup_hdrs": True, "deny_delete": True, "allow_direct": True}
    if ttl:
        config["allow_msg_ttl"] = True
    if max_age_s:
        config["max_age"] = int(max_age_s * 1e9)
    return config


async def ensure_bucket(connection: NatsConnection, config: Mapping[str, Any]) -> None:
    """Make the bucket unless it exists (with these settings or others)."""
    try:
        await api.api(connection, f"STREAM.CREATE.{config['name']}", config)
    except api.JetStreamError as error:
        if error.err_code != api.ERR_STREAM_NAME_IN_USE:
            raise


async def get(connection: NatsConnection, bucket: str, subject: str) -> bytes | None:
    """The value at `subject` of the bucket as its leader has it; None when there is none or it was deleted."""
    try:
        answer = await api.api(connection, f"STREAM.MSG.GET.{kv_stream(bucket)}", {"last_by_subj": subject})
    except api.JetStreamError as error:
        if error.err_code == api.ERR_NO_MESSAGE_FOUND:
            return None
        raise
    return stored_value(answer.get("message") or {})


def stored_value(stored: Mapping[str, Any]) -> bytes | None:
    """The value of a stored KV message (STREAM.MSG.GET's form: base64 data and headers); None for a delete."""
    if HEADER_KV_OPERATION.encode() in base64.b64decode(stored.get("hdrs") or b""):
        return None
    return base64.b64decode(stored.get("data") or b"")


def put_nowait(connection: NatsConnection, bucket: str, key: str, payload: bytes,
               done: Callable[[Exception | None], None], *, timeout: float,
               headers: Mapping[str, str] | None = None) -> None:
    """Write the key (its NATS subject token: `api.token`); `done` gets None once stored, or why not."""

    def answered(reply: Msg | NatsError) -> None:
        done(api.publish_failure(reply))

    try:
        connection.request_nowait(kv_subject(bucket, api.token(key)), payload, answered, headers=headers,
                                  timeout=timeout)
    except NatsError as error:
        done(error)
