# The two commands: `make demo` runs a local mesh on the built-in model, `make test` runs the tests.
# Both create .venv on first use and install the project into it with the tested pins.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.meshd-installed

.PHONY: demo test test-fast lint proto bench clean

$(STAMP): pyproject.toml constraints.txt
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[dev]'
	@touch $@

demo: $(STAMP)
	$(BIN)/meshctl demo

test: $(STAMP)
	$(BIN)/ruff check meshd tests relay
	$(BIN)/mypy
	$(BIN)/python -m pytest

test-fast: $(STAMP)
	$(BIN)/python -m pytest -m 'not slow'

lint: $(STAMP)
	$(BIN)/ruff check meshd tests relay
	$(BIN)/mypy

# Regenerate the protobuf modules from proto/; tests fail when the committed ones differ.
proto: $(STAMP)
	$(BIN)/python -m meshd.wire.codegen

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
