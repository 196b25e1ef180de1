"""The NATS JetStream backend: a NATS client on trio (`nats_connection`) and what runs on it."""
