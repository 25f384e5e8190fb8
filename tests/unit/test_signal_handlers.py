"""Every signal handler in runstile/ only records the signal (docs/operations.md, "Signals").

A handler runs in the main thread between two bytecodes, wherever that thread is; one
that takes a lock the main thread may hold (``threading.Event.set()`` does) can wait for
itself forever.  So a handler may assign names or attributes (a flag), declare them
``nonlocal``/``global``, ``pass``, and write to a pipe with ``os.write``; nothing else.
Handlers registered with ``signal.signal`` are checked, and so are runstile's overrides
of the ``handle_*`` methods gunicorn's worker registers itself.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "runstile"


def registrations(tree: ast.Module) -> list[tuple[list[ast.AST], ast.expr]]:
    """Each ``signal.signal(signum, handler)`` call: the scopes around it (innermost
    first) and its handler argument."""
    found = []

    def visit(node: ast.AST, scopes: list[ast.AST]) -> None:
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            scopes = [node, *scopes]
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and node.func.attr == "signal" and isinstance(node.func.value, ast.Name) \
                and node.func.value.id == "signal" and len(node.args) == 2:
            found.append((scopes, node.args[1]))
        for child in ast.iter_child_nodes(node):
            visit(child, scopes)

    visit(tree, [])
    return found


def handler_body(scopes: list[ast.AST], handler: ast.expr) -> list[ast.stmt] | None:
    """The statements of the function ``handler`` names (None for SIG_IGN/SIG_DFL): a
    nested or module-level function for a name, a method of the enclosing class for
    ``self.name``."""
    if isinstance(handler, ast.Attribute) and isinstance(handler.value, ast.Name) \
            and handler.value.id == "signal":
        return None  # signal.SIG_IGN, signal.SIG_DFL
    if isinstance(handler, ast.Lambda):
        return [ast.Expr(handler.body)]
    if isinstance(handler, ast.Attribute) and getattr(handler.value, "id", None) != "self":
        # ``obj.method`` on a local object: the one method of that name in the module.
        methods = [node.body for cls in ast.walk(scopes[-1]) if isinstance(cls, ast.ClassDef)
                   for node in cls.body
                   if isinstance(node, ast.FunctionDef) and node.name == handler.attr]
        if len(methods) == 1:
            return methods[0]
    if isinstance(handler, ast.Attribute):
        name, kinds = handler.attr, (ast.ClassDef,)
    else:
        name, kinds = getattr(handler, "id", None), (ast.FunctionDef, ast.Module)
    for scope in scopes:
        if isinstance(scope, kinds):
            for node in scope.body:
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) \
                        and node.name == name:
                    return node.body
    raise AssertionError(f"cannot tell which function handles the signal: "
                         f"{ast.unparse(handler)}")


def is_pipe_write(node: ast.AST) -> bool:
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
        and node.func.attr == "write" and getattr(node.func.value, "id", None) == "os"


def allowed(stmt: ast.stmt) -> bool:
    if isinstance(stmt, (ast.Pass, ast.Nonlocal, ast.Global)):
        return True
    if isinstance(stmt, ast.Expr):
        return isinstance(stmt.value, ast.Constant) or is_pipe_write(stmt.value)  # docstring
    if isinstance(stmt, ast.Assign):
        return all(isinstance(t, (ast.Name, ast.Attribute)) for t in stmt.targets) \
            and isinstance(stmt.value, (ast.Constant, ast.Name))
    if isinstance(stmt, ast.Try):  # try: os.write(...) except OSError: pass
        return all(allowed(s) for s in stmt.body) and not stmt.finalbody and \
            all(allowed(s) for handler in stmt.handlers for s in handler.body)
    return False


#: Methods of gunicorn's worker that gunicorn registers as handlers (runstile overrides
#: them in web/worker_signals.py).
GUNICORN_HANDLERS = ("handle_exit", "handle_quit", "handle_abort", "handle_winch",
                     "handle_usr1")


def handlers() -> list[tuple[str, list[ast.AST], ast.expr]]:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        found += [(str(path.relative_to(PACKAGE.parent)), scopes, handler)
                  for scopes, handler in registrations(tree)]
        found += [(str(path.relative_to(PACKAGE.parent)), [cls],
                   ast.Attribute(ast.Name("self"), node.name))
                  for cls in ast.walk(tree) if isinstance(cls, ast.ClassDef)
                  for node in cls.body
                  if isinstance(node, ast.FunctionDef) and node.name in GUNICORN_HANDLERS]
    return found


def test_runstile_registers_signal_handlers():
    # The check below would pass vacuously if registrations were not found.
    assert {path for path, _, _ in HANDLERS} >= {"runstile/signals.py",
                                                    "runstile/web/writer/server.py",
                                                    "runstile/web/worker_signals.py"}


HANDLERS = handlers()


@pytest.mark.parametrize("path, scopes, handler", HANDLERS,
                         ids=[f"{path}:{ast.unparse(handler)}" for path, _, handler in HANDLERS])
def test_a_signal_handler_only_sets_a_flag_or_writes_to_a_pipe(path, scopes, handler):
    body = handler_body(scopes, handler)
    if body is None:
        return
    offending = [ast.unparse(stmt) for stmt in body if not allowed(stmt)]
    assert offending == [], f"{path}: a signal handler does more than set a flag: {offending}"
