"""The queue engine: topics, queues, consumers, in-flight, timers, storage. Knows no protocol."""
