# `make pipeline` installs (once) and runs the four DVC stages; `make test` installs and runs the tests.
# The install is the pinned requirements.lock; `make lock` re-resolves it from pyproject.toml.
VENV ?= .venv
PYTHON ?= python3
BIN := $(abspath $(VENV))/bin
export PATH := $(BIN):$(PATH)

.PHONY: install pipeline test lock

# Every dependency at its locked version, then the project itself (editable, deps already there).
$(VENV)/.installed: pyproject.toml requirements.lock
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check -r requirements.lock
	$(BIN)/pip install --quiet --disable-pip-version-check --no-deps -e .
	touch $@

install: $(VENV)/.installed

pipeline: install
	dvc repro

test: install
	pytest

# After editing pyproject.toml: newest releases that satisfy it (Linux x86_64, Python 3.11).
lock: install
	$(BIN)/pip-compile --upgrade --extra dev --strip-extras --allow-unsafe \
	    --no-emit-index-url --no-emit-find-links --output-file requirements.lock pyproject.toml
