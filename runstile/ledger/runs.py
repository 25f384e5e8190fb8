"""Runs: admission (SPEC §3.1 reservation), lookup and listing (SPEC §3.2)."""

from __future__ import annotations

import json
import secrets
import sqlite3
import time
from dataclasses import dataclass
from typing import Callable, Iterable

from ..errors import (CapacityExceeded, IdempotencyKeyConflict, IdempotencyKeyExpired,
                      LedgerUnavailable, RunIdConflict, RunstileError)
from . import broker_queue, db, events
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
#: writes the message or raises (rolling the whole transaction back).  It may also offer
#: ``message(run, dispatch_id) -> broker_queue.NewMessage``: then a batch of admissions
#: inserts all its messages with one statement (broker_queue.insert_messages).
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
    reservation shares its transaction with the other admissions of this process waiting
    at that moment, and is written together with them (:func:`reserve_many`); without
    one it runs in its own transaction on ``conn``.
    """
    reserve = Reservation(req, refusal, max_active_runs, enqueue)
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
    replay = _decide(conn, req, refusal)
    if replay is not None:
        return replay
    scope = (req.principal.profile_id, req.principal.key_id)
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


#: A key's record as the reservation reads it: (run id, fingerprint, fingerprint version,
#: tombstone).  The run id and fingerprint are None for a tombstone.
_KeyRecord = tuple


def _key_record(conn, req: AdmissionRequest) -> _KeyRecord | None:
    # One read answers both "is the key bound?" and "is it a tombstone?".
    scope = (req.principal.profile_id, req.principal.key_id)
    return conn.execute(
        "SELECT run_id, fingerprint, fingerprint_version, 0 AS tombstone "
        "FROM idempotency_keys WHERE profile_id = ? AND key_id = ? AND idempotency_key = ? "
        "UNION ALL SELECT NULL, NULL, NULL, 1 FROM key_tombstones "
        "WHERE profile_id = ? AND key_id = ? AND idempotency_key = ?",
        (*scope, req.key, *scope, req.key)).fetchone()


_UNREAD = object()


def _decide(conn, req: AdmissionRequest, refusal, record=_UNREAD) -> Admitted | None:
    """The reads of the reservation (SPEC §3.1 table): a replay, a refusal (raised), or
    None when a new run is to be created.  ``record`` is the key's record when the caller
    already read it (:func:`reserve_many` reads a batch's keys at once).  The only write
    is a replay binding a new header key to an existing client run id."""
    scope = (req.principal.profile_id, req.principal.key_id)
    if req.key is not None:
        if record is _UNREAD:
            record = _key_record(conn, req)
        if record is not None and not record[3]:
            if (record[1], record[2]) == (req.fingerprint, req.fingerprint_version):
                return Admitted(_get(conn, record[0]), replayed=True)
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
    return None


class Reservation:
    """One admission handed to the group committer: callable alone (its own reservation,
    :func:`_reserve`), or run together with the others of a batch (:func:`reserve_many`,
    through ``run_many``, which group_commit looks for)."""

    __slots__ = ("req", "refusal", "max_active_runs", "enqueue")

    def __init__(self, req: AdmissionRequest, refusal, max_active_runs: int,
                 enqueue: Enqueue | None) -> None:
        self.req, self.refusal = req, refusal
        self.max_active_runs, self.enqueue = max_active_runs, enqueue

    def __call__(self, conn: sqlite3.Connection) -> Admitted:
        return _reserve(conn, self.req, self.refusal, self.max_active_runs, self.enqueue)

    @staticmethod
    def run_many(conn: sqlite3.Connection, reservations: list) -> list:
        return reserve_many(conn, reservations)


#: The columns of a runs row, for the row a batch writes (what SELECT * would return).
_RUN_COLUMNS = ("seq", "id", "profile_id", "key_id", "task", "input", "session_key",
                "trigger_id", "metadata", "callback_url", "fingerprint",
                "fingerprint_version", "status", "attempt", "result", "error_code",
                "error_message", "recovery_attempts", "recovery_reason", "created_at",
                "updated_at", "started_at", "finished_at", "approval", "owner_node",
                "owner_generation", "owner_pid", "owner_thread", "lease_expires_at",
                "interruption", "slot_wait_since")
_QUEUED_EVENT = json.dumps({"attempt": 1}, separators=(",", ":"))


def reserve_many(conn: sqlite3.Connection, reservations: list[Reservation]) -> list:
    """The reservations of one group commit, in order, with their writes set-based.

    Returns ``(Admitted, None)`` or ``(None, refusal)`` per reservation; raises (aborting
    the batch, which group_commit then retries one reservation per transaction) on
    anything else.  Each answer is the one the reservations would get one after another:

    * reads first: the batch's keys in one query per scope, then each reservation's own
      decision (_decide), a refusal raised before anything is written;
    * a reservation that names a key or run id that an earlier new run of this batch
      takes waits until those are written, and is then decided on its own (_reserve):
      two identical requests in one batch give one run and one replay, as in sequence;
    * capacity is counted per profile from one read of active_runs, plus the new runs
      before it in the batch (the trigger adds them one by one, as in sequence);
    * then every new run's rows by one multi-row INSERT per table (runs, keys,
      dispatches, events, broker messages) instead of five statements per run.  Fewer
      statements is what matters: each hands the GIL away while the write lock is held
      by this process and waited for by every other (measured with 2 web processes on
      2 shared CPUs: 1.83 -> 1.71 M instructions per admission even in batches of one,
      and a median of 30% more admissions/s in six interleaved runs).
    """
    outcomes: list = [None] * len(reservations)
    records = _key_records(conn, [r.req for r in reservations
                                  if r.req.key is not None and r.req.run_id is None])
    claimed: set = set()     # ("key", scope..., key) and ("run", id) of this batch's new runs
    bound: set = set()       # keys a replay bound to a client run id in this batch
    capacity: dict[str, int] = {}
    now = None
    fresh: list[tuple[int, Reservation, str]] = []
    later: list[int] = []
    for i, res in enumerate(reservations):
        req = res.req
        scope = (req.principal.profile_id, req.principal.key_id)
        marks = ([("key", *scope, req.key)] if req.key is not None else []) + (
            [("run", req.run_id)] if req.run_id is not None else [])
        if claimed.intersection(marks):
            later.append(i)
            continue
        try:
            if req.run_id is not None or ("key", *scope, req.key) in bound:
                replay = _decide(conn, req, res.refusal)
                if req.key is not None:
                    bound.add(("key", *scope, req.key))
            else:
                replay = _decide(conn, req, res.refusal,
                                 records.get((*scope, req.key)) if req.key is not None
                                 else None)
            if replay is not None:
                outcomes[i] = (replay, None)
                continue
            if scope[0] not in capacity:
                now, active = conn.execute(
                    f"SELECT {NOW}, COALESCE((SELECT active_runs FROM profiles "
                    "WHERE id = ?), 0)", (scope[0],)).fetchone()
                capacity[scope[0]] = res.max_active_runs - active
            if capacity[scope[0]] <= 0:
                raise CapacityExceeded(f"this profile already has {res.max_active_runs} "
                                       f"unfinished runs (the limit)")
        except RunstileError as exc:
            if isinstance(exc, LedgerUnavailable):
                raise
            outcomes[i] = (None, exc)
            continue
        capacity[scope[0]] -= 1
        claimed.update(marks)
        fresh.append((i, res, req.run_id or new_run_id()))
    if fresh:
        for i, admitted in _write_new_runs(conn, fresh, now):
            outcomes[i] = (admitted, None)
    for i in later:
        res = reservations[i]
        try:
            outcomes[i] = (_reserve(conn, res.req, res.refusal, res.max_active_runs,
                                    res.enqueue), None)
        except RunstileError as exc:
            if isinstance(exc, LedgerUnavailable):
                raise
            outcomes[i] = (None, exc)
    return outcomes


def _key_records(conn, reqs: list[AdmissionRequest]) -> dict:
    """{(profile, key id, key): record} for those of ``reqs``' keys that have a record:
    one indexed read per scope (an IN list on the primary key) instead of one per key."""
    by_scope: dict[tuple[str, str], list[str]] = {}
    for req in reqs:
        by_scope.setdefault((req.principal.profile_id, req.principal.key_id), []).append(req.key)
    records: dict = {}
    for (profile_id, key_id), keys in by_scope.items():
        marks = ", ".join("?" * len(keys))
        for row in conn.execute(
                "SELECT idempotency_key, run_id, fingerprint, fingerprint_version, 0 "
                "FROM idempotency_keys WHERE profile_id = ? AND key_id = ? AND "
                f"idempotency_key IN ({marks}) UNION ALL SELECT idempotency_key, NULL, NULL, "
                "NULL, 1 FROM key_tombstones WHERE profile_id = ? AND key_id = ? AND "
                f"idempotency_key IN ({marks})", (profile_id, key_id, *keys,
                                                  profile_id, key_id, *keys)):
            # A key is never both bound and a tombstone; if it were, the binding wins
            # (it is read first), as in _key_record.
            records.setdefault((profile_id, key_id, row[0]), tuple(row[1:]))
    return records


def _write_new_runs(conn, fresh: list[tuple[int, Reservation, str]], now: float):
    """Rows for the new runs of a batch, one INSERT per table; yields (index, Admitted).

    ``now`` is the ledger clock read in this transaction: every row of the batch gets
    it.  Dispatch ids are given explicitly (one above the largest, as SQLite would), so
    that each run knows its own without reading it back.
    """
    n = len(fresh)
    args: list = []
    for _, res, run_id in fresh:
        req = res.req
        args += (run_id, req.principal.profile_id, req.principal.key_id, req.task,
                 req.input_json, req.session_key, req.trigger_id, req.metadata_json,
                 req.callback_url, req.fingerprint, req.fingerprint_version, now, now)
    last_seq = conn.execute(
        "INSERT INTO runs (id, profile_id, key_id, task, input, session_key, trigger_id, "
        "metadata, callback_url, fingerprint, fingerprint_version, created_at, updated_at, "
        "status, attempt) VALUES "
        + ", ".join(["(?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, 'queued', 1)"] * n), args).lastrowid
    keyed = [(res.req, run_id) for _, res, run_id in fresh if res.req.key is not None]
    if keyed:
        args = []
        for req, run_id in keyed:
            args += (req.principal.profile_id, req.principal.key_id, req.key, run_id,
                     req.fingerprint, req.fingerprint_version, int(req.key_is_derived), now)
        conn.execute("INSERT INTO idempotency_keys (profile_id, key_id, idempotency_key, "
                     "run_id, fingerprint, fingerprint_version, derived, created_at) VALUES "
                     + ", ".join(["(?, ?, ?, ?, ?, ?, ?, ?)"] * len(keyed)), args)
    first_dispatch = conn.execute("SELECT COALESCE(MAX(id), 0) + 1 FROM dispatches").fetchone()[0]
    args = []
    for j, (_, res, run_id) in enumerate(fresh):
        args += (first_dispatch + j, run_id, now, now if res.enqueue is not None else None)
    conn.execute("INSERT INTO dispatches (id, run_id, attempt, reason, created_at, sent_at) "
                 "VALUES " + ", ".join(["(?, ?, 1, 'admitted', ?, ?)"] * n), args)
    args = []
    for _, _, run_id in fresh:
        args += (run_id, _QUEUED_EVENT, now)
    conn.execute("INSERT INTO events (run_id, seq, type, data, created_at) VALUES "
                 + ", ".join(["(?, 1, 'run.queued', ?, ?)"] * n), args)
    messages: list = []
    for j, (i, res, run_id) in enumerate(fresh):
        req = res.req
        run = dict.fromkeys(_RUN_COLUMNS)
        # AUTOINCREMENT numbers the rows of one INSERT consecutively, in VALUES order.
        run.update(seq=last_seq - n + 1 + j, id=run_id, profile_id=req.principal.profile_id,
                   key_id=req.principal.key_id, task=req.task, input=req.input_json,
                   session_key=req.session_key, trigger_id=req.trigger_id,
                   metadata=req.metadata_json, callback_url=req.callback_url,
                   fingerprint=req.fingerprint, fingerprint_version=req.fingerprint_version,
                   status="queued", attempt=1, recovery_attempts=0, created_at=now,
                   updated_at=now)
        dispatch_id = first_dispatch + j
        if res.enqueue is not None:
            message = getattr(res.enqueue, "message", None)
            if message is not None:
                messages.append(message(run, dispatch_id))
            else:
                res.enqueue(conn, run, dispatch_id)
        yield i, Admitted(run, replayed=False, dispatch_id=dispatch_id)
    if messages:
        broker_queue.insert_messages(conn, messages)


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
    if run.get("slot_wait_since") is not None:
        # It waited for a slot of its profile without a message; now it has one, so a
        # freed slot must not be handed to it a second time (ledger/profile_slots.py).
        conn.execute("UPDATE runs SET slot_wait_since = NULL WHERE id = ?", (run["id"],))
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
