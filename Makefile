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

.PHONY: run test chaos bench lint docs clean venv

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --disable-pip-version-check -e '.[dev]'
	touch $(STAMP) $(RUN_STAMP)

$(RUN_STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --disable-pip-version-check -e .
	touch $(RUN_STAMP)

## run: install the runtime into .venv and start runstile (embedded broker, demo tasks)
## on PORT (default 8000)
run: $(RUN_STAMP)
	$(VENV)/bin/runstile up --data-dir $(DATA) --port $(PORT)

## test: install dev dependencies and run the whole suite (chaos profile excluded)
test: venv
	$(PY) -m pytest $(PYTEST_ARGS)

## chaos: the long fault-injection and soak runs
chaos: venv
	$(PY) -m pytest -m chaos -p no:cacheprovider $(PYTEST_ARGS)

## bench: benchmarks, reported as ratios against baselines measured in the same run
bench: venv
	$(PY) bench/run.py

## lint: ruff (every file) and mypy (strict where pyproject.toml says)
lint: venv
	$(VENV)/bin/ruff check runstile tests bench
	$(VENV)/bin/mypy

## docs: build docs/ with mkdocs --strict (a broken link or anchor fails)
docs: venv
	$(VENV)/bin/mkdocs build --strict

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache build *.egg-info
