# Quick start:  make demo   (set up + run the embedded demo)
#               make test   (set up + run the test suite)
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
OPENBLAS := /usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0
# arctic-inference's wheel, built once from source and reused by every venv.
WHEELS := build/wheels
ARCTIC := $(shell grep -o 'arctic-inference==[0-9.]*' setup.cfg)
# The oldest mlx-lm in setup.cfg's range and the oldest mlx it takes
# (`make test-oldest`); `make test` gets the newest of the range.
OLDEST_MLX_LM := 0.32.0
OLDEST_MLX := 0.32.2
OLDEST_VENV ?= .venv-oldest
MLX := $(if $(filter Darwin,$(shell uname -s)),mlx,mlx[cpu])

.PHONY: setup demo test test-oldest lint bench clean

setup: $(VENV)/.installed

$(VENV)/.installed: setup.cfg setup.py pyproject.toml build-constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade "pip>=25.3"
	# arctic-inference builds from source (~2 minutes, once).
	$(BIN)/python -m pip wheel --no-deps --build-constraint build-constraints.txt \
		--find-links $(WHEELS) -w $(WHEELS) "$(ARCTIC)"
	$(BIN)/python -m pip install --find-links $(WHEELS) -e ".[test,bench]"
	touch $@

# A venv with the oldest supported mlx-lm installed first, as a user's would
# be; installing the plugin beside it must leave every package as it was.
$(OLDEST_VENV)/.installed: $(VENV)/.installed
	rm -rf $(OLDEST_VENV)
	$(PYTHON) -m venv $(OLDEST_VENV)
	$(OLDEST_VENV)/bin/python -m pip install --quiet --upgrade "pip>=25.3"
	$(OLDEST_VENV)/bin/python -m pip install --quiet "mlx-lm==$(OLDEST_MLX_LM)" "$(MLX)==$(OLDEST_MLX)"
	.ci/install-beside $(OLDEST_VENV)/bin/python --find-links $(WHEELS) -e ".[test,bench]"
	touch $@

demo: setup
	$(BIN)/mlx-lm-suffix demo

test: setup
	$(BIN)/python -m pytest -q

test-oldest: $(OLDEST_VENV)/.installed
	$(OLDEST_VENV)/bin/python -m pytest -q

lint: setup
	$(BIN)/ruff check mlx_lm_suffix tests examples

# Benchmarks want an optimised BLAS on Linux (see README, "Benchmarks").
bench: setup
	$(BIN)/mlx-lm-suffix bench

clean:
	rm -rf $(VENV) $(OLDEST_VENV) build *.egg-info .pytest_cache
