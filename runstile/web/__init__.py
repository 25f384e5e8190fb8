"""The HTTP API (docs/api.md): ``create_app(settings)`` builds a Flask app; nothing global.

The web tier never imports ``workers.actors`` (actors bind to a broker when decorated);
it learns task names from the registry and hands runs to workers through the ledger.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

from .. import tasks as registry
from ..config import Settings
from ..dispatch import Dispatcher
from ..ledger.db import ConnectionPool, connect
from ..ledger.group_commit import GroupCommitter
from .writer import WriterClient, max_frame

if TYPE_CHECKING:
    from flask import Flask


@dataclass
class WebState:
    settings: Settings
    #: This process's one dispatcher; the pool's connections settle with it.
    dispatcher: Dispatcher
    pool: ConnectionPool
    task_names: frozenset[str]
    #: Admissions of this process share write transactions (ledger/group_commit.py),
    #: or go to the node's admission writer (web/writer/) when ``serve`` runs one.
    committer: GroupCommitter | WriterClient
    #: Where ``serve``'s processes share metric samples (None: this process's alone).
    metrics_dir: str | None = None


def create_app(settings: Settings, *, writer_socket: str | None = None,
               metrics_dir: str | None = None) -> Flask:
    """The WSGI app.  Call after fork: it opens ledger connections lazily per thread.

    ``writer_socket``: where ``serve``'s admission writer listens (web/writer/); without
    it the process commits its own admissions.
    """
    # Flask is imported here, not with the package: the admission writer process
    # (web/writer/) lives in this package and never serves HTTP.
    from flask import Flask
    from flask.json.provider import DefaultJSONProvider

    from . import approvals, deliveries, errors, metrics, runs, schedules, service, ui
    from .admission_endpoint import AdmissionEndpoint

    app = Flask("runstile")
    json_provider = cast(DefaultJSONProvider, app.json)  # Flask's default provider
    json_provider.sort_keys = False
    json_provider.compact = True
    tasks = registry.load(settings.tasks)
    dispatcher = Dispatcher(settings)
    app.extensions["runstile"] = WebState(
        settings=settings,
        dispatcher=dispatcher,
        pool=dispatcher.pool(),
        task_names=frozenset(tasks),
        committer=_committer(settings, writer_socket, metrics.WRITER_UNREACHABLE.inc),
        metrics_dir=metrics_dir,
    )
    errors.install(app)
    app.register_blueprint(runs.blueprint)
    app.register_blueprint(approvals.blueprint)
    app.register_blueprint(deliveries.blueprint)
    app.register_blueprint(service.blueprint)
    app.register_blueprint(schedules.blueprint)
    ui.install(app, settings)  # the dashboard at /ui/ (docs/dashboard.md)
    # POST /v1/runs is answered in front of Flask, every other request by it.
    app.wsgi_app = AdmissionEndpoint(  # type: ignore[method-assign]
        app.extensions["runstile"], app.wsgi_app)
    return app


def _committer(settings: Settings, writer_socket: str | None,
               on_unreachable: Callable[[], None]) -> GroupCommitter | WriterClient:
    """Where this process's admissions commit: its own group committer, or ``serve``'s
    admission writer, with that committer to fall back on when the writer cannot be
    reached."""
    own = GroupCommitter(lambda: connect(
        settings.ledger_target, synchronous=settings.synchronous,
        busy_timeout_ms=settings.busy_timeout_ms))
    if writer_socket is None:
        return own
    return WriterClient(writer_socket, own, timeout_s=settings.busy_timeout_ms / 1000 + 5.0,
                        max_frame=max_frame(settings), on_unreachable=on_unreachable)
