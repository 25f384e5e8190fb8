"""The per-profile cap on running runs (``RUNSTILE_MAX_RUNNING_PER_PROFILE``,
docs/configuration.md): at most N runs of one profile ``running`` or ``stopping`` at once,
across every worker of the deployment, so that one tenant cannot hold every worker thread.

Enforced by the claim, the way sessions are (ledger/sessions.py).  Inside the claim's
transaction the profile's running and stopping runs are counted; a run over the cap stays
``queued``, marked ``slot_wait_since``, and its message is acknowledged as a no-op.  Every
transition that moves a run out of running/stopping (finish, pause, re-queue, approval
wait, recovery's classification) then hands the freed slot to the profile's oldest marked
run in its own transaction: a dispatch, exactly like a session's next run, published after
the commit on Redis/RabbitMQ.  Recovery dispatches marked runs of profiles that have a
free slot (a message lost since, or a cap raised or removed at a restart).

Race: the count, the mark and every hand-over happen under the ledger's write lock
(``BEGIN IMMEDIATE``), so a refusal and the freeing of the slot it waited for are ordered.
A refusal committed first is marked, and the later freeing transition finds and
dispatches it; a freeing committed first leaves a free slot, and the later claim takes it.
A dispatched run whose claim then loses the slot to another run's message (a new
admission, a session's next run) is simply marked again: a duplicate message is harmless.
"""

from __future__ import annotations

import collections
import sqlite3
from collections.abc import Iterable
from typing import Any

from .db import NOW
from .runs import Enqueue, add_dispatch
from .sessions import CLAIMABLE

#: Statuses that hold one of a profile's slots (a stopping body still runs).
HOLDING = "('running', 'stopping')"
#: The claim's answer for a run over its profile's cap.
REFUSAL = "profile_busy"


def running(conn: sqlite3.Connection, profile_id: str) -> int:
    """The profile's runs holding a slot (through runs_running_by_profile: a few rows)."""
    count: int = conn.execute(f"SELECT COUNT(*) FROM runs WHERE profile_id = ? AND status IN "
                              f"{HOLDING}", (profile_id,)).fetchone()[0]
    return count


def claim_refusal(conn: sqlite3.Connection, run: dict[str, Any], cap: int | None) -> str | None:
    """Inside the claim's transaction: ``REFUSAL`` if ``run`` (queued, its session's turn)
    would exceed its profile's cap, having marked it as waiting; else None."""
    if cap is None or running(conn, run["profile_id"]) < cap:
        return None
    # Guarded on queued (it is: the caller read it in this transaction); the first refusal's
    # time is kept, so the mark says how long the run has waited.
    conn.execute(f"UPDATE runs SET slot_wait_since = COALESCE(slot_wait_since, {NOW}) "
                 "WHERE id = ? AND status = 'queued'", (run["id"],))
    return REFUSAL


def _waiting(conn: sqlite3.Connection, profile_id: str, limit: int) -> list[dict[str, Any]]:
    """The profile's oldest runs waiting for a slot that may go now (their session's
    turn: a run behind a busy session would only be refused again)."""
    rows = conn.execute(
        "SELECT r.* FROM runs r WHERE r.profile_id = ? AND r.slot_wait_since IS NOT NULL AND "
        f"r.status = 'queued' AND {CLAIMABLE} ORDER BY r.seq LIMIT ?",
        (profile_id, limit)).fetchall()
    return [dict(r) for r in rows]


def dispatch_waiting(conn: sqlite3.Connection, profile_id: str, count: int,
                     enqueue: Enqueue | None) -> list[str]:
    """Hand ``count`` freed slots of a profile to its oldest waiting runs, in the caller's
    transaction; returns the dispatched run ids.  A run over the cap still (a cap lowered
    at a restart) is refused and marked again by its claim: nothing is lost."""
    if count <= 0:
        return []
    waiting = _waiting(conn, profile_id, count)
    for run in waiting:
        add_dispatch(conn, run, "profile_slot", enqueue)  # clears the mark
    return [run["id"] for run in waiting]


def dispatch_next(conn: sqlite3.Connection, run: dict[str, Any],
                  enqueue: Enqueue | None) -> str | None:
    """After ``run`` left running or stopping, in the same transaction: its slot goes to
    the profile's oldest waiting run, if any (an indexed lookup that finds nothing when
    no cap is set)."""
    dispatched = dispatch_waiting(conn, run["profile_id"], 1, enqueue)
    return dispatched[0] if dispatched else None


def dispatch_freed(conn: sqlite3.Connection, runs: Iterable[dict[str, Any]],
                   enqueue: Enqueue | None) -> list[str]:
    """:func:`dispatch_next` for a batch of runs that all left running or stopping."""
    freed = collections.Counter(run["profile_id"] for run in runs)
    return [rid for profile_id, count in sorted(freed.items())
            for rid in dispatch_waiting(conn, profile_id, count, enqueue)]


def dispatch_stranded(conn: sqlite3.Connection, cap: int | None, enqueue: Enqueue | None, *,
                      limit: int) -> list[str]:
    """Recovery: dispatch waiting runs of every profile with a free slot, at most one per
    free slot (every one with no cap), at most ``limit`` in all; in the caller's
    transaction.

    A run dispatched by a freeing transition moments ago and not yet claimed does not
    count as holding a slot, so this may hand that slot out once more; the extra message
    loses its claim and is marked again (harmless, and once per pass at most).
    """
    profiles = [row[0] for row in conn.execute(
        "SELECT DISTINCT profile_id FROM runs WHERE slot_wait_since IS NOT NULL AND "
        "status = 'queued' ORDER BY profile_id LIMIT ?", (limit,)).fetchall()]
    dispatched: list[str] = []
    for profile_id in profiles:
        free = limit if cap is None else cap - running(conn, profile_id)
        room = min(free, limit - len(dispatched))
        dispatched += dispatch_waiting(conn, profile_id, room, enqueue)
        if len(dispatched) >= limit:
            break
    return dispatched
