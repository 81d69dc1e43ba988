# One command each from a fresh clone: `make demo`, `make test` (lint, types and the full suite).
# `make test-fast` is the edit loop: the tests not marked slow, on 2 workers, under a minute on 2 cores; no lint
# or types.
PYTHON ?= python3.11
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: demo test test-fast test-conformance lint typecheck install clean bench bytecode

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[test]'
	# Chakra's converter alone (it imports protobuf only); its dependencies pull in ~70 packages for its linker.
	$(BIN)/python -m pip install --quiet --no-deps mlc-chakra==1.0.0
	touch $(STAMP)

install: $(STAMP)

# Byte-compile our own modules once: with PYTHONDONTWRITEBYTECODE set (common in containers and CI images) every
# interpreter would compile them again on import (0.55 s instead of 0.41 s for `import allreduce` here), and the
# suite and the demo start hundreds of interpreters (ranks, launchers, CLI runs).
bytecode: $(STAMP)
	$(BIN)/python -m compileall -q src tests benchmarks

demo: $(STAMP) bytecode
	$(BIN)/allreduce demo

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/ruff format --check src tests benchmarks

typecheck: $(STAMP)
	$(BIN)/mypy

# Two workers for everything that does not time real processes against each other (one module per worker: its
# fixtures start once), then the timing tests alone (marked serial). Both parts must run a test (exit 5 fails).
test: lint typecheck bytecode
	$(BIN)/python -m pytest -q -n 2 --dist loadscope --no-loadscope-reorder -m "not serial"
	$(BIN)/python -m pytest -q -m serial

# pytest exits 5 when the marker selects no test: make stops on it, as on any failure.
test-fast: $(STAMP) bytecode
	$(BIN)/python -m pytest -q -m "not slow and not serial" -n 2

# torch's own distributed test suite on the allreduce backend, at 2 and 3 ranks: every test Gloo passes here
# (tests/torch/conformance/gloo_passes.json) must pass, or fail as expected_failures.yaml says and why. A few
# minutes on 2 cores, so a CI step of its own after `make test` (which runs a slice of it).
test-conformance: $(STAMP)
	$(BIN)/python tests/torch/conformance/run.py check --jobs 2

clean:
	rm -rf $(VENV) build .pytest_cache .mypy_cache .ruff_cache src/*.egg-info
