"""The house rules of docs/architecture.md ("Rules the tests keep"), read from the code.

Each rule is a function over a source tree, so the tests below check runstile's own tree
and also that a rule fails on a tree that breaks it (a rule that cannot fail is no rule).
"""

from __future__ import annotations

import ast
import re
import shutil
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "runstile"

#: Which runstile modules each part may import (by first name under ``runstile.``).
#: Imports point one way: foundations -> ledger -> dispatch -> web | workers | recovery
#: -> up -> cli.  ``client`` stands apart: it imports nothing of the server side.
FOUNDATIONS = {"errors", "config", "config_values", "crashpoints", "filemodes", "fingerprint", "jsondepth",
               "netguard", "nodelock", "objects", "processes", "queues", "signals", "tasks",
               "ticks", "webhooks", "logs", "__version__"}
ALLOWED: dict[str, set[str]] = {
    "errors": set(),
    "config": {"config_values", "errors", "processes"},
    "config_values": {"errors", "queues"},  # the settings' parsers, for config
    "crashpoints": {"config"},
    "fingerprint": {"errors"},
    "jsondepth": set(),
    "filemodes": set(),
    "signals": set(),
    "processes": set(),  # whether a pid has exited (a zombie has)
    "logs": set(),
    "netguard": {"errors"},
    "nodelock": {"errors", "filemodes"},
    "objects": {"errors", "jsondepth"},
    "queues": {"errors"},  # queue names and their broker queues
    "tasks": {"errors", "queues", "ticks"},
    "ticks": {"errors"},  # a schedule's tick arithmetic (croniter), for tasks
    "webhooks": {"errors", "netguard"},
    "client": {"errors"},
    "ledger": {"errors", "filemodes", "jsondepth", "nodelock"},  # SQLite's node lock
    "rabbitmq": set(),  # Dramatiq's RabbitMQ broker with run priority, for dispatch
    "dispatch": {"config", "errors", "ledger", "queues", "rabbitmq"},
    "web": FOUNDATIONS | {"ledger", "dispatch"},
    "workers": FOUNDATIONS | {"ledger", "dispatch"},
    "recovery": FOUNDATIONS | {"ledger", "dispatch"},
    "node_lock_watch": FOUNDATIONS | {"ledger"},  # the supervisor's lock, taken again
    "boot": {"errors"},  # the supervisor's start: its port, a ledger waited for
    "up": FOUNDATIONS | {"ledger", "dispatch", "recovery", "workers", "node_lock_watch",
                         "boot"},
    "demo": {"tasks", "errors", "__init__"},
    "cli": FOUNDATIONS | {"ledger", "dispatch", "web", "workers", "recovery", "up", "client"},
    "__main__": {"cli"},
    # The public facade; it loads ``workers`` lazily, on first use of RunContext
    # (test_the_client_loads_nothing_of_the_server_side).
    "__init__": {"client", "config", "errors", "tasks", "workers"},
}

#: Statements that make a string SQL (a comment or docstring that names one is prose).
SQL = re.compile(r"^\s*(?:(?:SELECT|INSERT|UPDATE|DELETE|PRAGMA|CREATE|DROP|ALTER|WITH|VACUUM)"
                 r"\s+\S|(?:BEGIN|COMMIT|ROLLBACK|SAVEPOINT|RELEASE)\b)")

MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 40
#: Modules and functions over budget today.  This list may only shrink: a new entry, or
#: an entry that grew, fails the test (the number is the most lines it may have).
LONG_MODULES: dict[str, int] = {}
LONG_FUNCTIONS: dict[str, int] = {
    "ledger.recovery:apply_terminal_many": 61, "workers.context:step": 43,
}


def modules(root: Path) -> dict[str, Path]:
    """'web.runs' -> path, for every module under ``root`` (the package folder)."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__" and len(parts) > 1:
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def part(module: str) -> str:
    return module.split(".")[0]


def imported(module: str, path: Path) -> set[str]:
    """The runstile modules ``module`` imports, as dotted names under ``runstile.``."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = module.split(".") if path.name == "__init__.py" and module != "__init__" \
        else module.split(".")[:-1]
    if module == "__init__":
        package = []
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name.removeprefix("runstile.") for a in node.names
                      if a.name == "runstile" or a.name.startswith("runstile.")}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - (node.level - 1)]
                stem = ".".join(base + ([node.module] if node.module else []))
            elif node.module and (node.module == "runstile"
                                  or node.module.startswith("runstile.")):
                stem = node.module.removeprefix("runstile").lstrip(".")
            else:
                continue
            names |= ({f"{stem}.{a.name}".lstrip(".") for a in node.names}
                      if not node.module else {stem})
    return {name or "__init__" for name in names}


def import_violations(root: Path) -> list[str]:
    found = []
    for module, path in modules(root).items():
        allowed = ALLOWED.get(part(module))
        if allowed is None:
            found.append(f"{module}: a new top-level module; give it a place in ALLOWED")
            continue
        for target in imported(module, path):
            if part(target) != part(module) and part(target) not in allowed:
                found.append(f"{module} imports {target}")
    return found


def docstrings(tree: ast.AST) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                ids.add(id(body[0].value))
    return ids


def sql_outside_ledger(root: Path) -> list[str]:
    found = []
    for module, path in modules(root).items():
        if part(module) == "ledger":
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        prose = docstrings(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) \
                    and id(node) not in prose and SQL.match(node.value):
                found.append(f"{module}:{node.lineno}: {node.value.strip()[:40]!r}")
    return found


def environment_outside_config(root: Path) -> list[str]:
    found = []
    for module, path in modules(root).items():
        if module == "config":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv", "environb") \
                    and isinstance(node.value, ast.Name) and node.value.id == "os":
                found.append(f"{module}:{node.lineno}: os.{node.attr}")
    return found


def oversized(root: Path) -> tuple[dict[str, int], dict[str, int]]:
    """Modules over MAX_MODULE_LINES and functions over MAX_FUNCTION_LINES, with sizes."""
    long_modules, long_functions = {}, {}
    for module, path in modules(root).items():
        text = path.read_text(encoding="utf-8")
        lines = len(text.splitlines())
        if lines > MAX_MODULE_LINES:
            long_modules[module] = lines
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                size = (node.end_lineno or node.lineno) - node.lineno + 1
                if size > MAX_FUNCTION_LINES:
                    long_functions[f"{module}:{node.name}"] = size
    return long_modules, long_functions


def test_imports_point_one_way():
    assert import_violations(PACKAGE) == []


def test_sql_lives_only_in_the_ledger():
    assert sql_outside_ledger(PACKAGE) == []


def test_only_config_reads_the_environment():
    assert environment_outside_config(PACKAGE) == []


def test_no_module_or_function_outgrows_its_budget_and_the_allowlist_only_shrinks():
    long_modules, long_functions = oversized(PACKAGE)
    grown = {m: n for m, n in long_modules.items() if n > LONG_MODULES.get(m, MAX_MODULE_LINES)}
    grown |= {f: n for f, n in long_functions.items()
              if n > LONG_FUNCTIONS.get(f, MAX_FUNCTION_LINES)}
    assert grown == {}, "over budget (split it, never raise the allowlist)"
    stale = (set(LONG_MODULES) - set(long_modules)) | (set(LONG_FUNCTIONS) - set(long_functions))
    assert stale == set(), "back under budget: remove these from the allowlist"


@pytest.fixture
def copy(tmp_path) -> Path:
    """A copy of the package to break on purpose."""
    target = tmp_path / "runstile"
    shutil.copytree(PACKAGE, target, ignore=shutil.ignore_patterns("__pycache__"))
    return target


def test_the_rules_fail_on_a_forbidden_import_and_on_sql_outside_the_ledger(copy):
    with open(copy / "web" / "runs.py", "a", encoding="utf-8") as f:
        f.write("\nfrom ..workers import actors  # noqa\n")
    with open(copy / "client" / "__init__.py", "a", encoding="utf-8") as f:
        f.write("\nfrom ..ledger import db  # noqa\n"
                "QUERY = 'SELECT id FROM runs WHERE status = ?'\n"
                "import os\nHOME = os.environ.get('HOME')\n")
    assert set(import_violations(copy)) == {"web.runs imports workers",
                                            "client imports ledger"}
    assert [v.split(":")[0] for v in sql_outside_ledger(copy)] == ["client"]
    assert [v.split(":")[0] for v in environment_outside_config(copy)] == ["client"]


def test_the_size_rule_fails_on_a_long_function(copy):
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES + 1))
    (copy / "web" / "long.py").write_text(f"def too_long():\n{body}", encoding="utf-8")
    _, long_functions = oversized(copy)
    assert long_functions["web.long:too_long"] == MAX_FUNCTION_LINES + 2


def test_the_client_loads_nothing_of_the_server_side():
    import subprocess
    import sys
    code = ("import sys, runstile; runstile.Client; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in "
            "('flask', 'dramatiq', 'gunicorn', 'werkzeug') or m.startswith('runstile.ledger')"
            " or m.startswith('runstile.workers') or m.startswith('runstile.web')))")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=True).stdout.strip()
    assert loaded == "[]"


def test_the_clients_terminal_statuses_are_the_ledgers():
    from runstile.client import TERMINAL_STATUSES
    from runstile.ledger.states import TERMINAL
    assert TERMINAL_STATUSES == {status.value for status in TERMINAL}


def test_every_runtime_dependency_is_imported_by_the_package():
    import tomllib
    pyproject = tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text(encoding="utf-8"))
    names = {re.split(r"[\[<>=~!; ]", spec, maxsplit=1)[0].lower().replace("-", "_")
             for spec in pyproject["project"]["dependencies"]}
    imported_names = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                imported_names |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                imported_names.add(node.module.split(".")[0])
    # (Each distribution here imports under its own name, '-' read as '_'.)
    assert names - imported_names == set()
