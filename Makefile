# The two commands of a fresh machine: `make serve` and `make test` (see README.md).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.polymq-installed

.PHONY: install serve test lint interop-envs system-tools bench conformance example-spark

COMPILED := $(VENV)/.polymq-compiled
# Tests run on the pure-Python sources too (POLYMQ_PURE_PYTHON=1): the engine, store, codec and
# session units, the MQKS session through a gateway, the ZeroMQ pump and service (a gateway a
# test starts inherits the variable).
PURE_TESTS := tests/test_engine.py tests/test_engine_stateful.py tests/test_records_properties.py \
	tests/test_storage_recovery.py tests/test_commit_path.py tests/test_nsq_codec.py \
	tests/test_nsq_codec_properties.py tests/test_timers.py tests/test_compiled.py tests/test_schedules.py tests/test_streams.py \
	tests/test_protocol_units.py tests/test_nsq_delivery.py tests/test_slow_consumer.py \
	tests/test_mqks_codec.py tests/test_mqks_codec_properties.py tests/test_mqks.py \
	tests/test_emqp_codec.py tests/test_zmq_pump.py tests/test_zmq_service.py tests/test_shared_barrier.py tests/test_shared_order.py \
	tests/test_jetstream_backend.py

$(STAMP): pyproject.toml
	@echo "==> polymq: creating the virtual environment $(VENV)"
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	@echo "==> polymq: installing polymq and its dependencies into $(VENV) (the first time takes a few minutes)"
	$(BIN)/pip install --progress-bar off -e '.[test,compile,spark]'
	# Spark finds data sources by listing sys.path (pkgutil.iter_modules), where an editable
	# install's import hook does not show: put the folder of pyspark_polymq there (docs/spark.md).
	echo "$(CURDIR)/spark" > "$$($(BIN)/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/polymq-spark.pth"
	touch $(STAMP)

# The hot modules compiled with mypyc next to their sources (docs/performance.md). If it fails,
# the pure-Python modules stay in use and the message says so; an edited source is used as it is
# until the next compile.
$(COMPILED): $(STAMP) $(wildcard core/*.py codecs/*.py) adapters/transport.py adapters/traffic.py adapters/host_loop.py adapters/session.py adapters/nsq/tcp.py adapters/mqks/session.py adapters/zmq_pump.py adapters/emqp/broker.py native/zmq_frames.c
	@echo "==> polymq: compiling the hot modules with mypyc (a minute or two)"
	-$(BIN)/python tools/mypyc_build.py && touch $(COMPILED)

install: $(STAMP) $(COMPILED)

# The gateway with every protocol built so far, default ports, loopback.
serve: install
	$(BIN)/polymq serve

# The real NSQ client libraries (PyPI, npm) the interop tests drive, each in its own environment.
interop-envs:
	bash tests/interop/setup_envs.sh

# strace records the gateway's system calls in the fsync-order test; php-cli runs the PHP PHPMQ
# client of the interop tests; chromium and chromium-driver run the admin page's browser test, curl
# its documented examples, ip (iproute2) the loopback of the network namespace docs/cluster.md's example runs
# in (Debian's packages, installed when missing).
system-tools:
	@missing=""; command -v strace >/dev/null || missing="$$missing strace"; \
	command -v php >/dev/null || missing="$$missing php-cli"; \
	command -v chromium >/dev/null || missing="$$missing chromium"; \
	command -v chromedriver >/dev/null || missing="$$missing chromium-driver"; \
	command -v curl >/dev/null || missing="$$missing curl"; \
	command -v ip >/dev/null || missing="$$missing iproute2"; \
	if [ -n "$$missing" ]; then apt-get update -qq && apt-get install -y -qq $$missing; fi

lint: install
	$(BIN)/ruff check .

# Everything: lint, unit, property, integration, interop, conformance.
test: install interop-envs system-tools lint
	POLYMQ_PURE_PYTHON=1 $(BIN)/pytest -q $(PURE_TESTS)
	POLYMQ_EXPECT_COMPILED=1 $(BIN)/pytest

# Against a gateway already running on the default ports (`make serve`).
bench: install
	$(BIN)/polymq bench nsq --tcp 127.0.0.1:4150 --http 127.0.0.1:4151
	$(BIN)/polymq bench mqks --addr 127.0.0.1:25000

# The Spark orders pipeline end to end against a gateway it starts (docs/spark.md).
example-spark: install
	$(BIN)/python examples/spark_orders/run.py

conformance: install
	$(BIN)/polymq conformance all --emqp-pubsub-in 127.0.0.1:47298 --emqp-pubsub-out 127.0.0.1:47299
