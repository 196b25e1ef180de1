"""The running process: CLI, config, listeners, HTTP APIs, signals."""
