# The two set-up commands of the README. Each installs what it needs first (idempotent, fast
# when .venv is already up to date), then runs its job.
VENV := .venv
BIN := $(VENV)/bin

.PHONY: setup quickstart test lint bench

setup:
	@bash scripts/setup.sh

quickstart: setup
	$(BIN)/adapt quickstart

test: setup
	$(BIN)/ruff check .
	$(BIN)/lint-imports
	$(BIN)/python -m pytest -q --maxfail=20 || { code=$$?; [ $$code -eq 5 ] && echo "no tests collected: failing" >&2; exit $$code; }

lint: setup
	$(BIN)/ruff check .
	$(BIN)/lint-imports
	$(BIN)/ruff format --check .

bench: setup
	$(BIN)/python -m experiments.bench_replay
