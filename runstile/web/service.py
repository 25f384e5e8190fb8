"""Service routes (docs/api.md, "GET /v1/capabilities" and after): capabilities, health, readiness, metrics, OpenAPI."""

from __future__ import annotations

from flask import Blueprint, Response, jsonify, request

from .. import __version__
from ..errors import LedgerUnavailable, RouteNotFound, RunstileError, Unauthorized
from ..fingerprint import FINGERPRINT_VERSION
from ..ledger import db as ledger_db
from ..ledger import migrations
from ..ledger import recovery as ledger_recovery
from ..ledger import status as ledger_status
from ..ledger.states import TERMINAL, RunStatus
from ..objects import rfc3339
from . import metrics, openapi
from .admission import RUN_ID_PATTERN
from .auth import authenticate
from .state import conn, state

blueprint = Blueprint("service", __name__)


@blueprint.get("/healthz")
def healthz() -> Response:
    return jsonify({"status": "ok"})


@blueprint.get("/readyz")
def readyz() -> Response:
    checks = {"ledger": False, "migrated": False, "recovered": False}
    ledger: dict[str, str] = {}
    try:
        connection = conn()
        checks["ledger"] = ledger_status.ping(connection)
        ledger = ledger_status.storage(connection)
        checks["migrated"] = migrations.is_current(connection)
        checks["recovered"] = checks["migrated"] and ledger_recovery.barrier_is_open(
            connection, state().settings.node_id)
    except (LedgerUnavailable, RunstileError):
        state().pool.discard()
    ready = all(checks.values())
    response = jsonify({"status": "ready" if ready else "not_ready", "checks": checks,
                        "ledger": ledger})
    response.status_code = 200 if ready else 503
    if not ready:
        response.headers["Retry-After"] = str(state().settings.retry_after_s)
    return response


@blueprint.get("/metrics")
def prometheus() -> Response:
    web = state()
    # RUNSTILE_METRICS_TOKEN, when set, is the one credential /metrics takes (API keys
    # are not: a scraper's token is not a tenant's key).
    if not metrics.token_matches(web.settings.metrics_token,
                                 request.environ.get("HTTP_AUTHORIZATION", "")):
        raise Unauthorized("authentication required")
    body, content_type = metrics.render(web.metrics_dir, conn)
    return Response(body, content_type=content_type)


@blueprint.get("/openapi.json")
def openapi_document() -> Response:
    authenticate()  # docs/api.md: only /healthz, /readyz and /metrics answer without a key
    return jsonify(openapi.document())


@blueprint.get("/v1/recovery")
def recovery_reports() -> Response:
    principal = authenticate()
    if not principal.is_admin:
        raise RouteNotFound("no route matches this path")  # no 403: admins only see it
    reports = ledger_recovery.latest_reports(conn())
    return jsonify({"object": "list", "data": [
        {"object": "recovery_report", "id": r["id"], "node_id": r["node_id"],
         "generation": r["generation"], "trigger": r["trigger"],
         "started_at": rfc3339(r["started_at"]), "finished_at": rfc3339(r["finished_at"]),
         "duration_s": r["counts"].pop("duration_s", None), "counts": r["counts"],
         "taken_over": r["taken_over"]}
        for r in reports]})


@blueprint.get("/v1/capabilities")
def capabilities() -> Response:
    authenticate()
    settings = state().settings
    synchronous, durable = ledger_status.durability(conn(), settings.synchronous)
    return jsonify({
        "object": "capabilities",
        "api_version": "v1",
        "version": __version__,
        # The engine's name only: the PostgreSQL URL (its password) never leaves serve.
        "ledger": ledger_db.dialect(conn()).name,
        "durable": durable,
        "synchronous": synchronous,
        "idempotency": {
            "header": "Idempotency-Key",
            "key_syntax": "1-255 visible ASCII characters (code points 33-126)",
            "reserved_prefixes": ["legacy-run:"],
            "replay_header": "Idempotency-Replayed",
            "fingerprint": "sha256-jcs-rfc8785",
            "fingerprint_version": FINGERPRINT_VERSION,
            "retention_s": settings.run_retention_s,
            "tombstone_s": settings.key_tombstone_s,
        },
        "run_id_pattern": RUN_ID_PATTERN,
        "statuses": [s.value for s in RunStatus],
        "terminal_statuses": sorted(s.value for s in TERMINAL),
        "events": {"format": "text/event-stream", "json": "application/json",
                   "resumable": True, "resume": ["Last-Event-ID", "after"]},
        "tasks": sorted(state().task_names),
        "webhooks": {"signing": "standard-webhooks v1 (HMAC-SHA256)",
                     "headers": ["webhook-id", "webhook-timestamp", "webhook-signature"],
                     "max_attempts": settings.delivery_max_attempts,
                     "backoff_s": settings.delivery_backoff_s,
                     "backoff_max_s": settings.delivery_backoff_max_s,
                     "follows_redirects": False},
        "limits": {"max_body_bytes": settings.max_body_bytes,
                   "max_active_runs": settings.max_active_runs,
                   "max_result_bytes": settings.max_result_bytes},
        "node": {"id": settings.node_id,
                 "generation": ledger_status.node_generation(conn(), settings.node_id)},
    })
