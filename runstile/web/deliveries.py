"""Delivery obligations over HTTP (docs/api.md, "Deliveries (webhooks)").

``GET /v1/runs/<id>/deliveries`` lists a run's obligations; a person re-arms a parked
one (``POST /v1/deliveries/<id>/retry``) or settles it for good (``…/discard``).  An
obligation is visible exactly when its run is (404 otherwise, never 403).
"""

from __future__ import annotations

from typing import Any

from flask import Blueprint, Response, jsonify

from ..errors import DeliveryInFlight, DeliveryNotFound, DeliverySettled, RunNotFound
from ..ledger import obligations, runs
from ..objects import delivery_object
from .auth import authenticate, principal
from .state import conn

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
