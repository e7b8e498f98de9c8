# Two commands on a fresh clone: `make train` and `make test`; both set themselves up first.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
TORCH   := torch==2.13.0

.PHONY: setup train test test-all test-slow test-fast test-dist lint bench clean

setup: $(STAMP)

# torch goes in first, pinned, so that nothing later pulls the CUDA wheels from the registry.
$(STAMP): pyproject.toml
	test -d $(VENV) || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $(TORCH)
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

train: setup
	$(BIN)/python -m launcher.train $(ARGS)

# Everything but the `slow` tier (rows another row already covers, compile): under 30 minutes
# on 2 cores. test-all adds it.
test: setup
	$(BIN)/python -m pytest -q -m "not slow" $(ARGS)

test-all: setup
	$(BIN)/python -m pytest -q $(ARGS)

test-slow: setup
	$(BIN)/python -m pytest -q -m slow $(ARGS)

test-fast: setup
	$(BIN)/python -m pytest -q -m "not dist and not e2e" $(ARGS)

test-dist: setup
	$(BIN)/python -m pytest -q -m "dist or e2e" $(ARGS)

bench: setup
	$(BIN)/python -m launcher.bench

lint: setup
	$(BIN)/ruff check launcher models tests
	$(BIN)/ruff format --check launcher models tests

clean:
	rm -rf outputs .pytest_cache
