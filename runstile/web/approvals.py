"""POST /v1/runs/<id>/approval: a person's decision on a pending approval (docs/api.md,
"POST /v1/runs/{run_id}/approval — decide a pending approval")."""

from __future__ import annotations

from typing import Any

from flask import Blueprint, Response, jsonify, request

from ..errors import InvalidRequest, RunNotFound
from ..ledger import approvals, runs
from ..objects import run_object
from . import admission
from .auth import authenticate, principal
from .state import conn, state

blueprint = Blueprint("approvals", __name__)


@blueprint.post("/v1/runs/<run_id>/approval")
def decide(run_id: str) -> Response:
    authenticate()
    if runs.get_visible(conn(), principal(), run_id) is None:
        raise RunNotFound("no such run")
    raw = admission.read_body(request, state().settings.max_body_bytes)
    admission.require_json_content_type(request)
    body = admission.parse_json(raw)
    if not isinstance(body, dict):
        raise InvalidRequest("the body must be a JSON object")
    unknown = sorted(set(body) - {"approval_id", "decision"})
    if unknown:
        raise InvalidRequest(f"unknown field {unknown[0]!r}", field=unknown[0])
    approval_id, decision = body.get("approval_id"), body.get("decision")
    if not isinstance(approval_id, str) or not 1 <= len(approval_id) <= 64:
        raise InvalidRequest("approval_id must be the id from the run's approval object",
                             field="approval_id")
    return jsonify(run_object(decide_approval(run_id, approval_id, decision)))


def decide_approval(run_id: str, approval_id: str, decision: object) -> dict[str, Any]:
    """A decision on a run the caller may see (checked by the caller), shared by the
    API's route and the dashboard's forms (web/ui/)."""
    if decision not in approvals.DECISIONS:
        raise InvalidRequest("decision must be 'approve' or 'deny'", field="decision")
    return approvals.decide(conn(), run_id, approval_id, str(decision),
                            state().dispatcher.enqueue)
