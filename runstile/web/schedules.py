"""``GET /v1/schedules`` (docs/api.md, "GET /v1/schedules — list schedules"): each declared
schedule of the admin's profile with its state, its last and its next tick.

The declarations are this process's task modules' (``runstile.schedule``); the state
(paused, last tick admitted) is the ledger's (ledger/schedules.py).
"""

from __future__ import annotations

import time
from typing import Any

from flask import Blueprint, Response, jsonify

from .. import tasks as registry
from .. import ticks
from ..errors import RouteNotFound
from ..ledger import schedules as ledger
from ..objects import rfc3339
from ..tasks import ScheduleSpec
from .auth import authenticate
from .state import conn

blueprint = Blueprint("schedules", __name__)


def schedule_object(spec: ScheduleSpec, state: dict[str, Any] | None,
                    now: float) -> dict[str, Any]:
    """One schedule as the API and ``runstile schedules list --json`` show it."""
    paused = state is not None and state["paused_at"] is not None
    rule = spec.ticks
    return {
        "object": "schedule", "name": spec.name, "task": spec.task, "profile": spec.profile,
        "cron": rule.cron, "every_s": rule.every_s, "timezone": rule.zone,
        "catchup": spec.catchup, "input": spec.input, "paused": paused,
        "paused_at": rfc3339(state["paused_at"]) if paused and state else None,
        "last_tick": _tick(state["last_tick"]) if state else None,
        "last_run_id": state["last_run_id"] if state else None,
        "next_tick": None if paused else _tick(rule.next_after(now)),
    }


def _tick(tick: float | None) -> str | None:
    """A tick as its run's idempotency key spells it (``YYYY-MM-DDTHH:MM:SSZ``)."""
    return None if tick is None else ticks.spell(tick)


def schedule_objects(states: dict[str, dict[str, Any]], profile: str | None = None,
                     now: float | None = None) -> list[dict[str, Any]]:
    """Every declared schedule (of ``profile``, if given), by name."""
    moment = time.time() if now is None else now
    return [schedule_object(spec, states.get(name), moment)
            for name, spec in registry.schedules().items()
            if profile is None or spec.profile == profile]


@blueprint.get("/v1/schedules")
def list_schedules() -> Response:
    principal = authenticate()
    if not principal.is_admin:
        raise RouteNotFound("no route matches this path")  # no 403: admins only see it
    return jsonify({"object": "list",
                    "data": schedule_objects(ledger.states(conn()), principal.profile_id)})
