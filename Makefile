# `make demo` and `make test` do all the set-up on a fresh machine (a venv in .venv).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# torch 2.13.0 is the CPU build CI machines carry on disk; the GPU machine runs its own torch.
TORCH_PIN ?= torch==2.13.0
TRITON_PIN ?= triton==3.6.0

.PHONY: install demo test lint unit clean

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_PIN)" "$(TRITON_PIN)" "numpy<2.4"
	$(PY) -m pip install -q -e ".[dev,report]"
	touch $@

install: $(VENV)/.installed

demo: install
	$(VENV)/bin/fusegraph demo

lint: install
	$(VENV)/bin/ruff check src tests bench
	$(VENV)/bin/mypy

unit: install
	TRITON_INTERPRET=1 $(VENV)/bin/pytest -q -n 2 tests

test: lint unit

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
