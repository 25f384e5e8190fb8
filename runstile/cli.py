"""The ``runstile`` command (SPEC §9).  ``main(argv=None)`` is testable in-process.

Every subcommand takes ``--data-dir`` and ``--tasks`` after its name; ``--json`` prints
one JSON object on the last line of stdout.  Exit codes: 0 ok, 1 failure, 2 usage.
"""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path

import click

from . import filemodes
from .config import Settings
from .errors import ConfigError, RunstileError


def _common(fn):
    """Add --data-dir and --tasks to a subcommand and turn them into ``settings``."""

    @click.option("--data-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
                  help="Data directory [env RUNSTILE_DATA_DIR; default ./runstile-data].")
    @click.option("--tasks", "tasks", multiple=True,
                  help="Task module to import (repeatable) [env RUNSTILE_TASKS; "
                       "default runstile.demo].")
    @functools.wraps(fn)
    def wrapper(*args, data_dir, tasks, **kwargs):
        try:
            settings = Settings.from_env(data_dir=data_dir, tasks=tuple(tasks) or None)
        except ConfigError as exc:
            raise click.UsageError(exc.message) from None
        return fn(settings, *args, **kwargs)

    return wrapper


def _emit_json(obj: dict) -> None:
    click.echo(json.dumps(obj, separators=(",", ":"), sort_keys=True))


def _fail(message: str, code: int = 1):
    click.echo(f"error: {message}", err=True)
    sys.exit(code)


def _ledger(settings: Settings):
    """Migrate (once, at start) and open a connection."""
    from .ledger import db, migrations
    migrations.migrate(settings.ledger_path, synchronous=settings.synchronous,
                       busy_timeout_ms=settings.busy_timeout_ms)
    return db.connect(settings.ledger_path, synchronous=settings.synchronous,
                      busy_timeout_ms=settings.busy_timeout_ms)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="runstile")
def cli() -> None:
    """runstile: durable run admission and at-most-once execution."""


# ---------------------------------------------------------------- keys

@cli.group()
def keys() -> None:
    """Create, list, revoke and rotate API keys."""


def _check_profile(profile: str) -> None:
    from .ledger import keys as ledger_keys
    if not ledger_keys.valid_profile(profile):
        raise click.BadParameter("1-64 letters, digits, '_', '.' or '-', starting with a "
                                 "letter or digit", param_hint="--profile")


def _key_json(key_id: str, secret: str, profile: str, role: str) -> dict:
    return {"key_id": key_id, "secret": secret, "profile": profile, "role": role}


@keys.command("create")
@_common
@click.option("--profile", required=True, help="Profile (tenant); created if new.")
@click.option("--label", default=None, help="Free text to recognise the key by.")
@click.option("--admin", is_flag=True, help="An admin key sees every run of its profile.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def keys_create(settings, profile, label, admin, as_json):
    """Create a key (and its profile if new); prints the secret once."""
    from .ledger import keys as ledger_keys
    _check_profile(profile)
    if label is not None and len(label) > 200:
        raise click.BadParameter("at most 200 characters", param_hint="--label")
    role = "admin" if admin else "client"
    conn = _ledger(settings)
    key_id, secret = ledger_keys.create(conn, profile, label=label, role=role)
    if as_json:
        _emit_json(_key_json(key_id, secret, profile, role))
    else:
        click.echo(f"key id:  {key_id}\nprofile: {profile}\nrole:    {role}\n"
                   f"secret:  {secret}\n(the secret is shown only now)")


@keys.command("list")
@_common
@click.option("--profile", default=None, help="Only this profile's keys.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def keys_list(settings, profile, as_json):
    """List keys (never their secrets)."""
    from .ledger import keys as ledger_keys
    from .objects import rfc3339
    rows = ledger_keys.list_keys(_ledger(settings), profile)
    for row in rows:
        for name in ("created_at", "rotated_at", "revoked_at"):
            row[name] = rfc3339(row[name])
    if as_json:
        _emit_json({"object": "list", "data": rows})
        return
    for row in rows:
        state = "revoked" if row["revoked_at"] else "active"
        click.echo(f"{row['id']}  {row['profile_id']:<16} {row['role']:<6} {state:<8} "
                   f"{row['label'] or ''}")


@keys.command("revoke")
@_common
@click.argument("key_id")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def keys_revoke(settings, key_id, as_json):
    """Revoke a key; requests with it get 401 from the next one on."""
    from .ledger import keys as ledger_keys
    conn = _ledger(settings)
    if not ledger_keys.exists(conn, key_id):
        _fail(f"no key {key_id!r}")
    revoked = ledger_keys.revoke(conn, key_id)
    if as_json:
        _emit_json({"key_id": key_id, "revoked": True, "changed": revoked})
    else:
        click.echo(f"{key_id} revoked" if revoked else f"{key_id} was already revoked")


@keys.command("rotate")
@_common
@click.argument("key_id")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def keys_rotate(settings, key_id, as_json):
    """Give a key a new secret; its id, runs and idempotency records stay."""
    from .ledger import keys as ledger_keys
    rotated = ledger_keys.rotate(_ledger(settings), key_id)
    if rotated is None:
        _fail(f"no live key {key_id!r} (unknown or revoked)")
    secret, profile, role = rotated
    if as_json:
        _emit_json(_key_json(key_id, secret, profile, role))
    else:
        click.echo(f"key id:  {key_id}\nsecret:  {secret}\n(the old secret no longer works)")


# ---------------------------------------------------------------- webhooks

@cli.group()
def webhooks() -> None:
    """Webhook signing secrets (SPEC §7)."""


@webhooks.command("secret")
@_common
@click.option("--profile", required=True, help="Profile whose deliveries it signs.")
@click.option("--rotate", is_flag=True,
              help="Make a new secret; the old one keeps signing for "
                   "RUNSTILE_WEBHOOK_ROTATION_GRACE_S.")
def webhooks_secret(settings, profile, rotate):
    """Print the profile's signing secret alone on the last line (created if absent).

    The profile must exist (made by `keys create`); an unknown one is an error, exit 1.
    """
    from .ledger import webhook_secrets
    from .webhooks import new_secret
    _check_profile(profile)
    secret = webhook_secrets.current(_ledger(settings), profile, new_secret, rotate=rotate,
                                     grace_s=settings.webhook_rotation_grace_s)
    if secret is None:
        _fail(f"profile_not_found: no profile {profile!r} (`runstile keys create --profile "
              f"{profile}` creates it with its first key)")
    if rotate:
        click.echo(f"rotated: the old secret keeps signing for "
                   f"{settings.webhook_rotation_grace_s:g}s", err=True)
    click.echo(secret)


# ---------------------------------------------------------------- deliveries

@cli.group()
def deliveries() -> None:
    """Delivery obligations of runs, for operators (SPEC §7, §9)."""


def _delivery_row(row: dict) -> str:
    from .objects import delivery_object
    d = delivery_object(row)
    error = f"  {d['last_error']}" if d["last_error"] and d["state"] != "delivered" else ""
    return (f"{d['id']}  {d['state']:<10} {d['type']:<20} attempts={d['attempts']:<3} "
            f"{d['url']}{error}")


@deliveries.command("list")
@_common
@click.argument("run_id")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def deliveries_list(settings, run_id, as_json):
    """List a run's obligations."""
    import re

    from .ledger import obligations
    from .objects import delivery_object
    if not re.fullmatch(r"run_[0-9a-f]{32}", run_id):
        raise click.BadParameter("a run id is run_ + 32 lowercase hex", param_hint="RUN_ID")
    conn = _ledger(settings)
    if obligations.run_row(conn, run_id) is None:
        _fail(f"run_not_found: no run {run_id}")
    rows = obligations.for_run(conn, run_id)
    if as_json:
        _emit_json({"object": "list", "data": [delivery_object(r) for r in rows]})
        return
    for row in rows:
        click.echo(_delivery_row(row))
    if not rows:
        click.echo("no deliveries")


def _settle_delivery(settings, delivery_id: str, action: str, as_json: bool) -> None:
    import getpass
    import re

    from . import dispatch
    from .ledger import obligations
    from .objects import delivery_object
    if not re.fullmatch(r"msg_[0-9a-f]{32}", delivery_id):
        raise click.BadParameter("a delivery id is msg_ + 32 lowercase hex",
                                 param_hint="DELIVERY_ID")
    conn = _ledger(settings)
    by = f"cli:{getpass.getuser()}"
    done = (obligations.rearm if action == "retry" else obligations.discard)(
        conn, delivery_id, by=by)
    if done is None:
        _fail(f"delivery_not_found: no delivery {delivery_id}")
    row, changed = done
    if not changed and (row["state"] == "delivered" or
                        (action == "retry" and row["state"] == "discarded")):
        _fail(f"delivery_settled: the delivery is {row['state']}")
    if not changed and action == "discard" and row["state"] == "attempting":
        _fail("delivery_in_flight: an attempt is under way; try again in a few seconds")
    if changed and action == "retry":
        dispatch.send_deliveries(settings, conn, run_id=row["run_id"])
    if as_json:
        _emit_json(delivery_object(obligations.get(conn, delivery_id)))
    else:
        click.echo(_delivery_row(obligations.get(conn, delivery_id)))


@deliveries.command("retry")
@_common
@click.argument("delivery_id")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def deliveries_retry(settings, delivery_id, as_json):
    """Re-arm a parked obligation with fresh attempts and send it now."""
    _settle_delivery(settings, delivery_id, "retry", as_json)


@deliveries.command("discard")
@_common
@click.argument("delivery_id")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def deliveries_discard(settings, delivery_id, as_json):
    """Settle a pending or parked obligation for good (a person's decision, recorded)."""
    _settle_delivery(settings, delivery_id, "discard", as_json)


# ---------------------------------------------------------------- db

@cli.group()
def db() -> None:
    """Migrate, check and back up the ledger."""


@db.command("migrate")
@_common
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def db_migrate(settings, as_json):
    """Bring the ledger to the current schema (safe to run any time)."""
    from .ledger import migrations
    before = migrations.migrate(settings.ledger_path, synchronous=settings.synchronous,
                                busy_timeout_ms=settings.busy_timeout_ms)
    if as_json:
        _emit_json({"path": str(settings.ledger_path), "from_version": before,
                    "version": migrations.LATEST_VERSION})
    else:
        click.echo(f"{settings.ledger_path}: schema version {before} -> "
                   f"{migrations.LATEST_VERSION}")


@db.command("check")
@_common
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def db_check(settings, as_json):
    """Integrity and invariant report; exit 1 if anything is wrong."""
    from .ledger import db as ledger_db, maintenance
    if not settings.ledger_path.exists():
        _fail(f"no ledger at {settings.ledger_path}")
    conn = ledger_db.connect(settings.ledger_path, busy_timeout_ms=settings.busy_timeout_ms,
                             readonly=True)
    report = maintenance.check(conn)
    # Warnings, not problems: the ledger is sound, but other users may read it.
    report["warnings"] = filemodes.loose(settings.data_dir)
    if as_json:
        _emit_json(report)
    else:
        click.echo(f"schema version {report['schema_version']}, journal {report['journal_mode']}")
        for name, count in report["counts"].items():
            click.echo(f"  {name}: {count}")
        for problem in report["problems"]:
            click.echo(f"PROBLEM: {problem}")
        for warning in report["warnings"]:
            click.echo(f"WARNING: {warning}")
        click.echo("ok" if report["ok"] else "NOT OK")
    sys.exit(0 if report["ok"] else 1)


@db.command("backup")
@_common
@click.argument("path", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--force", is_flag=True, help="Overwrite PATH if it exists.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def db_backup(settings, path, force, as_json):
    """Online, consistent copy of the ledger (SQLite backup API, never a file copy)."""
    from .ledger import db as ledger_db, maintenance
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


# ---------------------------------------------------------------- serve

def _host_port(settings: Settings, host: str | None, port: int | None) -> Settings:
    return settings.replace(host=host or settings.host, port=port or settings.port)


@cli.command("serve")
@_common
@click.option("--host", default=None, help="Listen address [default 127.0.0.1].")
@click.option("--port", type=click.IntRange(1, 65535), default=None,
              help="Listen port [default 8000].")
@click.option("--web-workers", type=click.IntRange(1, 64), default=None,
              help="Web processes [default 2].")
@click.option("--threads", "web_threads", type=click.IntRange(1, 256), default=None,
              help="Threads per web process [env RUNSTILE_WEB_THREADS; default 16].")
def serve(settings, host, port, web_workers, web_threads):
    """Serve the HTTP API (gunicorn, gthread workers)."""
    settings = _host_port(settings, host, port).replace(
        web_workers=web_workers or settings.web_workers,
        web_threads=web_threads or settings.web_threads)
    from .web.server import run_gunicorn
    _ledger(settings).close()
    filemodes.warn_loose(settings.data_dir)
    click.echo(f"runstile API on http://{_url_host(settings.host)}:{settings.port} "
               f"(ledger {settings.ledger_path})", err=True)
    run_gunicorn(settings)


@cli.command("up")
@_common
@click.option("--host", default=None, help="Listen address [default 127.0.0.1].")
@click.option("--port", type=click.IntRange(1, 65535), default=None,
              help="Listen port [default 8000].")
@click.option("--workers", type=click.IntRange(1, 64), default=None,
              help="Worker processes [default 2].")
@click.option("--threads", type=click.IntRange(1, 256), default=None,
              help="Threads per worker process [default 4].")
@click.option("--web-workers", type=click.IntRange(1, 64), default=None,
              help="Web processes [default 2].")
def up(settings, host, port, workers, threads, web_workers):
    """The main job: web, workers and recovery on the embedded broker, one process tree."""
    from .up import Supervisor
    settings = _host_port(settings, host, port).replace(
        workers=workers or settings.workers, threads=threads or settings.threads,
        web_workers=web_workers or settings.web_workers)
    sys.exit(Supervisor(settings).run())


@cli.command("worker")
@_common
@click.option("--workers", type=click.IntRange(1, 64), default=None,
              help="Worker processes [default 2].")
@click.option("--threads", type=click.IntRange(1, 256), default=None,
              help="Threads per worker process [default 4].")
def worker(settings, workers, threads):
    """Worker processes only (for deployments with Redis or RabbitMQ, or a separate web)."""
    from .up import Supervisor
    settings = settings.replace(workers=workers or settings.workers,
                                threads=threads or settings.threads)
    sys.exit(Supervisor(settings, web=False).run())


@cli.command("worker-process", hidden=True)
@_common
@click.option("--generation", type=click.IntRange(1), required=True)
@click.option("--threads", type=click.IntRange(1, 256), default=None)
def worker_process(settings, generation, threads):
    """One worker process; started by `up` / `worker`, which hold the node lock."""
    from .workers import process
    sys.exit(process.run(settings.replace(threads=threads or settings.threads), generation))


@cli.command("recover")
@_common
@click.option("--json", "as_json", is_flag=True, help="Print the report as one JSON object.")
def recover(settings, as_json):
    """One recovery pass now (for cron); never bumps a node generation."""
    import logging
    from .ledger import db as ledger_db, recovery as ledger_recovery
    from .recovery import reconcile
    from . import tasks as registry
    logging.basicConfig(level=logging.INFO if not as_json else logging.WARNING,
                        format="%(asctime)s %(levelname)s [recover] %(message)s")
    registry.load(settings.tasks)
    _ledger(settings).close()
    conn = ledger_db.connect(settings.ledger_path, busy_timeout_ms=settings.busy_timeout_ms)
    try:
        generation, _ = ledger_recovery.node_generations(conn, settings.node_id)
    finally:
        conn.close()
    report = reconcile.run_pass(settings, generation=generation, trigger="command")
    if as_json:
        _emit_json(report.as_dict())
    else:
        click.echo(f"recovered: {dict(report.counts) or 'nothing to do'} "
                   f"in {report.duration_s:.3f}s")


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def main(argv: list[str] | None = None) -> int:
    # Before anything is created: the ledger, its WAL, locks, backups and every child
    # process (gunicorn, the admission writer, worker processes) are for this user only
    # (docs/operations.md, "File modes").
    filemodes.restrict_umask()
    try:
        cli.main(args=argv, prog_name="runstile", standalone_mode=False)
    except click.exceptions.Exit as exc:
        return exc.exit_code
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        return 1
    except click.ClickException as exc:
        exc.show()
        return exc.exit_code
    except ConfigError as exc:
        click.echo(f"error: {exc.message}", err=True)
        return 2
    except RunstileError as exc:
        click.echo(f"error: {exc.message}", err=True)
        return 1
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    return 0



# ---------------------------------------------------------------- runs (HTTP client)
# `runstile runs …` talks to a server over HTTP with runstile.Client (SPEC §9); it never
# opens the ledger.  --url and --api-key are read once, by click, from flags or env.

def _status_choice() -> click.Choice:
    from .ledger.states import RunStatus
    return click.Choice([status.value for status in RunStatus])


def _client_options(fn):
    """Add --url and --api-key to a `runs` command and hand it a ``Client``.

    An API error ends the command with exit 1 and ``error: <code>: <message>``.
    """

    @click.option("--url", envvar="RUNSTILE_URL", default="http://127.0.0.1:8000",
                  show_default=True, help="Server URL [env RUNSTILE_URL].")
    @click.option("--api-key", envvar="RUNSTILE_API_KEY", default=None,
                  help="API key [env RUNSTILE_API_KEY].")
    @functools.wraps(fn)
    def wrapper(settings, *args, url, api_key, **kwargs):
        from .client import Client
        from .errors import ApiError
        if not api_key:
            raise click.UsageError("an API key is needed: --api-key or RUNSTILE_API_KEY "
                                   "(`runstile keys create` makes one)")
        try:
            client = Client(url, api_key)
        except ValueError as exc:  # a URL that is not http(s), a malformed key
            raise click.UsageError(str(exc)) from None
        try:
            return fn(client, *args, **kwargs)
        except ApiError as exc:
            _fail(f"{exc.code}: {exc.message}")
        finally:
            client.close()

    return wrapper


def _json_input(ctx, param, value):
    """--input: JSON text, ``@path`` for a file, or ``-`` for stdin."""
    if value is None:
        return None
    text = value
    if value == "-":
        text = click.get_text_stream("stdin").read()
    elif value.startswith("@"):
        try:
            text = Path(value[1:]).read_text(encoding="utf-8")
        except OSError as exc:
            raise click.BadParameter(f"cannot read {value[1:]}: {exc.strerror}") from None

    def refuse(name):
        raise ValueError(f"{name} is not JSON")

    try:
        return json.loads(text, parse_constant=refuse)
    except ValueError as exc:
        raise click.BadParameter(f"not valid JSON: {exc}") from None


def _run_line(run: dict) -> str:
    line = f"{run['id']}  {run['status']:<9} {run['task']}  attempt {run['attempt']}"
    if run.get("replayed"):
        line += "  (replayed)"
    return line


def _show_run(run: dict, as_json: bool) -> None:
    if as_json:
        _emit_json(run)
        return
    click.echo(_run_line(run))
    for name in ("created_at", "started_at", "finished_at"):
        if run.get(name):
            click.echo(f"  {name + ':':<13}{run[name]}")
    if run.get("result") is not None:
        click.echo(f"  result:      {json.dumps(run['result'])}")
    if run.get("error"):
        click.echo(f"  error:       {run['error']['code']}: {run['error']['message']}")
    if run.get("recovery"):
        click.echo(f"  recovery:    {json.dumps(run['recovery'])}")


def _outcome(run: dict) -> int:
    """Exit code for a finished run: 0 completed, 1 anything else."""
    return 0 if run["status"] == "completed" else 1


class _Watch:
    """Renders a run's events: one line each, a bar for run.progress, message.delta text
    joined on one line."""

    #: Characters in a progress bar.
    bar_width = 20

    def __init__(self) -> None:
        self.in_text = False

    def show(self, event: dict) -> None:
        kind, data = event["type"], event.get("data")
        if kind == "message.delta" and isinstance(data, dict):
            click.echo(str(data.get("text", "")), nl=False)
            self.in_text = True
            return
        self.end_text()
        prefix = f"{event['seq']:>4} {kind}"
        pct = data.get("pct") if isinstance(data, dict) else None
        if kind == "run.progress" and isinstance(pct, (int, float)):
            pct = max(0.0, min(100.0, float(pct)))
            filled = round(pct * self.bar_width / 100)
            click.echo(f"{prefix} [{'#' * filled}{'.' * (self.bar_width - filled)}] {pct:.0f}%")
        elif data:
            click.echo(f"{prefix} {json.dumps(data, separators=(',', ':'))}")
        else:
            click.echo(prefix)

    def end_text(self) -> None:
        if self.in_text:
            click.echo()
            self.in_text = False


@cli.group()
def runs() -> None:
    """Submit, read, watch and control runs on a server (an HTTP client)."""


@runs.command("submit")
@_common
@_client_options
@click.argument("task")
@click.option("--input", "input_", callback=_json_input, default=None,
              help="The task's input as JSON (or @FILE, or - for stdin).")
@click.option("--key", "idempotency_key", default=None,
              help="Idempotency-Key [default: a new uuid4, reused by the client's retries].")
@click.option("--session-key", default=None, help="Run one at a time with this session.")
@click.option("--wait", is_flag=True, help="Wait for the run to end; exit 0 only if completed.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def runs_submit(client, task, input_, idempotency_key, session_key, wait, as_json):
    """Admit a run of TASK; safe to repeat with the same --key."""
    run = client.submit(task, input_, idempotency_key=idempotency_key, session_key=session_key)
    if not wait:
        _show_run(run, as_json)
        return
    if not as_json:
        click.echo(_run_line(run))
    final = client.wait(run["id"])
    _show_run(final, as_json)
    sys.exit(_outcome(final))


@runs.command("get")
@_common
@_client_options
@click.argument("run_id")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def runs_get(client, run_id, as_json):
    """Show one run."""
    _show_run(client.get(run_id), as_json)


@runs.command("list")
@_common
@_client_options
@click.option("--status", "statuses", multiple=True, type=_status_choice(),
              help="Only runs in this status (repeatable).")
@click.option("--task", "task_name", default=None, help="Only runs of this task.")
@click.option("--session-key", default=None, help="Only runs of this session.")
@click.option("--limit", type=click.IntRange(1, 200), default=20, show_default=True,
              help="Runs per page.")
@click.option("--cursor", default=None, help="A previous page's next_cursor.")
@click.option("--all", "every", is_flag=True, help="Follow the cursor through every page.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def runs_list(client, statuses, task_name, session_key, limit, cursor, every, as_json):
    """List runs, newest first."""
    filters = {"status": list(statuses), "task": task_name, "session_key": session_key,
               "limit": limit, "cursor": cursor}
    if every:
        page = {"object": "list", "data": list(client.iter_runs(**filters)),
                "has_more": False, "next_cursor": None}
    else:
        page = client.list(**filters)
    if as_json:
        _emit_json(page)
        return
    for run in page["data"]:
        click.echo(f"{run['id']}  {run['status']:<9} {run['task']:<16} {run['created_at']}")
    if page.get("has_more"):
        click.echo(f"more: --cursor {page['next_cursor']}")


@runs.command("watch")
@_common
@_client_options
@click.argument("run_id")
@click.option("--json", "as_json", is_flag=True,
              help="Print the finished run as one JSON object on the last line.")
def runs_watch(client, run_id, as_json):
    """Show a run's events live until it ends; exit 0 if it completed, 1 otherwise."""
    view = _Watch()
    for event in client.events(run_id):
        view.show(event)
    view.end_text()
    final = client.get(run_id)
    _show_run(final, as_json)
    sys.exit(_outcome(final))


@runs.command("stop")
@_common
@_client_options
@click.argument("run_id")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def runs_stop(client, run_id, as_json):
    """Stop a run: cancelled at once if not running, else stopping until its body sees it."""
    _show_run(client.stop(run_id), as_json)


@runs.command("approve")
@_common
@_client_options
@click.argument("run_id")
@click.argument("approval_id")
@click.option("--decision", type=click.Choice(["approve", "deny"]), required=True,
              help="The decision on the pending approval.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def runs_approve(client, run_id, approval_id, decision, as_json):
    """Decide a run's pending approval."""
    _show_run(client.approve(run_id, approval_id, decision), as_json)


@runs.command("resume")
@_common
@_client_options
@click.argument("run_id")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def runs_resume(client, run_id, as_json):
    """Resume a paused run (a person accepts the uncertainty); it runs again."""
    _show_run(client.resume(run_id), as_json)
