"""Execution transitions (docs/architecture.md, "Run lifecycle" and "Worker processes"):
claim, heartbeat, finish, pause, re-queue.

Each is one guarded UPDATE that names the status (and, for an owner's writes, the
whole owner and a live lease) it expects, reports whether it won, and appends its
event in the same transaction.  A loser changes nothing.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from . import broker_queue, db, events, sessions, slots
from .db import NOW
from .runs import SLOT_MARKS, Enqueue, add_dispatch, due


@dataclass(frozen=True)
class Owner:
    """Who holds a run's lease: (node, generation, process, thread), as in
    docs/tasks.md, "Time limits, leases and the heartbeat"."""

    node: str
    generation: int
    pid: int
    thread: int

    def as_dict(self) -> dict[str, str | int]:
        return {"node": self.node, "generation": self.generation, "pid": self.pid,
                "thread": self.thread}


_OWNED = ("owner_node = ? AND owner_generation = ? AND owner_pid = ? AND owner_thread = ? "
          f"AND lease_expires_at > {NOW}")


def _owner_args(owner: Owner) -> tuple[str, int, int, int]:
    return owner.node, owner.generation, owner.pid, owner.thread


@dataclass(frozen=True)
class Delivery:
    """The embedded broker's row that brought a run's message to this worker: its
    delivery id and the consumer holding it (workers/sqlite_broker/consumer.py)."""

    delivery_id: int
    consumer_id: str


@dataclass(frozen=True)
class Claim:
    """The outcome of a claim: ``run`` is set when this worker won and may start the body."""

    run: dict[str, Any] | None
    #: claimed | missing | not_queued | session_busy | not_session_head | not_due |
    #: unknown_task | profile_busy | task_busy
    outcome: str


def claim(conn: sqlite3.Connection, run_id: str, owner: Owner, *, lease_s: float,
          task_known: Callable[[str], bool], enqueue: Enqueue | None = None,
          max_running_per_profile: int | None = None,
          task_limit: Callable[[str], int | None] | None = None,
          delivery: Delivery | None = None, unlimited_tasks: str | None = None) -> Claim:
    """queued -> running for ``owner``, or queued -> failed(unknown_task); one transaction.

    ``task_known`` and ``task_limit`` (a task's concurrency, None: unlimited) are what
    the claiming worker's registry says; ``max_running_per_profile`` is its setting.
    ``unlimited_tasks``: a JSON array of task names the registry knows and does not limit
    (a subset is fine, a name outside it never), for the plain claim below.
    ``delivery``: the embedded broker's row of the message being processed, acked in
    this same transaction whatever the claim decides -- once it has decided, the message
    has done its work: a claimed run is recovery's from here (its lease), a refused one
    was a no-op or has been handed a message of its own.  Rolled back with the claim, so
    a claim that fails leaves the message held, as before.

    Race: two workers holding duplicate messages both get here; the write lock orders
    them and the loser's UPDATE finds status != 'queued' and changes nothing.
    """
    with db.transaction(conn):
        acks = [] if delivery is None else [
            broker_queue.ack_in_statement(delivery.delivery_id, delivery.consumer_id)]
        if unlimited_tasks is not None and max_running_per_profile is None:
            # The ack and the plain claim need nothing of each other: one round trip.
            *_, plain = db.together(conn, [*acks, _start_plain(conn, run_id, owner, lease_s,
                                                               unlimited_tasks)])
            row = plain.fetchone()
            if row is not None:
                return _started(conn, db.as_dict(row), owner)
        elif acks:
            db.together(conn, acks)
        return _decide(conn, run_id, owner, lease_s=lease_s, task_known=task_known,
                       enqueue=enqueue, max_running_per_profile=max_running_per_profile,
                       task_limit=task_limit)


def _start_plain(conn: sqlite3.Connection, run_id: str, owner: Owner, lease_s: float,
                 unlimited_tasks: str) -> db.Statement:
    """The claim of a run nothing can refuse, in one guarded UPDATE instead of a read
    and then the UPDATE: no session, a task the worker knows and does not limit, and no
    profile cap (the caller's to know).  For such a run that is due, :func:`_decide` would
    find no refusal and call :func:`_start`: this is that UPDATE (whose guard already
    holds "queued and due") with those facts added to its guard, so it wins exactly when
    _decide would have started the run.  When it returns no row (any other run, or one
    no longer queued) the caller decides as ever.  (Each statement is a round trip to a
    PostgreSQL ledger, paid under its writer lock.)"""
    return _start_statement(run_id, owner, lease_s,
                            guard=f" AND session_key IS NULL AND task IN "
                                  f"{db.dialect(conn).json_array_values()}",
                            guard_args=(unlimited_tasks,))


def _decide(conn: sqlite3.Connection, run_id: str, owner: Owner, *, lease_s: float,
            task_known: Callable[[str], bool], enqueue: Enqueue | None,
            max_running_per_profile: int | None,
            task_limit: Callable[[str], int | None] | None) -> Claim:
    """The claim's decision, inside its transaction."""
    row = conn.execute("SELECT * FROM runs WHERE id = ?", (run_id,)).fetchone()
    if row is None:
        return Claim(None, "missing")
    if row["status"] != "queued":
        return Claim(None, "not_queued")
    limits = slots.Limits(max_running_per_profile, {} if task_limit is None else
                          {row["task"]: task_limit(row["task"])})
    refusal = _refusal(conn, db.as_dict(row), task_known, limits, enqueue)
    if refusal is not None:
        return Claim(None, refusal)
    return _start(conn, run_id, owner, lease_s)


def _refusal(conn: sqlite3.Connection, row: dict[str, Any], task_known: Callable[[str], bool],
             limits: slots.Limits, enqueue: Enqueue | None) -> str | None:
    """Why the queued run ``row`` may not start now (the claim's outcome), or None."""
    refusal = sessions.claim_refusal(conn, row)
    if refusal is not None:
        # Not this run's turn in its session; whatever frees the session will dispatch
        # the next run, so this message is a no-op.
        return refusal
    if row["not_before"] is not None and not _due(conn, row):
        # Before its time (an early duplicate, a clock step): this message is a no-op, and
        # the transaction hands the run a message due at its not_before (the enqueue
        # delays it that long, docs/api.md "Delayed runs"), so its start is not lost.
        add_dispatch(conn, row, "not_due", enqueue)
        return "not_due"
    if not task_known(row["task"]):
        _fail_unknown_task(conn, row, enqueue)
        return "unknown_task"
    # Over its profile's cap or its task's concurrency, the run is marked as waiting, and
    # whatever frees one of those slots dispatches it (under this same write lock, so the
    # two are ordered), so this message is a no-op.
    return slots.claim_refusal(conn, row, limits, enqueue)


def _due(conn: sqlite3.Connection, row: dict[str, Any]) -> bool:
    """Has the ledger clock reached the run's not_before?"""
    return bool(conn.execute(f"SELECT ? <= {NOW}", (row["not_before"],)).fetchone()[0])


def _start(conn: sqlite3.Connection, run_id: str, owner: Owner, lease_s: float) -> Claim:
    """queued -> running for ``owner``, in the claim's transaction; its marks go.
    ``not_queued`` when the guard (queued and due) does not hold."""
    run = conn.execute(*_start_statement(run_id, owner, lease_s)).fetchone()
    if run is None:
        return Claim(None, "not_queued")
    return _started(conn, db.as_dict(run), owner)


def _start_statement(run_id: str, owner: Owner, lease_s: float, *, guard: str = "",
                     guard_args: tuple[Any, ...] = ()) -> db.Statement:
    """The guarded UPDATE of a claim: queued and due (and ``guard``) -> running."""
    return ("UPDATE runs SET status = 'running', owner_node = ?, owner_generation = ?, "
            f"owner_pid = ?, owner_thread = ?, lease_expires_at = {NOW} + ?, "
            f"started_at = COALESCE(started_at, {NOW}), updated_at = {NOW}, "
            f"interruption = NULL, {', '.join(f'{mark} = NULL' for mark in SLOT_MARKS)} "
            f"WHERE id = ? AND status = 'queued' AND {due()}{guard} RETURNING *",
            (*_owner_args(owner), lease_s, run_id, *guard_args))


def _started(conn: sqlite3.Connection, run: dict[str, Any], owner: Owner) -> Claim:
    """The run the claim's UPDATE started: its run.started event, in the same transaction."""
    events.append(conn, run["id"], "run.started",
                  {"attempt": run["attempt"], "owner": owner.as_dict()})
    return Claim(run, "claimed")


def _fail_unknown_task(conn: sqlite3.Connection, row: dict[str, Any],
                      enqueue: Enqueue | None) -> None:
    """queued -> failed(unknown_task), in the claim's transaction: the task is not
    registered on this worker.  It never ran, so it frees its session, not a slot."""
    failed = conn.execute(
        "UPDATE runs SET status = 'failed', error_code = 'unknown_task', "
        "error_message = ?, finished_at = " + NOW + ", updated_at = " + NOW + " "
        "WHERE id = ? AND status = 'queued' RETURNING id, attempt",
        (f"no task named {row['task']!r} is registered on this worker", row["id"]),
    ).fetchone()
    if failed is not None:
        events.append(conn, row["id"], "run.failed", {
            "attempt": failed["attempt"],
            "error": {"code": "unknown_task",
                      "message": f"no task named {row['task']!r} is registered"}})
        sessions.dispatch_next(conn, row, enqueue)


def heartbeat(conn: sqlite3.Connection, node: str, generation: int, pid: int,
              lease_s: float, run_ids: list[str]) -> dict[str, str]:
    """Renew, in one UPDATE, the live leases this process holds on the runs whose bodies
    it is executing right now (``run_ids``); return the renewed ids.

    Only executing runs: a run whose body thread is gone without an outcome must lapse
    so recovery can judge it.  A lease that already expired is not renewed: recovery
    may have handed the run on, so the holder must treat it as lost, not resurrect it.
    Returns run id -> status, so the holder also learns of stop requests.
    """
    if not run_ids:
        return {}
    marks = ", ".join("?" for _ in run_ids)
    with db.transaction(conn):
        rows = conn.execute(
            f"UPDATE runs SET lease_expires_at = {NOW} + ? WHERE id IN ({marks}) AND "
            "owner_node = ? AND owner_generation = ? AND owner_pid = ? AND "
            f"status IN ('running', 'stopping') AND lease_expires_at > {NOW} "
            "RETURNING id, status", (lease_s, *run_ids, node, generation, pid)).fetchall()
    return {row[0]: row[1] for row in rows}


def finish(conn: sqlite3.Connection, run_id: str, owner: Owner, *, status: str,
           result_json: str | None = None, error_code: str | None = None,
           error_message: str | None = None,
           enqueue: Enqueue | None = None) -> dict[str, Any] | None:
    """running -> completed | failed (or stopping -> cancelled), only for the current
    owner with a live lease.

    A stop that arrived while the body ran wins over its outcome: a ``stopping`` run
    ends ``cancelled`` whatever the body returned, keeping no result (docs/api.md,
    "POST /v1/runs/{run_id}/stop — stop a run").
    Returns the finished run, or None when the caller no longer owns the run (a stale
    owner can never record an outcome).
    """
    assert status in ("completed", "failed", "cancelled")
    with db.transaction(conn):
        run = conn.execute(
            "UPDATE runs SET status = CASE status WHEN 'stopping' THEN 'cancelled' ELSE ? END, "
            "result = CASE status WHEN 'stopping' THEN NULL ELSE ? END, "
            "error_code = CASE status WHEN 'stopping' THEN NULL ELSE ? END, "
            "error_message = CASE status WHEN 'stopping' THEN NULL ELSE ? END, "
            f"finished_at = {NOW}, updated_at = {NOW}, lease_expires_at = NULL "
            f"WHERE id = ? AND status IN ('running', 'stopping') AND {_OWNED} "
            f"RETURNING *, {slots.waiting_columns()}",
            (status, result_json, error_code, error_message, run_id, *_owner_args(owner)),
        ).fetchone()
        if run is None:
            return None
        run = db.as_dict(run)
        waiting = slots.waiting_of(run)
        data: dict[str, Any] = {"attempt": run["attempt"]}
        if run["status"] == "cancelled":
            data["reason"] = "stopped"
        elif error_code is not None:
            data["error"] = {"code": error_code, "message": error_message}
        events.append(conn, run_id, f"run.{run['status']}", data, run=run)
        sessions.dispatch_next(conn, run, enqueue)
        slots.dispatch_next(conn, run, enqueue, waiting=waiting)
        return run


def stop(conn: sqlite3.Connection, run_id: str,
         enqueue: Enqueue | None = None) -> tuple[dict[str, Any], bool] | None:
    """The stop of docs/api.md, "POST /v1/runs/{run_id}/stop — stop a run", bound to this
    run: (run, settled_now).

    queued / paused / waiting_for_approval -> cancelled at once (settled: 200);
    running -> stopping (the body sees it at its next emit/checkpoint/step: 202);
    stopping stays stopping (202); terminal stays as it is (200).  Guarded on the
    status read, inside the write lock, so a concurrent claim is ordered before or
    after: a claimed run becomes stopping, an unclaimed one never starts.
    """
    with db.transaction(conn):
        row = conn.execute("SELECT status FROM runs WHERE id = ?", (run_id,)).fetchone()
        if row is None:
            return None
        status = row[0]
        if status in ("queued", "paused", "waiting_for_approval"):
            run = conn.execute(
                f"UPDATE runs SET status = 'cancelled', finished_at = {NOW}, updated_at = {NOW}, "
                "owner_node = NULL, owner_generation = NULL, owner_pid = NULL, "
                "owner_thread = NULL, lease_expires_at = NULL WHERE id = ? AND status = ? "
                "RETURNING *", (run_id, status)).fetchone()
            events.append(conn, run_id, "run.cancelled", {"reason": "stopped", "was": status})
            run = db.as_dict(run)
            sessions.dispatch_next(conn, run, enqueue)
            return run, True
        if status == "running":
            run = conn.execute(f"UPDATE runs SET status = 'stopping', updated_at = {NOW} "
                               "WHERE id = ? AND status = 'running' RETURNING *",
                               (run_id,)).fetchone()
            events.append(conn, run_id, "run.stopping", {})
            return db.as_dict(run), False
        run = db.as_dict(conn.execute("SELECT * FROM runs WHERE id = ?", (run_id,)).fetchone())
        return run, status != "stopping"


def is_stopping(conn: sqlite3.Connection, run_id: str) -> bool:
    with db.ledger_errors():
        row = conn.execute("SELECT status FROM runs WHERE id = ?", (run_id,)).fetchone()
    return row is not None and row[0] == "stopping"


def pause(conn: sqlite3.Connection, run_id: str, owner: Owner, reason: str,
          enqueue: Enqueue | None = None) -> dict[str, Any] | None:
    """running -> paused (a person must decide), only for the current owner."""
    with db.transaction(conn):
        run = conn.execute(
            f"UPDATE runs SET status = 'paused', recovery_reason = ?, updated_at = {NOW}, "
            f"lease_expires_at = NULL WHERE id = ? AND status = 'running' AND {_OWNED} "
            "RETURNING *", (reason, run_id, *_owner_args(owner))).fetchone()
        if run is None:
            return None
        events.append(conn, run_id, "run.paused", {"reason": reason})
        run = db.as_dict(run)
        sessions.dispatch_next(conn, run, enqueue)
        slots.dispatch_next(conn, run, enqueue)
        return run


def requeue(conn: sqlite3.Connection, run_id: str, *, from_statuses: tuple[str, ...],
            reason: str, event_type: str = "run.requeued", next_attempt: bool = True,
            enqueue: Enqueue | None = None, owner: Owner | None = None,
            event_data: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """``from_statuses`` -> queued for another execution, with a dispatch record.

    Used by task retries, /resume, recovery and drain
    (docs/tasks.md, "What replays and what re-runs").  The owner and lease are cleared, so
    the next claim starts afresh; the event is written before any new start, which is what
    lets a history checker tell a re-run from a duplicate.
    """
    placeholders = ", ".join("?" for _ in from_statuses)
    guard, guard_args = ("", ()) if owner is None else (f" AND {_OWNED}", _owner_args(owner))
    with db.transaction(conn):
        run = conn.execute(
            f"UPDATE runs SET status = 'queued', attempt = attempt + ?, recovery_reason = ?, "
            "owner_node = NULL, owner_generation = NULL, owner_pid = NULL, "
            f"owner_thread = NULL, lease_expires_at = NULL, updated_at = {NOW} "
            f"WHERE id = ? AND status IN ({placeholders}){guard} RETURNING *",
            (1 if next_attempt else 0, reason, run_id, *from_statuses, *guard_args)).fetchone()
        if run is None:
            return None
        run = db.as_dict(run)
        events.append(conn, run_id, event_type,
                      {"reason": reason, "attempt": run["attempt"], **(event_data or {})})
        add_dispatch(conn, run, reason, enqueue)
        if "running" in from_statuses or "stopping" in from_statuses:
            # It left its slots: the runs waiting for its profile's or its task's may take
            # them (this run, queued again, competes like any other; its claim decides).
            slots.dispatch_next(conn, run, enqueue)
        return run


def owns(conn: sqlite3.Connection, run_id: str, owner: Owner) -> dict[str, Any] | None:
    """The run's row if ``owner`` still holds a live lease on it (inside a transaction)."""
    row = conn.execute(f"SELECT * FROM runs WHERE id = ? AND status IN ('running', 'stopping') "
                       f"AND {_OWNED}", (run_id, *_owner_args(owner))).fetchone()
    return None if row is None else db.as_dict(row)
