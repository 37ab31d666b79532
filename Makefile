# Quick start: `make demo` runs the main example, `make test` runs the suite.
# Both make .venv and install what they need. torch==2.13.0 first: the CPU build this
# machine class carries (a bare `torch` would make pip fetch a multi-GB CUDA build).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH := torch==2.13.0

.PHONY: demo test bench bench-data lint clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q $(TORCH)
	$(BIN)/pip install -q -e .
	touch $@

$(VENV)/.installed-dev: $(VENV)/.installed
	$(BIN)/pip install -q -e ".[dev]"
	touch $@

$(VENV)/.installed-bench: $(VENV)/.installed
	$(BIN)/pip install -q -e ".[bench]"
	touch $@

demo: $(VENV)/.installed
	$(BIN)/asyncrl launch examples/grpo_tiny.py

test: $(VENV)/.installed-dev
	$(BIN)/python -m pytest -q --durations=15  # the slowest, to keep the suite in its budget

bench: $(VENV)/.installed-bench
	$(BIN)/python benchmarks/control_plane.py

bench-data: $(VENV)/.installed-bench
	$(BIN)/python benchmarks/data_plane.py

lint: $(VENV)/.installed-dev
	$(BIN)/ruff check asyncrl tests benchmarks examples
	$(BIN)/mypy

clean:
	rm -rf $(VENV)
