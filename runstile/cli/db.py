"""``runstile db migrate|check|backup``: the ledger file itself, for operators.

Migrations, the integrity and invariant report (with warnings about loose file modes)
and an online backup through SQLite's backup API.  ``runstile.cli`` adds the group to the
root command.
"""

from __future__ import annotations

import sys
from pathlib import Path

import click

from .. import filemodes
from .options import _emit_json, _fail, json_option, runs_on_postgresql, settings_options


@click.group("db")
def db() -> None:
    """Migrate, check and back up the ledger."""


@db.command("migrate")
@settings_options
@runs_on_postgresql
@json_option
def db_migrate(settings, as_json):
    """Bring the ledger to the current schema (safe to run any time)."""
    from ..ledger import db as ledger_db
    from ..ledger import migrations
    ledger_db.check_usable(settings.ledger_target, busy_timeout_ms=settings.busy_timeout_ms)
    before = migrations.migrate(settings.ledger_target, synchronous=settings.synchronous,
                                busy_timeout_ms=settings.busy_timeout_ms)
    if as_json:
        _emit_json({"path": settings.ledger_name, "from_version": before,
                    "version": migrations.LATEST_VERSION})
    else:
        click.echo(f"{settings.ledger_name}: schema version {before} -> "
                   f"{migrations.LATEST_VERSION}")


@db.command("check")
@settings_options
@runs_on_postgresql
@json_option
def db_check(settings, as_json):
    """Integrity and invariant report; exit 1 if anything is wrong."""
    from ..ledger import db as ledger_db
    from ..ledger import maintenance
    if not ledger_db.ledger_exists(settings.ledger_target):
        _fail(f"no ledger at {settings.ledger_name}")
    ledger_db.check_usable(settings.ledger_target, busy_timeout_ms=settings.busy_timeout_ms,
                           write=False)
    conn = ledger_db.connect(settings.ledger_target, busy_timeout_ms=settings.busy_timeout_ms,
                             readonly=True)
    report = maintenance.check(conn)
    # Warnings, not problems: the ledger is sound, but other users may read it.
    report["warnings"] = filemodes.loose(settings.data_dir)
    if as_json:
        _emit_json(report)
    else:
        storage = ledger_db.dialect(conn).storage_line(report)
        click.echo(f"schema version {report['schema_version']}, {storage}")
        for name, count in report["counts"].items():
            click.echo(f"  {name}: {count}")
        for problem in report["problems"]:
            click.echo(f"PROBLEM: {problem}")
        for warning in report["warnings"]:
            click.echo(f"WARNING: {warning}")
        click.echo("ok" if report["ok"] else "NOT OK")
    sys.exit(0 if report["ok"] else 1)


@db.command("backup")
@settings_options
@click.argument("path", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--force", is_flag=True, help="Overwrite PATH if it exists.")
@json_option
def db_backup(settings, path, force, as_json):
    """Online, consistent copy of the ledger (SQLite backup API, never a file copy)."""
    from ..ledger import db as ledger_db
    from ..ledger import maintenance
    if not settings.ledger_path.exists():
        _fail(f"no ledger at {settings.ledger_path}")
    if path.exists() and not force:
        _fail(f"{path} exists; pass --force to overwrite it")
    conn = ledger_db.connect(settings.ledger_path, busy_timeout_ms=settings.busy_timeout_ms)
    # Write beside the target and rename: an old backup survives a failed new one.
    partial = path.with_name(path.name + ".partial")
    partial.unlink(missing_ok=True)
    pages = maintenance.backup(conn, partial)
    partial.replace(path)
    if as_json:
        _emit_json({"path": str(path), "pages": pages})
    else:
        click.echo(f"backed up {settings.ledger_path} to {path} ({pages} pages)")
