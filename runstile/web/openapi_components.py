"""The components of the OpenAPI document (``web/openapi.py``): its schemas, and the
pieces its routes share.  Split from openapi.py along that seam (docs/api.md).  The
request body's limits are admission's own (``web/admission.py``, and ``netguard`` for the
callback URL), so the document cannot drift from what admission checks.
"""

from __future__ import annotations

from typing import Any

from ..ledger.broker_queue import MAX_PRIORITY, MIN_PRIORITY
from ..ledger.states import RunStatus
from ..netguard import MAX_URL_LENGTH
from . import admission

#: A JSON object of the document (a schema, a path item, an operation, a response...).
JSONObject = dict[str, Any]

_TEXT = {"type": "string"}
_NULL_TEXT = {"type": ["string", "null"]}
_TIME = {"type": ["string", "null"], "format": "date-time"}
#: No C0 or C1 control characters (and no DEL), as admission checks session keys.
_NO_CONTROL_CHARS = "^[^\\u0000-\\u001f\\u007f-\\u009f]*$"
_RUN_ID = {"type": "string", "pattern": f"^{admission.RUN_ID_PATTERN}$"}
_STATUSES = [s.value for s in RunStatus]


def error(description: str) -> JSONObject:
    return {"description": description,
            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}


def json_body(ref: str, description: str) -> JSONObject:
    return {"description": description,
            "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{ref}"}}}}


def list_of(ref: str) -> JSONObject:
    """A page of a list route: ``{"object": "list", "data": [...], ...}``."""
    return {"type": "object", "required": ["object", "data", "has_more", "next_cursor"],
            "properties": {"object": {"const": "list"},
                           "data": {"type": "array",
                                    "items": {"$ref": f"#/components/schemas/{ref}"}},
                           "has_more": {"type": "boolean"}, "next_cursor": _NULL_TEXT}}


# -- components ---------------------------------------------------------------------

def _error_schema() -> JSONObject:
    return {"type": "object", "required": ["error"],
            "properties": {"error": {
                "type": "object", "required": ["code", "message"],
                "properties": {"code": _TEXT, "message": _TEXT, "field": _TEXT},
            }}}


def _run_create_schema() -> JSONObject:
    """The body of POST /v1/runs, with admission's limits (web/admission.py)."""
    properties = {
        "task": {"type": "string", "minLength": 1, "maxLength": admission.MAX_TASK_NAME,
                 "description": "a registered task; required unless RUNSTILE_DEFAULT_TASK "
                                "is set"},
        "input": {"description": "any I-JSON value (RFC 7493): numbers an IEEE double "
                                 "holds exactly, so integers within ±(2^53-1)"},
        "run_id": dict(_RUN_ID),
        "session_key": {"type": "string", "minLength": 1, "maxLength": admission.MAX_TEXT,
                        "pattern": _NO_CONTROL_CHARS},
        "trigger_id": {"type": "string", "minLength": 1, "maxLength": admission.MAX_TEXT},
        "callback_url": {"type": "string", "format": "uri", "maxLength": MAX_URL_LENGTH},
        "metadata": {"type": "object", "maxProperties": admission.MAX_METADATA_KEYS,
                     "propertyNames": {"minLength": 1, "maxLength": admission.MAX_METADATA_KEY},
                     "additionalProperties": {"type": "string",
                                              "maxLength": admission.MAX_METADATA_VALUE}},
        "priority": {"type": "integer", "minimum": MIN_PRIORITY, "maximum": MAX_PRIORITY,
                     "default": 5, "description": "higher starts first among a queue's "
                                                  "claimable runs; absent: 5"},
    }
    if set(properties) != admission.FIELDS:
        # admission refuses any field outside FIELDS: the document must name the same.
        raise ValueError(f"RunCreate names {sorted(properties)}, admission takes "
                         f"{sorted(admission.FIELDS)}")
    return {"type": "object", "additionalProperties": False, "properties": properties}


def _run_schema() -> JSONObject:
    return {
        "type": "object",
        "required": ["object", "id", "status", "task", "input", "created_at", "attempt"],
        "properties": {
            "object": {"const": "run"}, "id": dict(_RUN_ID), "status": {"enum": _STATUSES},
            "task": _TEXT, "input": {},
            "session_key": _NULL_TEXT, "trigger_id": _NULL_TEXT,
            "metadata": {"type": ["object", "null"],
                         "additionalProperties": {"type": "string"}},
            "callback_url": _NULL_TEXT,
            "created_at": _TIME, "updated_at": _TIME, "started_at": _TIME,
            "finished_at": _TIME,
            "attempt": {"type": "integer", "minimum": 1},
            "retry_of": {**_RUN_ID, "type": ["string", "null"]},
            "priority": {"type": "integer", "minimum": MIN_PRIORITY, "maximum": MAX_PRIORITY},
            "result": {},
            "error": {"type": ["object", "null"],
                      "properties": {"code": _TEXT, "message": _TEXT}},
            "approval": {"type": ["object", "null"]},
            "recovery": {"type": ["object", "null"],
                         "properties": {"attempts": {"type": "integer"},
                                        "reason": _NULL_TEXT}},
            "replayed": {"type": "boolean"},
        },
    }


def _event_schemas() -> JSONObject:
    return {
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
    }


def _delivery_schema() -> JSONObject:
    return {
        "type": "object",
        "required": ["object", "id", "run_id", "kind", "type", "url", "state", "attempts"],
        "properties": {
            "object": {"const": "delivery"}, "id": _TEXT, "run_id": dict(_RUN_ID),
            "kind": {"enum": ["callback", "deliver"]}, "type": _TEXT, "url": _TEXT,
            "state": {"enum": ["pending", "attempting", "delivered", "parked", "discarded"]},
            "attempts": {"type": "integer", "minimum": 0}, "recovered": {"type": "boolean"},
            "next_attempt_at": _TIME, "last_status": {"type": ["integer", "null"]},
            "last_error": _NULL_TEXT, "settled_by": _NULL_TEXT, "created_at": _TIME,
            "updated_at": _TIME, "settled_at": _TIME,
        },
    }


def schemas() -> JSONObject:
    return {"Error": _error_schema(), "RunCreate": _run_create_schema(), "Run": _run_schema(),
            "RunList": list_of("Run"), **_event_schemas(), "Delivery": _delivery_schema(),
            "DeliveryList": list_of("Delivery"),
            "Capabilities": {"type": "object"}, "Health": {"type": "object"}}
