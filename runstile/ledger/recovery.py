"""Recovery's SQL (docs/operations.md, "Recovery"): find runs whose owner is gone and move
each, by one guarded UPDATE, to the state the table of
docs/tasks.md, "When the worker is gone" gives; find queued runs whose message is missing.

Every UPDATE is guarded on the exact row recovery read (status, whole owner, lease
expiry): if the owner renewed its lease in between, or another recovery got there
first, the guard fails and the run is left alone.  So recoveries may overlap, be
killed at any point and run again: k interrupted passes plus one clean pass equal one
clean pass.
"""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from typing import Any

from . import db, events, sessions, slots
from .db import NOW
from .journal import uncertain_steps
from .runs import Enqueue, add_dispatch, due, not_waiting_for_a_slot

#: Columns whose values recovery guards on; a change means "not the row I judged".
_GUARD = ("id = ? AND status = ? AND owner_node IS ? AND owner_generation IS ? AND "
          "owner_pid IS ? AND owner_thread IS ? AND lease_expires_at IS ?")


def _guard_args(run: dict[str, Any]) -> tuple[object, ...]:
    return (run["id"], run["status"], run["owner_node"], run["owner_generation"],
            run["owner_pid"], run["owner_thread"], run["lease_expires_at"])


#: What recovery reads of an orphan: enough to classify it
#: (docs/tasks.md, "When the worker is gone"), guard its UPDATE and free its session;
#: never input, result or metadata (up to RUNSTILE_MAX_BODY_BYTES each, and a batch
#: holds CLASSIFY_BATCH runs).
_ORPHAN_COLUMNS = ("seq, id, profile_id, key_id, task, session_key, status, attempt, "
                   "recovery_attempts, interruption, owner_node, owner_generation, owner_pid, "
                   "owner_thread, lease_expires_at")


def orphaned(conn: sqlite3.Connection, *, node_id: str, generation: int,
             limit: int) -> list[dict[str, Any]]:
    """Runs handed to a worker whose owner is gone: the lease lapsed, or the owner is an
    earlier generation of this node (dead by definition once this generation booted)."""
    # Two index ranges instead of one OR (which SQLite answers by walking every
    # in-flight run): lapsed leases on runs_in_flight, dead generations on runs_by_owner.
    rows = conn.execute(
        f"SELECT {_ORPHAN_COLUMNS} FROM runs WHERE status IN ('running', 'stopping') AND "
        f"(lease_expires_at IS NULL OR lease_expires_at <= {NOW}) "
        f"UNION SELECT {_ORPHAN_COLUMNS} FROM runs WHERE owner_node = ? AND "
        "owner_generation < ? AND status IN ('running', 'stopping') LIMIT ?",
        (node_id, generation, limit)).fetchall()
    return [db.as_dict(r) for r in rows]


def dead_nodes(conn: sqlite3.Connection, *, node_id: str) -> dict[str, int]:
    """Other nodes that still own running or stopping runs and whose node lock no session
    holds: {node id: generation}.  Every run such a node owns at that generation or an
    earlier one is orphaned, whatever its lease says (takeover, docs/operations.md,
    "Node lock and generations").  Empty where the engine cannot read a lock without
    taking it (SQLite: leases lapse instead)."""
    free = db.dialect(conn).node_lock_free("?")
    if free is None:
        return {}
    with db.ledger_errors():
        candidates = conn.execute(
            "SELECT id, generation, lock_key FROM nodes WHERE id != ? AND generation > 0 "
            "AND lock_key IS NOT NULL AND EXISTS (SELECT 1 FROM runs WHERE runs.owner_node "
            "= nodes.id AND runs.status IN ('running', 'stopping'))", (node_id,)).fetchall()
        # The order is the argument, so two statements: first the generation G, then the
        # lock.  A node bumps its generation only while holding its lock, and holds it
        # for life; so if the lock is free after G was read, whoever booted G (and every
        # generation before it) has let go of it, and is dead.  A node that takes the
        # lock after that look boots G + 1 or later, and its runs are not ours to judge.
        # Read the other way round (lock free, then the generation), a node starting in
        # between would have its brand-new generation judged dead.
        return {row[0]: int(row[1]) for row in candidates
                if conn.execute(f"SELECT {free}", (row[2],)).fetchone()[0]}


def orphaned_of(conn: sqlite3.Connection, *, node_id: str, generation: int,
                limit: int) -> list[dict[str, Any]]:
    """Running or stopping runs of another node found dead (:func:`dead_nodes`) at
    ``generation``, owned by that generation or an earlier one."""
    rows = conn.execute(
        f"SELECT {_ORPHAN_COLUMNS} FROM runs WHERE owner_node = ? AND owner_generation <= ? "
        "AND status IN ('running', 'stopping') LIMIT ?", (node_id, generation, limit)).fetchall()
    return [db.as_dict(r) for r in rows]


def classify(conn: sqlite3.Connection, run: dict[str, Any], *, on_crash: str, budget: int,
             uncertain: bool | None = None) -> tuple[str, str | None]:
    """The row of docs/tasks.md, "When the worker is gone" for ``run``: (class, reason).
    Pure decision from the ledger (``uncertain`` may be given when the caller looked up a
    whole batch at once)."""
    if run["status"] == "stopping":
        return "cancelled", "stopped"
    if uncertain is None:
        uncertain = bool(uncertain_steps(conn, run["id"]))
    if uncertain:
        return "paused", "uncertain_side_effect"
    if run["interruption"] == "drain":
        requeue_reason = "drained"
    elif on_crash == "resume":
        requeue_reason = "owner_lost"
    elif on_crash == "pause":
        return "paused", "owner_lost"
    else:
        return "interrupted", "owner_lost"
    if run["recovery_attempts"] >= budget:
        return "paused", "recovery_budget_exhausted"
    return "requeued", requeue_reason


#: The terminal classes: (status, error code, error message).
_TERMINAL: dict[str, tuple[str, str | None, str | None]] = {
    "cancelled": ("cancelled", None, None),
    "interrupted": ("interrupted", "owner_lost",
                    "the worker running this run stopped before it finished")}


#: What every move out of an owner's hands resets (the guard proved the owner gone).
_CLEAR_OWNER = ("owner_node = NULL, owner_generation = NULL, owner_pid = NULL, "
                "owner_thread = NULL, lease_expires_at = NULL, interruption = NULL, "
                f"recovery_attempts = recovery_attempts + 1, updated_at = {NOW}")


def _move(conn: sqlite3.Connection, run: dict[str, Any], assignments: str,
          args: tuple[object, ...]) -> dict[str, Any] | None:
    """One UPDATE guarded on the run as classified (status, owner, lease); the row as it
    now is, or None if the guard lost (the owner came back, or another pass won)."""
    row = conn.execute(f"UPDATE runs SET {assignments}, {_CLEAR_OWNER} WHERE {_GUARD} "
                       "RETURNING *", (*args, *_guard_args(run))).fetchone()
    return None if row is None else db.as_dict(row)


def apply(conn: sqlite3.Connection, run: dict[str, Any], klass: str, reason: str | None,
          enqueue: Enqueue | None) -> bool:
    """Move ``run`` to ``klass`` in the caller's transaction; False if the guard lost."""
    if klass == "requeued":
        row = _move(conn, run, "status = 'queued', attempt = attempt + 1, recovery_reason = ?",
                    (reason,))
        if row is None:
            return False
        events.append(conn, run["id"], "run.requeued",
                      {"reason": reason, "attempt": row["attempt"]})
        add_dispatch(conn, row, "recovered", enqueue)
    elif klass == "paused":
        if _move(conn, run, "status = 'paused', recovery_reason = ?", (reason,)) is None:
            return False
        data: dict[str, Any] = {"reason": reason}
        if reason == "uncertain_side_effect":
            data["steps"] = uncertain_steps(conn, run["id"])
        events.append(conn, run["id"], "run.paused", data)
        sessions.dispatch_next(conn, run, enqueue)
    else:
        status, code, message = _TERMINAL[klass]
        if _move(conn, run, f"status = ?, error_code = ?, error_message = ?, "
                 f"recovery_reason = ?, finished_at = {NOW}",
                 (status, code, message, reason)) is None:
            return False
        events.append(conn, run["id"], f"run.{status}",
                      {"reason": reason} if code is None else
                      {"reason": reason, "error": {"code": code, "message": message}})
        sessions.dispatch_next(conn, run, enqueue)
    # Out of running or stopping: the run's slots (its profile's, its task's) are free
    # for waiting runs.
    slots.dispatch_next(conn, run, enqueue)
    return True


#: One run's classification for :func:`apply_terminal_many`: (run, class, reason).
Decision = tuple[dict[str, Any], str, str | None]


def uncertain_among(conn: sqlite3.Connection, run_ids: list[str]) -> set[str]:
    """Which of ``run_ids`` have a non-idempotent step started and never settled."""
    rows = conn.execute(
        "SELECT DISTINCT run_id FROM journal WHERE run_id IN "
        f"{db.dialect(conn).json_array_values()} "
        "AND kind = 'step' AND state = 'started' AND idempotent = 0",
        (json.dumps(run_ids),)).fetchall()
    return {r[0] for r in rows}


def _terminal_batch_sql(d: db.SqliteDialect) -> str:
    """The batch UPDATE of apply_terminal_many: each guard is a JSON array element g of
    [seq, id, status, owner_node, owner_generation, owner_pid, owner_thread,
    lease_expires_at, reason]."""
    def at(i: int, sql_type: str) -> str:
        return d.json_at("g.value", i, sql_type)
    return (
        "UPDATE runs SET status = ?, error_code = ?, error_message = ?, "
        f"recovery_reason = {at(8, 'TEXT')}, "
        f"finished_at = {NOW}, owner_node = NULL, owner_generation = NULL, "
        "owner_pid = NULL, owner_thread = NULL, lease_expires_at = NULL, "
        "interruption = NULL, recovery_attempts = recovery_attempts + 1, "
        f"updated_at = {NOW} FROM {d.json_rows('?', 'g')} "
        f"WHERE runs.seq = {at(0, 'INTEGER')} "
        f"AND runs.id = {at(1, 'TEXT')} AND runs.status = {at(2, 'TEXT')} "
        f"AND runs.owner_node IS {at(3, 'TEXT')} "
        f"AND runs.owner_generation IS {at(4, 'INTEGER')} "
        f"AND runs.owner_pid IS {at(5, 'INTEGER')} "
        f"AND runs.owner_thread IS {at(6, 'INTEGER')} "
        f"AND runs.lease_expires_at IS {at(7, 'REAL')} RETURNING runs.id")


def apply_terminal_many(conn: sqlite3.Connection, decisions: list[Decision],
                        enqueue: Enqueue | None) -> list[str]:
    """Set-based ``apply`` for the terminal classes (interrupted, cancelled): one guarded
    UPDATE per class for a whole batch, then its events, in the caller's transaction.
    Each row is still guarded on exactly what recovery read; returns the ids whose guard
    won (only those get an event)."""
    won: list[str] = []
    for klass, (status, code, message) in _TERMINAL.items():
        rows = sorted(((run, reason) for run, k, reason in decisions if k == klass),
                      key=lambda item: item[0]["seq"])
        if not rows:
            continue
        # Each guard is a JSON array (a positional ->> is cheaper than a key lookup),
        # matched on seq, the rowid: one b-tree seek per run instead of a probe of the
        # id index then the table; in seq order, so the table is walked forwards.  The
        # id is still compared, with the status, the whole owner and the lease.
        guards = json.dumps([
            [run["seq"], run["id"], run["status"], run["owner_node"], run["owner_generation"],
             run["owner_pid"], run["owner_thread"], run["lease_expires_at"], reason]
            for run, reason in rows])
        ids = [r[0] for r in conn.execute(_terminal_batch_sql(db.dialect(conn)),
                                          (status, code, message, guards)).fetchall()]
        if not ids:
            continue
        by_id = {run["id"]: (run, reason) for run, reason in rows}
        data: dict[str | None, str] = {}   # the event's JSON, made once per reason
        for reason in {by_id[rid][1] for rid in ids}:
            data[reason] = json.dumps(
                {"reason": "stopped"} if code is None else
                {"reason": reason, "error": {"code": code, "message": message}},
                separators=(",", ":"))
        # One prepared INSERT ... VALUES stepped once per run (executemany), its seq read
        # from the run's own last event by a subquery.  Not INSERT ... SELECT: a SELECT
        # that reads the table it inserts into is first copied into a temporary table
        # (for a whole batch, or for each row), which took about twice as long.  In
        # run_id order, the primary key's: the inserts walk the b-tree forwards.  No race
        # on seq: the caller holds the write lock (BEGIN IMMEDIATE).
        conn.executemany(
            "INSERT INTO events (run_id, seq, type, data, created_at) VALUES (?1, "
            f"(SELECT COALESCE(MAX(seq), 0) + 1 FROM events WHERE run_id = ?1), ?2, ?3, {NOW})",
            [(rid, f"run.{status}", data[by_id[rid][1]]) for rid in sorted(ids)])
        for rid in ids:
            run = by_id[rid][0]
            if run.get("session_key") is not None:
                sessions.dispatch_next(conn, run, enqueue)
        # Each run left its profile's slot and its task's: one lookup per slot, not per run.
        slots.dispatch_freed(conn, (by_id[rid][0] for rid in ids), enqueue)
        won += ids
    return won


def stranded_queued(conn: sqlite3.Connection, *, older_than_s: float,
                    limit: int) -> list[dict[str, Any]]:
    """Queued runs, idle longer than ``older_than_s``, with no live message in the
    embedded broker (a message that was dead-lettered, flushed or lost).  Not those
    waiting for a slot of their profile or their task: they have no message on purpose,
    and step 5 hands them out (ledger/slots.py).  Nor a delayed run before its time: it
    is idle on purpose, and its message counts as lost only that long after its time."""
    rows = conn.execute(
        f"SELECT * FROM runs WHERE status = 'queued' AND updated_at <= {NOW} - ? AND NOT EXISTS "
        "(SELECT 1 FROM broker_messages m WHERE m.run_id = runs.id AND m.state != 'dead') "
        f"AND {not_waiting_for_a_slot()} AND {due(behind='?')} ORDER BY updated_at LIMIT ?",
        (older_than_s, older_than_s, limit)).fetchall()
    return [db.as_dict(r) for r in rows]


def republish(conn: sqlite3.Connection, run: dict[str, Any], enqueue: Enqueue | None) -> bool:
    """Hand a stranded queued run to the broker again (a duplicate is harmless: the
    claim lets one execution through).  Guarded on the run still being queued."""
    row = conn.execute(f"UPDATE runs SET updated_at = {NOW} WHERE id = ? AND status = 'queued' "
                       "AND updated_at IS ? RETURNING *", (run["id"], run["updated_at"])).fetchone()
    if row is None:
        return False
    add_dispatch(conn, db.as_dict(row), "republished", enqueue)
    return True


def mark_drained(conn: sqlite3.Connection, *, node: str, generation: int, pid: int) -> list[str]:
    """The drain (docs/architecture.md, "Worker processes"): every run this process still
    holds becomes a controlled interruption, in ONE transaction, and its lease is released
    so recovery can act at once."""
    with db.transaction(conn):
        rows = conn.execute(
            f"UPDATE runs SET interruption = 'drain', lease_expires_at = {NOW}, "
            f"updated_at = {NOW} WHERE owner_node = ? AND owner_generation = ? AND "
            "owner_pid = ? AND status IN ('running', 'stopping') RETURNING id",
            (node, generation, pid)).fetchall()
    return [r[0] for r in rows]


#: KiB of page cache for a recovery pass's connection (SQLite's default is 2,000).  One
#: batch of CLASSIFY_BATCH orphans dirties ~9 MB, most of it events leaves (a run's
#: events sit wherever its id sorts); a smaller cache spills dirty pages to the WAL in
#: the middle of the transaction.  Memory is taken as pages are read, and given back
#: when the pass closes its connection.
PASS_CACHE_KIB = 32 * 1024


def open_pass(path: Path | str, *, synchronous: str, busy_timeout_ms: int) -> sqlite3.Connection:
    """The connection one recovery pass does all its work on.

    Besides the cache: temporary storage in memory, because the batch UPDATE (many rows,
    triggers that may abort) keeps a statement journal of every page it changes, and
    past 64 KiB SQLite spills that journal to a file in /var/tmp (measured: 5,200 extra
    writes per 1,000 runs).  And its commits never checkpoint: SQLite's automatic
    checkpoint runs inside the COMMIT that crosses 1,000 WAL pages, as a full batch's
    COMMIT does, so every other writer would wait at the writer gate while ~9 MB is
    copied back and fsynced.  The pass calls :func:`checkpoint` instead once its writes
    are done.
    """
    conn = db.connect(path, synchronous=synchronous, busy_timeout_ms=busy_timeout_ms)
    with db.ledger_errors():
        for statement in db.dialect(conn).pass_setup(PASS_CACHE_KIB):
            conn.execute(statement)
    return conn


def checkpoint(conn: sqlite3.Connection) -> tuple[int, int, int]:
    """Copy the WAL back into the ledger file, outside any transaction.  PASSIVE: it
    takes no write lock, so writers go on meanwhile, and it stops at frames a reader
    still needs (that reader's commit or the next checkpoint does the rest).  Returns
    (busy, WAL frames, frames checkpointed)."""
    with db.ledger_errors():
        sql = db.dialect(conn).checkpoint
        return (0, 0, 0) if sql is None else tuple(conn.execute(sql).fetchone())


def node_generations(conn: sqlite3.Connection, node_id: str) -> tuple[int, int]:
    """(generation, recovered_generation) of a node; (0, 0) when it never booted."""
    with db.ledger_errors():
        row = conn.execute("SELECT generation, recovered_generation FROM nodes WHERE id = ?",
                           (node_id,)).fetchone()
    return (0, 0) if row is None else (int(row[0]), int(row[1]))


def barrier_is_open(conn: sqlite3.Connection, node_id: str) -> bool:
    """The recovery barrier (docs/guarantees.md, "Recovery barrier"): True when the node's
    current boot has recovered, or the node never booted workers (a web-only deployment
    has nothing to wait for).

    The process holding the node lock bumps the generation, runs recovery, then opens the
    barrier (:func:`open_barrier`); only then does it start the worker processes.
    Readiness (``/readyz``) reads the same record, so a web process on this node answers
    503 until recovery for the current boot has finished.
    """
    generation, recovered = node_generations(conn, node_id)
    return generation == 0 or recovered >= generation


def open_barrier(conn: sqlite3.Connection, node_id: str, generation: int) -> bool:
    """Record that this boot's recovery finished (guarded: only for the live generation)."""
    with db.transaction(conn):
        cur = conn.execute("UPDATE nodes SET recovered_generation = ? WHERE id = ? AND "
                           "generation = ?", (generation, node_id, generation))
    return cur.rowcount == 1


def record_report(conn: sqlite3.Connection, *, node_id: str, generation: int, trigger: str,
                  started_at: float, counts: dict[str, float],
                  taken_over: dict[str, int] | None = None) -> int:
    """The pass's report; ``taken_over``: the dead nodes whose runs it classified."""
    with db.transaction(conn):
        report_id: int = conn.execute(
            "INSERT INTO recovery_reports (node_id, generation, trigger, started_at, finished_at, "
            f"counts, taken_over) VALUES (?, ?, ?, ?, {NOW}, ?, ?) RETURNING id",
            (node_id, generation, trigger, started_at, json.dumps(counts, sort_keys=True),
             json.dumps(taken_over, sort_keys=True) if taken_over else None)
        ).fetchone()[0]
        return report_id


def latest_reports(conn: sqlite3.Connection, limit: int = 20) -> list[dict[str, Any]]:
    with db.ledger_errors():
        rows = conn.execute("SELECT * FROM recovery_reports ORDER BY id DESC LIMIT ?",
                            (limit,)).fetchall()
    return [{**db.as_dict(r), "counts": json.loads(r["counts"]),
             "taken_over": json.loads(r["taken_over"]) if r["taken_over"] else {}}
            for r in rows]


def ledger_now(conn: sqlite3.Connection) -> float:
    with db.ledger_errors():
        now: float = conn.execute(f"SELECT {NOW}").fetchone()[0]
        return now
