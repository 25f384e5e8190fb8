"""Admission: the reservation that creates, replays or refuses a run (docs/api.md,
"Reservation"), alone or in a batch.

``web/runs.py`` calls :func:`admit` for each ``POST /v1/runs`` and each retry of a run.
Through the web process's group committer (``ledger/group_commit.py``) or the admission
writer (``web/writer/``, which carries a :class:`Reservation` over its socket), the
admissions waiting at one moment share one transaction: :func:`reserve_many` decides them
in order, then writes every new run's rows together (``ledger/admission_rows.py``).
Without a committer (tests, benchmarks) :func:`admit` runs its reservation alone.
Reading runs is ``ledger/runs.py``.
"""

from __future__ import annotations

import enum
import secrets
import sqlite3
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final, Protocol

from ..errors import (
    AdmissionRace,
    CapacityExceeded,
    IdempotencyKeyConflict,
    IdempotencyKeyExpired,
    LedgerUnavailable,
    RunIdConflict,
    RunstileError,
)
from . import admission_rows, db, events
from .broker_queue import DEFAULT_PRIORITY
from .db import NOW
from .keys import Principal
from .runs import Enqueue, add_dispatch

#: How many times a reservation is re-read after a uniqueness race before giving up.
#: Under SQLite's database-wide write lock a race cannot happen; the loop is for
#: ledgers without one (docs/architecture.md, "Not built yet": PostgreSQL) and costs
#: nothing here.
_RACE_RETRIES = 3

#: A write that lost a race with another writer: re-read, and answer as a replay.
_RACES: tuple[type[Exception], ...] = (*db.INTEGRITY_ERRORS, AdmissionRace)


@dataclass(frozen=True)
class AdmissionRequest:
    """One validated POST /v1/runs (or retry of a run), ready for the reservation."""

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
    retry_of: str | None = None  # the run a retry is a new run of (docs/api.md)
    priority: int = DEFAULT_PRIORITY  # 0-9, higher first (docs/api.md, "POST /v1/runs")
    #: A delayed run (docs/api.md, "Delayed runs"), at most one set: runs.not_before.
    delay_s: float | None = None  # seconds after the reservation's ledger clock
    not_before: float | None = None
    #: Its task's queue (docs/tasks.md, "Queues"): runs.queue.
    queue: str = "default"


@dataclass(frozen=True)
class Admitted:
    run: dict[str, Any]
    replayed: bool
    #: The dispatch record a new run was created with (None for a replay): brokers
    #: published to after commit publish exactly this record.
    dispatch_id: int | None = None


#: What :func:`reserve_many` answers per reservation: (Admitted, None) or (None, refusal).
Outcome = tuple[Admitted | None, RunstileError | None]


class Committer(Protocol):
    """What :func:`admit` hands a reservation to, to run in a shared transaction: the
    group committer (``ledger/group_commit.py``) or the admission writer's client."""

    def run(self, work: Reservation, /) -> Admitted: ...


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
          committer: Committer | None = None) -> Admitted:
    """Reserve and create (or replay) a run in one BEGIN IMMEDIATE transaction.

    ``refusal`` is the error to raise *only* if a new run would be created (unknown
    task, bad callback URL): checked by the caller before the transaction, raised here
    so that replays always answer (docs/api.md, "Check order").  With a ``committer``
    (group_commit) the reservation shares its transaction with the other admissions of
    this process waiting at that moment, and is written together with them
    (:func:`reserve_many`); without one it runs in its own transaction on ``conn``.
    """
    reserve = Reservation(req, refusal, max_active_runs, enqueue)
    for _ in range(_RACE_RETRIES):
        try:
            if committer is not None:
                return committer.run(reserve)
            assert conn is not None, "admit needs a connection or a committer"
            with db.transaction(conn):
                return reserve(conn)
        except _RACES:
            # Another writer created the same key or run id between our read and our
            # insert.  It has committed, so re-reading answers as a replay or a 409.
            # (The engine reports it as a refused write, db.INTEGRITY_ERRORS; the
            # admission writer reports the same
            # race from its process as AdmissionRace.)
            continue
    raise LedgerUnavailable("the admission kept racing with concurrent writers")


# ------------------------------------------------------------------ one reservation

def _reserve(conn: sqlite3.Connection, req: AdmissionRequest, refusal: RunstileError | None,
             max_active_runs: int, enqueue: Enqueue | None) -> Admitted:
    """The reservation of docs/api.md ("Reservation").  Every refusal is raised before the
    first write, so a refused admission leaves the transaction it shares (group commit)
    untouched."""
    replay = _decide(conn, req, refusal)
    if replay is not None:
        return replay
    scope = (req.principal.profile_id, req.principal.key_id)
    run_id = req.run_id or new_run_id()
    # The capacity check rides on the INSERT: no row comes back when the profile is full.
    row = conn.execute(
        "INSERT INTO runs (id, profile_id, key_id, task, input, session_key, trigger_id, "
        "metadata, callback_url, fingerprint, fingerprint_version, retry_of, not_before, "
        "priority, queue, status, attempt, created_at, updated_at) SELECT ?, ?, ?, ?, ?, ?, "
        f"?, ?, ?, ?, ?, ?, COALESCE({NOW} + ?, ?), ?, ?, 'queued', 1, {NOW}, {NOW} WHERE "
        "COALESCE((SELECT active_runs FROM profiles WHERE id = ?), 0) < ? RETURNING *",
        (run_id, *scope, req.task, req.input_json, req.session_key, req.trigger_id,
         req.metadata_json, req.callback_url, req.fingerprint, req.fingerprint_version,
         req.retry_of, req.delay_s, req.not_before, req.priority, req.queue, scope[0],
         max_active_runs)).fetchone()
    if row is None:
        raise CapacityExceeded(f"this profile already has {max_active_runs} unfinished runs "
                               f"(the limit)")
    run = db.as_dict(row)
    if req.key is not None:
        _bind_key(conn, req, run_id)
    dispatch_id = add_dispatch(conn, run, "admitted", enqueue)
    events.append_first(conn, run_id, "run.queued", {"attempt": 1})
    return Admitted(run, replayed=False, dispatch_id=dispatch_id)


#: A key's record as the reservation reads it: (run id, fingerprint, fingerprint version,
#: tombstone).  The run id and fingerprint are None for a tombstone.  The row itself
#: (:func:`_key_record`) or a tuple of its values (``admission_rows.key_records``).
_KeyRecord = Sequence[Any]


def _key_record(conn: sqlite3.Connection, req: AdmissionRequest) -> _KeyRecord | None:
    # One read answers both "is the key bound?" and "is it a tombstone?".
    scope = (req.principal.profile_id, req.principal.key_id)
    record: sqlite3.Row | None = conn.execute(
        "SELECT run_id, fingerprint, fingerprint_version, 0 AS tombstone "
        "FROM idempotency_keys WHERE profile_id = ? AND key_id = ? AND idempotency_key = ? "
        "UNION ALL SELECT NULL, NULL, NULL, 1 FROM key_tombstones "
        "WHERE profile_id = ? AND key_id = ? AND idempotency_key = ?",
        (*scope, req.key, *scope, req.key)).fetchone()
    return record


class _Unread(enum.Enum):
    """A key record not read yet (None is a key read and found to have none)."""

    UNREAD = enum.auto()


_UNREAD: Final = _Unread.UNREAD


def _decide(conn: sqlite3.Connection, req: AdmissionRequest, refusal: RunstileError | None,
            record: _KeyRecord | None | _Unread = _UNREAD) -> Admitted | None:
    """The reads of the reservation (the table of docs/api.md, "Reservation"): a replay, a
    refusal (raised), or None when a new run is to be created.  ``record`` is the key's
    record when the caller already read it (:func:`reserve_many` reads a batch's keys at
    once).  The only write is a replay binding a new header key to an existing client run
    id."""
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


def _bind_key(conn: sqlite3.Connection, req: AdmissionRequest, run_id: str) -> None:
    conn.execute(
        "INSERT INTO idempotency_keys (profile_id, key_id, idempotency_key, run_id, "
        "fingerprint, fingerprint_version, derived, created_at) "
        f"VALUES (?, ?, ?, ?, ?, ?, ?, {NOW})",
        (req.principal.profile_id, req.principal.key_id, req.key, run_id, req.fingerprint,
         req.fingerprint_version, int(req.key_is_derived)))


def _get(conn: sqlite3.Connection, run_id: str) -> dict[str, Any]:
    return db.as_dict(conn.execute("SELECT * FROM runs WHERE id = ?", (run_id,)).fetchone())


@dataclass(slots=True, eq=False)
class Reservation:
    """One admission handed to the group committer: callable alone (its own reservation,
    :func:`_reserve`), or run together with the others of a batch (:func:`reserve_many`,
    through ``run_many``, which group_commit looks for).

    The admission writer's wire format is derived from these fields and the
    :class:`AdmissionRequest`'s (``web/writer/codec.py``): a new field travels to the
    writer without touching it.  ``eq=False``: each reservation is one request, equal
    only to itself."""

    req: AdmissionRequest
    refusal: RunstileError | None
    max_active_runs: int
    enqueue: Enqueue | None

    def __call__(self, conn: sqlite3.Connection) -> Admitted:
        return _reserve(conn, self.req, self.refusal, self.max_active_runs, self.enqueue)

    @staticmethod
    def run_many(conn: sqlite3.Connection,
                 reservations: list[Reservation]) -> list[Outcome | None]:
        return reserve_many(conn, reservations)


# ------------------------------------------------------------------ a batch

def reserve_many(conn: sqlite3.Connection,
                 reservations: list[Reservation]) -> list[Outcome | None]:
    """The reservations of one group commit, in order, with their writes set-based.

    Returns ``(Admitted, None)`` or ``(None, refusal)`` per reservation; raises (aborting
    the batch, which group_commit then retries one reservation per transaction) on
    anything else.  Each answer is the one the reservations would get one after another:
    every reservation is decided first (:class:`_Batch`), then the new runs' rows are
    written together (``admission_rows.write_new_runs``), then the reservations that had
    to wait for those rows are decided and written one by one.
    """
    batch = _Batch(conn, reservations)
    for i, res in enumerate(reservations):
        batch.decide(i, res)
    if batch.fresh:
        assert batch.now is not None  # read by the capacity check every new run passed
        written = admission_rows.write_new_runs(conn, batch.fresh, batch.now)
        for i, run, dispatch_id in written:
            batch.outcomes[i] = (Admitted(run, replayed=False, dispatch_id=dispatch_id), None)
    for i in batch.later:
        res = reservations[i]
        try:
            batch.outcomes[i] = (_reserve(conn, res.req, res.refusal, res.max_active_runs,
                                          res.enqueue), None)
        except RunstileError as exc:
            if isinstance(exc, LedgerUnavailable):
                raise
            batch.outcomes[i] = (None, exc)
    return batch.outcomes


class _Batch:
    """The decisions of :func:`reserve_many`, in order, before anything of the batch's new
    runs is written.

    * Reads first: the batch's keys in one query per scope, then each reservation's own
      decision (_decide), a refusal raised before anything is written.
    * A reservation that names a key or run id that an earlier new run of this batch
      takes waits (``later``) until those are written, and is then decided on its own
      (_reserve): two identical requests in one batch give one run and one replay, as in
      sequence.
    * Capacity is counted per profile from one read of active_runs, plus the new runs
      before it in the batch (the trigger adds them one by one, as in sequence).
    """

    def __init__(self, conn: sqlite3.Connection, reservations: list[Reservation]) -> None:
        self.conn = conn
        #: Every reservation's outcome, each set by the time reserve_many returns.
        self.outcomes: list[Outcome | None] = [None] * len(reservations)
        self.records = admission_rows.key_records(
            conn, [r.req for r in reservations if r.req.key is not None and r.req.run_id is None])
        self.claimed: set[tuple[str, ...]] = set()  # new runs' ("key", scope..., key), ("run", id)
        self.bound: set[tuple[str, ...]] = set()  # keys a replay in this batch bound to a run id
        self.capacity: dict[str, int] = {}  # profile -> new runs it may still take
        self.now: float | None = None  # the ledger clock, read with capacity; new rows get it
        self.fresh: list[tuple[int, Reservation, str]] = []  # (index, res, new run id)
        self.later: list[int] = []

    def decide(self, i: int, res: Reservation) -> None:
        """Settle reservation ``i`` as a replay or a refusal, or count it as a new run."""
        req = res.req
        scope = (req.principal.profile_id, req.principal.key_id)
        marks = ([("key", *scope, req.key)] if req.key is not None else []) + (
            [("run", req.run_id)] if req.run_id is not None else [])
        if self.claimed.intersection(marks):
            # An earlier new run of this batch takes this key or run id: its rows are not
            # written yet, so this one is decided after them, as it would be in sequence.
            self.later.append(i)
            return
        try:
            replay = self._replay(req, res.refusal, scope)
            if replay is not None:
                self.outcomes[i] = (replay, None)
                return
            self._check_capacity(scope[0], res.max_active_runs)
        except RunstileError as exc:
            if isinstance(exc, LedgerUnavailable):
                raise
            self.outcomes[i] = (None, exc)
            return
        self.capacity[scope[0]] -= 1
        self.claimed.update(marks)
        self.fresh.append((i, res, req.run_id or new_run_id()))

    def _replay(self, req: AdmissionRequest, refusal: RunstileError | None,
                scope: tuple[str, str]) -> Admitted | None:
        """_decide for one reservation.  The batch's key records were read before any of
        its reservations ran, and only for those without a client run id: one with a run
        id, or whose key a replay earlier in this batch bound (a replay by run id binds
        the request's key), reads its key afresh."""
        if req.run_id is not None or ("key", *scope, req.key) in self.bound:
            replay = _decide(self.conn, req, refusal)
            if req.key is not None:
                self.bound.add(("key", *scope, req.key))
            return replay
        return _decide(self.conn, req, refusal,
                       self.records.get((*scope, req.key)) if req.key is not None else None)

    def _check_capacity(self, profile_id: str, max_active_runs: int) -> None:
        if profile_id not in self.capacity:
            self.now, active = self.conn.execute(
                f"SELECT {NOW}, COALESCE((SELECT active_runs FROM profiles "
                "WHERE id = ?), 0)", (profile_id,)).fetchone()
            self.capacity[profile_id] = max_active_runs - active
        if self.capacity[profile_id] <= 0:
            raise CapacityExceeded(f"this profile already has {max_active_runs} "
                                   f"unfinished runs (the limit)")
