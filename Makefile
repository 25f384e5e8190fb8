# runstile — the two commands: `make run` and `make test` (see README.md).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed
DATA   ?= ./runstile-data
PYTEST_ARGS ?=

.PHONY: run test chaos bench lint docs screenshots clean venv

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet -e '.[dev]'
	touch $(STAMP)

## run: install into .venv and start runstile on the embedded default with demo tasks
run: venv
	$(VENV)/bin/runstile up --data-dir $(DATA)

## test: install dev dependencies and run the whole suite (chaos profile excluded)
test: venv
	$(PY) -m pytest $(PYTEST_ARGS)

## chaos: the long fault-injection and soak runs
chaos: venv
	$(PY) -m pytest -m chaos -p no:cacheprovider $(PYTEST_ARGS)

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
