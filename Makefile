# Everything runs from a virtual environment that these targets create and reuse.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: help install demo test test-fast test-embedded test-kafka test-kafka-slow lint docs bench bench-smoke bench-backlog bench-scaleout bench-hotpath train clean kafka-jars kafka

help:
	@echo "make demo   - broker + worker + 1,797 real digits from 16 devices, prints a summary"
	@echo "make test   - the test suite: unit + integration on the embedded broker and Apache Kafka"
	@echo "make test-embedded / test-kafka - integration tests on one broker only"
	@echo "make test-kafka-slow - delivery under worker and broker failures on Apache Kafka (~9 min; CI runs it)"
	@echo "make kafka-jars - fetch Apache Kafka's jars with Maven (done on first use anyway)"
	@echo "make kafka  - run a local single-node Apache Kafka until Ctrl-C"
	@echo "make lint   - ruff and mypy"
	@echo "make bench  - benchmarks on CPU: ceilings, product, seeds' comparison, backlog, scale-out; Apache Kafka beside the embedded broker (~12 min), isolation from web queries and failing requests (~4 min), the cost of a hot swap (bench.swap, ~15 s)"
	@echo "make bench-smoke   - the same code paths, both brokers, in about 3 minutes (CI runs it as a test)"
	@echo "make bench-backlog - worker RSS with 1,000,000 requests waiting, alone"
	@echo "make bench-scaleout - only the scale-out: N = 1, 2 workers and the ceilings (~4 min)"
	@echo "make bench-hotpath - the worker's CPU per result against the best Faust agent on Apache Kafka (~3 min)"
	@echo "make train  - retrain the digits model (needs the 'train' extra: torch)"

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev,bench]'
	# tensorrt-stubs declares a dependency on tensorrt itself, which is not installable here;
	# the stubs alone are enough for mypy.
	$(BIN)/python -m pip install --quiet --no-deps 'tensorrt-stubs>=10.13'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/streamapp demo

# Everything except the heavy Apache Kafka delivery tests (test-kafka-slow; .ci/run runs both).
test: $(STAMP)
	$(BIN)/python -m pytest -m "not (slow and apache_kafka)"

test-kafka-slow: $(STAMP) kafka-jars
	$(BIN)/python -m pytest -m "slow and apache_kafka"

test-embedded: $(STAMP)
	$(BIN)/python -m pytest --broker=embedded

test-kafka: $(STAMP) kafka-jars
	$(BIN)/python -m pytest --broker=kafka

# Apache Kafka for the tests and `streamapp broker --kafka` (streamapp/kafka_server.py): the jars
# of deploy/kafka/pom.xml in ~/.cache/streamapp/kafka-<version>/libs ($$STREAMAPP_KAFKA_HOME).
kafka-jars: $(STAMP)
	$(BIN)/python scripts/kafka_jars.py

kafka: $(STAMP)
	$(BIN)/streamapp broker --kafka

test-fast: $(STAMP)
	$(BIN)/python -m pytest -m "not kafka and not slow"

lint: $(STAMP)
	$(BIN)/ruff check streamapp engines tests scripts bench
	$(BIN)/mypy
	$(BIN)/python scripts/mypy_tensorrt.py

train: $(STAMP)
	$(BIN)/python -m pip install --quiet -e '.[train]'
	$(BIN)/python scripts/train_digits.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache *.egg-info

docs: $(STAMP)
	$(BIN)/python scripts/update_readme.py

# Benchmarks (bench/, issue 6). Results: JSON, report.txt and PNGs under bench-results/.
bench: $(STAMP)
	$(BIN)/python -m bench run --profile cpu --out bench-results/cpu
	$(BIN)/python -m bench isolation --out bench-results/isolation
	$(BIN)/python -m bench.swap --out bench-results/swap.json

bench-smoke: $(STAMP)
	$(BIN)/python -m bench run --profile smoke --out bench-results/smoke

bench-backlog: $(STAMP)
	$(BIN)/python -m bench backlog --requests 1000000 --out bench-results/backlog

bench-scaleout: $(STAMP)
	$(BIN)/python -m bench scaleout --profile cpu --out bench-results/scaleout

bench-hotpath: $(STAMP) kafka-jars
	$(BIN)/python -m bench hotpath --out bench-results/hotpath
