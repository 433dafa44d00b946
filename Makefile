# Every target sets itself up: a fresh clone needs only `make demo` or `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install demo test lint format bench clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --disable-pip-version-check -q "torch==2.13.0" -e ".[dev]"
	touch $(STAMP)

demo: install
	$(VENV)/bin/stepwatch demo

lint: install
	$(VENV)/bin/ruff check src tests bench examples
	$(VENV)/bin/ruff format --check src tests bench examples
	$(VENV)/bin/mypy

format: install
	$(VENV)/bin/ruff format src tests bench examples
	$(VENV)/bin/ruff check --fix src tests bench examples

test: lint
	$(PY) -m pytest -q

$(VENV)/.bench-installed: $(STAMP)
	$(PY) -m pip install --disable-pip-version-check -q "torch==2.13.0" -e ".[dev,bench]"
	touch $@

bench: $(VENV)/.bench-installed
	$(PY) bench/import_time.py
	$(PY) bench/overhead.py
	$(PY) bench/step_overhead.py
	$(PY) bench/logging_throughput.py
	$(PY) bench/memory.py
	$(PY) bench/gpu_sync.py
	$(PY) bench/gpu_amp.py
	$(PY) bench/distributed.py

clean:
	rm -rf $(VENV) build dist src/*.egg-info .pytest_cache .ruff_cache
