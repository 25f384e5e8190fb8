"""What the templates show: times, JSON and statuses as people read them."""

from __future__ import annotations

import json
from typing import Any

from ...jsondepth import loads_for_reading
from ...ledger.states import RETRYABLE, TERMINAL, RunStatus
from ...objects import rfc3339
from . import blueprint

#: JSON longer than this many lines (or characters) is folded into a <details>.
FOLD_LINES = 12
FOLD_CHARS = 800

#: The one-line meaning of every status, shown beside its label.
STATUS_HELP = {
    "queued": "waiting for a worker",
    "running": "a worker is executing the body",
    "stopping": "asked to stop; ends cancelled",
    "waiting_for_approval": "waiting for a person's decision",
    "paused": "stopped for a person: a step may have run",
    "completed": "finished with a result",
    "failed": "finished with an error",
    "cancelled": "stopped before it finished",
    "interrupted": "cut off and not resumed",
}


@blueprint.app_template_filter("utc")
def utc(ts: float | None) -> str:
    """Unix seconds as RFC 3339 UTC (the <time> element's machine value)."""
    return rfc3339(ts) or ""


@blueprint.app_template_filter("utc_text")
def utc_text(ts: float | None) -> str:
    """Unix seconds as people read UTC; ui.js rewrites it into the viewer's zone."""
    text = rfc3339(ts)
    return "" if text is None else text[:19].replace("T", " ") + " UTC"


#: JSON whose one-line form is at most this long is shown on one line.
ONE_LINE = 72


@blueprint.app_template_filter("pretty_json")
def pretty_json(value: Any) -> str:
    """Short JSON on one line, longer JSON indented."""
    flat = json.dumps(value, ensure_ascii=False, separators=(", ", ": "))
    if len(flat) <= ONE_LINE:
        return flat
    return json.dumps(value, indent=2, ensure_ascii=False)


@blueprint.app_template_filter("stored_json")
def stored_json(text: str | None) -> Any:
    """A JSON column as its value (None stays None)."""
    return None if text is None else loads_for_reading(text)


@blueprint.app_template_filter("folds")
def folds(text: str) -> bool:
    return text.count("\n") >= FOLD_LINES or len(text) > FOLD_CHARS


@blueprint.app_template_filter("label")
def label(status: str) -> str:
    return status.replace("_", " ")


@blueprint.app_template_global()
def status_help(status: str) -> str:
    return STATUS_HELP.get(status, "")


def actions_for(run: dict[str, Any]) -> dict[str, bool]:
    """Which control buttons a run's page offers (the server decides again on POST)."""
    status = RunStatus(run["status"])
    return {"stop": status not in TERMINAL | {RunStatus.STOPPING}, "resume": status is RunStatus.PAUSED,
            "retry": status in RETRYABLE,
            "approve": status is RunStatus.WAITING_FOR_APPROVAL}
