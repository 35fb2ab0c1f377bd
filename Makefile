# Two commands on a fresh machine: `make demo` and `make test`. Each installs what it needs
# into .venv with pip, pinned by constraints.txt (torch==2.13.0, the CPU build).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
LMFORGE := $(VENV)/bin/lmforge
STAMP := $(VENV)/.installed
# Caches and temporary files (torch inductor's, pytest's, Ray's session files, torchrun's logs)
# stay under .cache/ (git-ignored), not in the system's temporary directory; tests/conftest.py
# sets the same for a bare `pytest`.
CACHE := $(CURDIR)/.cache
export TMPDIR := $(CACHE)/tmp
export TORCHINDUCTOR_CACHE_DIR := $(CACHE)/torchinductor

.PHONY: demo test lint docs install clean-demo

install: $(STAMP)

$(TMPDIR):
	mkdir -p $@

$(STAMP): pyproject.toml constraints.txt | $(TMPDIR)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints.txt torch==2.13.0
	$(PY) -m pip install --quiet -c constraints.txt -e '.[dev,serve,eval,docs,wandb,mlflow,dp,lowbit]'
	# a headless Chromium (and its driver) for the chat page's browser test, where apt can install one;
	# without it that one test skips and says why
	command -v chromium >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null \
		&& apt-get install -y -qq chromium chromium-driver >/dev/null 2>&1; } || true
	# torchao: the test-only reference of NF4 (tests/peft), kept out of site-packages, where
	# transformers and peft import it and its CUDA extensions fail to load on the CPU torch, noisily
	$(PY) -m pip uninstall --quiet --yes torchao 2>/dev/null || true
	$(PY) -m pip install --quiet --no-deps --upgrade --target $(VENV)/reference -c constraints.txt torchao
	# torchtune: a test-only reference for the DPO losses; its loss module needs only torch
	$(PY) -m pip install --quiet --no-deps -c constraints.txt torchtune
	touch $(STAMP)

demo: $(STAMP) | $(TMPDIR)
	$(LMFORGE) run recipes/demo/lifecycle.yaml

# the suite in one worker per usable core (tests/conftest.py counts them and splits the threads);
# loadgroup keeps the tests that share a module-scoped fixture on one worker (docs/demo.md)
test: $(STAMP) | $(TMPDIR)
	$(PY) -m pytest -q --durations=25 -n auto --dist loadgroup

# the docs site (mkdocs.yml) at http://127.0.0.1:8000, rebuilt as docs/ changes; `make test` builds it
# with --strict (tests/test_docs_site.py)
docs: $(STAMP) | $(TMPDIR)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs serve -a 127.0.0.1:8000

lint: $(STAMP)
	$(VENV)/bin/ruff check lmforge tests benchmarks scripts
	$(VENV)/bin/lint-imports --no-cache

clean-demo:
	rm -rf runs/demo
