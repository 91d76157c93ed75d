# One entry point for every check; CI (.ci/run) calls `make test` too.
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: demo test lint typecheck check install clean

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

typecheck: $(VENV)/.installed
	$(VENV)/bin/mypy

test: $(VENV)/.installed lint
	$(PY) scripts/ensure_redis.py
	$(PY) -m pytest $(PYTEST_ARGS)

check: test typecheck

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache tokenfleet-demo
