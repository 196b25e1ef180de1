# The two commands of a fresh machine: `make serve` and `make test` (see README.md).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.polymq-installed

.PHONY: install serve test lint interop-envs system-tools bench conformance

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

# The gateway with every protocol built so far, default ports, loopback.
serve: install
	$(BIN)/polymq serve

# The real NSQ client libraries (PyPI, npm) the interop tests drive, each in its own environment.
interop-envs:
	bash tests/interop/setup_envs.sh

# strace records the gateway's system calls in the fsync-order test (Debian's package).
system-tools:
	command -v strace >/dev/null || (apt-get update -qq && apt-get install -y -qq strace)

lint: install
	$(BIN)/ruff check .

# Everything: lint, unit, property, integration, interop, conformance.
test: install interop-envs system-tools lint
	$(BIN)/pytest

# Against a gateway already running on the default ports (`make serve`).
bench: install
	$(BIN)/polymq bench nsq --tcp 127.0.0.1:4150 --http 127.0.0.1:4151
	$(BIN)/polymq bench mqks --addr 127.0.0.1:25000

conformance: install
	$(BIN)/polymq conformance nsq --tcp 127.0.0.1:4150 --http 127.0.0.1:4151
	$(BIN)/polymq conformance mqks --addr 127.0.0.1:25000
