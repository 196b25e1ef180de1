"""What the run publishes where and who reads it (docs/architecture.md's mapping of each protocol).

A *flow* is one publishing protocol writing to one topic; each queue bound to that topic is a
*sink* that gets its own copy of every message, read by one protocol's consumers. Every copy is
accounted for on its own: acknowledged when its publish was confirmed, delivered when a consumer
of its sink acknowledged it.
"""

from __future__ import annotations

import attrs

PROTOCOLS = ("nsq", "mqks", "phpmq", "pzq", "emqp")

NSQ_TOPIC = "torture_nsq"
NSQ_CHANNEL = "c"
MQKS_EVENT = "torture_mqks"
MQKS_QUEUE = "torture_mqks"
MQKS_QUEUE_OF_NSQ = "torture_mqks_nsq"  # an MQKS queue bound to the NSQ topic
PHPMQ_QUEUE = "torture_phpmq"
PZQ_QUEUE = "torture_pzq"  # the gateway's --pzq-queue
EMQP_QUEUE = "torture_emqp"
# NSQ's publishes to an eMQP queue go to one of their own: a request is acknowledged only when a
# worker is free as it comes, so eMQP's own queue is kept short.
EMQP_QUEUE_OF_NSQ = "torture_emqp_nsq"
# Queues PHPMQ and eMQP read that MQKS binds to another protocol's topic (a bridge between PHP and Python
# services): made by an MQKS client before the run's clients start, never by the readers.
PHPMQ_QUEUE_OF_MQKS = "torture_phpmq_mqks"
EMQP_QUEUE_OF_NSQ_BOUND = "torture_emqp_bound_nsq"


@attrs.frozen(slots=True)
class Sink:
    name: str  # how the report and the consumers name it
    protocol: str  # whose consumers read it
    queue: str  # the protocol's own name: an NSQ topic (channel NSQ_CHANNEL), an MQKS queue, …
    events: tuple[str, ...] = ()  # MQKS: the events the queue is bound to
    # Another protocol's queue bound over MQKS to these topics before the run (`mqks.bind_over_mqks`).
    bound_over_mqks: tuple[str, ...] = ()


@attrs.frozen(slots=True)
class Flow:
    index: int
    publisher: str
    topic: str
    sinks: tuple[str, ...]


SINKS = {
    sink.name: sink
    for sink in (
        Sink("nsq:torture_nsq/c", "nsq", NSQ_TOPIC),
        Sink("nsq:torture_mqks/c", "nsq", MQKS_EVENT),
        Sink("mqks:torture_mqks", "mqks", MQKS_QUEUE, (MQKS_EVENT,)),
        Sink("mqks:torture_mqks_nsq", "mqks", MQKS_QUEUE_OF_NSQ, (NSQ_TOPIC,)),
        Sink("phpmq:torture_phpmq", "phpmq", PHPMQ_QUEUE),
        Sink("pzq:torture_pzq", "pzq", PZQ_QUEUE),
        Sink("emqp:torture_emqp", "emqp", EMQP_QUEUE),
        Sink("emqp:torture_emqp_nsq", "emqp", EMQP_QUEUE_OF_NSQ),
        Sink("phpmq:torture_phpmq_mqks", "phpmq", PHPMQ_QUEUE_OF_MQKS, bound_over_mqks=(MQKS_EVENT,)),
        Sink("emqp:torture_emqp_bound_nsq", "emqp", EMQP_QUEUE_OF_NSQ_BOUND, bound_over_mqks=(NSQ_TOPIC,)),
    )
}

FLOWS = (
    # Each protocol into its own queues; NSQ's topic is read by an NSQ channel, an MQKS queue and an eMQP
    # queue MQKS bound to it; MQKS's event by an MQKS queue, an NSQ channel and a PHPMQ queue MQKS bound to it.
    Flow(0, "nsq", NSQ_TOPIC, ("nsq:torture_nsq/c", "mqks:torture_mqks_nsq", "emqp:torture_emqp_bound_nsq")),
    Flow(1, "mqks", MQKS_EVENT, ("mqks:torture_mqks", "nsq:torture_mqks/c", "phpmq:torture_phpmq_mqks")),
    Flow(2, "phpmq", PHPMQ_QUEUE, ("phpmq:torture_phpmq",)),
    Flow(3, "pzq", PZQ_QUEUE, ("pzq:torture_pzq",)),
    Flow(4, "emqp", EMQP_QUEUE, ("emqp:torture_emqp",)),
    # Other protocols into the queues of PHPMQ, PZQ and eMQP (a topic of the queue's name).
    Flow(5, "nsq", PHPMQ_QUEUE, ("phpmq:torture_phpmq",)),
    Flow(6, "mqks", PZQ_QUEUE, ("pzq:torture_pzq",)),
    Flow(7, "nsq", EMQP_QUEUE_OF_NSQ, ("emqp:torture_emqp_nsq",)),
)


def flows_of(protocol: str) -> tuple[Flow, ...]:
    return tuple(flow for flow in FLOWS if flow.publisher == protocol)


def sinks_of(protocol: str) -> tuple[Sink, ...]:
    return tuple(sink for sink in SINKS.values() if sink.protocol == protocol)
