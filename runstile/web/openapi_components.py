"""The components of the OpenAPI document (``web/openapi.py``): the schemas of errors,
runs, events and deliveries, and the response pieces its routes share.  Split from
openapi.py along that seam (docs/api.md).  The request body's limits are admission's own
(``web/admission.py``, ``web/delay.py``, ``ledger/broker_queue.py`` for priorities, and
``netguard`` for the callback URL), so the document cannot drift from what admission
checks."""

from __future__ import annotations

from typing import Any

from ..ledger.broker_queue import DEFAULT_PRIORITY, MAX_PRIORITY, MIN_PRIORITY
from ..ledger.states import RunStatus
from ..netguard import MAX_URL_LENGTH
from ..queues import QUEUE_PATTERN
from . import admission, delay

#: A JSON object of the document (a schema, a path item, an operation, a response...).
JSONObject = dict[str, Any]

TEXT = {"type": "string"}
NULL_TEXT = {"type": ["string", "null"]}
TIME = {"type": ["string", "null"], "format": "date-time"}
#: No C0 or C1 control characters (and no DEL), as admission checks session keys.
NO_CONTROL_CHARS = "^[^\\u0000-\\u001f\\u007f-\\u009f]*$"
RUN_ID = {"type": "string", "pattern": f"^{admission.RUN_ID_PATTERN}$"}
STATUSES = [s.value for s in RunStatus]


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
                           "has_more": {"type": "boolean"}, "next_cursor": NULL_TEXT}}


def error_schema() -> JSONObject:
    return {"type": "object", "required": ["error"],
            "properties": {"error": {
                "type": "object", "required": ["code", "message"],
                "properties": {"code": TEXT, "message": TEXT, "field": TEXT},
            }}}


def run_create_schema() -> JSONObject:
    """The body of POST /v1/runs, with admission's limits (web/admission.py)."""
    properties = {
        "task": {"type": "string", "minLength": 1, "maxLength": admission.MAX_TASK_NAME,
                 "description": "a registered task; required unless RUNSTILE_DEFAULT_TASK "
                                "is set"},
        "input": {"description": "any I-JSON value (RFC 7493): numbers an IEEE double "
                                 "holds exactly, so integers within ±(2^53-1)"},
        "run_id": dict(RUN_ID),
        "session_key": {"type": "string", "minLength": 1, "maxLength": admission.MAX_TEXT,
                        "pattern": NO_CONTROL_CHARS},
        "trigger_id": {"type": "string", "minLength": 1, "maxLength": admission.MAX_TEXT},
        "callback_url": {"type": "string", "format": "uri", "maxLength": MAX_URL_LENGTH},
        "metadata": {"type": "object", "maxProperties": admission.MAX_METADATA_KEYS,
                     "propertyNames": {"minLength": 1, "maxLength": admission.MAX_METADATA_KEY},
                     "additionalProperties": {"type": "string",
                                              "maxLength": admission.MAX_METADATA_VALUE}},
        "priority": {"type": "integer", "minimum": MIN_PRIORITY, "maximum": MAX_PRIORITY,
                     "default": DEFAULT_PRIORITY,
                     "description": "higher starts first among a queue's claimable runs; "
                                    f"absent: {DEFAULT_PRIORITY}"},
        "delay_s": {"type": "number", "minimum": 0, "maximum": delay.MAX_DELAY_S,
                    "description": "start no sooner than this many seconds after admission"},
        "not_before": {"type": "string", "format": "date-time",
                       "pattern": f"^{delay.RFC3339_PATTERN}$",
                       "description": "start no sooner than this time (RFC 3339, at most 30 "
                                      "days ahead; a past time means now)"},
    }
    if set(properties) != admission.FIELDS:
        # admission refuses any field outside FIELDS: the document must name the same.
        raise ValueError(f"RunCreate names {sorted(properties)}, admission takes "
                         f"{sorted(admission.FIELDS)}")
    # delay_s and not_before are exclusive: a body names one or neither.
    return {"type": "object", "additionalProperties": False, "properties": properties,
            "not": {"required": ["delay_s", "not_before"]}}


def run_schema() -> JSONObject:
    return {
        "type": "object",
        "required": ["object", "id", "status", "task", "input", "created_at", "attempt"],
        "properties": {
            "object": {"const": "run"}, "id": dict(RUN_ID), "status": {"enum": STATUSES},
            "task": TEXT, "input": {},
            "session_key": NULL_TEXT, "trigger_id": NULL_TEXT,
            "metadata": {"type": ["object", "null"],
                         "additionalProperties": {"type": "string"}},
            "callback_url": NULL_TEXT,
            "created_at": TIME, "updated_at": TIME, "started_at": TIME,
            "finished_at": TIME,
            "attempt": {"type": "integer", "minimum": 1},
            "retry_of": {**RUN_ID, "type": ["string", "null"]}, "not_before": TIME,
            "priority": {"type": "integer", "minimum": MIN_PRIORITY, "maximum": MAX_PRIORITY},
            "queue": {"type": "string", "pattern": f"^{QUEUE_PATTERN}$"},
            "result": {},
            "error": {"type": ["object", "null"],
                      "properties": {"code": TEXT, "message": TEXT}},
            "approval": {"type": ["object", "null"]},
            "recovery": {"type": ["object", "null"],
                         "properties": {"attempts": {"type": "integer"},
                                        "reason": NULL_TEXT}},
            "replayed": {"type": "boolean"},
        },
    }


def event_schemas() -> JSONObject:
    return {
        "Event": {
            "type": "object", "required": ["seq", "type", "data", "created_at"],
            "properties": {"seq": {"type": "integer", "minimum": 1}, "type": TEXT, "data": {},
                           "created_at": TIME},
        },
        "EventList": {
            "type": "object", "required": ["data", "next_after"],
            "properties": {"data": {"type": "array",
                                    "items": {"$ref": "#/components/schemas/Event"}},
                           "next_after": {"type": "integer", "minimum": 0}},
        },
    }


def delivery_schema() -> JSONObject:
    return {
        "type": "object",
        "required": ["object", "id", "run_id", "kind", "type", "url", "state", "attempts"],
        "properties": {
            "object": {"const": "delivery"}, "id": TEXT, "run_id": dict(RUN_ID),
            "kind": {"enum": ["callback", "deliver"]}, "type": TEXT, "url": TEXT,
            "state": {"enum": ["pending", "attempting", "delivered", "parked", "discarded"]},
            "attempts": {"type": "integer", "minimum": 0}, "recovered": {"type": "boolean"},
            "next_attempt_at": TIME, "last_status": {"type": ["integer", "null"]},
            "last_error": NULL_TEXT, "settled_by": NULL_TEXT, "created_at": TIME,
            "updated_at": TIME, "settled_at": TIME,
        },
    }


def step_schema() -> JSONObject:
    return {
        "type": "object",
        "required": ["position", "name", "state", "idempotent", "attempt", "started_at",
                     "finished_at", "result"],
        "properties": {
            "position": {"type": "integer", "minimum": 1}, "name": TEXT,
            "state": {"enum": ["started", "completed", "failed"]},
            "idempotent": {"type": "boolean"}, "attempt": {"type": "integer", "minimum": 1},
            "started_at": TIME, "finished_at": TIME, "result": {},
        },
    }


def schemas() -> JSONObject:
    return {"Error": error_schema(), "RunCreate": run_create_schema(), "Run": run_schema(),
            "RunList": list_of("Run"), **event_schemas(), "Delivery": delivery_schema(),
            "DeliveryList": list_of("Delivery"), "Step": step_schema(),
            "StepList": {"type": "object", "required": ["object", "data"],
                         "properties": {"object": {"const": "list"}, "data": {
                             "type": "array", "items": {"$ref": "#/components/schemas/Step"}}}},
            "Capabilities": {"type": "object"}, "Health": {"type": "object"}}
