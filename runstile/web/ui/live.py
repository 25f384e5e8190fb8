"""What ui.js polls to keep statuses live without a reload (docs/dashboard.md, "Live
updates"): small JSON answers under the session, scoped as every page is.

Polling, not the event stream: a runs page watches up to fifty runs at once, and a poll
holds no request thread between answers (an event stream holds one for minutes).
"""

from __future__ import annotations

from flask import jsonify, request
from werkzeug.wrappers import Response

from ...ledger import dashboard, events
from ...objects import rfc3339
from ..auth import principal
from ..runs import visible_run
from ..state import conn
from . import blueprint
from .pages import PAGE_SIZE


@blueprint.get("/ui/live/statuses")
def live_statuses() -> Response:
    """The status of each ``id`` the key may see (others are left out)."""
    ids = [i for i in request.args.getlist("id")[:PAGE_SIZE] if len(i) <= 64]
    found = dashboard.statuses(conn(), principal(), ids)
    return jsonify({"runs": {run_id: {"status": row["status"],
                                      "updated_at": rfc3339(row["updated_at"])}
                             for run_id, row in found.items()}})


@blueprint.get("/ui/live/runs/<run_id>")
def live_run(run_id: str) -> Response:
    """A run's status, last change and whether it has events after ``after``: the run
    page redraws itself when any of them moved."""
    run = visible_run(run_id)
    raw = request.args.get("after", "0")
    after = int(raw) if raw.isascii() and raw.isdigit() and len(raw) <= 18 else 0
    newer = bool(events.after(conn(), run_id, after, limit=1))
    return jsonify({"status": run["status"], "updated_at": rfc3339(run["updated_at"]),
                    "newer_events": newer})
