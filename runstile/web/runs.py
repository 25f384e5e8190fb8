"""/v1/runs: admission, reading and the event log (docs/api.md, from "POST /v1/runs —
admit a run" to "GET /v1/runs/{run_id}/events — the event log"), stop, resume and retry."""

from __future__ import annotations

import base64
from typing import Any

from flask import Blueprint, Response, jsonify, request

from ..errors import InvalidRequest, RunNotFound, RunNotPaused, RunNotRetryable
from ..ledger import events, execution, journal, runs
from ..ledger.admission import Admitted
from ..ledger.states import RETRYABLE, RunStatus
from ..objects import event_object, parse_rfc3339, run_object, step_object
from . import admission, admission_endpoint, metrics, openapi, streams
from .auth import authenticate, principal
from .errors import as_response
from .state import conn, state

blueprint = Blueprint("runs", __name__)

LIST_PARAMS = {"status", "task", "session_key", "idempotency_key", "created_after",
               "created_before", "limit", "cursor"}
#: ``metadata.<k>=<v>`` values one list request may filter on: each is a scan of every
#: row's JSON, and hundreds took 27 s on a 20,000-run ledger (docs/api.md, "Limits on a
#: list query").
MAX_METADATA_FILTERS = 8


def _whole_number(text: str) -> int | None:
    """``text`` as a whole number that fits the ledger's seqs (an SQLite INTEGER), or None.

    ASCII digits only: str.isdigit() also accepts '²' (which int() refuses) and '٣' (which
    it reads as 3); and a larger number cannot even be bound to a query.
    """
    if not (text.isascii() and text.isdigit()):
        return None
    value = int(text)
    return value if value <= openapi.MAX_SEQ else None


@blueprint.before_request
def _authenticate() -> None:
    authenticate()


@blueprint.post("/v1/runs")
def create_run() -> Response:
    """Reached only by a caller of the Flask app that bypasses the admission endpoint in
    front of it (web/admission_endpoint.py), which answers POST /v1/runs itself: the same
    answer either way, the key resolved by this blueprint's hook.  Registered so that the
    URL map knows the method."""
    return as_response(admission_endpoint.admitted_answer(state(), request.environ,
                                                          principal()))


def visible_run(run_id: str) -> dict[str, Any]:
    run = runs.get_visible(conn(), principal(), run_id)
    if run is None:
        raise RunNotFound("no such run")
    return run


@blueprint.post("/v1/runs/<run_id>/stop")
def stop_run(run_id: str) -> Response:
    """200 when the run is settled (cancelled now, or already terminal), 202 while a
    running body is being stopped.  Repeats are harmless (docs/api.md,
    "POST /v1/runs/{run_id}/stop — stop a run")."""
    run, settled = stop(run_id)
    response = jsonify(run_object(run))
    response.status_code = 200 if settled else 202
    return response


@blueprint.post("/v1/runs/<run_id>/resume")
def resume_run(run_id: str) -> Response:
    """A person accepts the uncertainty of a paused run; it runs again (docs/api.md,
    "POST /v1/runs/{run_id}/resume — resume a paused run")."""
    return jsonify(run_object(resume(run_id)))


@blueprint.post("/v1/runs/<run_id>/retry")
def retry_run(run_id: str) -> Response:
    """A new run of a failed, cancelled or interrupted run's task and input, admitted as
    any run is (docs/api.md, "POST /v1/runs/{run_id}/retry — retry a finished run")."""
    key = admission.parse_idempotency_key(request.environ)
    return as_response(admission_endpoint.accepted(retry(run_id, key)))


# The control actions, shared by the API's routes and the dashboard's forms (web/ui/),
# so a transition has one implementation whichever surface asks for it.

def stop(run_id: str) -> tuple[dict[str, Any], bool]:
    """Stop a run the caller may see: (run, settled)."""
    visible_run(run_id)
    # A cancel may free the run's session and owe its callback a notice: the commit
    # pays both (docs/architecture.md, "What a commit owes").
    stopped = execution.stop(conn(), run_id, enqueue=state().dispatcher.enqueue)
    if stopped is None:
        raise RunNotFound("no such run")
    return stopped


def resume(run_id: str) -> dict[str, Any]:
    """Re-queue a paused run the caller may see; RunNotPaused otherwise."""
    run = visible_run(run_id)
    resumed = execution.requeue(conn(), run_id, from_statuses=("paused",), reason="resumed",
                                event_type="run.resumed", enqueue=state().dispatcher.enqueue)
    if resumed is None:
        current = runs.get_visible(conn(), principal(), run_id) or run
        raise RunNotPaused(f"the run is {current['status']}, not paused",
                           run_status=current["status"])
    return resumed


def retry(run_id: str, key: str | None) -> Admitted:
    """Admit a new run of a retryable run the caller may see (``key``: its
    Idempotency-Key, if any); RunNotRetryable otherwise."""
    web = state()
    original = visible_run(run_id)
    # Retryable statuses are terminal, so the status read here is the run's for good.
    if original["status"] not in RETRYABLE:
        raise RunNotRetryable(f"the run is {original['status']}; only a failed, cancelled "
                              "or interrupted run can be retried",
                              run_status=original["status"])
    req, refusal = admission.build_retry(original, principal(), key, settings=web.settings,
                                         task_names=web.task_names)
    admitted = admission_endpoint.admit_and_publish(web, req, refusal)
    if not admitted.replayed:
        metrics.observe_admitted(admitted.run["task"])
    return admitted


@blueprint.get("/v1/runs/<run_id>")
def get_run(run_id: str) -> Response:
    return jsonify(run_object(visible_run(run_id)))


@blueprint.get("/v1/runs/<run_id>/steps")
def run_steps(run_id: str) -> Response:
    """The run's step journal in call order (docs/api.md, "GET /v1/runs/{run_id}/steps")."""
    visible_run(run_id)
    return jsonify({"object": "list",
                    "data": [step_object(r) for r in journal.steps(conn(), run_id)]})


def encode_cursor(seq: int) -> str:
    return base64.urlsafe_b64encode(f"v1:{seq}".encode()).decode().rstrip("=")


def decode_cursor(text: str) -> int:
    try:
        raw = base64.urlsafe_b64decode(text + "=" * (-len(text) % 4)).decode()
        version, _, seq = raw.partition(":")
        if version != "v1" or _whole_number(seq) is None:
            raise ValueError
        return int(seq)
    except (ValueError, UnicodeDecodeError):
        raise InvalidRequest("cursor is not one this API returned", field="cursor") from None


def _time_param(name: str) -> float | None:
    value = request.args.get(name)
    if value is None:
        return None
    try:
        return parse_rfc3339(value)
    except ValueError:
        raise InvalidRequest(f"{name} must be an RFC 3339 time with a timezone",
                             field=name) from None


def _list_filter() -> runs.RunFilter:
    for name in request.args:
        if name not in LIST_PARAMS and not name.startswith("metadata."):
            raise InvalidRequest(f"unknown query parameter {name!r}", field=name)
    statuses = tuple(request.args.getlist("status"))
    if not runs.statuses_known(statuses):
        raise InvalidRequest("status must be one of " + ", ".join(s.value for s in RunStatus),
                             field="status")
    metadata = tuple((name.removeprefix("metadata."), value)
                     for name in request.args for value in request.args.getlist(name)
                     if name.startswith("metadata."))
    if any(not key for key, _ in metadata):
        raise InvalidRequest("metadata filters look like metadata.<key>=<value>",
                             field="metadata")
    if len(metadata) > MAX_METADATA_FILTERS:
        raise InvalidRequest(f"at most {MAX_METADATA_FILTERS} metadata.<key>=<value> filters "
                             f"per request ({len(metadata)} were sent)", field="metadata")
    return runs.RunFilter(
        statuses=statuses, task=request.args.get("task"),
        session_key=request.args.get("session_key"),
        idempotency_key=request.args.get("idempotency_key"),
        created_after=_time_param("created_after"),
        created_before=_time_param("created_before"), metadata=metadata)


@blueprint.get("/v1/runs")
def list_runs() -> Response:
    flt = _list_filter()
    limit = _whole_number(request.args.get("limit", "20"))
    if limit is None or not 1 <= limit <= 200:
        raise InvalidRequest("limit must be a whole number from 1 to 200", field="limit")
    cursor = request.args.get("cursor")
    before = None if cursor is None else decode_cursor(cursor)
    rows, has_more = runs.list_visible(
        conn(), principal(), flt, before_seq=before, limit=limit,
        timeout_s=state().settings.list_query_timeout_ms / 1000)
    return jsonify({"object": "list", "data": [run_object(r) for r in rows],
                    "has_more": has_more,
                    "next_cursor": encode_cursor(rows[-1]["seq"]) if has_more else None})


def _after_param() -> int:
    raw = request.args.get("after")
    if raw is None:
        raw = request.headers.get("Last-Event-ID")
    if raw is None or raw == "":
        return 0
    after = _whole_number(raw)
    if after is None:
        raise InvalidRequest(f"after / Last-Event-ID must be a whole number up to "
                             f"{openapi.MAX_SEQ}", field="after")
    return after


def _wants_json() -> bool:
    best = request.accept_mimetypes.best_match(["text/event-stream", "application/json"])
    return best == "application/json" and request.accept_mimetypes["application/json"] > \
        request.accept_mimetypes["text/event-stream"]


@blueprint.get("/v1/runs/<run_id>/events")
def run_events(run_id: str) -> Response:
    visible_run(run_id)
    after = _after_param()
    if _wants_json():
        data = events.after(conn(), run_id, after)
        return jsonify({"data": [event_object(e) for e in data],
                        "next_after": data[-1]["seq"] if data else after})
    return streams.open_stream(run_id, after, principal().key_id)
