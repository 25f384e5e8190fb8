"""Schedules' durable state (docs/tasks.md, "Schedules"): paused or not, and how far
their ticks are settled; and the admission of one tick (:func:`admit_tick`).

A tick's run is admitted through admission's own reservation (ledger/admission.py),
with the idempotency key ``schedule:<name>:<tick>`` in the scope of the profile's
schedule key (``keys.schedule_key_id``).  That key's uniqueness is what admits a tick once,
whichever node's scheduler gets there first (docs/architecture.md, "The scheduler");
this table only says which ticks are still to be looked at.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Iterable
from typing import Any

from ..errors import AdmissionRace, IdempotencyKeyConflict, IdempotencyKeyExpired, LedgerUnavailable
from . import db
from .admission import Admitted
from .db import NOW
from .keys import SCHEDULE_KEY_PREFIX, ensure_profile, schedule_key_id

#: The label of a profile's schedule key in ``runstile keys list``.
KEY_LABEL = "schedules (runs admitted by the profile's schedules; no secret)"
#: What a schedule key stores for its secret's hash: no SHA-256 looks like this, so no
#: presented secret ever matches it (and the key is revoked from birth besides).
_NO_SECRET = "none"
#: How many times a tick's admission is tried again after a uniqueness race (as
#: ledger/admission.py does; under SQLite's write lock none happens).
_RACE_RETRIES = 3

#: A write that lost a race with another writer: re-read, and answer as a replay.
_RACES: tuple[type[Exception], ...] = (*db.INTEGRITY_ERRORS, AdmissionRace)


def idempotency_key(name: str, tick: str) -> str:
    """The idempotency key of schedule ``name``'s run at ``tick`` (spelled by ticks.spell)."""
    return f"{SCHEDULE_KEY_PREFIX}{name}:{tick}"


def ensure(conn: sqlite3.Connection, schedules: Iterable[tuple[str, str]]) -> None:
    """Give each (name, profile) its row, its profile and the profile's schedule key, if
    it has none yet; one transaction.  The schedule key is a revoked api_keys row with no
    secret: runs need a key to belong to, and this one can never authenticate."""
    with db.transaction(conn):
        for name, profile_id in schedules:
            ensure_profile(conn, profile_id)
            conn.execute(
                "INSERT INTO api_keys (id, profile_id, label, role, secret_hash, created_at, "
                f"revoked_at) VALUES (?, ?, ?, 'client', ?, {NOW}, {NOW}) "
                "ON CONFLICT (id) DO NOTHING",
                (schedule_key_id(profile_id), profile_id, KEY_LABEL, _NO_SECRET))
            conn.execute(
                "INSERT INTO schedules (name, profile_id, first_seen_at, updated_at) "
                f"VALUES (?, ?, {NOW}, {NOW}) ON CONFLICT (name) DO UPDATE SET "
                "profile_id = excluded.profile_id WHERE schedules.profile_id != excluded.profile_id",
                (name, profile_id))


def states(conn: sqlite3.Connection) -> dict[str, dict[str, Any]]:
    """Every schedule's row, by name: the scheduler's one read per wake-up."""
    with db.ledger_errors():
        return {row["name"]: db.as_dict(row) for row in conn.execute("SELECT * FROM schedules")}


#: SQL condition: the schedule may admit the tick ``?`` (given twice): not paused, the tick
#: not inside a pause and not before settled_through.  The tick AT settled_through is let
#: through on purpose: a node racing the one that settled it reserves it too and gets a
#: replay, so what admits a tick once is its key, never this table.  A tick before
#: settled_through was admitted, or passed over by the catch-up policy, for good.
_OPEN = ("paused_at IS NULL AND COALESCE(settled_through, 0) <= ? AND "
         "COALESCE(resumed_at, 0) < ?")


def admit_tick(conn: sqlite3.Connection, name: str, tick: float,
               reserve: Callable[[sqlite3.Connection], Admitted]) -> Admitted | None:
    """Admit schedule ``name``'s run at ``tick`` and settle the schedule through it, in one
    transaction; a replay when another node admitted it first; None when the schedule is
    paused, or ``tick`` is older than the tick it is settled through.

    The pause is read inside the transaction, so a pause committed before it admits
    nothing more.  A key already bound (another node admitted this tick, perhaps with a
    since-changed input) or purged by retention is this tick admitted once already: it
    is settled, not admitted again.  A refusal of a new run (capacity) rolls back and is
    raised: the tick stays due and the next wake-up tries again."""
    for _ in range(_RACE_RETRIES):
        try:
            with db.transaction(conn):
                if conn.execute(f"SELECT 1 FROM schedules WHERE name = ? AND {_OPEN}",
                                (name, tick, tick)).fetchone() is None:
                    return None
                try:
                    admitted: Admitted | None = reserve(conn)
                except (IdempotencyKeyConflict, IdempotencyKeyExpired):
                    admitted = None  # the reservation refuses before its first write
                _settle(conn, name, tick, admitted)
                return admitted
        except _RACES:
            continue  # another writer took the key first: re-read, now a replay
    raise LedgerUnavailable("a schedule's tick kept racing with concurrent writers")


def _settle(conn: sqlite3.Connection, name: str, tick: float,
            admitted: Admitted | None) -> None:
    new = admitted is not None and not admitted.replayed
    conn.execute(
        f"UPDATE schedules SET settled_through = ?, updated_at = {NOW}, "
        "last_tick = CASE WHEN ? THEN ? ELSE last_tick END, "
        "last_run_id = CASE WHEN ? THEN ? ELSE last_run_id END WHERE name = ?",
        (tick, new, tick, new, admitted.run["id"] if new and admitted else None, name))


def pause(conn: sqlite3.Connection, name: str) -> bool:
    """Pause ``name`` for good (until resumed); whether this call paused it."""
    with db.transaction(conn):
        cur = conn.execute(f"UPDATE schedules SET paused_at = {NOW}, updated_at = {NOW} "
                           "WHERE name = ? AND paused_at IS NULL", (name,))
    return cur.rowcount == 1


def resume(conn: sqlite3.Connection, name: str) -> bool:
    """Resume ``name``: its next tick after now is due, none of the pause's; whether this
    call resumed it."""
    with db.transaction(conn):
        cur = conn.execute(
            f"UPDATE schedules SET paused_at = NULL, resumed_at = {NOW}, updated_at = {NOW} "
            "WHERE name = ? AND paused_at IS NOT NULL", (name,))
    return cur.rowcount == 1
