"""Sessions: runs of one (scope, session_key) execute one at a time, in order (docs/api.md,
"POST /v1/runs — admit a run", ``session_key``).

A run may be claimed only when no run of its session is running, stopping or waiting
for approval, and it is the session's first queued run (resumed runs first, then
admission order).  Paused and terminal runs never block.  Whatever frees a session
(a run ending, pausing, being stopped) dispatches the session's next run in the same
transaction, so nobody waits for a sweep; a message for a run that may not go yet is
acknowledged as a no-op by the claim.
"""

from __future__ import annotations

import sqlite3
from typing import Any

from . import db
from .runs import Enqueue, add_dispatch, due, not_waiting_for_a_slot

#: Statuses that hold a session's head.
HOLDING = "('running', 'stopping', 'waiting_for_approval')"
_SESSION = "profile_id = ? AND key_id = ? AND session_key = ?"
#: Resumed runs first (a person asked for them), then admission order.
_HEAD_ORDER = "ORDER BY (recovery_reason IS 'resumed') DESC, seq"
#: SQL condition on a queued run ``r``: it is due (a delayed run's not_before has passed),
#: nothing holds its session and it is the session's head (or it has no session).  A
#: delayed head is still the head: the runs after it wait.  Recovery re-publishes only
#: such runs, and a freed slot (ledger/slots.py) goes only to such a run; the others wait
#: for whatever frees their session, or for their time.
CLAIMABLE = (
    f"{due('r.')} AND (r.session_key IS NULL OR (NOT EXISTS (SELECT 1 FROM runs h WHERE "
    "h.profile_id = r.profile_id AND h.key_id = r.key_id AND h.session_key = r.session_key "
    f"AND h.status IN {HOLDING}) AND NOT EXISTS "
    "(SELECT 1 FROM runs q WHERE q.profile_id = r.profile_id AND q.key_id = r.key_id AND "
    "q.session_key = r.session_key AND q.status = 'queued' AND q.id != r.id AND "
    "((q.recovery_reason IS 'resumed') > (r.recovery_reason IS 'resumed') OR "
    "((q.recovery_reason IS 'resumed') = (r.recovery_reason IS 'resumed') AND q.seq < r.seq)))))")


def _key(run: dict[str, Any]) -> tuple[str, str, str]:
    return run["profile_id"], run["key_id"], run["session_key"]


def claim_refusal(conn: sqlite3.Connection, run: dict[str, Any]) -> str | None:
    """Why ``run`` (queued) may not be claimed now, or None if it may."""
    if run["session_key"] is None:
        return None
    if conn.execute(f"SELECT 1 FROM runs WHERE {_SESSION} AND status IN {HOLDING} LIMIT 1",
                    _key(run)).fetchone():
        return "session_busy"
    head = conn.execute(f"SELECT id FROM runs WHERE {_SESSION} AND status = 'queued' "
                        f"{_HEAD_ORDER} LIMIT 1", _key(run)).fetchone()
    return None if head is not None and head[0] == run["id"] else "not_session_head"


def dispatch_next(conn: sqlite3.Connection, run: dict[str, Any],
                  enqueue: Enqueue | None) -> str | None:
    """After ``run`` stopped holding its session: dispatch the session's next run, in the
    caller's transaction.  Returns the dispatched run id, if any."""
    if run.get("session_key") is None:
        return None
    if conn.execute(f"SELECT 1 FROM runs WHERE {_SESSION} AND status IN {HOLDING} LIMIT 1",
                    _key(run)).fetchone():
        return None
    head = conn.execute(f"SELECT * FROM runs WHERE {_SESSION} AND status = 'queued' "
                        f"{_HEAD_ORDER} LIMIT 1", _key(run)).fetchone()
    if head is None:
        return None
    add_dispatch(conn, db.as_dict(head), "session_next", enqueue)
    run_id: str = head["id"]
    return run_id


def heads_without_dispatch(conn: sqlite3.Connection, *, limit: int) -> list[dict[str, Any]]:
    """Recovery step 5: each session with queued runs and nothing holding it, by its head."""
    rows = conn.execute(
        "SELECT r.* FROM runs r WHERE r.session_key IS NOT NULL AND r.status = 'queued' "
        "AND NOT EXISTS (SELECT 1 FROM runs h WHERE h.profile_id = r.profile_id AND "
        "h.key_id = r.key_id AND h.session_key = r.session_key AND h.status IN "
        f"{HOLDING}) AND r.id = (SELECT q.id FROM runs q WHERE q.profile_id = r.profile_id "
        "AND q.key_id = r.key_id AND q.session_key = r.session_key AND q.status = 'queued' "
        f"{_HEAD_ORDER.replace('recovery_reason', 'q.recovery_reason').replace('seq', 'q.seq')} "
        # A head waiting for a slot of its profile or its task is dispatched when one
        # frees (recovery hands those out in the same step, ledger/slots.py).
        f"LIMIT 1) AND {not_waiting_for_a_slot('r.')} AND {due('r.')} LIMIT ?",
        (limit,)).fetchall()
    return [db.as_dict(r) for r in rows]
