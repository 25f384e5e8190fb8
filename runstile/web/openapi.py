"""The OpenAPI 3.1 document served at /openapi.json; a test checks it covers every route."""

from __future__ import annotations

from functools import lru_cache

from .. import __version__
from ..ledger.states import RunStatus

_TEXT = {"type": "string"}
_NULL_TEXT = {"type": ["string", "null"]}
_TIME = {"type": ["string", "null"], "format": "date-time"}
#: No C0 or C1 control characters (and no DEL), as admission checks session keys.
_NO_CONTROL_CHARS = "^[^\\u0000-\\u001f\\u007f-\\u009f]*$"


def _error(description: str) -> dict:
    return {"description": description,
            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}


def _json(ref: str, description: str) -> dict:
    return {"description": description,
            "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{ref}"}}}}


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
_AUTH_ERRORS = {"401": _error("missing, malformed, unknown or revoked key"),
                "503": _error("run_storage_unavailable: the ledger is unavailable; retry")}

_SCHEMAS = {
    "Error": {
        "type": "object", "required": ["error"],
        "properties": {"error": {
            "type": "object", "required": ["code", "message"],
            "properties": {"code": _TEXT, "message": _TEXT, "field": _TEXT},
        }},
    },
    "RunCreate": {
        "type": "object", "additionalProperties": False,
        "properties": {
            "task": {"type": "string", "minLength": 1, "maxLength": 128,
                     "description": "a registered task; required unless RUNSTILE_DEFAULT_TASK "
                                    "is set"},
            "input": {"description": "any I-JSON value (RFC 7493): numbers an IEEE double "
                                     "holds exactly, so integers within ±(2^53-1)"},
            "run_id": {"type": "string", "pattern": "^run_[0-9a-f]{32}$"},
            "session_key": {"type": "string", "minLength": 1, "maxLength": 256,
                            "pattern": _NO_CONTROL_CHARS},
            "trigger_id": {"type": "string", "minLength": 1, "maxLength": 256},
            "callback_url": {"type": "string", "format": "uri", "maxLength": 2048},
            "metadata": {"type": "object", "maxProperties": 32,
                         "propertyNames": {"minLength": 1, "maxLength": 128},
                         "additionalProperties": {"type": "string", "maxLength": 512}},
        },
    },
    "Run": {
        "type": "object",
        "required": ["object", "id", "status", "task", "input", "created_at", "attempt"],
        "properties": {
            "object": {"const": "run"},
            "id": {"type": "string", "pattern": "^run_[0-9a-f]{32}$"},
            "status": {"enum": [s.value for s in RunStatus]},
            "task": _TEXT, "input": {},
            "session_key": _NULL_TEXT, "trigger_id": _NULL_TEXT,
            "metadata": {"type": ["object", "null"],
                         "additionalProperties": {"type": "string"}},
            "callback_url": _NULL_TEXT,
            "created_at": _TIME, "updated_at": _TIME, "started_at": _TIME,
            "finished_at": _TIME,
            "attempt": {"type": "integer", "minimum": 1},
            "result": {},
            "error": {"type": ["object", "null"],
                      "properties": {"code": _TEXT, "message": _TEXT}},
            "approval": {"type": ["object", "null"]},
            "recovery": {"type": ["object", "null"],
                         "properties": {"attempts": {"type": "integer"},
                                        "reason": _NULL_TEXT}},
            "replayed": {"type": "boolean"},
        },
    },
    "RunList": {
        "type": "object", "required": ["object", "data", "has_more", "next_cursor"],
        "properties": {"object": {"const": "list"},
                       "data": {"type": "array", "items": {"$ref": "#/components/schemas/Run"}},
                       "has_more": {"type": "boolean"}, "next_cursor": _NULL_TEXT},
    },
    "Event": {
        "type": "object", "required": ["seq", "type", "data", "created_at"],
        "properties": {"seq": {"type": "integer", "minimum": 1}, "type": _TEXT, "data": {},
                       "created_at": _TIME},
    },
    "EventList": {
        "type": "object", "required": ["data", "next_after"],
        "properties": {"data": {"type": "array",
                                "items": {"$ref": "#/components/schemas/Event"}},
                       "next_after": {"type": "integer", "minimum": 0}},
    },
    "Delivery": {
        "type": "object",
        "required": ["object", "id", "run_id", "kind", "type", "url", "state", "attempts"],
        "properties": {
            "object": {"const": "delivery"}, "id": _TEXT,
            "run_id": {"type": "string", "pattern": "^run_[0-9a-f]{32}$"},
            "kind": {"enum": ["callback", "deliver"]}, "type": _TEXT, "url": _TEXT,
            "state": {"enum": ["pending", "attempting", "delivered", "parked", "discarded"]},
            "attempts": {"type": "integer", "minimum": 0}, "recovered": {"type": "boolean"},
            "next_attempt_at": _TIME, "last_status": {"type": ["integer", "null"]},
            "last_error": _NULL_TEXT, "settled_by": _NULL_TEXT, "created_at": _TIME,
            "updated_at": _TIME, "settled_at": _TIME,
        },
    },
    "DeliveryList": {
        "type": "object", "required": ["object", "data", "has_more", "next_cursor"],
        "properties": {"object": {"const": "list"},
                       "data": {"type": "array",
                                "items": {"$ref": "#/components/schemas/Delivery"}},
                       "has_more": {"type": "boolean"}, "next_cursor": _NULL_TEXT},
    },
    "Capabilities": {"type": "object"},
    "Health": {"type": "object"},
}

_DELIVERY_ID_PARAM = {"name": "delivery_id", "in": "path", "required": True,
                      "schema": {"type": "string"}}


def _list_parameters() -> list[dict]:
    query = lambda name, schema, desc: {"name": name, "in": "query", "required": False,
                                        "schema": schema, "description": desc}
    return [
        {"name": "status", "in": "query", "required": False, "style": "form", "explode": True,
         "schema": {"type": "array", "items": {"enum": [s.value for s in RunStatus]}},
         "description": "repeatable"},
        query("task", _TEXT, "exact task name"),
        query("session_key", _TEXT, "exact session key"),
        query("idempotency_key", _TEXT, "exact lookup in the caller's scope (0 or 1 run)"),
        query("created_after", {"type": "string", "format": "date-time"}, "RFC 3339"),
        query("created_before", {"type": "string", "format": "date-time"}, "RFC 3339"),
        query("limit", {"type": "integer", "minimum": 1, "maximum": 200, "default": 20}, ""),
        query("cursor", _TEXT, "next_cursor of the previous page"),
    ]


@lru_cache(maxsize=1)
def document() -> dict:
    return {
        "openapi": "3.1.0",
        "info": {"title": "runstile", "version": __version__,
                 "description": "Durable, idempotent run admission with at-most-once "
                                "execution. Errors are {\"error\": {\"code\", \"message\"}}."},
        "components": {
            "schemas": _SCHEMAS,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
        "security": [{"bearer": []}],
        "paths": {
            "/v1/runs": {
                "post": {
                    "operationId": "createRun", "summary": "Admit a run (idempotent)",
                    "parameters": [{"name": "Idempotency-Key", "in": "header", "required": False,
                                    "schema": {"type": "string", "pattern": "^[!-~]{1,255}$"}}],
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
                },
                "get": {
                    "operationId": "listRuns", "summary": "List runs, newest first",
                    "parameters": _list_parameters(),
                    "responses": {"200": _json("RunList", "one page"),
                                  "400": _error("invalid_request (also: more than 8 "
                                                "metadata.* filters)"),
                                  **_AUTH_ERRORS,
                                  "503": _error("run_storage_unavailable, or "
                                                "list_query_timeout: the query ran past "
                                                "RUNSTILE_LIST_QUERY_TIMEOUT_MS (Retry-After)")},
                },
            },
            "/v1/runs/{run_id}": {
                "get": {
                    "operationId": "getRun", "summary": "Read one run",
                    "parameters": [_RUN_ID_PARAM],
                    "responses": {"200": _json("Run", "the run"),
                                  "404": _error("run_not_found"), **_AUTH_ERRORS},
                },
            },
            "/v1/runs/{run_id}/events": {
                "get": {
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
                            "application/json": {
                                "schema": {"$ref": "#/components/schemas/EventList"}},
                            "text/event-stream": {"schema": _SSE_EVENT}}},
                        "400": _error("invalid_request"),
                        "404": _error("run_not_found"),
                        "429": _error("too_many_streams_for_key: this key already holds "
                                      "RUNSTILE_MAX_STREAMS_PER_KEY streams here (Retry-After)"),
                        **_AUTH_ERRORS,
                        "503": _error("run_storage_unavailable, or too_many_streams: this "
                                      "process serves its maximum of streams (Retry-After)"),
                    },
                },
            },
            "/v1/runs/{run_id}/stop": {
                "post": {
                    "operationId": "stopRun",
                    "summary": "Stop this run: cancelled at once if not running (200), "
                               "stopping while its body is asked to stop (202)",
                    "parameters": [_RUN_ID_PARAM],
                    "responses": {"200": _json("Run", "cancelled now, or already terminal"),
                                  "202": _json("Run", "stopping: the body is being stopped"),
                                  "404": _error("run_not_found"), **_AUTH_ERRORS},
                },
            },
            "/v1/runs/{run_id}/approval": {
                "post": {
                    "operationId": "decideApproval",
                    "summary": "Decide a pending approval: the first decision re-queues the run",
                    "parameters": [_RUN_ID_PARAM],
                    "requestBody": {"required": True, "content": {"application/json": {
                        "schema": {"type": "object", "additionalProperties": False,
                                   "required": ["approval_id", "decision"],
                                   "properties": {"approval_id": {
                                                      "type": "string", "minLength": 1,
                                                      "maxLength": 64},
                                                  "decision": {"enum": ["approve", "deny"]}}}}}},
                    "responses": {"200": _json("Run", "decided (or the same decision again)"),
                                  "400": _error("invalid_request / invalid_json"),
                                  "404": _error("run_not_found"),
                                  "409": _error("approval_already_resolved or "
                                                "approval_not_pending"),
                                  **_AUTH_ERRORS},
                },
            },
            "/v1/runs/{run_id}/resume": {
                "post": {
                    "operationId": "resumeRun",
                    "summary": "Re-queue a paused run (attempt + 1): a person accepts the "
                               "uncertainty",
                    "parameters": [_RUN_ID_PARAM],
                    "responses": {"200": _json("Run", "the re-queued run"),
                                  "404": _error("run_not_found"),
                                  "409": _error("run_not_paused"), **_AUTH_ERRORS},
                },
            },
            "/v1/runs/{run_id}/deliveries": {
                "get": {
                    "operationId": "listDeliveries",
                    "summary": "The run's delivery obligations (webhooks), oldest first",
                    "parameters": [_RUN_ID_PARAM],
                    "responses": {"200": _json("DeliveryList", "the run's obligations"),
                                  "404": _error("run_not_found"), **_AUTH_ERRORS},
                },
            },
            "/v1/deliveries/{delivery_id}/retry": {
                "post": {
                    "operationId": "retryDelivery",
                    "summary": "Re-arm a parked delivery with fresh attempts",
                    "parameters": [_DELIVERY_ID_PARAM],
                    "responses": {"200": _json("Delivery", "re-armed (or already pending)"),
                                  "404": _error("delivery_not_found"),
                                  "409": _error("delivery_settled"), **_AUTH_ERRORS},
                },
            },
            "/v1/deliveries/{delivery_id}/discard": {
                "post": {
                    "operationId": "discardDelivery",
                    "summary": "Settle a pending or parked delivery for good",
                    "parameters": [_DELIVERY_ID_PARAM],
                    "responses": {"200": _json("Delivery", "discarded (or already)"),
                                  "404": _error("delivery_not_found"),
                                  "409": _error("delivery_settled or delivery_in_flight"),
                                  **_AUTH_ERRORS},
                },
            },
            "/v1/recovery": {
                "get": {"operationId": "recoveryReports",
                        "summary": "The latest recovery reports (admin keys; 404 otherwise)",
                        "responses": {"200": {"description": "reports", "content": {
                            "application/json": {"schema": {"type": "object"}}}},
                            "404": _error("not_found for a client key"), **_AUTH_ERRORS}},
            },
            "/v1/capabilities": {
                "get": {"operationId": "capabilities", "summary": "The contract, machine-readable",
                        "responses": {"200": _json("Capabilities", "capabilities"),
                                      **_AUTH_ERRORS}},
            },
            "/healthz": {
                "get": {"operationId": "healthz", "summary": "Process alive", "security": [],
                        "responses": {"200": _json("Health", "alive")}},
            },
            "/readyz": {
                "get": {"operationId": "readyz", "security": [],
                        "summary": "Ledger open and migrated (recovery joins this check "
                                   "when the recovery barrier lands)",
                        "responses": {"200": _json("Health", "ready"),
                                      "503": _json("Health", "not ready (Retry-After)")}},
            },
            "/metrics": {
                "get": {"operationId": "metrics", "summary": "Prometheus text", "security": [],
                        "responses": {"200": {"description": "metrics", "content": {
                            "text/plain": {"schema": {"type": "string"}}}}}},
            },
            "/openapi.json": {
                "get": {"operationId": "openapi", "summary": "This document",
                        "responses": {"200": {"description": "OpenAPI 3.1", "content": {
                            "application/json": {"schema": {"type": "object"}}}},
                            "401": _error("missing, malformed, unknown or revoked key")}},
            },
        },
    }
