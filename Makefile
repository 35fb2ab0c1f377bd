# Two commands on a fresh machine: `make demo` and `make test`. Each installs what it needs
# into .venv with pip, pinned by constraints.txt (torch==2.13.0, the CPU build).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
LMFORGE := $(VENV)/bin/lmforge
STAMP := $(VENV)/.installed

.PHONY: demo test lint install clean-demo

install: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints.txt torch==2.13.0
	$(PY) -m pip install --quiet -c constraints.txt -e '.[dev]'
	# torchtune: a test-only reference for the DPO losses; its loss module needs only torch
	$(PY) -m pip install --quiet --no-deps -c constraints.txt torchtune
	touch $(STAMP)

demo: $(STAMP)
	$(LMFORGE) run recipes/demo/lifecycle.yaml

test: $(STAMP)
	$(PY) -m pytest -q

lint: $(STAMP)
	$(VENV)/bin/ruff check lmforge tests benchmarks scripts
	$(VENV)/bin/lint-imports --no-cache

clean-demo:
	rm -rf runs/demo
