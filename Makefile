# Two commands work on a fresh machine with nothing but python3 installed:
#   make demo   - builds .venv and runs the quick-start examples
#   make test   - builds .venv, builds the docs (strict) and runs the whole test suite (what CI runs, via .ci/run)
#   make docs   - builds the documentation site into site/ with warnings as errors (open site/index.html)
#
# torch is installed first, pinned, so that pip never pulls a multi-gigabyte CUDA build for the
# `torch>=2.4` requirement; set TORCH_SPEC to use another build (e.g. TORCH_SPEC="torch==2.5.1").

PYTHON ?= python3
TORCH_SPEC ?= torch==2.13.0
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test docs clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e ".[test,triton,plot,docs]"
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python examples/01_celsius_to_fahrenheit.py
	$(BIN)/python examples/02_digits.py

# (no --quiet: it hides the warnings that --strict turns into errors, and the build then passes)
docs: $(STAMP)
	$(BIN)/python -m mkdocs build --strict

test: docs
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) .pytest_cache site
