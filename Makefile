# One-command set-up: `make test` creates .venv, installs the pinned stack, lints and tests.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install test test-fast lint quickstart clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet "pip==26.3"
	$(BIN)/pip install --quiet -c constraints.txt -e ".[dev,bench,ray,eval,finetune,ft,fp8]"
	touch $(STAMP)

install: $(STAMP)

lint: $(STAMP)
	$(BIN)/ruff check src tests bench
	$(BIN)/ruff format --check src tests bench

test: lint
	$(BIN)/python -m pytest -q

# Unit tests only (no training runs, no spawned processes): the tier for your own loop.
test-fast: lint
	$(BIN)/python -m pytest -q -m "not slow"

quickstart: $(STAMP)
	$(BIN)/marinlm quickstart

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
