"""The dashboard's pages (docs/dashboard.md): runs, run, deliveries, recovery, health.

Every read goes through the API's scoping: the runs a key sees here are exactly those
``GET /v1/runs`` shows it (runs.list_visible, runs.get_visible).
"""

from __future__ import annotations

import secrets
from typing import Any

from flask import render_template, request
from werkzeug.datastructures import MultiDict

from ...errors import RouteNotFound, RunstileError
from ...ledger import dashboard, events, journal, obligations, recovery, runs, status
from ...ledger.states import RunStatus
from ..auth import principal
from ..runs import MAX_METADATA_FILTERS, visible_run
from ..state import conn, state
from . import blueprint
from .view import actions_for

PAGE_SIZE = 50


class FilterError(ValueError):
    """A filter the runs page cannot apply (shown on the page, nothing listed)."""


def _metadata(args: MultiDict[str, str]) -> tuple[tuple[str, str], ...]:
    pairs = []
    for raw in args.getlist("metadata"):
        if not raw.strip():
            continue
        key, sep, value = raw.partition("=")
        if not sep or not key.strip():
            raise FilterError("a metadata filter looks like key=value")
        pairs.append((key.strip(), value.strip()))
    if len(pairs) > MAX_METADATA_FILTERS:
        raise FilterError(f"at most {MAX_METADATA_FILTERS} metadata filters")
    return tuple(pairs)


def _run_filter(args: MultiDict[str, str]) -> runs.RunFilter:
    statuses = tuple(s for s in args.getlist("status") if s)
    if not runs.statuses_known(statuses):
        raise FilterError("unknown status")
    return runs.RunFilter(statuses=statuses, task=args.get("task") or None,
                          session_key=args.get("session_key") or None,
                          metadata=_metadata(args))


def _before(args: MultiDict[str, str]) -> int | None:
    raw = args.get("before", "")
    if not raw:
        return None
    if not (raw.isascii() and raw.isdigit() and len(raw) <= 18):
        raise FilterError("the page link is not one this dashboard made")
    return int(raw)


@blueprint.get("/ui/runs")
def runs_page() -> str:
    rows: list[dict[str, Any]] = []
    has_more, error = False, None
    try:
        flt, before = _run_filter(request.args), _before(request.args)
        rows, has_more = runs.list_visible(
            conn(), principal(), flt, before_seq=before, limit=PAGE_SIZE,
            timeout_s=state().settings.list_query_timeout_ms / 1000)
    except (FilterError, RunstileError) as exc:
        error = exc.message if isinstance(exc, RunstileError) else str(exc)
    args = request.args.copy()
    args.pop("before", None)
    return render_template(
        "runs.html", title="Runs", rows=rows, has_more=has_more, error=error,
        statuses=[s.value for s in RunStatus], chosen=set(request.args.getlist("status")),
        args=request.args, first_page=args, paged="before" in request.args,
        next_before=rows[-1]["seq"] if has_more and rows else None)


@blueprint.get("/ui/runs/<run_id>")
def run_page(run_id: str) -> str:
    run = visible_run(run_id)
    return render_template(
        "run.html", title=f"Run {run_id}", run=run, actions=actions_for(run),
        timeline=events.after(conn(), run_id, 0, limit=500),
        steps=journal.steps(conn(), run_id),
        deliveries=obligations.for_run(conn(), run_id),
        retry_token=secrets.token_urlsafe(16))


@blueprint.get("/ui/deliveries")
def deliveries_page() -> str:
    chosen = [s for s in request.args.getlist("state") if s in dashboard.DELIVERY_STATES]
    states = tuple(chosen) or dashboard.OPEN_DELIVERY_STATES
    rows = dashboard.deliveries(conn(), principal(), states)
    return render_template("deliveries.html", title="Deliveries", rows=rows,
                           states=dashboard.DELIVERY_STATES, chosen=set(states))


@blueprint.get("/ui/recovery")
def recovery_page() -> str:
    if not principal().is_admin:
        raise RouteNotFound("no route matches this path")  # as GET /v1/recovery: no 403
    return render_template("recovery.html", title="Recovery",
                           reports=recovery.latest_reports(conn()))


@blueprint.get("/ui/health")
def health_page() -> str:
    settings = state().settings
    connection = conn()
    node = dashboard.node(connection, settings.node_id)
    return render_template(
        "health.html", title="Health", node=node, node_id=settings.node_id,
        recovered=recovery.barrier_is_open(connection, settings.node_id),
        ledger_ok=status.ping(connection), broker=settings.broker_url.split("://")[0],
        consumers=dashboard.consumers(connection),
        depths=dashboard.queue_depths(connection),
        counts=dashboard.status_counts(connection, principal()),
        statuses=[s.value for s in RunStatus])
