"""Schedules (eMQP `SCHEDULE`) on JetStream: kept for every node, fired by one node at a time.

Each schedule is a key of the key-value bucket `POLYMQ_SCHEDULES` (the stream `KV_POLYMQ_SCHEDULES`,
as NATS's own KV clients lay a bucket out, so `nats kv` reads it): its record, as the embedded store
keeps it, with its next firing time. Every node loads the bucket at start and follows its changes,
so each holds every schedule, armed; a node whose link was down reads the bucket again once it is back.

Which node fires is decided by a lease: the key `schedules` of the bucket `POLYMQ_LEASES`, a message
with a TTL. A node takes it only when the key is empty (`Nats-Expected-Last-Subject-Sequence: 0`) and
keeps it by writing it again over its own sequence before the TTL ends; a node that dies lets it
lapse, and another takes it within LEASE_TTL_S + LEASE_RENEW_S. The holder fires what is due and saves
each schedule's next time; the others, when a schedule is due, look again every second, and take
over from the last saved time (a firing due while nobody held the lease comes at once). A holder
that dies between a firing's publish and its save has that firing made again by the next holder.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING

import trio

from polymq.core.schedules import Schedule, Schedules
from polymq.jetstream import api, kv
from polymq.jetstream.nats_connection import Msg, NatsError

if TYPE_CHECKING:
    from polymq.jetstream.backend import JetStreamLink

log = logging.getLogger("polymq.jetstream")

BUCKET = "POLYMQ_SCHEDULES"
LEASES = "POLYMQ_LEASES"
LEASE_KEY = "schedules"
# How long a lease lasts unless renewed, and how often its holder renews it (three tries per TTL), or
# another node tries to take it: a dead holder's schedules wait at most about their sum.
LEASE_TTL_S = 6
LEASE_RENEW_S = 2.0
# The JetStream header of an optimistic write.
HEADER_EXPECTED_LAST_SUBJECT_SEQ = "Nats-Expected-Last-Subject-Sequence"


class SharedScheduleKeeper:
    """The `ScheduleKeeper` of a node on JetStream."""

    def __init__(self, link: JetStreamLink, schedules: Schedules, node: int) -> None:
        self.link = link
        self.connection = link.connection
        self.schedules = schedules
        self.node = node
        self.holding = False
        self._lease_sequence = 0  # the lease's sequence while this node holds it
        self.leases_taken = 0
        # Set when the node's link came back: the watch heard nothing while it was down, so the bucket is
        # read again (at the lease's next round).
        self.reload_due = False

    # -- ScheduleKeeper ---------------------------------------------------------------------------

    def may_fire(self) -> bool:
        return self.holding

    def saved(self, schedule: Schedule) -> None:
        record = {**schedule.to_record(), "node": self.node}
        self._write(schedule.key, json.dumps(record).encode(), None)

    def deleted(self, key: str) -> None:
        self._write(key, b"", {kv.HEADER_KV_OPERATION: kv.KV_DELETE})

    def _write(self, key: str, payload: bytes, headers: Mapping[str, str] | None) -> None:
        def done(error: Exception | None) -> None:
            if error is not None:
                log.warning("schedule %r not kept in JetStream: %r", key, str(error))

        kv.put_nowait(self.connection, BUCKET, key, payload, done, timeout=self.link.settings.publish_timeout_s,
                      headers=headers)

    # -- start and follow ---------------------------------------------------------------------------

    async def prepare(self, replicas: int) -> None:
        """Make both buckets unless they exist, follow the schedules' changes, then load what is kept."""
        for bucket, ttl in ((BUCKET, False), (LEASES, True)):
            await kv.ensure_bucket(self.connection, kv.bucket_config(bucket, replicas, ttl=ttl))
        self.connection.subscribe(kv.kv_subject(BUCKET, ">"), self._on_change)
        await self.load()

    async def load(self, *, again: bool = False) -> None:
        """Every schedule kept; `again`, after the link was down: what was added, changed or removed meanwhile
        (a removal leaves its key's delete marker), this node's own records left to its newer copy."""
        info = await api.api(self.connection, f"STREAM.INFO.{kv.kv_stream(BUCKET)}",
                             {"subjects_filter": kv.kv_subject(BUCKET, ">")})
        subjects = (info.get("state") or {}).get("subjects") or {}
        for subject in subjects:
            data = await kv.get(self.connection, BUCKET, subject)  # None: removed
            if data:
                self._apply(data, skip_own=again)
            elif again and (key := self._key_of(subject)) is not None:
                self.schedules.forget(key)

    def _on_change(self, msg: Msg) -> None:
        operation = (msg.headers or {}).get(kv.HEADER_KV_OPERATION)
        if operation is not None:
            key = self._key_of(msg.subject)
            if key is not None:
                self.schedules.forget(key)
            return
        self._apply(msg.payload, skip_own=True)

    def _apply(self, data: bytes, *, skip_own: bool = False) -> None:
        try:
            record = json.loads(data)
            if skip_own and record.get("node") == self.node:
                return  # this node's own save coming back: its copy is newer or the same
            self.schedules.known(record)
        except (ValueError, KeyError, TypeError) as error:
            log.warning("a schedule kept in JetStream cannot be read: %r", str(error))

    def _key_of(self, subject: str) -> str | None:
        token = subject.removeprefix(kv.kv_subject(BUCKET, ""))
        for key in self.schedules.by_key:
            if api.token(key) == token:
                return key
        return None

    # -- the lease --------------------------------------------------------------------------------

    async def run(self) -> None:
        """Take or renew the lease every LEASE_RENEW_S, for as long as the node runs."""
        subject = kv.kv_subject(LEASES, LEASE_KEY)
        while True:
            if self.reload_due:
                self.reload_due = False
                try:
                    await self.load(again=True)
                except (NatsError, api.JetStreamError) as error:
                    self.reload_due = True
                    log.warning("the schedules could not be read again: %r", str(error))
            expected = self._lease_sequence if self.holding else 0
            headers = {HEADER_EXPECTED_LAST_SUBJECT_SEQ: str(expected), api.HEADER_TTL: f"{LEASE_TTL_S}s"}
            try:
                reply = await self.connection.request(subject, str(self.node).encode(), headers=headers,
                                                      timeout=LEASE_RENEW_S)
                _, sequence, _ = api.parse_publish_ack(reply.payload)
            except (NatsError, api.JetStreamError, ValueError, KeyError):
                if self.holding:
                    log.info("node %d no longer fires the schedules (its lease was not renewed)", self.node)
                self.holding = False
            else:
                if not self.holding:
                    self.leases_taken += 1
                    log.info("node %d fires the schedules", self.node)
                self.holding, self._lease_sequence = True, sequence
            await trio.sleep(LEASE_RENEW_S)
