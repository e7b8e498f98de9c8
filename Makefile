# Two commands on a fresh clone: `make train` and `make test`; both set themselves up first.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
DEV     := $(VENV)/.dev-installed
TORCH   := torch==2.13.0
TRITON  := triton==3.9.0
TORCHAO := torchao==0.18.0
TITAN_WHEELS := torchtitan==0.3.0 spmd_types==0.2.3 tyro==1.0.17 docstring-parser==0.18.0

.PHONY: setup dev train test test-all test-slow test-fast test-dist docs lint bench bench-gpu gpu-wheels clean

setup: $(STAMP)

# The runtime only (`make train`): pyproject.toml's dependencies. torch goes in first, the CPU
# build, and only where no torch is there yet: a machine whose Python already has one (a GPU
# image's CUDA build) gets a venv that sees it (--system-site-packages) and keeps it; a
# looser install would pull the CUDA wheels from the registry.
$(STAMP): pyproject.toml Makefile
	test -d $(VENV) || $(PY) -m venv \
		$$($(PY) -c 'import torch' 2>/dev/null && echo --system-site-packages) $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/python -c 'import torch' 2>/dev/null || $(BIN)/pip install -q $(TORCH)
	$(BIN)/pip install -q -e .
	touch $(STAMP)

# The test and benchmark tools on top (`make test`, `make bench`): the dev extra, and
# torchtitan (the peer the benchmark tests compare against) without its dependencies: its
# Llama model needs only these (triton is imported, never run, on CPU); its own requirements
# (datasets, torchdata, ...) serve its trainer, which the tests do not use.
dev: $(DEV)
$(DEV): $(STAMP)
	$(BIN)/pip install -q -e '.[dev]'
	$(BIN)/pip install -q --no-deps $(TITAN_WHEELS) $(TRITON)
	touch $(DEV)

train: setup
	$(BIN)/python -m launcher.train $(ARGS)

# Everything but the `slow` tier (the few comparisons that need minutes: docs/testing.md), with
# the 25 slowest tests and the process groups' times at the end. test-all adds the slow tier
# and ten times the property-test examples.
PYTEST := $(BIN)/python -m pytest -q --durations=25

test: dev
	-bash tests/slurm/install.sh
	$(PYTEST) -m "not slow" $(ARGS)

test-all: dev
	-bash tests/slurm/install.sh
	HYPOTHESIS_PROFILE=thorough $(PYTEST) $(ARGS)

test-slow: dev
	-bash tests/slurm/install.sh
	$(PYTEST) -m slow $(ARGS)

test-fast: dev
	$(PYTEST) -m "not dist and not e2e" $(ARGS)

test-dist: dev
	$(PYTEST) -m "dist or e2e" $(ARGS)

# Every block of real output in README.md and docs/ run again and rewritten where it changed
# (launcher/docs.py; make test checks them), the slow tier's and the SLURM ones (on the test
# cluster) included.
docs: dev
	-bash tests/slurm/install.sh
	DOCS_UPDATE=1 $(PYTEST) -m "" tests/test_docs.py tests/slurm/test_docs.py -k block_matches

bench: dev
	$(BIN)/python -m launcher.bench

# One GPU: the engine, transformers and torchtitan on Llama 3.2 1B (docs/speed.md).
bench-gpu: dev
	$(BIN)/python -m launcher.bench.gpu $(ARGS)

# What the GPU machine's image lacks, as wheels for its Python 3.12 (docs/speed.md):
# pure-Python distributions, installed there with pip --no-deps --target.
# torchao's wheel (precision=fp8) is abi3 for manylinux_2_28, built against the image's torch.
GPU_WHEELS := hydra-core==1.3.8 omegaconf==2.3.1 $(TORCHAO) $(TITAN_WHEELS)
gpu-wheels: dev
	mkdir -p .whl
	$(BIN)/pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
		--implementation cp --platform manylinux2014_x86_64 \
		--platform manylinux_2_28_x86_64 -d .whl $(GPU_WHEELS)
	$(BIN)/pip wheel -q --no-deps -w .whl antlr4-python3-runtime==4.9.3  # sdist only

lint: dev
	$(BIN)/ruff check launcher tests hydra_plugins
	$(BIN)/ruff format --check launcher tests hydra_plugins

clean:
	rm -rf outputs .pytest_cache
