"""Approvals: a body asks a person; the run parks; a decision re-queues it.

The request (``ctx.request_approval``: docs/tasks.md, "RunContext") is a journaled call
like a step (kind 'approval', matched by position), so a re-run body finds the decision in
its journal instead of asking again.  A person decides through the route of
docs/api.md, "POST /v1/runs/{run_id}/approval — decide a pending approval".  The run's
``approval`` column holds the latest request for the API.
"""

from __future__ import annotations

import json
import secrets
import sqlite3
from typing import Any

from ..errors import ApprovalAlreadyResolved, ApprovalNotPending
from . import db, events, slots
from .db import NOW
from .execution import Owner, owns
from .runs import Enqueue, add_dispatch

DECISIONS = ("approve", "deny")


def request(conn: sqlite3.Connection, run_id: str, owner: Owner, *, position: int,
            args_hash: str, details: object,
            enqueue: Enqueue | None = None) -> dict[str, Any] | None:
    """running -> waiting_for_approval, fenced on the lease, in one transaction; the
    lease is released so the worker thread is free at once.  Returns the approval
    object, or None if this worker no longer owns the run.

    The run keeps its session's head, but not its slots: a waiting run runs nothing, so
    its profile's slot and its task's go to the runs waiting for them (ledger/slots.py).
    """
    with db.transaction(conn):
        run = owns(conn, run_id, owner)
        if run is None or run["status"] != "running":
            return None
        approval_id = "apr_" + secrets.token_hex(12)
        conn.execute(
            "INSERT INTO journal (run_id, position, kind, name, args_hash, state, result, "
            f"attempt, started_at) VALUES (?, ?, 'approval', 'request_approval', ?, 'started', "
            f"?, ?, {NOW})",
            (run_id, position, args_hash, json.dumps({"approval_id": approval_id}),
             run["attempt"]))
        d = db.dialect(conn)
        approval_sql = d.json_object(
            f"'approval_id', {d.text_param}, 'details', {d.json_param}, 'requested_at', "
            f"{NOW}, 'decision', NULL, 'resolved_at', NULL")
        row = conn.execute(
            f"UPDATE runs SET status = 'waiting_for_approval', approval = {approval_sql}, "
            "owner_node = NULL, owner_generation = NULL, "
            "owner_pid = NULL, owner_thread = NULL, lease_expires_at = NULL, "
            f"updated_at = {NOW} WHERE id = ? AND status = 'running' RETURNING approval",
            (approval_id, json.dumps(details), run_id)).fetchone()
        events.append(conn, run_id, "approval.requested",
                      {"approval_id": approval_id, "details": details})
        slots.dispatch_next(conn, run, enqueue)
        approval: dict[str, Any] = json.loads(row[0])
        return approval


def decide(conn: sqlite3.Connection, run_id: str, approval_id: str, decision: str,
           enqueue: Enqueue | None) -> dict[str, Any]:
    """Record a person's decision; returns the run row.

    Rules for a known approval id come first (same decision again: fine, any time;
    the other decision: 409 approval_already_resolved), then the run's status: the
    first decision is one guarded transition waiting_for_approval -> queued (same
    attempt) with a dispatch record.
    """
    assert decision in DECISIONS
    d = db.dialect(conn)
    with db.transaction(conn):
        entry = conn.execute(
            "SELECT position, state, result FROM journal WHERE run_id = ? AND kind = 'approval' "
            f"AND {d.json_text('result', 'approval_id')} = ?", (run_id, approval_id)).fetchone()
        if entry is None:
            raise ApprovalNotPending("no pending approval with this id on this run")
        recorded = json.loads(entry["result"]).get("decision")
        if recorded is not None:
            if recorded != decision:
                raise ApprovalAlreadyResolved(f"this approval was already decided: {recorded}")
            return db.as_dict(conn.execute("SELECT * FROM runs WHERE id = ?", (run_id,)).fetchone())
        decided = d.json_set("approval", [("decision", d.text_param), ("resolved_at", NOW)])
        row = conn.execute(
            f"UPDATE runs SET status = 'queued', approval = {decided}, updated_at = {NOW} "
            "WHERE id = ? AND status = 'waiting_for_approval' AND "
            f"{d.json_text('approval', 'approval_id')} = ? "
            "RETURNING *", (decision, run_id, approval_id)).fetchone()
        if row is None:
            raise ApprovalNotPending("the run is not waiting for this approval")
        conn.execute(
            f"UPDATE journal SET state = 'completed', completed_at = {NOW}, "
            f"result = {d.json_set('result', [('decision', d.text_param)])} "
            "WHERE run_id = ? AND position = ?",
            (decision, run_id, entry["position"]))
        events.append(conn, run_id, "approval.resolved",
                      {"approval_id": approval_id, "decision": decision})
        run = db.as_dict(row)
        add_dispatch(conn, run, "approval", enqueue)
        return run
