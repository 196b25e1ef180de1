"""Which `0` answers of PZQ consumers are honoured, when every delivery of a message has one key.

The original PZQ sends every delivery of a message under the same key, so an answer names the
message, not the delivery; polymq sends the same keys. Its send socket is a DEALER, as the
original's: ZeroMQ picks the consumer of each delivery, and the server sees neither which consumer
got a delivery nor which one an answer came from. So the rule counts answers instead
(docs/protocols/pzq.md):

- a `1` ends the message whoever sends it (the service does that, as the original);
- every delivery is taken to answer at most once. A delivery that went unanswered until its ACK
  timeout, and was sent again, is superseded: for one more ACK timeout (`grace`) it may still
  answer, and the next `0` of the message in that time is taken as its answer and ignored;
- otherwise a `0` is honoured once per delivery (the message is sent again at once); a second `0`
  of the same delivery is ignored.

A superseded delivery whose consumer never answers (the reference client drops a delivery that
arrives after its timeout) makes the current holder's `0` count as the old one's: that message
comes back after the ACK timeout instead of at once. Nothing is ever lost by the rule.
"""

from __future__ import annotations

from collections.abc import Container

import attrs

# Records kept before the first sweep of those no longer needed; later sweeps wait for twice as many
# as the last one kept, so sweeping costs O(1) per delivery.
SWEEP_AT_LEAST = 1024


@attrs.define(slots=True)
class _Deliveries:
    attempt: int  # the number (the engine's attempts) of the message's latest delivery
    # Until when that delivery, or its answer, may matter: its ACK timeout, then the grace.
    needed_until: float
    answered: bool = False  # that delivery answered `0` already
    # Until when (the engine's clock) each superseded, unanswered earlier delivery may still answer.
    superseded: list[float] = attrs.Factory(list)

    def drop_expired(self, now: float) -> None:
        if self.superseded:
            self.superseded = [until for until in self.superseded if until > now]


@attrs.define(slots=True)
class NackRule:
    grace: float  # how long a superseded delivery may still answer: the ACK timeout
    _records: dict[int, _Deliveries] = attrs.Factory(dict)
    _sweep_at: int = SWEEP_AT_LEAST

    def __len__(self) -> int:
        return len(self._records)

    def delivered(self, message_id: int, attempt: int, now: float, in_flight: Container[int]) -> None:
        """Delivery number `attempt` of the message goes out; `in_flight` is what the consumer holds."""
        record = self._records.get(message_id)
        if record is None:
            if len(self._records) >= self._sweep_at:
                self._sweep(now, in_flight)
            self._records[message_id] = _Deliveries(attempt, now + 2 * self.grace)
            return
        record.drop_expired(now)
        if attempt > record.attempt and not record.answered:
            record.superseded.append(now + self.grace)  # it timed out unanswered: it may still answer
        record.attempt, record.answered, record.needed_until = attempt, False, now + 2 * self.grace

    def nack(self, message_id: int, now: float) -> bool:
        """A `0` for the message came: True when it is the latest delivery's first answer."""
        record = self._records.get(message_id)
        if record is None:
            return False  # no delivery of ours
        record.drop_expired(now)
        if record.superseded:
            record.superseded.pop(0)  # taken as the answer of the oldest superseded delivery
            return False
        if record.answered:
            return False  # that delivery asked for the message again already
        record.answered = True
        return True

    def forget(self, message_id: int) -> None:
        """The message is done (a `1`)."""
        self._records.pop(message_id, None)

    def clear(self) -> None:
        self._records.clear()

    def _sweep(self, now: float, in_flight: Container[int]) -> None:
        """Forget messages no PZQ consumer holds and no superseded delivery may answer for any more:
        they left the queue another way (another protocol's consumer, a deleted queue)."""
        for message_id, record in list(self._records.items()):
            record.drop_expired(now)
            if not record.superseded and record.needed_until <= now and message_id not in in_flight:
                del self._records[message_id]
        self._sweep_at = max(SWEEP_AT_LEAST, 2 * len(self._records))
