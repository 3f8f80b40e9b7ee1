# The two commands: `make demo` runs a local mesh on the built-in model, `make test` runs the tests.
# Both create .venv on first use and install the project into it with the tested pins.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.meshd-installed
NATIVE := $(VENV)/.meshd-native

.PHONY: demo test test-fast lint proto bench clean native system-tools

$(STAMP): pyproject.toml constraints.txt
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[dev]'
	@touch $@

# llama.cpp for GGUF models (native/): built from source, about 5 minutes the first time.
$(NATIVE): $(STAMP) native/build.sh
	native/build.sh $(BIN)/python cpu
	@touch $@

native: $(NATIVE)

# Tools some tests drive: systemd-analyze (unit files) and chromium (the status page, headless).
# Installed with Debian's apt-get when missing and this is root; otherwise those tests say what is missing.
SYSTEM_TOOLS := systemd-analyze:systemd chromium:chromium
system-tools:
	@missing=""; for pair in $(SYSTEM_TOOLS); do command -v $${pair%%:*} >/dev/null || missing="$$missing $${pair#*:}"; done; \
	if [ -n "$$missing" ]; then \
		if command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ]; then \
			echo "installing Debian packages:$$missing"; \
			apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing >/dev/null; \
		else echo "note: missing$$missing and cannot install here; the tests that need them will fail"; fi; \
	fi

demo: $(STAMP)
	$(BIN)/meshctl demo

# MESHD_REQUIRE_*: the llama.cpp and system-tool tests fail rather than skip when what they need is missing.
test: $(NATIVE) system-tools
	$(BIN)/ruff check meshd tests relay
	$(BIN)/mypy
	MESHD_REQUIRE_NATIVE=1 MESHD_REQUIRE_SYSTEM_TOOLS=1 $(BIN)/python -m pytest

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
