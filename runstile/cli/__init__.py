"""The ``runstile`` command (docs/operations.md, "Command line").

``main(argv=None)`` is the console script ``runstile`` and ``python -m runstile``, and is
testable in-process; ``cli`` is the root click group.  The commands live by group:
``serve`` (up, serve, worker, recover), ``keys`` (keys …, webhooks secret), ``db``,
``deliveries``, ``schedules`` and ``runs`` (the HTTP client); ``options`` holds what they share.

Every subcommand that may open a ledger takes ``--data-dir`` and ``--tasks`` after its
name; the ``runs`` commands only speak HTTP and take neither.  ``--json`` prints
one JSON object on the last line of stdout; it is taken by every ``keys``, ``db``,
``deliveries``, ``schedules`` and ``runs`` command and by ``recover``, and by no other (not ``up``,
``serve``, ``worker`` or ``webhooks secret``).  Exit codes: 0 ok, 1 failure, 2 usage.
"""

from __future__ import annotations

import click

from .. import filemodes
from ..errors import ConfigError, NodeLocked, RunstileError
from . import db, deliveries, keys, runs, schedules, serve


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="runstile")
def cli() -> None:
    """runstile: durable run admission and at-most-once execution."""


for _command in (keys.keys, keys.webhooks, deliveries.deliveries, db.db, serve.serve,
                 serve.up, serve.worker, serve.worker_process, serve.recover, runs.runs,
                 schedules.schedules):
    cli.add_command(_command)


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
    except (ConfigError, NodeLocked) as exc:
        # A second live node of one name is an operator's mistake, as bad input is.
        click.echo(f"error: {exc.message}", err=True)
        return 2
    except RunstileError as exc:
        click.echo(f"error: {exc.message}", err=True)
        return 1
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    return 0
