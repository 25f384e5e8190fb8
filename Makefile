# runstile — the two commands: `make run` and `make test` (see README.md).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
# Two stamps: `make run` installs what running needs (RUN_STAMP); `make test` and the
# other developer targets add the dev extra (STAMP), which includes the runtime too.
STAMP  := $(VENV)/.installed
RUN_STAMP := $(VENV)/.installed-run
DATA   ?= ./runstile-data
PORT   ?= 8000
PYTEST_ARGS ?=
# The ledger the suite runs on: sqlite, or postgresql (a database per test on the server
# RUNSTILE_TEST_DATABASE_URL names; tests/postgres.py). Unset: SQLite, plus the ledger
# unit tests on PostgreSQL too when RUNSTILE_TEST_DATABASE_URL is set.
LEDGER ?=

.PHONY: run test chaos bench lint docs screenshots clean venv

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip --version >/dev/null 2>&1 || $(PY) -m ensurepip --upgrade
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet -e '.[dev]'
	touch $(STAMP) $(RUN_STAMP)

# The runtime alone, quickly: a venv without its own pip, filled by this Python's pip
# (pip >= 22.3 installs into another interpreter with --python), else by the venv's.
$(RUN_STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv --without-pip $(VENV)
	if $(PYTHON) -m pip --python $(PY) --version >/dev/null 2>&1; then \
	  $(PYTHON) -m pip --python $(PY) install --quiet --disable-pip-version-check -e . ; \
	else \
	  $(PY) -m ensurepip --upgrade >/dev/null && \
	  $(PIP) install --quiet --disable-pip-version-check -e . ; \
	fi
	touch $(RUN_STAMP)

## run: install the runtime into .venv and start runstile (embedded broker, demo tasks)
## on PORT (default 8000)
run: $(RUN_STAMP)
	$(VENV)/bin/runstile up --data-dir $(DATA) --port $(PORT)

## test: install dev dependencies and run the whole suite (chaos profile excluded);
## LEDGER=postgresql runs it on PostgreSQL
test: venv
	RUNSTILE_TEST_LEDGER=$(LEDGER) $(PY) -m pytest $(PYTEST_ARGS)

## chaos: the long fault-injection and soak runs (LEDGER=postgresql: on PostgreSQL)
chaos: venv
	RUNSTILE_TEST_LEDGER=$(LEDGER) $(PY) -m pytest -m chaos -p no:cacheprovider $(PYTEST_ARGS)

## bench: benchmarks, reported as ratios against baselines measured in the same run
bench: venv
	$(PY) bench/run.py

## screenshots: the dashboard's browser tests, leaving docs/img/*.png for docs/dashboard.md
screenshots: venv
	RUNSTILE_SCREENSHOTS=docs $(PY) -m pytest tests/ui -p no:cacheprovider $(PYTEST_ARGS)

## lint: ruff (every file) and mypy (strict where pyproject.toml says)
lint: venv
	$(VENV)/bin/ruff check runstile tests bench
	$(VENV)/bin/mypy

## docs: build docs/ with mkdocs --strict (a broken link or anchor fails)
docs: venv
	$(VENV)/bin/mkdocs build --strict

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache build *.egg-info
