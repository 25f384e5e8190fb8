"""The HTTP API (SPEC §3): ``create_app(settings)`` builds a Flask app; nothing global.

The web tier never imports ``workers.actors`` (actors bind to a broker when decorated);
it learns task names from the registry and hands runs to workers through the ledger.
"""

from __future__ import annotations

from dataclasses import dataclass

from flask import Flask

from ..config import Settings
from ..ledger.db import ConnectionPool, connect
from ..ledger.group_commit import GroupCommitter
from ..workers import registry


@dataclass
class WebState:
    settings: Settings
    pool: ConnectionPool
    task_names: frozenset[str]
    #: Admissions of this process share write transactions (ledger/group_commit.py).
    committer: GroupCommitter


def create_app(settings: Settings) -> Flask:
    """The WSGI app.  Call after fork: it opens ledger connections lazily per thread."""
    from . import approvals, deliveries, errors, runs, service

    app = Flask("runstile")
    app.json.sort_keys = False
    app.json.compact = True
    tasks = registry.load(settings.tasks)
    app.extensions["runstile"] = WebState(
        settings=settings,
        pool=ConnectionPool(settings.ledger_path, synchronous=settings.synchronous,
                            busy_timeout_ms=settings.busy_timeout_ms),
        task_names=frozenset(tasks),
        committer=GroupCommitter(lambda: connect(
            settings.ledger_path, synchronous=settings.synchronous,
            busy_timeout_ms=settings.busy_timeout_ms)),
    )
    errors.install(app)
    app.register_blueprint(runs.blueprint)
    app.register_blueprint(approvals.blueprint)
    app.register_blueprint(deliveries.blueprint)
    app.register_blueprint(service.blueprint)
    return app
