# `make demo` and `make test` do all the set-up on a fresh machine: a virtual environment in .venv,
# the pinned torch/triton, this package (editable) with its dev tools, then the run.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# torch 2.13.0 (the CPU build on CI machines) and the GPU machine's triton; override on the command line.
TORCH_PIN ?= torch==2.13.0
TRITON_PIN ?= triton==3.6.0
# pytest workers for `make unit`
JOBS ?= 2
LINT_PATHS := src tests $(wildcard bench)

.PHONY: install demo test lint unit clean

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_PIN)" "$(TRITON_PIN)" "numpy<2.4"
	$(PY) -m pip install -q -e ".[dev,report]"
	touch $@

install: $(VENV)/.installed

# Without a GPU the demo's generated Triton kernels run under Triton's CPU interpreter.
demo: install
	@if $(PY) -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then \
		$(VENV)/bin/fusegraph demo; \
	else \
		TRITON_INTERPRET=1 $(VENV)/bin/fusegraph demo; \
	fi

lint: install
	$(VENV)/bin/ruff check $(LINT_PATHS)
	$(VENV)/bin/mypy

unit: install
	TRITON_INTERPRET=1 $(VENV)/bin/pytest -q -n $(JOBS) tests

test: lint unit

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
