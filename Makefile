# Every target creates .venv when missing and installs into it. torch comes first from TORCH_SPEC
# (a CPU build by default) so pip never pulls a multi-GB CUDA build on a CPU machine; override it,
# e.g. `make serve TORCH_SPEC='torch==2.13.0 --index-url https://download.pytorch.org/whl/cu124'`.
PYTHON ?= python3
TORCH_SPEC ?= torch==2.13.0
VENV := .venv
BIN := $(VENV)/bin
STATE_DIR ?= var
PYTEST_ARGS ?=

.PHONY: serve test bench loadtest isolation install dev clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --upgrade pip >/dev/null

$(VENV)/.torch: | $(BIN)/python
	$(BIN)/pip install $(TORCH_SPEC)
	touch $@

$(VENV)/.installed: pyproject.toml $(VENV)/.torch
	$(BIN)/pip install -e .
	touch $@

$(VENV)/.installed-dev: pyproject.toml $(VENV)/.torch
	$(BIN)/pip install -e '.[dev]'
	touch $@ $(VENV)/.installed

install: $(VENV)/.installed
dev: $(VENV)/.installed-dev

serve: $(VENV)/.installed
	$(BIN)/lorafarm up --state-dir $(STATE_DIR)

test: $(VENV)/.installed-dev
	$(BIN)/python -m pytest $(PYTEST_ARGS)

bench: $(VENV)/.installed-dev
	$(BIN)/python -m pytest benchmarks --benchmark-only --benchmark-enable -p no:cacheprovider $(PYTEST_ARGS)

loadtest: $(VENV)/.installed-dev
	$(BIN)/lorafarm loadtest --ab

isolation: $(VENV)/.installed-dev
	LORAFARM_ISOLATION_REQUESTS=10000 $(BIN)/python -m pytest tests/e2e -k isolation $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .cache build *.egg-info
