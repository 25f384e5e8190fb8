"""The options and helpers every ``runstile`` command group shares.

Each repeated option stack is one decorator here, so a command names it once and its
help text is written once: ``settings_options`` (``--data-dir``, ``--tasks``, turned into
``settings``), ``json_option`` (``--json``), ``client_options`` (``--url`` and
``--api-key``, turned into a ``Client``), ``client_or_ledger_options`` (all four: HTTP
with a key, else the local ledger), ``listen_options`` (``--host``, ``--port``),
``pool_options`` (``--workers``, ``--threads``) and ``web_workers_option``.  A decorator
adds its options where it stands in a command's stack, so ``--help`` lists them in that
order.

``_emit_json``, ``_fail`` and ``_ledger`` keep the names they had in the one-module
command line: the command modules of this package (keys, db, deliveries, serve, runs)
call them; nothing outside ``runstile.cli`` does.
"""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path
from typing import NoReturn

import click

from ..config import Settings
from ..errors import ConfigError


def settings_options(fn):
    """Add --data-dir, --tasks and --database-url to a subcommand and turn them into
    ``settings`` (every command runs on either ledger: docs/configuration.md)."""

    @click.option("--data-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
                  help="Data directory [env RUNSTILE_DATA_DIR; default ./runstile-data].")
    @click.option("--tasks", "tasks", multiple=True,
                  help="Task module to import (repeatable) [env RUNSTILE_TASKS; "
                       "default runstile.demo].")
    @click.option("--database-url", default=None,
                  help="A PostgreSQL ledger, postgresql://user:password@host:port/db "
                       "[env RUNSTILE_DATABASE_URL; default: <data-dir>/ledger.db].")
    @functools.wraps(fn)
    def wrapper(*args, data_dir, tasks, database_url, **kwargs):
        try:
            if database_url is not None:
                database_url = _database_url_flag(database_url)
            settings = Settings.from_env(data_dir=data_dir, tasks=tuple(tasks) or None,
                                         database_url=database_url)
        except ConfigError as exc:
            raise click.UsageError(exc.message) from None
        return fn(settings, *args, **kwargs)

    return wrapper


def url_flag_given() -> bool:
    """Whether this command's --database-url came from its command line (not the env)."""
    from click.core import ParameterSource
    source = click.get_current_context().get_parameter_source("database_url")
    return source is ParameterSource.COMMANDLINE


def exec_with_url_in_env(settings: Settings, args: list[str]) -> NoReturn:
    """Become ``runstile ARGS`` (the same pid) with the ledger's URL in the environment
    and not on the command line: a process that forks children (gunicorn's web
    processes) hands them its command line as it is, where every local user can read the
    password."""
    import os

    from ..config import environment_for_children
    from ..up import RUNSTILE
    os.execve(sys.executable, [*RUNSTILE, *args], environment_for_children(settings))


def _database_url_flag(raw: str) -> str | None:
    from ..config_values import database_url
    from ..errors import redact_url
    try:
        return database_url(raw)
    except ValueError as exc:
        raise ConfigError(f"--database-url={redact_url(raw)!r} is invalid: {exc}") from None


def json_option(fn=None, *, help: str = "Print one JSON object."):
    """Add --json (as ``as_json``); ``help`` for a command whose JSON is not all it prints."""
    option = click.option("--json", "as_json", is_flag=True, help=help)
    return option if fn is None else option(fn)


def client_options(fn):
    """Add --url and --api-key to a `runs` command and hand it a ``Client``.

    No --data-dir or --tasks: `runs` only speaks HTTP and never opens the ledger.  An API
    error ends the command with exit 1 and ``error: <code>: <message>``.
    """
    return _http_options(_with_client(fn, local=False))


def client_or_ledger_options(fn):
    """--url and --api-key beside --data-dir and --tasks (``deliveries``): with an API
    key (flag or RUNSTILE_API_KEY) the command goes over HTTP and gets a ``Client`` as
    ``client`` (``settings`` None); without one it gets ``settings`` for the local ledger
    (``client`` None)."""
    inner = _with_client(fn, local=True)

    @functools.wraps(fn)
    def wrapper(settings, *args, **kwargs):
        return inner(*args, settings=settings, **kwargs)

    return settings_options(_http_options(wrapper))


def _http_options(fn):
    # --url and --api-key are read once, by click, from flags or env.
    fn = click.option("--api-key", envvar="RUNSTILE_API_KEY", default=None,
                      help="API key [env RUNSTILE_API_KEY].")(fn)
    return click.option("--url", envvar="RUNSTILE_URL", default="http://127.0.0.1:8000",
                        show_default=True, help="Server URL [env RUNSTILE_URL].")(fn)


def _with_client(fn, *, local: bool):
    @functools.wraps(fn)
    def wrapper(*args, url, api_key, settings=None, **kwargs):
        from ..client import Client
        from ..errors import ApiError
        if local and not api_key:
            return fn(*args, client=None, settings=settings, **kwargs)
        if not api_key:
            raise click.UsageError("an API key is needed: --api-key or RUNSTILE_API_KEY "
                                   "(`runstile keys create` makes one)")
        try:
            client = Client(url, api_key)
        except ValueError as exc:  # a URL that is not http(s), a malformed key
            raise click.UsageError(str(exc)) from None
        try:
            if local:
                return fn(*args, client=client, settings=None, **kwargs)
            return fn(client, *args, **kwargs)
        except ApiError as exc:
            _fail(f"{exc.code}: {exc.message}")
        finally:
            client.close()

    return wrapper


def listen_options(fn):
    """Add --host and --port (``serve``, ``up``)."""
    fn = click.option("--port", type=click.IntRange(1, 65535), default=None,
                      help="Listen port [default 8000].")(fn)
    return click.option("--host", default=None, help="Listen address [default 127.0.0.1].")(fn)


def pool_options(fn):
    """Add --workers and --threads, the worker pool (``up``, ``worker``)."""
    fn = click.option("--threads", type=click.IntRange(1, 256), default=None,
                      help="Threads per worker process [default 4].")(fn)
    return click.option("--workers", type=click.IntRange(1, 64), default=None,
                        help="Worker processes [default 2].")(fn)


def web_workers_option(fn):
    """Add --web-workers (``serve``, ``up``)."""
    return click.option("--web-workers", type=click.IntRange(1, 64), default=None,
                        help="Web processes [default 2].")(fn)


def _emit_json(obj: dict) -> None:
    click.echo(json.dumps(obj, separators=(",", ":"), sort_keys=True))


def _fail(message: str, code: int = 1) -> NoReturn:
    click.echo(f"error: {message}", err=True)
    sys.exit(code)


def _ledger(settings: Settings, *, create: bool = False):
    """Migrate (once, at start) and open a connection; what its commits owe (a re-armed
    delivery's message) is paid as in a server process (docs/architecture.md, "What a
    commit owes").

    Only ``create`` (up, serve, worker, db migrate, keys create) makes a ledger that does
    not exist: any other command would make an empty one beside the real one (a wrong
    --data-dir, another working directory) and report on it as if all were well."""
    from ..dispatch import Dispatcher
    from ..ledger import db, migrations
    # A PostgreSQL ledger that cannot be used is one line and exit 2 here, not a 503 at
    # every request or a traceback halfway through a migration.
    db.check_usable(settings.ledger_target, busy_timeout_ms=settings.busy_timeout_ms)
    if not create and not db.ledger_exists(settings.ledger_target):
        _fail(f"no ledger at {settings.ledger_name} (give the --data-dir of a runstile "
              "that has run, or RUNSTILE_DATA_DIR)")
    migrations.migrate(settings.ledger_target, synchronous=settings.synchronous,
                       busy_timeout_ms=settings.busy_timeout_ms)
    return Dispatcher(settings).pool().get()
