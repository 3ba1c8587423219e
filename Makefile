# Two entry points for a new user: `make demo` and `make test`.
# Both create .venv, install the CPU build of torch first (a bare `torch`
# requirement would pull a multi-GB CUDA build), then the project.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
CHECKPOINT ?= checkpoints/tiny-llama

.PHONY: install demo test lint typecheck clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

demo: install
	$(VENV)/bin/disagg demo

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

typecheck: install
	$(VENV)/bin/mypy

test: lint typecheck
	$(PY) -m pytest -q tests

clean:
	rm -rf $(VENV) checkpoints
