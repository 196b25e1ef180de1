"""PHPMQ for integration tests: the blocking client (`polymq.clients.phpmq`), whose `barrier()`
proves the gateway handled what a connection sent (PHPMQ never answers), and the /stats views
that show what a queue holds.
"""

from __future__ import annotations

import json
import time
import urllib.request
from typing import Any

from polymq.clients.phpmq import DEFAULT_TIMEOUT_S as DEFAULT_TIMEOUT
from polymq.clients.phpmq import Connection
from polymq.clients.tcp import Closed

__all__ = ["DEFAULT_TIMEOUT", "Closed", "PHPMQWire", "queue_stats", "wait_until_handed_back"]


class PHPMQWire(Connection):
    def nothing_more(self, wait: float = 0.2) -> bool:
        """True if no delivery arrives within `wait` (use after the gateway's state proved none is due)."""
        return self.quiet(wait)


def queue_stats(http: str, queue: str) -> dict[str, Any]:
    """The /stats entry of engine queue `queue` (a PHPMQ queue shows as a channel of its topic)."""
    with urllib.request.urlopen(f"http://{http}/stats?format=json", timeout=DEFAULT_TIMEOUT) as reply:
        stats = json.load(reply)
    for topic in stats["topics"]:
        for channel in topic["channels"]:
            if channel["channel_name"] in (queue, queue.partition("/")[2]) and (
                    topic["topic_name"] == queue or f"{topic['topic_name']}/{channel['channel_name']}" == queue):
                return channel
    raise KeyError(f"no queue {queue!r} in /stats")


def wait_until_handed_back(http: str, queue: str, timeout: float = DEFAULT_TIMEOUT) -> None:
    """PHPMQ never answers: after a consumer's disconnect, /stats shows when its messages are back."""
    deadline = time.monotonic() + timeout
    while queue_stats(http, queue)["in_flight_count"]:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{queue}: messages still in flight")
        time.sleep(0.01)
