# Two commands for a newcomer on a fresh machine:
#   make run    install everything, then start the main job
#   make test   install everything, then run the test suite
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install run test bench

# torch first and pinned: an unpinned torch pulls a multi-GB CUDA build; 2.13.0 is a CPU build on CPU hosts.
$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

run: install
	$(BIN)/serve run configs/default.yaml

test: install
	$(BIN)/python -m pytest -q

bench: install
	$(BIN)/python benchmarks/throughput.py
