"""The journal of a run's body (docs/tasks.md, "What replays and what re-runs"): steps,
emits and deliveries by call position.

Every write is fenced: it happens in a transaction that first proves the caller still
owns the run with a live lease (execution.owns).  A zombie worker that wakes after its
lease expired therefore cannot start a step or add an event.
"""

from __future__ import annotations

import json
import sqlite3
from dataclasses import dataclass
from typing import Any

from ..errors import LeaseLost, RunStopping
from . import db, events, obligations
from .db import NOW
from .execution import Owner, owns


@dataclass(frozen=True)
class Entry:
    position: int
    kind: str
    name: str
    args_hash: str
    state: str
    result: str | None
    starts: int


def entries(conn: sqlite3.Connection, run_id: str) -> dict[int, Entry]:
    """All journal rows of a run, by position (read once, at a body's first journaled call)."""
    with db.ledger_errors():
        rows = conn.execute("SELECT position, kind, name, args_hash, state, result, starts "
                            "FROM journal WHERE run_id = ?", (run_id,)).fetchall()
    return {r["position"]: Entry(*tuple(r)) for r in rows}


def _fence(conn: sqlite3.Connection, run_id: str, owner: Owner) -> dict[str, Any]:
    """Prove ownership (and no pending stop) inside the caller's transaction."""
    run = owns(conn, run_id, owner)
    if run is None:
        raise LeaseLost(f"run {run_id} is no longer owned by this worker")
    if run["status"] == "stopping":
        raise RunStopping(f"run {run_id} was asked to stop")
    return run


def start_step(conn: sqlite3.Connection, run_id: str, owner: Owner, *, position: int,
               name: str, args_hash: str, idempotent: bool, restart: bool) -> dict[str, Any]:
    """Journal "started" for a step, fenced on the lease; returns the run row.

    ``restart`` is set when a row for this position exists and the step must run again
    (idempotent, failed before, or a person accepted the uncertainty): the row records
    the new start instead of a second row.
    """
    with db.transaction(conn):
        run = _fence(conn, run_id, owner)
        if restart:
            conn.execute(
                f"UPDATE journal SET state = 'started', result = NULL, attempt = ?, "
                f"starts = starts + 1, started_at = {NOW}, completed_at = NULL "
                "WHERE run_id = ? AND position = ?", (run["attempt"], run_id, position))
        else:
            conn.execute(
                "INSERT INTO journal (run_id, position, kind, name, args_hash, idempotent, "
                f"state, attempt, started_at) VALUES (?, ?, 'step', ?, ?, ?, 'started', ?, {NOW})",
                (run_id, position, name, args_hash, int(idempotent), run["attempt"]))
        return run


def settle_step(conn: sqlite3.Connection, run_id: str, owner: Owner, *, position: int,
                state: str, result_json: str | None) -> bool:
    """started -> completed | failed for the current owner; False if it lost the run."""
    with db.transaction(conn):
        if owns(conn, run_id, owner) is None:
            return False
        cur = conn.execute(
            f"UPDATE journal SET state = ?, result = ?, completed_at = {NOW} "
            "WHERE run_id = ? AND position = ? AND state = 'started'",
            (state, result_json, run_id, position))
        return cur.rowcount == 1


def record_emit(conn: sqlite3.Connection, run_id: str, owner: Owner, *, position: int,
                type_: str, data: object, args_hash: str) -> int:
    """Append a task event and its journal row in one fenced transaction; return seq."""
    with db.transaction(conn):
        run = _fence(conn, run_id, owner)
        seq = events.append(conn, run_id, type_, data)
        conn.execute(
            "INSERT INTO journal (run_id, position, kind, name, args_hash, state, result, "
            f"attempt, started_at, completed_at) VALUES (?, ?, 'emit', ?, ?, 'completed', ?, ?, "
            f"{NOW}, {NOW})",
            (run_id, position, type_, args_hash, json.dumps(seq), run["attempt"]))
        return seq


def record_deliver(conn: sqlite3.Connection, run_id: str, owner: Owner, *, position: int,
                   url: str, payload_json: str, args_hash: str) -> str:
    """A ``ctx.deliver`` obligation and its journal row in one fenced transaction
    (docs/tasks.md, "Deliveries"); returns the delivery id.  A re-run body finds the row
    and does not add another."""
    with db.transaction(conn):
        run = _fence(conn, run_id, owner)
        obligation_id = obligations.insert_deliver(conn, run, url=url, payload_json=payload_json)
        conn.execute(
            "INSERT INTO journal (run_id, position, kind, name, args_hash, state, result, "
            f"attempt, started_at, completed_at) VALUES (?, ?, 'deliver', 'deliver', ?, "
            f"'completed', ?, ?, {NOW}, {NOW})",
            (run_id, position, args_hash, json.dumps(obligation_id), run["attempt"]))
        return obligation_id


def uncertain_steps(conn: sqlite3.Connection, run_id: str) -> list[str]:
    """Names of non-idempotent steps that started and never settled: uncertain side
    effects (docs/tasks.md, "When the worker is gone")."""
    with db.ledger_errors():
        rows = conn.execute("SELECT name FROM journal WHERE run_id = ? AND kind = 'step' AND "
                            "state = 'started' AND idempotent = 0 ORDER BY position",
                            (run_id,)).fetchall()
    return [r[0] for r in rows]


def steps(conn: sqlite3.Connection, run_id: str) -> list[dict[str, Any]]:
    """A run's ``ctx.step`` rows in call order (docs/api.md, "GET /v1/runs/{run_id}/steps",
    and the dashboard's step journal, which also shows ``starts``); emits, deliveries and
    approvals have their own views (events, deliveries, approval)."""
    with db.ledger_errors():
        rows = conn.execute(
            "SELECT position, name, state, idempotent, attempt, starts, started_at, "
            "completed_at, result FROM journal WHERE run_id = ? AND kind = 'step' "
            "ORDER BY position",
            (run_id,)).fetchall()
    return [db.as_dict(r) for r in rows]
