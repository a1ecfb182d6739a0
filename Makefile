# Everything runs from a virtual environment that these targets create and reuse.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: help install demo test test-fast lint docs bench train clean

help:
	@echo "make demo   - broker + worker + 1,797 real digits from 16 devices, prints a summary"
	@echo "make test   - the whole test suite (unit + integration on the embedded broker)"
	@echo "make lint   - ruff and mypy"
	@echo "make train  - retrain the digits model (needs the 'train' extra: torch)"

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	# tensorrt-stubs declares a dependency on tensorrt itself, which is not installable here;
	# the stubs alone are enough for mypy.
	$(BIN)/python -m pip install --quiet --no-deps 'tensorrt-stubs>=10.13'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/streamapp demo

test: $(STAMP)
	$(BIN)/python -m pytest

test-fast: $(STAMP)
	$(BIN)/python -m pytest -m "not kafka and not slow"

lint: $(STAMP)
	$(BIN)/ruff check streamapp engines tests scripts
	$(BIN)/mypy

train: $(STAMP)
	$(BIN)/python -m pip install --quiet -e '.[train]'
	$(BIN)/python scripts/train_digits.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache *.egg-info

docs: $(STAMP)
	$(BIN)/python scripts/update_readme.py
