# One command each from a fresh clone: `make demo`, `make test` (lint, types and the full suite).
# `make test-fast` is the edit loop: the tests not marked slow, on 2 workers, under a minute on 2 cores; no lint
# or types.
PYTHON ?= python3.11
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: demo test test-fast lint typecheck install clean bench

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/allreduce demo

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/ruff format --check src tests benchmarks

typecheck: $(STAMP)
	$(BIN)/mypy

test: lint typecheck
	$(BIN)/python -m pytest -q

# pytest exits 5 when the marker selects no test: make stops on it, as on any failure.
test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow" -n 2

clean:
	rm -rf $(VENV) build .pytest_cache .mypy_cache .ruff_cache src/*.egg-info
