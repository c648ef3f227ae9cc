# Set-up, run, test and benchmark. Every target creates the venv first, so each works on a fresh clone.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: venv up test test-long lint bench tiny-model clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

venv: $(STAMP)

tiny-model: $(STAMP)
	$(VENV)/bin/orchestrator tiny-model

up: tiny-model
	$(VENV)/bin/orchestrator up deploy/local/cluster.yaml

test: tiny-model
	$(PY) -m pytest -q -m "not long"

test-long: tiny-model
	$(PY) -m pytest -q -m long

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy common frontend orchestrator postproc_worker

bench: tiny-model
	$(PY) bench/serving.py
	$(PY) bench/engine.py
	$(PY) bench/guided.py

clean:
	rm -rf $(VENV) *.egg-info
