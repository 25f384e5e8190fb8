"""The dashboard's buttons: each a POST (its CSRF token checked in session.py before
anything here runs) that calls the very function the API's route calls, so a stop,
decision, resume, retry or delivery decision has one implementation.

A refusal (a run no longer paused, an approval already decided, a delivery in flight)
comes back as a notice on the page the button was on.
"""

from __future__ import annotations

from collections.abc import Callable

from flask import flash, redirect, request, url_for
from werkzeug.wrappers import Response

from ...errors import DeliveryNotFound, RunNotFound, RunstileError
from .. import approvals
from .. import deliveries as api_deliveries
from .. import runs as api_runs
from . import blueprint

#: A form's retry token becomes the retry's Idempotency-Key: a double-clicked (or
#: re-sent) Retry admits one run, not two.
RETRY_KEY_PREFIX = "ui-retry:"


def _attempt(action: Callable[[], str]) -> None:
    """Run ``action``; flash what it says, or the refusal's message."""
    try:
        flash(action(), "ok")
    except (RunNotFound, DeliveryNotFound):
        raise  # what the key may not see is a "Not found" page, as in the API
    except RunstileError as exc:
        flash(exc.message, "error")


def _back_to_run(run_id: str) -> Response:
    return redirect(url_for("ui.run_page", run_id=run_id))


@blueprint.post("/ui/runs/<run_id>/stop")
def stop(run_id: str) -> Response:
    def act() -> str:
        run, settled = api_runs.stop(run_id)
        return ("Stopped: the run is " + run["status"].replace("_", " ") + "." if settled
                else "Stop requested: the run ends cancelled once its body stops.")
    _attempt(act)
    return _back_to_run(run_id)


@blueprint.post("/ui/runs/<run_id>/approval")
def decide(run_id: str) -> Response:
    api_runs.visible_run(run_id)
    decision = request.form.get("decision", "")
    approval_id = request.form.get("approval_id", "")[:64]

    def act() -> str:
        approvals.decide_approval(run_id, approval_id, decision)
        return "Approved: the run continues." if decision == "approve" else \
            "Denied: the run continues without it."
    _attempt(act)
    return _back_to_run(run_id)


@blueprint.post("/ui/runs/<run_id>/resume")
def resume(run_id: str) -> Response:
    def act() -> str:
        api_runs.resume(run_id)
        return "Resumed: the run is queued again (attempt + 1)."
    _attempt(act)
    return _back_to_run(run_id)


@blueprint.post("/ui/runs/<run_id>/retry")
def retry(run_id: str) -> Response:
    token = request.form.get("retry_token", "")
    key = RETRY_KEY_PREFIX + token if token.isascii() and 16 <= len(token) <= 64 \
        and token.replace("-", "").replace("_", "").isalnum() else None
    try:
        admitted = api_runs.retry(run_id, key)
    except RunNotFound:
        raise
    except RunstileError as exc:
        flash(exc.message, "error")
        return _back_to_run(run_id)
    flash(f"Retried as a new run of {run_id}.", "ok")
    return _back_to_run(admitted.run["id"])


def _delivery_decision(delivery_id: str, decide: Callable[[str], object], done: str) -> Response:
    _attempt(lambda: (decide(delivery_id), done)[1])
    run_id = request.form.get("run_id", "")
    if request.form.get("back") == "run" and run_id.startswith("run_"):
        return _back_to_run(run_id)  # only ever this app's own page: no open redirect
    return redirect(url_for("ui.deliveries_page"))


@blueprint.post("/ui/deliveries/<delivery_id>/retry")
def retry_delivery(delivery_id: str) -> Response:
    return _delivery_decision(delivery_id, api_deliveries.rearm,
                              "Re-armed: the delivery is pending again with fresh attempts.")


@blueprint.post("/ui/deliveries/<delivery_id>/discard")
def discard_delivery(delivery_id: str) -> Response:
    return _delivery_decision(delivery_id, api_deliveries.discard,
                              "Discarded: the delivery will not be sent.")
