"""The docs/ folder stays in step with the code (docs/architecture.md, "Rules the tests keep").

Every expectation is derived from the code itself: the settings from ``Settings()`` and
``ENV_VARIABLES``, the commands by walking the click group, the error codes from
``runstile.errors``, the routes from the OpenAPI document the server serves.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
from pathlib import Path

import click
import pytest

from runstile import errors
from runstile.cli import cli
from runstile.config import ENV_VARIABLES, Settings
from runstile.web import openapi

DOCS = Path(__file__).resolve().parents[2] / "docs"
PAGES = ("guarantees.md", "api.md", "tasks.md", "configuration.md", "operations.md", "architecture.md",
         "dashboard.md")

#: Settings whose default is computed on the machine that runs runstile, not a constant:
#: attribute -> the words configuration.md must use for it instead of a value.
COMPUTED_DEFAULTS = {"node_id": "host name"}

#: Error classes that never reach an HTTP answer, and where they are raised instead.
NOT_SENT_OVER_HTTP = {
    "ConfigError": "settings and task modules at start-up, and the CLI",
    "NodeLocked": "runstile up, when the node lock is taken",
    "LeaseLost": "inside workers",
    "RunStopping": "inside workers (a journaled call meets a stop)",
    "ApiError": "raised by runstile.Client from an answer, never sent by the server",
    "AdmissionRace": "inside admission: admit re-reads (a replay or a 409, at last a 503)",
}

#: One row of the main table in configuration.md: | `RUNSTILE_X` | default | ...
_CONFIG_ROW = re.compile(r"^\|\s*`(RUNSTILE_[A-Z0-9_]+)`\s*\|([^|]*)\|", re.MULTILINE)


def read(page: str) -> str:
    return (DOCS / page).read_text(encoding="utf-8")


def default_text(value) -> set[str]:
    """The spellings configuration.md may use for a default value."""
    if value is None:
        return {"unset"}
    if isinstance(value, tuple):
        return {",".join(value)} if value else {"empty"}
    if isinstance(value, Path):
        text = str(value)
        return {text} if value.is_absolute() else {text, f"./{text}"}
    if isinstance(value, float) and value.is_integer():
        return {str(int(value))}
    return {str(value)}


def config_rows() -> dict[str, list[str]]:
    rows: dict[str, list[str]] = {}
    for name, cell in _CONFIG_ROW.findall(read("configuration.md")):
        rows.setdefault(name, []).append(cell.strip().strip("`").strip())
    return rows


def command_paths(command: click.Command, prefix: str = "runstile"):
    """Every visible command and subcommand, as it is typed: 'runstile keys create'."""
    if not isinstance(command, click.Group):
        return
    for name, sub in sorted(command.commands.items()):
        if sub.hidden:  # internal entry points started by other commands
            continue
        path = f"{prefix} {name}"
        yield path
        yield from command_paths(sub, path)


def http_error_classes() -> list[type[errors.RunstileError]]:
    return [cls for _, cls in inspect.getmembers(errors, inspect.isclass)
            if issubclass(cls, errors.RunstileError) and cls.__module__ == errors.__name__
            and cls.__name__ not in NOT_SENT_OVER_HTTP]


def test_every_docs_page_the_readme_links_to_exists():
    readme = (DOCS.parent / "README.md").read_text(encoding="utf-8")
    linked = set(re.findall(r"\(docs/([\w.-]+\.md)\)", readme))
    assert linked <= set(PAGES)
    for page in PAGES:
        assert (DOCS / page).is_file(), page


def test_every_environment_variable_has_one_row_in_configuration_md_with_its_default():
    rows, defaults = config_rows(), Settings()
    fields = {f.name: f for f in dataclasses.fields(Settings)}
    for name in ENV_VARIABLES:
        attr = name.removeprefix("RUNSTILE_").lower()
        assert len(rows.get(name, [])) == 1, f"{name} needs exactly one row in configuration.md"
        cell = rows[name][0]
        if fields[attr].default_factory is not dataclasses.MISSING:
            assert attr in COMPUTED_DEFAULTS, f"say in COMPUTED_DEFAULTS how {attr} is documented"
            assert COMPUTED_DEFAULTS[attr] in cell, (name, cell)
        else:
            expected = default_text(getattr(defaults, attr))
            assert cell in expected, f"{name}: docs say {cell!r}, Settings() gives {expected}"


def test_configuration_md_documents_no_variable_that_runstile_does_not_read():
    assert set(config_rows()) <= set(ENV_VARIABLES)


def test_every_cli_command_and_subcommand_is_mentioned_in_the_operations_or_api_docs():
    text = read("operations.md") + read("api.md")
    paths = list(command_paths(cli))
    assert "runstile keys create" in paths  # the walk found the nested commands
    missing = [p for p in paths if not re.search(re.escape(p) + r"(?![\w-])", text)]
    assert not missing, f"not mentioned in docs/operations.md or docs/api.md: {missing}"


def test_every_error_code_sent_over_http_is_in_the_api_error_table_with_its_status():
    text = read("api.md")
    classes = http_error_classes()
    assert errors.RunNotFound in classes and errors.LedgerUnavailable in classes
    for cls in classes:
        row = re.compile(rf"^\|\s*`{re.escape(cls.code)}`\s*\|\s*{cls.status}\s*\|", re.MULTILINE)
        assert row.search(text), f"docs/api.md needs a row | `{cls.code}` | {cls.status} | ..."


def test_every_route_in_the_openapi_document_is_described_in_api_md():
    text = read("api.md")
    routes = [(method.upper(), path) for path, operations in openapi.document()["paths"].items()
              for method in operations]
    assert ("POST", "/v1/runs") in routes
    missing = [f"{m} {p}" for m, p in routes if f"`{m} {p}`" not in text]
    assert not missing, f"routes missing from docs/api.md: {missing}"


@pytest.mark.parametrize("page", PAGES)
def test_every_test_the_docs_cite_exists(page):
    """A cited `tests/x.py::test_name` (or a following `::test_name`) must be a real test."""
    root = DOCS.parent
    for line in read(page).splitlines():
        current = None
        for file, name in re.findall(r"`(tests/[\w/]+\.py)?::(\w+)`", line):
            current = file or current
            assert current is not None, f"{page}: `::{name}` without a file before it"
            source = (root / current).read_text(encoding="utf-8")
            assert re.search(rf"^def {name}\(", source, re.MULTILINE), \
                f"{page} cites {current}::{name}, which does not exist"
