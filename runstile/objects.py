"""Public JSON shapes (docs/api.md, "The run object"): the run object and event object, from ledger rows.

Shared by the web tier and (later) webhook payloads, so a run looks the same wherever
a client meets it.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from .jsondepth import loads_for_reading


def rfc3339(ts: float | None) -> str | None:
    """Unix seconds -> RFC 3339 UTC with milliseconds, e.g. 2026-11-29T18:31:30.123Z."""
    if ts is None:
        return None
    # isoformat in C (~3x faster than strftime); milliseconds truncated, as before.
    return dt.datetime.fromtimestamp(ts, tz=dt.UTC).isoformat(
        timespec="milliseconds")[:-6] + "Z"   # "+00:00" -> "Z"


def parse_rfc3339(text: str) -> float:
    """RFC 3339 -> Unix seconds; raises ValueError (a timezone is required)."""
    value = dt.datetime.fromisoformat(text.replace("Z", "+00:00").replace("z", "+00:00"))
    if value.tzinfo is None:
        raise ValueError("a timezone (Z or ±hh:mm) is required")
    return value.timestamp()


def _json(text: str | None) -> Any:
    return None if text is None else loads_for_reading(text)


def _approval(text: str | None) -> dict | None:
    approval = _json(text)
    if approval is not None:
        for name in ("requested_at", "resolved_at"):
            approval[name] = rfc3339(approval.get(name))
    return approval


def run_object(row: dict) -> dict:
    error = None
    if row.get("error_code"):
        error = {"code": row["error_code"], "message": row.get("error_message") or ""}
    recovery = None
    if row.get("recovery_attempts") or row.get("recovery_reason"):
        recovery = {"attempts": row.get("recovery_attempts") or 0,
                    "reason": row.get("recovery_reason")}
    return {
        "object": "run",
        "id": row["id"],
        "status": row["status"],
        "task": row["task"],
        "input": _json(row["input"]),
        "session_key": row["session_key"],
        "trigger_id": row["trigger_id"],
        "metadata": _json(row["metadata"]),
        "callback_url": row["callback_url"],
        "created_at": rfc3339(row["created_at"]),
        "updated_at": rfc3339(row["updated_at"]),
        "started_at": rfc3339(row["started_at"]),
        "finished_at": rfc3339(row["finished_at"]),
        "attempt": row["attempt"],
        "retry_of": row.get("retry_of"),
        "not_before": rfc3339(row.get("not_before")),
        "priority": row.get("priority", 5),
        "queue": row.get("queue") or "default",
        "result": _json(row["result"]),
        "error": error,
        "approval": _approval(row.get("approval")),
        "recovery": recovery,
    }


def event_object(event: dict) -> dict:
    return {"seq": event["seq"], "type": event["type"], "data": event["data"],
            "created_at": rfc3339(event["created_at"])}


def delivery_object(row: dict) -> dict:
    """A delivery obligation as the API shows it (docs/api.md, "Deliveries (webhooks)")."""
    return {
        "object": "delivery",
        "id": row["id"],
        "run_id": row["run_id"],
        "kind": row["kind"],
        "type": row["type"],
        "url": row["url"],
        "state": row["state"],
        "attempts": row["attempts"],
        "recovered": bool(row["ambiguous"]),
        "next_attempt_at": rfc3339(row["next_attempt_at"]) if row["state"] == "pending" else None,
        "last_status": row["last_status"],
        "last_error": row["last_error"],
        "settled_by": row["settled_by"],
        "created_at": rfc3339(row["created_at"]),
        "updated_at": rfc3339(row["updated_at"]),
        "settled_at": rfc3339(row["settled_at"]),
    }


def step_object(row: dict) -> dict:
    """A ``ctx.step`` journal row (docs/api.md, "GET /v1/runs/{run_id}/steps"): a failed
    step's result is ``{"error": "..."}`` as the journal recorded it."""
    return {"position": row["position"], "name": row["name"], "state": row["state"],
            "idempotent": bool(row["idempotent"]), "attempt": row["attempt"],
            "started_at": rfc3339(row["started_at"]),
            "finished_at": rfc3339(row["completed_at"]), "result": _json(row["result"])}
