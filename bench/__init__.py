"""The benchmarks behind `polymq bench` (loaded only when asked: `polymq serve` never imports them)."""

# `polymq bench NAME` for the benchmarks of no one protocol (each protocol's unit names its own).
COMMANDS = {
    "durable-pub": "polymq.bench.durable_pub:command",
    "jetstream": "polymq.bench.jetstream:command",
    "spark": "polymq.bench.spark:command",
    "versus-nsqd": "polymq.bench.versus_nsqd:command",
}
