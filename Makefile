# Quick start:  make demo   (set up + run the embedded demo)
#               make test   (set up + run the test suite)
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
OPENBLAS := /usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0

.PHONY: setup demo test lint bench clean

setup: $(VENV)/.installed

$(VENV)/.installed: setup.cfg setup.py pyproject.toml build-constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade "pip>=25.3"
	# arctic-inference builds from source (~2 minutes, once).
	$(BIN)/python -m pip install --build-constraint build-constraints.txt -e ".[test,bench]"
	touch $@

demo: setup
	$(BIN)/mlx-lm-suffix demo

test: setup
	$(BIN)/python -m pytest -q

lint: setup
	$(BIN)/ruff check mlx_lm_suffix tests examples

# Benchmarks want an optimised BLAS on Linux (see README, "Benchmarks").
bench: setup
	$(BIN)/mlx-lm-suffix bench

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
