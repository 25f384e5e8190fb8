"""Runs: lookup and listing (docs/api.md, "GET /v1/runs"), and the dispatch record that
every transition making a run claimable writes (:func:`add_dispatch`), and when a
delayed run is due (:func:`due` in SQL; :func:`wait_of` and the message times
``dispatch.py`` gives its messages).

The web tier reads runs here (``web/runs.py``, ``web/streams.py``, ``web/deliveries.py``,
``web/approvals.py``); admission, re-queue, a session's next run and recovery write
their dispatch records through :func:`add_dispatch`.  Admitting a run is
``ledger/admission.py``.
"""

from __future__ import annotations

import math
import sqlite3
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol, cast

from ..errors import ListQueryTimeout
from . import db
from .broker_queue import NewMessage
from .db import NOW
from .keys import SCHEDULE_KEY_PREFIX, Principal, schedule_key_id
from .states import RunStatus


class Enqueue(Protocol):
    """How a transition that makes a run claimable hands it to the broker, inside the
    transaction, right after its dispatch record is written.  ``runstile/dispatch.py``
    builds one per broker and delay (its ``Dispatcher``); the ledger only calls it."""

    #: True: the message itself is written in this transaction (the embedded broker, no
    #: dual write), so the dispatch record is born sent.  False: the record stays unsent
    #: and the commit owes its publish (ledger/owed.py); Redis and RabbitMQ.
    in_transaction: bool

    def __call__(self, conn: sqlite3.Connection, run: dict[str, Any],
                 dispatch_id: int) -> None:
        """Write the message (or what the commit owes); raising rolls the whole
        transaction back."""

    def message(self, run: dict[str, Any], dispatch_id: int) -> NewMessage | None:
        """The broker row, for a batch of admissions that inserts every message with one
        statement (``admission_rows``); None: call the enqueue instead."""


#: The marks of a queued run waiting for a slot (ledger/slots.py): of its profile (the cap)
#: and of its task (its concurrency).  Such a run has no message on purpose.
SLOT_MARKS = ("slot_wait_since", "task_wait_since")


def not_waiting_for_a_slot(alias: str = "") -> str:
    """SQL condition: the run (``alias`` + '.', or none) waits for no slot."""
    return " AND ".join(f"{alias}{mark} IS NULL" for mark in SLOT_MARKS)


def due(alias: str = "", behind: str = "0") -> str:
    """SQL condition: the run (``alias`` + '.', or none) may start by now, its not_before
    (docs/api.md, "Delayed runs") none or at least ``behind`` (an SQL expression, seconds)
    behind the ledger clock."""
    return f"({alias}not_before IS NULL OR {alias}not_before <= {NOW} - {behind})"


def wait_of(run: dict[str, Any]) -> float:
    """Seconds until ``run`` may start: until its ``not_before`` (docs/api.md, "Delayed
    runs"), 0 once that has passed or when it has none.  The ledger clock (``db.NOW``) is
    this host's clock, as ``time.time()`` is."""
    not_before = run.get("not_before")
    return 0.0 if not_before is None else max(0.0, not_before - time.time())


def eta_ms(run: dict[str, Any], delay_s: float) -> int:
    """A delayed message's eta (Unix ms): ``delay_s`` from now, and never before the run's
    not_before (rounded up past it, so the claim the message brings finds it due)."""
    eta = int((time.time() + delay_s) * 1000)
    not_before = run.get("not_before")
    if not_before is not None:
        eta = max(eta, math.ceil(not_before * 1000) + 1)
    return eta


def publish_wait(run: dict[str, Any]) -> float:
    """:func:`wait_of`, rounded up to the broker's milliseconds (plus one), so the message
    never comes before the run is due."""
    wait = wait_of(run)
    return 0.0 if wait <= 0 else (math.ceil(wait * 1000) + 1) / 1000


def add_dispatch(conn: sqlite3.Connection, run: dict[str, Any], reason: str,
                 enqueue: Enqueue | None) -> int:
    """Record that ``run`` must reach a worker; inside the caller's transaction.

    With an in-transaction ``enqueue`` (the embedded broker) the message is written in
    this same transaction, so the record is born sent; otherwise sent_at stays NULL
    until a publisher marks it after commit (the enqueue writes that debt down).
    Without one (admission for Redis/RabbitMQ, whose web process publishes its record
    itself), nothing is owed here.
    """
    # lastrowid, not RETURNING id: a RETURNING row costs a second sqlite3_step to fetch.
    # (After an INSERT, lastrowid is the new row's id: never None.)
    dispatch_id = cast(int, conn.execute(
        "INSERT INTO dispatches (run_id, attempt, reason, created_at, sent_at) "
        f"VALUES (?, ?, ?, {NOW}, CASE WHEN ? THEN {NOW} END)",
        (run["id"], run["attempt"], reason,
         enqueue is not None and enqueue.in_transaction)).lastrowid)
    if any(run.get(mark) is not None for mark in SLOT_MARKS):
        # It waited for a slot of its profile or its task without a message; now it has
        # one, so a freed slot must not be handed to it a second time (ledger/slots.py).
        conn.execute(f"UPDATE runs SET {', '.join(f'{m} = NULL' for m in SLOT_MARKS)} "
                     "WHERE id = ?", (run["id"],))
    if enqueue is not None:
        enqueue(conn, run, dispatch_id)
    return dispatch_id


def visible_clause(principal: Principal) -> tuple[str, tuple[str, ...]]:
    """SQL condition and arguments limiting runs to what a key may see (docs/guarantees.md,
    "6. Isolation")."""
    if principal.is_admin:
        return "profile_id = ?", (principal.profile_id,)
    return "profile_id = ? AND key_id = ?", (principal.profile_id, principal.key_id)


def get_visible(conn: sqlite3.Connection, principal: Principal,
                run_id: str) -> dict[str, Any] | None:
    """The run if the principal may see it, else None (the caller answers 404)."""
    where, args = visible_clause(principal)
    with db.ledger_errors():
        row = conn.execute(f"SELECT * FROM runs WHERE id = ? AND {where}",
                           (run_id, *args)).fetchone()
    return None if row is None else db.as_dict(row)


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
                 before_seq: int | None, limit: int,
                 timeout_s: float) -> tuple[list[dict[str, Any]], bool]:
    """Newest first.  Keyset pagination on seq: a run admitted while a client pages
    gets a larger seq than every cursor, so it can neither repeat nor shift a page.

    Raises :class:`ListQueryTimeout` past ``timeout_s``: filters that match few rows of a
    large scope make SQLite scan it all, and a client must not hold a thread and a read
    snapshot for as long as it likes (docs/api.md, "Limits on a list query")."""
    where, args = visible_clause(principal)
    clauses, params = [where], list[object](args)
    if flt.statuses:
        clauses.append(f"status IN ({', '.join('?' for _ in flt.statuses)})")
        params += [RunStatus(s).value for s in flt.statuses]
    for column, value in (("task", flt.task), ("session_key", flt.session_key)):
        if value is not None:
            clauses.append(f"{column} = ?")
            params.append(value)
    if flt.idempotency_key is not None:
        clauses.append("id IN (SELECT run_id FROM idempotency_keys WHERE profile_id = ? "
                       "AND key_id = ? AND idempotency_key = ?)")
        params += [principal.profile_id, _key_scope(principal, flt.idempotency_key),
                   flt.idempotency_key]
    if flt.created_after is not None:
        clauses.append("created_at > ?")
        params.append(flt.created_after)
    if flt.created_before is not None:
        clauses.append("created_at < ?")
        params.append(flt.created_before)
    for key, value in flt.metadata:
        clauses.append(db.dialect(conn).metadata_has("runs.metadata"))
        params += [key, value]
    if before_seq is not None:
        clauses.append("seq < ?")
        params.append(before_seq)
    sql = f"SELECT * FROM runs WHERE {' AND '.join(clauses)} ORDER BY seq DESC LIMIT ?"
    with db.time_limit(conn, timeout_s, _list_timeout(timeout_s)), db.ledger_errors():
        rows = conn.execute(sql, (*params, limit + 1)).fetchall()
    return [db.as_dict(r) for r in rows[:limit]], len(rows) > limit


def _key_scope(principal: Principal, key: str) -> str:
    """The key id whose scope an idempotency-key lookup reads.  Keys live in one scope, so
    the lookup gives 0 or 1 run: the caller's own, or for an admin's lookup of a
    scheduled run's key, its profile's schedule key's (docs/api.md, "GET /v1/runs")."""
    if principal.is_admin and key.startswith(SCHEDULE_KEY_PREFIX):
        return schedule_key_id(principal.profile_id)
    return principal.key_id


def _list_timeout(timeout_s: float) -> Callable[[], ListQueryTimeout]:
    return lambda: ListQueryTimeout(
        f"the list query ran past its limit of {timeout_s * 1000:g} ms and was stopped; "
        f"narrow it (status, task, session_key, created_after/created_before) or lower "
        f"limit")


def statuses_known(values: Iterable[str]) -> bool:
    known = {s.value for s in RunStatus}
    return all(v in known for v in values)


def status_of(conn: sqlite3.Connection, run_id: str) -> str | None:
    with db.ledger_errors():
        row = conn.execute("SELECT status FROM runs WHERE id = ?", (run_id,)).fetchone()
    return None if row is None else row[0]
