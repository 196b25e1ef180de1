"""A fake of nsq 1.3.0's nsq_stat for CI, which has no Go (written from `apps/nsq_stat/nsq_stat.go`
and `internal/clusterinfo`).

Its flags, in Go's syntax. Each round: the topic's producers from every lookupd's
`/lookup?topic=` (one per HTTP address; an error only when no lookupd answered) or from each nsqd's
`/stats?format=json&topic=`; then each producer's `/stats?format=json&topic=…&channel=…&include_clients=false`,
the channel's counts summed over the nodes (memory depth being depth less backend depth). The
header every 25 rounds, a line of counts from the second round on (rates over the interval), a
sleep of `--interval` after each; `--count=N` prints N lines and exits 0.
"""

from __future__ import annotations

import signal
import sys
import threading
import time
import urllib.parse
from typing import Any

from fake_nsq_common import (
    BOOL,
    DURATION,
    LIST,
    NSQ_VERSION,
    STRING,
    catch_signals,
    exit_now,
    fatal,
    get_v1,
    lookup_path,
    parse_flags,
)

INTERVAL_S = 2.0
HEADER_EVERY = 25  # rounds between headers (`i%25 == 0`)
# The channel counts a line shows, as nsqd's /stats names them.
COUNTS = ("depth", "backend_depth", "in_flight_count", "deferred_count", "requeue_count", "timeout_count",
          "message_count", "client_count")


def error_list(errors: list[str]) -> str:
    """clusterinfo ErrList's text: one error a line."""
    return "\n".join(errors)


def producers_of(topic: str, lookupds: list[str], nsqds: list[str], timeout: float) -> list[str]:
    """The HTTP addresses of the topic's producers (clusterinfo GetLookupdTopicProducers and
    GetNSQDTopicProducers), each once."""
    found: list[str] = []
    errors: list[str] = []
    if lookupds:
        for lookupd in lookupds:
            try:
                answer = get_v1(lookupd, lookup_path(topic), timeout)
            except (OSError, ValueError) as error:
                errors.append(f"{lookupd}: {error}")
                continue
            for producer in answer.get("producers") or []:
                address = f"{producer['broadcast_address']}:{producer['http_port']}"
                if address not in found:
                    found.append(address)
        if len(errors) == len(lookupds):
            fatal(f"ERROR: failed to get topic producers - failed to query any nsqlookupd: {error_list(errors)}")
        return found
    for nsqd in nsqds:
        try:
            stats = get_v1(nsqd, "/stats?format=json&topic=" + urllib.parse.quote_plus(topic), timeout)
        except (OSError, ValueError) as error:
            errors.append(f"{nsqd}: {error}")
            continue
        if any(t.get("topic_name") == topic for t in stats.get("topics") or []) and nsqd not in found:
            found.append(nsqd)
    if len(errors) == len(nsqds):
        fatal(f"ERROR: failed to get topic producers - failed to query any nsqd: {error_list(errors)}")
    return found


def channel_totals(producers: list[str], topic: str, channel: str, timeout: float) -> dict[str, int] | None:
    """The channel's counts summed over the producers (clusterinfo GetNSQDStats); None when no node has it."""
    path = ("/stats?format=json&topic=" + urllib.parse.quote_plus(topic) + "&channel="
            + urllib.parse.quote_plus(channel) + "&include_clients=false")
    totals: dict[str, int] | None = None
    errors = []
    for producer in producers:
        try:
            stats: dict[str, Any] = get_v1(producer, path, timeout)
        except (OSError, ValueError) as error:
            errors.append(f"{producer}: {error}")
            continue
        for topic_stats in stats.get("topics") or []:
            if topic_stats.get("topic_name") != topic:
                continue
            for channel_stats in topic_stats.get("channels") or []:
                if channel_stats.get("channel_name") != channel:
                    continue
                totals = totals or dict.fromkeys((*COUNTS, "memory_depth"), 0)
                for name in COUNTS:
                    totals[name] += int(channel_stats.get(name, 0))
                depth, backend = int(channel_stats.get("depth", 0)), int(channel_stats.get("backend_depth", 0))
                totals["memory_depth"] += depth - backend
    if len(errors) == len(producers):  # no producer at all too, as clusterinfo counts
        fatal(f"ERROR: failed to get nsqd stats - failed to query any nsqd: {error_list(errors)}")
    return totals


def stat_loop(values: dict[str, Any]) -> None:
    interval, timeout = values["interval"], values["http-client-request-timeout"]
    topic, channel = values["topic"], values["channel"]
    count = values["count"]
    previous: dict[str, int] | None = None
    round_ = 0
    while count is None or count >= round_:
        producers = producers_of(topic, values["lookupd-http-address"], values["nsqd-http-address"], timeout)
        current = channel_totals(producers, topic, channel, timeout)
        if current is None:
            fatal(f"ERROR: failed to find channel({channel}) in stats metadata for topic({topic})")
        assert current is not None
        if round_ % HEADER_EVERY == 0:
            print("------rate------+----------------depth----------------+--------------metadata---------------")
            print(f"{'ingress':>7} {'egress':>7} | {'total':>7} {'mem':>7} {'disk':>7} {'inflt':>5} {'def':>5} | "
                  f"{'req':>7} {'t-o':>7} {'msgs':>12} {'clients':>7}", flush=True)
        if previous is not None:
            received = current["message_count"] - previous["message_count"]
            ingress = int(received / interval)
            egress = int((received - (current["depth"] - previous["depth"])) / interval)
            print(f"{ingress:7d} {egress:7d} | {current['depth']:7d} {current['memory_depth']:7d} "
                  f"{current['backend_depth']:7d} {current['in_flight_count']:5d} {current['deferred_count']:5d} | "
                  f"{current['requeue_count']:7d} {current['timeout_count']:7d} {current['message_count']:12d} "
                  f"{current['client_count']:7d}", flush=True)
        previous = current
        time.sleep(interval)
        round_ += 1
    exit_now(0)


def main(argv: list[str]) -> None:
    values = parse_flags("nsq_stat", argv, {
        "version": (BOOL, False), "topic": (STRING, ""), "channel": (STRING, ""), "interval": (DURATION, INTERVAL_S),
        "http-client-connect-timeout": (DURATION, 2.0), "http-client-request-timeout": (DURATION, 5.0),
        "count": (STRING, None), "nsqd-http-address": (LIST, []), "lookupd-http-address": (LIST, [])})
    if values["version"]:
        print(f"nsq_stat v{NSQ_VERSION}")
        return
    if not values["topic"] or not values["channel"]:
        fatal("--topic and --channel are required")
    if values["interval"] <= 0:
        fatal("--interval should be positive")
    if values["count"] is not None:
        try:
            values["count"] = int(values["count"])
        except ValueError:
            sys.stderr.write(f'invalid value "{values["count"]}" for flag -count\n')
            sys.exit(2)
        if values["count"] <= 0:
            fatal("--count should be positive")
    if not values["nsqd-http-address"] and not values["lookupd-http-address"]:
        fatal("--nsqd-http-address or --lookupd-http-address required")
    if values["nsqd-http-address"] and values["lookupd-http-address"]:
        fatal("use --nsqd-http-address or --lookupd-http-address not both")
    for name in ("nsqd-http-address", "lookupd-http-address"):
        if any(address.startswith("http") for address in values[name]):
            fatal(f"--{name} error - address should not contain scheme")
    stopped = catch_signals([signal.SIGHUP, signal.SIGINT, signal.SIGTERM])
    # The rounds run beside the main thread, which waits for a signal, as nsq_stat's goroutine does.
    threading.Thread(target=stat_loop, args=(values,), daemon=True).start()
    stopped.wait()


if __name__ == "__main__":
    main(sys.argv[1:])
