"""``runstile db migrate|check|backup|copy``: the ledger itself, for operators.

Migrations, the integrity and invariant report (with warnings about loose file modes),
an online backup (SQLite's backup API, or pg_dump) and the copy of an SQLite ledger
into PostgreSQL.  ``runstile.cli`` adds the group to the
root command.
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import click

from .. import filemodes
from ..errors import redact_url
from .options import (
    _database_url_flag,
    _emit_json,
    _fail,
    json_option,
    settings_options,
)


@click.group("db")
def db() -> None:
    """Migrate, check and back up the ledger."""


@db.command("migrate")
@settings_options
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
    """Online, consistent copy of the ledger (SQLite backup API, never a file copy; a
    PostgreSQL ledger through pg_dump's custom format)."""
    from ..errors import ConfigError, LedgerUnavailable
    from ..ledger import db as ledger_db
    from ..ledger import maintenance
    if not ledger_db.ledger_exists(settings.ledger_target):
        _fail(f"no ledger at {settings.ledger_name}")
    if path.exists() and not force:
        _fail(f"{path} exists; pass --force to overwrite it")
    try:
        written, detail = maintenance.backup_ledger(
            settings.ledger_target, path, busy_timeout_ms=settings.busy_timeout_ms)
    except ConfigError as exc:  # pg_dump is not on PATH
        _fail(exc.message, code=2)
    except LedgerUnavailable as exc:
        _fail(exc.message)
    if as_json:
        _emit_json(written)
    else:
        click.echo(f"backed up {settings.ledger_name} to {path} ({detail})")


@db.command("copy")
@settings_options
@click.option("--to", "to", default=None, metavar="URL",
              help="The PostgreSQL database to copy into, postgresql://user:password@host:"
                   "port/db: empty, or holding only a migrated schema [default: "
                   "RUNSTILE_DATABASE_URL].")
@json_option
def db_copy(settings, to, as_json):
    """Copy the SQLite ledger <data-dir>/ledger.db into an empty PostgreSQL database.

    One snapshot of the source, one transaction on the target, every table's rows
    counted on both sides; refused while a node of the data directory runs.  The source
    is the SQLite file; RUNSTILE_DATABASE_URL, when set, is the target unless --to names
    one (docs/operations.md, "Moving a ledger from SQLite to PostgreSQL")."""
    url = _copy_target(to) if to is not None else settings.database_url
    if not url:
        raise click.UsageError("--to URL (or RUNSTILE_DATABASE_URL) names the PostgreSQL "
                               "database to copy into")
    if not settings.ledger_path.exists():
        _fail(f"no ledger at {settings.ledger_path}", code=2)
    report = _copy(settings, url)
    if as_json:
        _emit_json({"source": str(settings.ledger_path), "target": redact_url(url),
                    "ok": report.ok, "analyzed": report.analyzed,
                    "sequences": report.sequences,
                    "counts": {t: {"sqlite": s, "postgresql": p}
                               for t, (s, p) in report.counts.items()}})
    else:
        width = max(len(t) for t in report.counts)
        click.echo(f"{'table':<{width}}  {'sqlite':>10}  {'postgresql':>10}")
        for table, (source, target) in report.counts.items():
            mark = "" if source == target else "  DIFFERS"
            click.echo(f"{table:<{width}}  {source:>10}  {target:>10}{mark}")
        if report.ok:
            total = sum(s for s, _ in report.counts.values())
            click.echo(f"copied {settings.ledger_path} to {redact_url(url)}: {total} rows "
                       f"in {len(report.counts)} tables")
            if not report.analyzed:
                click.echo("the planner's statistics were not gathered: run ANALYZE on the "
                           "database before heavy load (autovacuum does it in time)", err=True)
        else:
            click.echo("NOT COPIED: the counts differ; the target was rolled back", err=True)
    sys.exit(0 if report.ok else 1)


def _copy_target(raw: str) -> str:
    from ..errors import ConfigError
    try:
        url = _database_url_flag(raw)
    except ConfigError as exc:
        raise click.UsageError(exc.message.replace("--database-url", "--to")) from None
    if not url:
        raise click.UsageError("--to needs a postgresql:// URL")
    return url


def _copy(settings, url: str):
    """The copy, holding every node lock of the data directory: a node running on the
    ledger would go on writing to it after the copy (exit 2 then), and one starting
    meanwhile is refused until the copy is done."""
    from ..errors import ConfigError, LedgerCorrupt, LedgerUnavailable, NodeLocked
    from ..ledger import db_postgresql_copy as copying
    from ..nodelock import NodeLock
    with contextlib.ExitStack() as held:
        for lock_file in sorted(settings.data_dir.glob("node-*.lock")):
            node_id = lock_file.name.removeprefix("node-").removesuffix(".lock")
            try:
                held.callback(NodeLock(settings.data_dir, node_id).acquire().release)
            except NodeLocked as exc:
                _fail(f"{exc.message.split(';')[0]}: stop it first, db copy copies a "
                      "ledger nobody is using", code=2)
        try:
            return copying.copy_ledger(settings.ledger_path, url,
                                       busy_timeout_ms=settings.busy_timeout_ms,
                                       progress=_progress_lines())
        except copying.CountMismatch as exc:
            return exc.report
        except (ConfigError, LedgerUnavailable, LedgerCorrupt) as exc:
            _fail(f"db copy to {redact_url(url)}: {exc.message}", code=2)


#: Rows between two progress lines of one table (on stderr, for large ledgers).
PROGRESS_ROWS = 100_000


def _progress_lines():
    """A progress callback for one copy: a line on stderr each time a table passes
    another PROGRESS_ROWS rows."""
    shown: dict[str, int] = {}

    def progress(table: str, done: int) -> None:
        step = done // PROGRESS_ROWS
        if step > shown.get(table, 0):
            shown[table] = step
            click.echo(f"copying {table}: {step * PROGRESS_ROWS} rows so far", err=True)

    return progress
