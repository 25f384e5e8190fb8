"""``runstile up|serve|worker|recover``: the commands that run runstile's processes.

``up`` is the supervised process tree (web, workers and recovery on the embedded
broker), ``serve`` the web tier alone, ``worker`` the worker processes alone, ``recover``
one recovery pass for cron; the hidden ``worker-process`` is the one worker process that
``up`` and ``worker`` start (runstile.up).  ``runstile.cli`` adds them to the root command.
"""

from __future__ import annotations

import sys

import click

from .. import config_values, filemodes
from ..config import Settings
from ..errors import ConfigError
from .options import (
    _emit_json,
    _ledger,
    exec_with_url_in_env,
    json_option,
    listen_options,
    pool_options,
    settings_options,
    url_flag_given,
    web_workers_option,
)


def _host_port(settings: Settings, host: str | None, port: int | None) -> Settings:
    return settings.replace(host=host or settings.host, port=port or settings.port)


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def queue_options(fn):
    """Add --queues and --queue-threads (``up``, ``worker``, ``worker-process``): which
    queues this node consumes and which get threads of their own (docs/tasks.md,
    "Queues")."""
    fn = click.option("--queue-threads", "queue_threads", multiple=True, metavar="QUEUE=N",
                      help="Give a queue N threads of its own in each worker process "
                           "(repeatable, or comma-separated) [env "
                           "RUNSTILE_QUEUE_THREADS].")(fn)
    return click.option("--queues", "queues", multiple=True, metavar="A,B",
                        help="Consume only these queues (repeatable, or comma-separated) "
                             "[env RUNSTILE_QUEUES; default every registered task's "
                             "queue].")(fn)


def _with_queues(settings: Settings, queues: tuple[str, ...],
                 queue_threads: tuple[str, ...]) -> Settings:
    """``settings`` with the flags' queues (they replace RUNSTILE_QUEUES and
    RUNSTILE_QUEUE_THREADS when given), checked against the task registry: a bad
    spec or a queue the node cannot consume is a ConfigError, exit 2 with one line."""
    from .. import tasks as registry
    from ..workers import pools
    for flag, given, parse in (("--queues", queues, config_values.queue_list),
                               ("--queue-threads", queue_threads, config_values.queue_threads)):
        if given:
            try:
                settings = settings.replace(**{flag[2:].replace("-", "_"):
                                               parse(",".join(given))})
            except ValueError as exc:
                raise ConfigError(f"{flag}: {exc}") from None
    registry.load(settings.tasks)
    pools.plan(settings, registry.queues())
    return settings


@click.command("serve")
@settings_options
@listen_options
@web_workers_option
@click.option("--threads", "web_threads", type=click.IntRange(1, 256), default=None,
              help="Threads per web process [env RUNSTILE_WEB_THREADS; default 16].")
def serve(settings, host, port, web_workers, web_threads):
    """Serve the HTTP API (gunicorn, gthread workers)."""
    settings = _host_port(settings, host, port).replace(
        web_workers=web_workers or settings.web_workers,
        web_threads=web_threads or settings.web_threads)
    if url_flag_given():
        # Before any child exists: gunicorn's web processes are forks of this process
        # and would show the flag's password in their command lines.
        exec_with_url_in_env(settings, _serve_args(settings))
    from .. import logs
    from ..web.server import run_gunicorn
    logs.configure(settings.log_format, node=settings.node_id,
                   text_format="%(asctime)s %(levelname)s [serve] %(message)s")
    _ledger(settings, create=True).close()
    filemodes.warn_loose(settings.data_dir)
    banner = (f"runstile API on http://{_url_host(settings.host)}:{settings.port} "
              f"(ledger {settings.ledger_name})")
    if settings.log_format == "json":
        banner = logs.json_line(banner, node=settings.node_id, logger="runstile.serve")
    click.echo(banner, err=True)
    run_gunicorn(settings)


def _serve_args(settings: Settings) -> list[str]:
    """``serve``'s command line for ``settings``, every flag but --database-url."""
    tasks = [word for task in settings.tasks for word in ("--tasks", task)]
    return ["serve", "--data-dir", str(settings.data_dir), *tasks, "--host", settings.host,
            "--port", str(settings.port), "--web-workers", str(settings.web_workers),
            "--threads", str(settings.web_threads)]


@click.command("up")
@settings_options
@listen_options
@pool_options
@queue_options
@web_workers_option
def up(settings, host, port, workers, threads, queues, queue_threads, web_workers):
    """The main job: web, workers and recovery on the embedded broker, one process tree."""
    from ..up import Supervisor
    settings = _host_port(settings, host, port).replace(
        workers=workers or settings.workers, threads=threads or settings.threads,
        web_workers=web_workers or settings.web_workers)
    sys.exit(Supervisor(_with_queues(settings, queues, queue_threads)).run())


@click.command("worker")
@settings_options
@pool_options
@queue_options
def worker(settings, workers, threads, queues, queue_threads):
    """Worker processes only (for deployments with Redis or RabbitMQ, or a separate web)."""
    from ..up import Supervisor
    settings = settings.replace(workers=workers or settings.workers,
                                threads=threads or settings.threads)
    sys.exit(Supervisor(_with_queues(settings, queues, queue_threads), web=False).run())


@click.command("worker-process", hidden=True)
@settings_options
@click.option("--generation", type=click.IntRange(1), required=True)
@click.option("--threads", type=click.IntRange(1, 256), default=None)
@queue_options
def worker_process(settings, generation, threads, queues, queue_threads):
    """One worker process; started by `up` / `worker`, which hold the node lock."""
    from ..workers import process
    settings = _with_queues(settings.replace(threads=threads or settings.threads), queues,
                            queue_threads)
    sys.exit(process.run(settings, generation))


@click.command("recover")
@settings_options
@json_option(help="Print the report as one JSON object.")
def recover(settings, as_json):
    """One recovery pass now (for cron); never bumps a node generation."""
    import logging

    from .. import logs
    from .. import tasks as registry
    from ..ledger import db as ledger_db
    from ..ledger import recovery as ledger_recovery
    from ..recovery import reconcile
    logs.configure(settings.log_format, node=settings.node_id,
                   level=logging.INFO if not as_json else logging.WARNING,
                   text_format="%(asctime)s %(levelname)s [recover] %(message)s")
    registry.load(settings.tasks)
    _ledger(settings).close()
    conn = ledger_db.connect(settings.ledger_target, busy_timeout_ms=settings.busy_timeout_ms)
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
