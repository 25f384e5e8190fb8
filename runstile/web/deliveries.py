"""Delivery obligations over HTTP (docs/api.md, "Deliveries (webhooks)").

``GET /v1/runs/<id>/deliveries`` lists a run's obligations, ``GET /v1/deliveries`` those
of every run the key may see (by state, newest first, paged); a person re-arms a parked
one (``POST /v1/deliveries/<id>/retry``) or settles it for good (``…/discard``).  An
obligation is visible exactly when its run is (404 otherwise, never 403).
"""

from __future__ import annotations

from typing import Any

from flask import Blueprint, Response, jsonify, request

from ..errors import (
    DeliveryInFlight,
    DeliveryNotFound,
    DeliverySettled,
    InvalidRequest,
    RunNotFound,
)
from ..ledger import obligations, runs
from ..objects import delivery_object
from .auth import authenticate, principal
from .runs import decode_cursor, encode_cursor
from .state import conn, state

blueprint = Blueprint("deliveries", __name__)


@blueprint.before_request
def _authenticate() -> None:
    authenticate()


@blueprint.get("/v1/runs/<run_id>/deliveries")
def list_deliveries(run_id: str) -> Response:
    if runs.get_visible(conn(), principal(), run_id) is None:
        raise RunNotFound("no such run")
    rows = obligations.for_run(conn(), run_id)
    return jsonify({"object": "list", "data": [delivery_object(r) for r in rows],
                    "has_more": False, "next_cursor": None})


_LIST_PARAMS = {"state", "limit", "cursor"}


@blueprint.get("/v1/deliveries")
def list_all_deliveries() -> Response:
    """The obligations of every run the key may see, newest first: ``state`` repeatable
    (none: every state), ``limit`` and ``cursor`` as for GET /v1/runs."""
    for name in request.args:
        if name not in _LIST_PARAMS:
            raise InvalidRequest(f"unknown query parameter {name!r}", field=name)
    states = tuple(request.args.getlist("state"))
    if any(s not in obligations.STATES for s in states):
        raise InvalidRequest("state must be one of " + ", ".join(obligations.STATES),
                             field="state")
    raw_limit = request.args.get("limit", "20")
    limit = int(raw_limit) if raw_limit.isascii() and raw_limit.isdigit() and \
        len(raw_limit) <= 3 else 0
    if not 1 <= limit <= 200:
        raise InvalidRequest("limit must be a whole number from 1 to 200", field="limit")
    cursor = request.args.get("cursor")
    rows, has_more = obligations.list_visible(
        conn(), runs.visible_clause(principal()), states=states, limit=limit,
        before=None if cursor is None else decode_cursor(cursor),
        timeout_s=state().settings.list_query_timeout_ms / 1000)
    return jsonify({"object": "list", "data": [delivery_object(r) for r in rows],
                    "has_more": has_more,
                    "next_cursor": encode_cursor(rows[-1]["page_seq"]) if has_more else None})


def _visible(delivery_id: str) -> dict[str, Any]:
    row = obligations.get(conn(), delivery_id) if len(delivery_id) <= 64 else None
    if row is None or runs.get_visible(conn(), principal(), row["run_id"]) is None:
        raise DeliveryNotFound("no such delivery")
    return row


def _by() -> str:
    return f"key:{principal().key_id}"


@blueprint.post("/v1/deliveries/<delivery_id>/retry")
def retry_delivery(delivery_id: str) -> Response:
    """parked -> pending with fresh attempts (200).  Already pending or in flight: 200,
    nothing changes.  Delivered or discarded: 409 delivery_settled."""
    return jsonify(delivery_object(rearm(delivery_id)))


@blueprint.post("/v1/deliveries/<delivery_id>/discard")
def discard_delivery(delivery_id: str) -> Response:
    """pending | parked -> discarded (200); again: 200.  Delivered: 409
    delivery_settled; an attempt under way: 409 delivery_in_flight (ask again)."""
    return jsonify(delivery_object(discard(delivery_id)))


# A person's decisions, shared by the API's routes and the dashboard's forms (web/ui/).

def rearm(delivery_id: str) -> dict[str, Any]:
    """Re-arm a parked delivery the caller may see: the row as it now stands."""
    _visible(delivery_id)
    decided = obligations.rearm(conn(), delivery_id, by=_by())
    if decided is None:  # gone since _visible read it
        raise DeliveryNotFound("no such delivery")
    row, changed = decided
    if not changed and row["state"] in ("delivered", "discarded"):
        raise DeliverySettled(f"the delivery is {row['state']}")
    if changed:  # its commit sent the re-armed delivery's message (ledger/owed.py)
        current = obligations.get(conn(), delivery_id)
        if current is None:  # not expected: retention keeps a run that owes a delivery
            raise DeliveryNotFound("no such delivery")
        row = current
    return row


def discard(delivery_id: str) -> dict[str, Any]:
    """Discard a pending or parked delivery the caller may see, for good."""
    _visible(delivery_id)
    decided = obligations.discard(conn(), delivery_id, by=_by())
    if decided is None:  # gone since _visible read it
        raise DeliveryNotFound("no such delivery")
    row, changed = decided
    if not changed and row["state"] == "delivered":
        raise DeliverySettled("the delivery was delivered")
    if not changed and row["state"] == "attempting":
        raise DeliveryInFlight("an attempt is under way; ask again when it ends")
    return row
