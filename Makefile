# One entry point for every check; CI (.ci/run) calls `make test` too.
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: demo test conformance compose-check lint typecheck check install clean

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $@

install: $(VENV)/.installed

demo: $(VENV)/.installed
	$(VENV)/bin/tokenfleet demo

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports

# The packages (pyproject's [tool.mypy]), then the benches and the conformance suite: their figures and
# checks of the real server are read as evidence, so they are typed too. (The rest of tests/ is not yet.)
typecheck: $(VENV)/.installed
	$(VENV)/bin/mypy
	$(VENV)/bin/mypy bench tests/conformance

test: $(VENV)/.installed lint
	$(PY) scripts/ensure_redis.py
	$(PY) -m pytest $(PYTEST_ARGS)

check: test typecheck

# The fleet against the real SGLang server (docs/servers.md). The recipe installs sglang for the CPU under
# REAL_SGLANG_ROOT once (3-4 minutes, ~6 GB) and serves a tiny model on REAL_SGLANG_PORT (the keyed server
# of one test takes the next port); a server already answering there with the suite's flags is reused.
REAL_SGLANG_RECIPE ?= $(abspath $(CURDIR)/../shared/real-sglang/recipe.sh)
REAL_SGLANG_ROOT ?= $(HOME)/.cache/real-sglang
REAL_SGLANG_PORT ?= 31000
REAL_SGLANG := REAL_SGLANG_RECIPE=$(REAL_SGLANG_RECIPE) REAL_SGLANG_ROOT=$(REAL_SGLANG_ROOT) REAL_SGLANG_PORT=$(REAL_SGLANG_PORT)

# One run of the suite at a time per REAL_SGLANG_ROOT (flock; a second run waits, and says how long): the
# recipe's serve step stops the server whose pid the root holds, so two runs at once stop each other's.
conformance: $(VENV)/.installed
	$(PY) scripts/ensure_redis.py
	$(REAL_SGLANG) $(PY) -m tests.conformance.real_server install
	$(REAL_SGLANG) flock --verbose $(REAL_SGLANG_ROOT)/.conformance.lock \
		$(PY) -m pytest tests/conformance -m conformance $(PYTEST_ARGS)

# The default compose.yaml stack on a real Docker engine (docs/operations.md): build, up, the demo job to exit
# 0, Flower, metrics, status, export, --scale worker=2, a crash and a revoke of a longer dataset, the ledger
# kept by `down`. A project of its own; `down -v` at the end. Needs `docker` (../shared/docker-local/setup.sh).
compose-check: $(VENV)/.installed
	$(PY) scripts/compose_check.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache tokenfleet-demo
