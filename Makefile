# Two commands on a fresh machine: `make demo` and `make test`. Both create or reuse .venv.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# torch first and pinned: an unpinned torch pulled in by deepspeed/transformers would resolve to the newest
# release with several GB of CUDA wheels. On a GPU machine, override e.g. TORCH_SPEC="torch==2.13.0" with
# your CUDA index configured, or install torch yourself before `make`.
TORCH_SPEC ?= torch==2.13.0
# The exact versions the test suite was run with (pyproject.toml states the wider tested ranges).
# `make CONSTRAINTS=` installs without them, e.g. on a GPU machine with its own torch.
CONSTRAINTS ?= constraints.txt
PIP := $(PY) -m pip install -q --disable-pip-version-check $(if $(CONSTRAINTS),-c $(CONSTRAINTS))
STAMP := $(VENV)/.grpo-stack-installed
PYTEST_ARGS ?=

.PHONY: install test test-fast lint demo bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)

# Re-installs when pyproject.toml changes.
$(STAMP): pyproject.toml $(CONSTRAINTS) | $(PY)
	$(PIP) "$(TORCH_SPEC)"
	$(PIP) "$(TORCH_SPEC)" -e ".[dev]"
	touch $@

install: $(STAMP)

lint: $(STAMP)
	$(VENV)/bin/ruff check .

test: $(STAMP) lint
	$(PY) -m pytest $(PYTEST_ARGS)

# The quick loop: everything except tests marked slow.
test-fast: $(STAMP)
	$(PY) -m pytest -m "not slow" $(PYTEST_ARGS)

# Until the launcher lands (grpo run), the demo builds and warms up the tiny model and reports its accuracy.
demo: $(STAMP)
	$(VENV)/bin/grpo tiny-model --out runs/demo/tiny-model

bench: $(STAMP)
	$(PY) bench/logprobs_memory.py

clean:
	rm -rf $(VENV) runs .pytest_cache .ruff_cache .hypothesis
