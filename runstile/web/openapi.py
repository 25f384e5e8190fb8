"""The OpenAPI 3.1 document served at /openapi.json (``web/service.py``).

Built from one function per group of routes here and one per component in
``web/openapi_components.py`` (the schemas, whose request body limits are admission's
own: ``web/admission.py``, ``web/delay.py``, and ``netguard`` for the callback URL, so
the document cannot drift from what admission checks); tests/api/test_openapi_fuzz.py
fuzzes the served document and tests/api/test_auth_and_service.py checks it covers every
route.
"""

from __future__ import annotations

from functools import lru_cache

from .. import __version__
from ..ledger.approvals import DECISIONS
from ..ledger.obligations import STATES as DELIVERY_STATES
from . import admission
from .openapi_components import STATUSES as _STATUSES
from .openapi_components import TEXT as _TEXT
from .openapi_components import JSONObject, schemas
from .openapi_components import error as _error
from .openapi_components import json_body as _json

#: Largest event or run seq (an SQLite INTEGER); an ``after`` or cursor beyond it is refused.
MAX_SEQ = 2**63 - 1
#: One Server-Sent Event of a run's stream (before OpenAPI 3.2, a text/event-stream
#: schema describes each event): its data is the JSON of an Event.
_SSE_EVENT = {
    "type": "object", "required": ["data"],
    "properties": {"id": {"type": "string", "pattern": "^[0-9]+$"}, "event": _TEXT,
                   "data": {"type": "string", "contentMediaType": "application/json",
                            "contentSchema": {"$ref": "#/components/schemas/Event"}},
                   "retry": {"type": "integer", "minimum": 0}},
}
_RUN_ID_PARAM = {"name": "run_id", "in": "path", "required": True,
                 "schema": {"type": "string"}}
_IDEMPOTENCY_KEY_PARAM = {"name": "Idempotency-Key", "in": "header", "required": False,
                          "schema": {"type": "string",
                                     "pattern": f"^{admission.IDEMPOTENCY_KEY_PATTERN}$"}}
_DELIVERY_ID_PARAM = {"name": "delivery_id", "in": "path", "required": True,
                      "schema": {"type": "string"}}
_AUTH_ERRORS = {"401": _error("missing, malformed, unknown or revoked key"),
                "503": _error("run_storage_unavailable: the ledger is unavailable; retry")}


# -- routes ---------------------------------------------------------------------------

def _create_run() -> JSONObject:
    return {
        "operationId": "createRun", "summary": "Admit a run (idempotent)",
        "parameters": [_IDEMPOTENCY_KEY_PARAM],
        "requestBody": {"required": True, "content": {"application/json": {
            "schema": {"$ref": "#/components/schemas/RunCreate"}}}},
        "responses": {
            "202": _json("Run", "admitted, or a replay (Idempotency-Replayed: true)"),
            "400": _error("invalid_json, invalid_request, invalid_idempotency_key, "
                          "invalid_run_id, invalid_callback_url or unknown_task"),
            "409": _error("idempotency_key_conflict or run_id_conflict"),
            "410": _error("idempotency_key_expired"),
            "413": _error("payload_too_large"),
            "415": _error("unsupported_media_type"),
            "429": _error("capacity_exceeded (Retry-After)"),
            **_AUTH_ERRORS,
        },
    }


def _query(name: str, schema: JSONObject, description: str) -> JSONObject:
    return {"name": name, "in": "query", "required": False, "schema": schema,
            "description": description}


def _list_parameters() -> list[JSONObject]:
    return [
        {"name": "status", "in": "query", "required": False, "style": "form", "explode": True,
         "schema": {"type": "array", "items": {"enum": _STATUSES}},
         "description": "repeatable"},
        _query("task", _TEXT, "exact task name"),
        _query("session_key", _TEXT, "exact session key"),
        _query("idempotency_key", _TEXT, "exact lookup in the caller's scope (0 or 1 run); an "
               "admin key's lookup of a schedule:<name>:<tick> key finds the profile's "
               "scheduled run"),
        _query("created_after", {"type": "string", "format": "date-time"}, "RFC 3339"),
        _query("created_before", {"type": "string", "format": "date-time"}, "RFC 3339"),
        _query("limit", {"type": "integer", "minimum": 1, "maximum": 200, "default": 20}, ""),
        _query("cursor", _TEXT, "next_cursor of the previous page"),
    ]


def _list_runs() -> JSONObject:
    return {
        "operationId": "listRuns", "summary": "List runs, newest first",
        "parameters": _list_parameters(),
        "responses": {"200": _json("RunList", "one page"),
                      "400": _error("invalid_request (also: more than 8 metadata.* filters)"),
                      **_AUTH_ERRORS,
                      "503": _error("run_storage_unavailable, or list_query_timeout: the "
                                    "query ran past RUNSTILE_LIST_QUERY_TIMEOUT_MS "
                                    "(Retry-After)")},
    }


def _run_events() -> JSONObject:
    return {
        "operationId": "runEvents",
        "summary": "A run's events: SSE by default, JSON with Accept: application/json",
        "parameters": [
            _RUN_ID_PARAM,
            {"name": "after", "in": "query", "required": False,
             "schema": {"type": "integer", "minimum": 0, "maximum": MAX_SEQ}},
            {"name": "Last-Event-ID", "in": "header", "required": False,
             "description": "the last seq received; ?after wins over it",
             "schema": {"type": "string", "pattern": "^[0-9]*$"}},
        ],
        "responses": {
            "200": {"description": "events after the given seq", "content": {
                "application/json": {"schema": {"$ref": "#/components/schemas/EventList"}},
                "text/event-stream": {"schema": _SSE_EVENT}}},
            "400": _error("invalid_request"),
            "404": _error("run_not_found"),
            "429": _error("too_many_streams_for_key: this key already holds "
                          "RUNSTILE_MAX_STREAMS_PER_KEY streams here (Retry-After)"),
            **_AUTH_ERRORS,
            "503": _error("run_storage_unavailable, or too_many_streams: this process "
                          "serves its maximum of streams (Retry-After)"),
        },
    }


def _run_paths() -> JSONObject:
    """Admitting, listing and reading runs, and a run's events."""
    return {
        "/v1/runs": {"post": _create_run(), "get": _list_runs()},
        "/v1/runs/{run_id}": {"get": {
            "operationId": "getRun", "summary": "Read one run", "parameters": [_RUN_ID_PARAM],
            "responses": {"200": _json("Run", "the run"), "404": _error("run_not_found"),
                          **_AUTH_ERRORS}}},
        "/v1/runs/{run_id}/events": {"get": _run_events()},
        "/v1/runs/{run_id}/steps": {"get": {
            "operationId": "runSteps", "summary": "The run's step journal, in call order",
            "parameters": [_RUN_ID_PARAM],
            "responses": {"200": _json("StepList", "the run's steps"),
                          "404": _error("run_not_found"), **_AUTH_ERRORS}}},
    }


def _decide_approval() -> JSONObject:
    return {
        "operationId": "decideApproval",
        "summary": "Decide a pending approval: the first decision re-queues the run",
        "parameters": [_RUN_ID_PARAM],
        "requestBody": {"required": True, "content": {"application/json": {"schema": {
            "type": "object", "additionalProperties": False,
            "required": ["approval_id", "decision"],
            "properties": {"approval_id": {"type": "string", "minLength": 1, "maxLength": 64},
                           "decision": {"enum": list(DECISIONS)}}}}}},
        "responses": {"200": _json("Run", "decided (or the same decision again)"),
                      "400": _error("invalid_request / invalid_json"),
                      "404": _error("run_not_found"),
                      "409": _error("approval_already_resolved or approval_not_pending"),
                      **_AUTH_ERRORS},
    }


def _run_action_paths() -> JSONObject:
    """What a person does to a run: stop it, decide its approval, resume or retry it."""
    return {
        "/v1/runs/{run_id}/stop": {"post": {
            "operationId": "stopRun",
            "summary": "Stop this run: cancelled at once if not running (200), stopping "
                       "while its body is asked to stop (202)",
            "parameters": [_RUN_ID_PARAM],
            "responses": {"200": _json("Run", "cancelled now, or already terminal"),
                          "202": _json("Run", "stopping: the body is being stopped"),
                          "404": _error("run_not_found"), **_AUTH_ERRORS}}},
        "/v1/runs/{run_id}/approval": {"post": _decide_approval()},
        "/v1/runs/{run_id}/resume": {"post": {
            "operationId": "resumeRun",
            "summary": "Re-queue a paused run (attempt + 1): a person accepts the uncertainty",
            "parameters": [_RUN_ID_PARAM],
            "responses": {"200": _json("Run", "the re-queued run"),
                          "404": _error("run_not_found"),
                          "409": _error("run_not_paused"), **_AUTH_ERRORS}}},
        "/v1/runs/{run_id}/retry": {"post": _retry_run()},
    }


def _retry_run() -> JSONObject:
    return {
        "operationId": "retryRun", "parameters": [_RUN_ID_PARAM, _IDEMPOTENCY_KEY_PARAM],
        "summary": "A new run of a failed, cancelled or interrupted run (idempotent)",
        "responses": {
            "202": _json("Run", "the new run (retry_of names the original), or a replay"),
            "400": _error("invalid_idempotency_key, invalid_callback_url or unknown_task"),
            "404": _error("run_not_found"), "410": _error("idempotency_key_expired"),
            "409": _error("run_not_retryable (run_status) or idempotency_key_conflict"),
            "429": _error("capacity_exceeded (Retry-After)"), **_AUTH_ERRORS}}


def _delivery_paths() -> JSONObject:
    """A run's delivery obligations (webhooks), and settling one by hand."""
    return {
        "/v1/runs/{run_id}/deliveries": {"get": {
            "operationId": "listDeliveries",
            "summary": "The run's delivery obligations (webhooks), oldest first",
            "parameters": [_RUN_ID_PARAM],
            "responses": {"200": _json("DeliveryList", "the run's obligations"),
                          "404": _error("run_not_found"), **_AUTH_ERRORS}}},
        "/v1/deliveries": {"get": {
            "operationId": "listAllDeliveries",
            "summary": "Delivery obligations of every run the key may see, newest first",
            "parameters": [
                {"name": "state", "in": "query", "required": False, "style": "form",
                 "explode": True, "description": "repeatable; none: every state",
                 "schema": {"type": "array", "items": {"enum": list(DELIVERY_STATES)}}},
                _query("limit", {"type": "integer", "minimum": 1, "maximum": 200,
                                 "default": 20}, ""),
                _query("cursor", _TEXT, "next_cursor of the previous page")],
            "responses": {"200": _json("DeliveryList", "one page"),
                          "400": _error("invalid_request"), **_AUTH_ERRORS,
                          "503": _error("run_storage_unavailable, or list_query_timeout "
                                        "(Retry-After)")}}},
        "/v1/deliveries/{delivery_id}/retry": {"post": {
            "operationId": "retryDelivery",
            "summary": "Re-arm a parked delivery with fresh attempts",
            "parameters": [_DELIVERY_ID_PARAM],
            "responses": {"200": _json("Delivery", "re-armed (or already pending)"),
                          "404": _error("delivery_not_found"),
                          "409": _error("delivery_settled"), **_AUTH_ERRORS}}},
        "/v1/deliveries/{delivery_id}/discard": {"post": {
            "operationId": "discardDelivery",
            "summary": "Settle a pending or parked delivery for good",
            "parameters": [_DELIVERY_ID_PARAM],
            "responses": {"200": _json("Delivery", "discarded (or already)"),
                          "404": _error("delivery_not_found"),
                          "409": _error("delivery_settled or delivery_in_flight"),
                          **_AUTH_ERRORS}}},
    }


def _any_object(description: str) -> JSONObject:
    """A JSON object response this document does not describe field by field."""
    return {"description": description,
            "content": {"application/json": {"schema": {"type": "object"}}}}


def _service_paths() -> JSONObject:
    """Recovery reports, capabilities, health, metrics and this document."""
    return {
        "/v1/recovery": {"get": {
            "operationId": "recoveryReports",
            "summary": "The latest recovery reports (admin keys; 404 otherwise)",
            "responses": {"200": _any_object("reports"),
                          "404": _error("not_found for a client key"), **_AUTH_ERRORS}}},
        "/v1/schedules": {"get": {
            "operationId": "listSchedules",
            "summary": "The profile's schedules, each with its last and next tick (admin "
                       "keys; 404 otherwise)",
            "responses": {"200": _any_object("schedules"),
                          "404": _error("not_found for a client key"), **_AUTH_ERRORS}}},
        "/v1/capabilities": {"get": {
            "operationId": "capabilities", "summary": "The contract, machine-readable",
            "responses": {"200": _json("Capabilities", "capabilities"), **_AUTH_ERRORS}}},
        "/healthz": {"get": {"operationId": "healthz", "summary": "Process alive", "security": [],
                             "responses": {"200": _json("Health", "alive")}}},
        "/readyz": {"get": {
            "operationId": "readyz", "security": [],
            "summary": "Ledger open and migrated (recovery joins this check when the "
                       "recovery barrier lands)",
            "responses": {"200": _json("Health", "ready"),
                          "503": _json("Health", "not ready (Retry-After)")}}},
        "/metrics": {"get": {"operationId": "metrics", "summary": "Prometheus text",
                             "security": [],
                             "responses": {"200": {"description": "metrics", "content": {
                                 "text/plain": {"schema": {"type": "string"}}}},
                                 "401": _error("RUNSTILE_METRICS_TOKEN is set and the "
                                               "request's bearer token is not it")}}},
        "/openapi.json": {"get": {
            "operationId": "openapi", "summary": "This document",
            "responses": {"200": _any_object("OpenAPI 3.1"),
                          "401": _error("missing, malformed, unknown or revoked key")}}},
    }


@lru_cache(maxsize=1)
def document() -> JSONObject:
    return {
        "openapi": "3.1.0",
        "info": {"title": "runstile", "version": __version__,
                 "description": "Durable, idempotent run admission with at-most-once "
                                "execution. Errors are {\"error\": {\"code\", \"message\"}}."},
        "components": {
            "schemas": schemas(),
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
        "security": [{"bearer": []}],
        "paths": {**_run_paths(), **_run_action_paths(), **_delivery_paths(),
                  **_service_paths()},
    }
