"""Runs: admission (SPEC §3.1 reservation), lookup and listing (SPEC §3.2)."""

from __future__ import annotations

import secrets
import sqlite3
import time
from dataclasses import dataclass
from typing import Callable, Iterable

from ..errors import (CapacityExceeded, IdempotencyKeyConflict, IdempotencyKeyExpired,
                      LedgerUnavailable, RunIdConflict, RunstileError)
from . import db, events
from .db import NOW
from .keys import Principal
from .states import RunStatus

#: How many times a reservation is re-read after a uniqueness race before giving up.
#: Under SQLite's database-wide write lock a race cannot happen; the loop is for
#: ledgers without one (SPEC §10) and costs nothing here.
_RACE_RETRIES = 3


@dataclass(frozen=True)
class AdmissionRequest:
    """One validated POST /v1/runs, ready for the reservation transaction."""

    principal: Principal
    key: str | None            # effective idempotency key (header, or legacy-run:<id>)
    key_is_derived: bool       # True when key is 'legacy-run:<run_id>'
    run_id: str | None         # client-chosen run id
    task: str
    input_json: str
    session_key: str | None
    trigger_id: str | None
    metadata_json: str | None
    callback_url: str | None
    fingerprint: str
    fingerprint_version: int


@dataclass(frozen=True)
class Admitted:
    run: dict
    replayed: bool
    #: The dispatch record a new run was created with (None for a replay): brokers
    #: published to after commit publish exactly this record.
    dispatch_id: int | None = None


#: Called inside the admission transaction after the run row exists, so that an embedded
#: broker can insert its message in the same transaction (no dual write).  It either
#: writes the message or raises (rolling the whole transaction back).
Enqueue = Callable[[sqlite3.Connection, dict, int], None]


def new_run_id() -> str:
    """``run_`` + 32 hex: 12 of the creation time in milliseconds, then 20 random (80 bits).

    Time first, so that ids the server makes sort in admission order.  Every table
    keyed or indexed by run id (runs.id, events, idempotency_keys_by_run,
    broker_messages_run, dispatches_by_run ...) then grows at its right edge: a batch of
    admissions dirties one leaf page per index instead of one random leaf per run
    (measured: 40 -> 25 WAL frames per group commit of 4 admissions, 25% less
    commit time).  The 80 random bits keep ids unguessable from one another; the
    UNIQUE index still decides, and a collision is retried like any uniqueness race.
    """
    return f"run_{time.time_ns() // 1_000_000 & 0xFFFF_FFFF_FFFF:012x}{secrets.token_hex(10)}"


def admit(conn: sqlite3.Connection | None, req: AdmissionRequest, *,
          refusal: RunstileError | None, max_active_runs: int, enqueue: Enqueue | None = None,
          committer=None) -> Admitted:
    """Reserve and create (or replay) a run in one BEGIN IMMEDIATE transaction.

    ``refusal`` is the error to raise *only* if a new run would be created (unknown
    task, bad callback URL): checked by the caller before the transaction, raised here
    so that replays always answer (SPEC §3.1).  With a ``committer`` (group_commit) the
    reservation shares its transaction with other admissions of this process, in a
    savepoint of its own; without one it runs in its own transaction on ``conn``.
    """
    def reserve(c: sqlite3.Connection) -> Admitted:
        return _reserve(c, req, refusal, max_active_runs, enqueue)

    for _ in range(_RACE_RETRIES):
        try:
            if committer is not None:
                return committer.run(reserve)
            with db.transaction(conn):
                return reserve(conn)
        except sqlite3.IntegrityError:
            # Another writer created the same key or run id between our read and our
            # insert.  It has committed, so re-reading answers as a replay or a 409.
            continue
    raise LedgerUnavailable("the admission kept racing with concurrent writers")


def _reserve(conn, req: AdmissionRequest, refusal, max_active_runs, enqueue) -> Admitted:
    """The reservation of SPEC §3.1.  Every refusal is raised before the first write, so a
    refused admission leaves the transaction it shares (group commit) untouched."""
    scope = (req.principal.profile_id, req.principal.key_id)
    if req.key is not None:
        # One read answers both "is the key bound?" and "is it a tombstone?".
        record = conn.execute(
            "SELECT run_id, fingerprint, fingerprint_version, 0 AS tombstone "
            "FROM idempotency_keys WHERE profile_id = ? AND key_id = ? AND idempotency_key = ? "
            "UNION ALL SELECT NULL, NULL, NULL, 1 FROM key_tombstones "
            "WHERE profile_id = ? AND key_id = ? AND idempotency_key = ?",
            (*scope, req.key, *scope, req.key)).fetchone()
        if record is not None and not record["tombstone"]:
            if (record["fingerprint"], record["fingerprint_version"]) == (
                    req.fingerprint, req.fingerprint_version):
                return Admitted(_get(conn, record["run_id"]), replayed=True)
            raise (RunIdConflict("this run id is already taken") if req.key_is_derived
                   else IdempotencyKeyConflict(
                       "this Idempotency-Key was used with a different request"))
        if record is not None:
            raise IdempotencyKeyExpired(
                "this Idempotency-Key belonged to a run that retention has purged")
    if req.run_id is not None:
        existing = conn.execute("SELECT * FROM runs WHERE id = ?", (req.run_id,)).fetchone()
        if existing is not None:
            same_scope = (existing["profile_id"], existing["key_id"]) == scope
            if same_scope and (existing["fingerprint"], existing["fingerprint_version"]) == (
                    req.fingerprint, req.fingerprint_version):
                if req.key is not None:
                    _bind_key(conn, req, req.run_id)
                return Admitted(dict(existing), replayed=True)
            raise RunIdConflict("this run id is already taken")
        tomb = conn.execute("SELECT profile_id, key_id FROM run_tombstones WHERE run_id = ?",
                            (req.run_id,)).fetchone()
        if tomb is not None:
            if (tomb["profile_id"], tomb["key_id"]) == scope:
                raise IdempotencyKeyExpired("this run id belonged to a run that retention "
                                            "has purged")
            raise RunIdConflict("this run id is already taken")
    if refusal is not None:
        raise refusal
    run_id = req.run_id or new_run_id()
    # The capacity check rides on the INSERT: no row comes back when the profile is full.
    row = conn.execute(
        "INSERT INTO runs (id, profile_id, key_id, task, input, session_key, trigger_id, "
        "metadata, callback_url, fingerprint, fingerprint_version, status, attempt, "
        f"created_at, updated_at) SELECT ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, 'queued', 1, {NOW}, "
        f"{NOW} WHERE COALESCE((SELECT active_runs FROM profiles WHERE id = ?), 0) < ? "
        "RETURNING *",
        (run_id, *scope, req.task, req.input_json, req.session_key, req.trigger_id,
         req.metadata_json, req.callback_url, req.fingerprint, req.fingerprint_version,
         scope[0], max_active_runs),
    ).fetchone()
    if row is None:
        raise CapacityExceeded(f"this profile already has {max_active_runs} unfinished runs "
                               f"(the limit)")
    run = dict(row)
    if req.key is not None:
        _bind_key(conn, req, run_id)
    dispatch_id = add_dispatch(conn, run, "admitted", enqueue)
    events.append_first(conn, run_id, "run.queued", {"attempt": 1})
    return Admitted(run, replayed=False, dispatch_id=dispatch_id)


def _bind_key(conn, req: AdmissionRequest, run_id: str) -> None:
    conn.execute(
        "INSERT INTO idempotency_keys (profile_id, key_id, idempotency_key, run_id, "
        "fingerprint, fingerprint_version, derived, created_at) "
        f"VALUES (?, ?, ?, ?, ?, ?, ?, {NOW})",
        (req.principal.profile_id, req.principal.key_id, req.key, run_id, req.fingerprint,
         req.fingerprint_version, int(req.key_is_derived)))


def add_dispatch(conn, run: dict, reason: str, enqueue: Enqueue | None) -> int:
    """Record that ``run`` must reach a worker; inside the caller's transaction.

    With an in-transaction ``enqueue`` (the embedded broker) the message is written in
    this same transaction, so the record is born sent; otherwise sent_at stays NULL
    until a publisher marks it after commit.
    """
    # lastrowid, not RETURNING id: a RETURNING row costs a second sqlite3_step to fetch.
    dispatch_id = conn.execute(
        "INSERT INTO dispatches (run_id, attempt, reason, created_at, sent_at) "
        f"VALUES (?, ?, ?, {NOW}, CASE WHEN ? THEN {NOW} END)",
        (run["id"], run["attempt"], reason, enqueue is not None)).lastrowid
    if enqueue is not None:
        enqueue(conn, run, dispatch_id)
    return dispatch_id


def _get(conn, run_id: str) -> dict:
    return dict(conn.execute("SELECT * FROM runs WHERE id = ?", (run_id,)).fetchone())


def visible_clause(principal: Principal) -> tuple[str, tuple]:
    """SQL condition and arguments limiting runs to what a key may see (SPEC §2.6)."""
    if principal.is_admin:
        return "profile_id = ?", (principal.profile_id,)
    return "profile_id = ? AND key_id = ?", (principal.profile_id, principal.key_id)


def get_visible(conn: sqlite3.Connection, principal: Principal, run_id: str) -> dict | None:
    """The run if the principal may see it, else None (the caller answers 404)."""
    where, args = visible_clause(principal)
    with db.ledger_errors():
        row = conn.execute(f"SELECT * FROM runs WHERE id = ? AND {where}",
                           (run_id, *args)).fetchone()
    return None if row is None else dict(row)


@dataclass(frozen=True)
class RunFilter:
    statuses: tuple[str, ...] = ()
    task: str | None = None
    session_key: str | None = None
    idempotency_key: str | None = None
    created_after: float | None = None
    created_before: float | None = None
    metadata: tuple[tuple[str, str], ...] = ()


def list_visible(conn: sqlite3.Connection, principal: Principal, flt: RunFilter, *,
                 before_seq: int | None, limit: int) -> tuple[list[dict], bool]:
    """Newest first.  Keyset pagination on seq: a run admitted while a client pages
    gets a larger seq than every cursor, so it can neither repeat nor shift a page."""
    where, args = visible_clause(principal)
    clauses, params = [where], list(args)
    if flt.statuses:
        clauses.append(f"status IN ({', '.join('?' for _ in flt.statuses)})")
        params += [RunStatus(s).value for s in flt.statuses]
    for column, value in (("task", flt.task), ("session_key", flt.session_key)):
        if value is not None:
            clauses.append(f"{column} = ?")
            params.append(value)
    if flt.idempotency_key is not None:
        # Keys live in the caller's own scope, so the lookup gives 0 or 1 run.
        clauses.append("id IN (SELECT run_id FROM idempotency_keys WHERE profile_id = ? "
                       "AND key_id = ? AND idempotency_key = ?)")
        params += [principal.profile_id, principal.key_id, flt.idempotency_key]
    if flt.created_after is not None:
        clauses.append("created_at > ?")
        params.append(flt.created_after)
    if flt.created_before is not None:
        clauses.append("created_at < ?")
        params.append(flt.created_before)
    for key, value in flt.metadata:
        clauses.append("EXISTS (SELECT 1 FROM json_each(runs.metadata) AS m "
                       "WHERE m.key = ? AND m.value = ? AND m.type = 'text')")
        params += [key, value]
    if before_seq is not None:
        clauses.append("seq < ?")
        params.append(before_seq)
    sql = f"SELECT * FROM runs WHERE {' AND '.join(clauses)} ORDER BY seq DESC LIMIT ?"
    with db.ledger_errors():
        rows = conn.execute(sql, (*params, limit + 1)).fetchall()
    return [dict(r) for r in rows[:limit]], len(rows) > limit


def statuses_known(values: Iterable[str]) -> bool:
    known = {s.value for s in RunStatus}
    return all(v in known for v in values)


def status_of(conn: sqlite3.Connection, run_id: str) -> str | None:
    with db.ledger_errors():
        row = conn.execute("SELECT status FROM runs WHERE id = ?", (run_id,)).fetchone()
    return None if row is None else row[0]
