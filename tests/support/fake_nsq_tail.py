"""A fake of nsq 1.3.0's nsq_tail for CI, which has no Go (written from `apps/nsq_tail/nsq_tail.go`).

Its flags, in Go's syntax; one consumer per `--topic` on the channel given, else on an ephemeral one of
its own (`tail` and six random digits, `#ephemeral`); max-in-flight lowered to `-n` when that is
smaller; each message's body and a newline on stdout (after `topic | ` with `--print-topic`), then
FIN; with `-n`, the process exits 0 right after printing the n-th message of a topic, without
finishing it. SIGINT or SIGTERM: CLS, and exit once every connection has closed.
"""

from __future__ import annotations

import queue
import random
import signal
import sys

from fake_nsq_common import (
    BOOL,
    GO_NSQ_VERSION,
    INT,
    NSQ_VERSION,
    STRING,
    Consumer,
    Delivery,
    catch_signals,
    check_sources,
    consumer_flags,
    exit_now,
    fatal,
    log,
    parse_flags,
    run,
)

# nsq_tail.go: `fmt.Sprintf("tail%06d#ephemeral", rand.Int()%999999)`.
CHANNEL_RANDOM_MODULUS = 999999
MAX_IN_FLIGHT = 200


def main(argv: list[str]) -> None:
    stop_asked = catch_signals([signal.SIGINT, signal.SIGTERM])
    values = parse_flags("nsq_tail", argv, {
        **consumer_flags(), "channel": (STRING, ""), "max-in-flight": (INT, MAX_IN_FLIGHT), "n": (INT, 0),
        "print-topic": (BOOL, False)}, unsupported=["consumer-opt"])
    if values["version"]:
        print(f"nsq_tail v{NSQ_VERSION}")
        return
    channel = values["channel"] or f"tail{random.randrange(CHANNEL_RANDOM_MODULUS):06d}#ephemeral"
    check_sources(values)
    if not values["topic"]:
        fatal("--topic required")
    total = values["n"]
    max_in_flight = values["max-in-flight"]
    if 0 < total < max_in_flight:  # don't ask for more messages than wanted
        max_in_flight = total
    user_agent = f"nsq_tail/{NSQ_VERSION} go-nsq/{GO_NSQ_VERSION}"
    deliveries: queue.Queue[Delivery] = queue.Queue()
    consumers = []
    shown: dict[Consumer, int] = {}
    for topic in values["topic"]:
        log(f"Adding consumer for topic: {topic}")
        try:
            consumer = Consumer(topic, channel, max_in_flight, user_agent, deliveries)
        except ValueError as error:
            fatal(str(error))
        shown[consumer] = 0
        consumer.connect_to_nsqds(values["nsqd-tcp-address"])
        consumer.connect_to_lookupds(values["lookupd-http-address"])
        consumers.append(consumer)

    def handle(delivery: Delivery) -> None:
        assert delivery.connection is not None and delivery.message is not None
        consumer = delivery.consumer
        shown[consumer] += 1
        out = sys.stdout.buffer
        if values["print-topic"]:
            out.write(consumer.topic.encode() + b" | ")
        out.write(delivery.message.body + b"\n")
        out.flush()
        if total > 0 and shown[consumer] >= total:
            exit_now(0)
        consumer.finish(delivery.connection, delivery.message)

    run(consumers, deliveries, stop_asked, handle)


if __name__ == "__main__":
    main(sys.argv[1:])
