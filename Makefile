# Every target sets itself up: a fresh clone needs only `make demo` or `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# The dashboard's chart library, fetched from npm and shipped inside the package (not committed):
# every build places it (build_support/stepwatch_build.py, which pins its version and hashes).
VENDOR := src/stepwatch/dashboard/static/vendor
UPLOT := $(VENDOR)/uPlot.iife.min.js

.PHONY: install browser postgres demo test lint format docs bench clean

install: $(STAMP) $(UPLOT) browser postgres

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --disable-pip-version-check -q "torch==2.13.0" -e ".[dev]"
	touch $(STAMP)

$(UPLOT): Makefile build_support/stepwatch_build.py
	$(PY) build_support/stepwatch_build.py

# The browser tests use Debian's Chromium; as root it is installed when missing, otherwise
# those tests skip (and .ci/run turns that skip into a failure).
browser:
	@if [ -x /usr/bin/chromium ] && [ -x /usr/bin/chromedriver ]; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null; \
	else echo "make install: no /usr/bin/chromium (not root): the browser tests will skip"; fi

# The PostgreSQL tests start a throwaway server from Debian's PostgreSQL; as root it is installed
# when missing, otherwise those tests skip (and .ci/run turns that skip into a failure).
postgres:
	@if command -v pg_config >/dev/null && [ -x "$$(pg_config --bindir)/initdb" ]; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql >/dev/null; \
	else echo "make install: no PostgreSQL server binaries (not root): the PostgreSQL tests will skip"; fi

demo: install
	$(VENV)/bin/stepwatch demo

lint: install
	$(VENV)/bin/ruff check src tests bench examples build_support docs/_hooks.py
	$(VENV)/bin/ruff format --check src tests bench examples build_support docs/_hooks.py
	$(VENV)/bin/mypy

format: install
	$(VENV)/bin/ruff format src tests bench examples build_support docs/_hooks.py
	$(VENV)/bin/ruff check --fix src tests bench examples build_support docs/_hooks.py

# The documentation site, into site/: a broken link, page or API reference fails the build.
docs: install
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet

test: lint docs
	$(PY) -m pytest -q

$(VENV)/.bench-installed: $(STAMP)
	$(PY) -m pip install --disable-pip-version-check -q "torch==2.13.0" -e ".[dev,bench]"
	touch $@

bench: $(VENV)/.bench-installed
	$(PY) bench/import_time.py
	$(PY) bench/overhead.py
	$(PY) bench/interleaved.py
	$(PY) bench/wake_cost.py
	$(PY) bench/step_overhead.py
	$(PY) bench/logging_throughput.py
	$(PY) bench/memory.py
	$(PY) bench/gpu_sync.py
	$(PY) bench/gpu_amp.py
	$(PY) bench/distributed.py
	$(PY) bench/bridges.py
	$(PY) bench/postgres.py
	$(PY) bench/dashboard.py
	$(PY) bench/diagnose.py

clean:
	rm -rf $(VENV) build dist site src/*.egg-info .pytest_cache .ruff_cache $(VENDOR) artifacts
