# Two commands set up a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install demo test test-all lint typecheck bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	# torch first, pinned: a looser requirement would pull a multi-GB CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) -m pipetrain demo

lint: $(STAMP)
	$(PY) -m ruff check pipetrain tests $(wildcard benchmarks)
	$(PY) -m ruff format --check pipetrain tests $(wildcard benchmarks)

# mypy (config in pyproject.toml): strict on schedule, sim, render, planner and the Pipeline
# module, basic elsewhere; its cache (.mypy_cache) makes a re-check take a few seconds.
typecheck: $(STAMP)
	$(PY) -m mypy

# two workers, each test file on one of them (its module fixtures run once): the multi-process
# cases of one file overlap the single-process cases of another instead of waiting for them
test: lint typecheck
	$(PY) -m pytest -n 2 --dist loadfile

# everything, the stress tier too (the benchmarks' long CPU dry runs)
test-all: lint typecheck
	$(PY) -m pytest -n 2 --dist loadfile -m "stress or not stress"

bench: $(STAMP)
	$(PY) benchmarks/schedules/schedule_build.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache .mypy_cache
