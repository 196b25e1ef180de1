"""Which protocol made a topic or a queue: the `origin` its maker gave, kept by the engine and the store."""

from __future__ import annotations

from pathlib import Path

from polymq.core.clock import ManualClock
from polymq.core.engine import MADE_BY_OPTION, Engine

from support.sync_store import Store


def test_the_origin_of_the_call_that_made_a_topic_or_queue_is_kept() -> None:
    engine = Engine()
    engine.publish("orders", b"one", origin="phpmq")  # makes the topic
    engine.ensure_topic("orders", origin="nsq")  # exists already: its maker stays
    engine.ensure_queue("orders/billing", origin="nsq", options={"max_attempts": 3})
    engine.bind("orders/billing", "orders")
    engine.ensure_queue("audit", origin="mqks")
    engine.bind("audit", "refunds")  # a binding makes the topic: made by whoever made the queue
    engine.ensure_queue("unknown")
    engine.bind("unknown", "made-by-unknown")
    assert engine.topics["orders"].made_by == "phpmq"
    assert engine.queues["orders/billing"].options == {MADE_BY_OPTION: "nsq", "max_attempts": 3}
    assert engine.topics["refunds"].made_by == "mqks"
    assert engine.topics["made-by-unknown"].made_by is None
    assert MADE_BY_OPTION not in engine.queues["unknown"].options


def test_makers_come_back_after_a_restart(tmp_path: Path) -> None:
    clock = ManualClock()
    store = Store(tmp_path, clock, 10_000)
    store.engine.publish("orders", b"one", origin="phpmq")
    store.engine.ensure_queue("orders/billing", origin="nsq")
    store.engine.bind("orders/billing", "orders")
    store.engine.topics["orders"].set_paused(True)  # the topic's record is written again: its maker stays
    store.engine.ensure_topic("plain")
    store.close()
    again = Store(tmp_path, clock, 10_000)
    try:
        assert again.engine.topics["orders"].made_by == "phpmq"
        assert again.engine.topics["orders"].paused
        assert again.engine.topics["plain"].made_by is None
        assert again.queue("orders/billing").options[MADE_BY_OPTION] == "nsq"
    finally:
        again.close()
