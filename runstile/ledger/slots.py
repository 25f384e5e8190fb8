"""Slots: the limits on running runs that the claim enforces (docs/architecture.md, "The
per-profile cap" and "Per-task concurrency").  Two kinds, kept by one mechanism:

- a profile's cap (``RUNSTILE_MAX_RUNNING_PER_PROFILE``, docs/configuration.md): at most N
  runs of one profile ``running`` or ``stopping`` at once, so that one tenant cannot hold
  every worker thread;
- a task's concurrency (``@runstile.task(name, concurrency=N)``, docs/tasks.md,
  "Registering a task"): at most N runs of that task ``running`` or ``stopping`` at once.

Both count across every worker of the deployment, and both are enforced by the claim, the
way sessions are (ledger/sessions.py).  Inside the claim's transaction the run's profile's
and task's running and stopping runs are counted; a run over a limit stays ``queued``,
marked as waiting for each kind that is full (``slot_wait_since``: its profile's,
``task_wait_since``: its task's), with the limits that claim applied written beside
(``wait_profile_cap``, ``wait_task_limit``), and its message is acknowledged as a no-op.
Every transition that moves a run out of running/stopping (finish, pause, re-queue,
approval wait, recovery's classification) frees one slot of its profile and one of its
task, and hands each, in its own transaction, to the oldest run waiting for it whose
session may go and whose other limit has room: a dispatch, exactly like a session's next
run, published after the commit on Redis/RabbitMQ.  Recovery hands out the free slots
that runs wait for (a message lost since, a limit raised or removed at a restart).

The ledger knows no task registry: a claim is told the cap and its task's concurrency by
its caller (the worker's settings and registry), a freed slot is handed on by the limits
its waiting runs were refused under, and recovery passes its own.

Race: the counts, the marks and every hand-over happen under the ledger's write lock
(``BEGIN IMMEDIATE``), so a refusal and the freeing of the slot it waited for are ordered.
A refusal committed first is marked, and the later freeing transition finds and
dispatches it; a freeing committed first leaves a free slot, and the later claim takes it.
A dispatched run whose claim then loses a slot to another run's message (a new
admission, a session's next run) is simply marked again (a duplicate message is
harmless), and the slot of the other kind it did not take goes on to that kind's next
waiting run in the same claim, so no slot is left free with a run waiting for it.
"""

from __future__ import annotations

import collections
import json
import sqlite3
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from . import db
from .db import NOW
from .runs import Enqueue, add_dispatch
from .sessions import CLAIMABLE

#: Statuses that hold a slot (a stopping body still runs).
HOLDING = "('running', 'stopping')"


@dataclass(frozen=True)
class Kind:
    """One kind of slot, as the runs table keeps it."""

    #: The run's column that names whose slots (its profile, its task).
    column: str
    #: Set while the run waits for a slot of this kind (migrations 4 and 6).
    mark: str
    #: The limit of this kind the claim that marked the run applied (NULL: none).
    seen: str
    #: The claim's answer for a run over this limit.
    refusal: str
    #: The reason of the dispatch that hands a freed slot of this kind on.
    reason: str


PROFILE = Kind("profile_id", "slot_wait_since", "wait_profile_cap", "profile_busy",
               "profile_slot")
TASK = Kind("task", "task_wait_since", "wait_task_limit", "task_busy", "task_slot")
KINDS = (PROFILE, TASK)

#: One profile's or one task's slots: (kind, the profile id or task name).
Slot = tuple[Kind, str]


def other(kind: Kind) -> Kind:
    return TASK if kind is PROFILE else PROFILE


def slots_of(run: Mapping[str, Any]) -> tuple[Slot, Slot]:
    """The two slots a running run holds: one of its profile's, one of its task's."""
    return (PROFILE, run["profile_id"]), (TASK, run["task"])


@dataclass(frozen=True)
class Limits:
    """What the calling process knows of the limits: the profile cap (its setting) and
    the concurrency of the tasks its registry has.  A task it does not know keeps the
    limit its waiting runs were refused under."""

    profile_cap: int | None = None
    tasks: Mapping[str, int | None] = field(default_factory=dict)

    def of(self, kind: Kind, key: str, seen: int | None) -> int | None:
        return self.profile_cap if kind is PROFILE else self.tasks.get(key, seen)

    @property
    def bounded(self) -> bool:
        return self.profile_cap is not None or any(v is not None for v in self.tasks.values())


def running(conn: sqlite3.Connection, kind: Kind, key: str) -> int:
    """The runs holding one of these slots (through runs_running_by_profile or
    runs_running_by_task: a few rows, never the profile's or task's whole history)."""
    count: int = conn.execute(f"SELECT COUNT(*) FROM runs WHERE {kind.column} = ? AND "
                              f"status IN {HOLDING}", (key,)).fetchone()[0]
    return count


def claim_refusal(conn: sqlite3.Connection, run: dict[str, Any], limits: Limits,
                  enqueue: Enqueue | None) -> str | None:
    """Inside the claim's transaction: the refusal if ``run`` (queued, its session's turn)
    would exceed its profile's cap or its task's concurrency, having marked it as waiting
    for each kind that is full; else None.

    A limit it does not exceed has room that this run does not take now: that slot goes
    on to the oldest run waiting for it (it may be a slot handed to this very run by a
    freeing transition, which another claim overtook on the other kind)."""
    caps = {kind: limits.of(kind, run[kind.column], None) for kind in KINDS}
    full = [kind for kind, cap in caps.items()
            if cap is not None and running(conn, kind, run[kind.column]) >= cap]
    if not full:
        return None
    # Guarded on queued (it is: the caller read it in this transaction); the first
    # refusal's time is kept, so a mark says how long the run has waited.
    marks = ", ".join(f"{k.mark} = CASE WHEN ? THEN COALESCE({k.mark}, {NOW}) END"
                      for k in KINDS)
    conn.execute(f"UPDATE runs SET {marks}, {', '.join(f'{k.seen} = ?' for k in KINDS)} "
                 "WHERE id = ? AND status = 'queued'",
                 (*(k in full for k in KINDS), *(caps[k] for k in KINDS), run["id"]))
    hand_on(conn, collections.Counter((kind, run[kind.column]) for kind in KINDS
                                      if kind not in full and caps[kind] is not None), enqueue)
    return full[0].refusal


def _pick(conn: sqlite3.Connection, slot: Slot, handed: collections.Counter[Slot],
          limits: Limits | None) -> dict[str, Any] | None:
    """The oldest run waiting for ``slot`` whose session may go (a run behind a busy
    session would only be refused again; its session dispatches it) and whose limit of
    the other kind has room, counting the runs this transaction ``handed`` a slot.

    A waiting run passed over because its other limit is full is marked as waiting for
    that one too (with every other run waiting here behind the same full slot), so that
    the transition freeing it finds them."""
    kind, key = slot
    blocker = other(kind)
    full: list[str] = []
    while True:
        row = conn.execute(
            f"SELECT r.* FROM runs r WHERE r.{kind.column} = ? AND r.{kind.mark} IS NOT NULL "
            f"AND r.status = 'queued' AND {CLAIMABLE} AND r.{blocker.column} NOT IN "
            f"{db.dialect(conn).json_array_values()} ORDER BY r.seq LIMIT 1",
            (key, json.dumps(full))).fetchone()
        if row is None:
            return None
        run, theirs = db.as_dict(row), row[blocker.column]
        cap = run[blocker.seen] if limits is None else limits.of(blocker, theirs,
                                                                 run[blocker.seen])
        if cap is None or running(conn, blocker, theirs) + handed[(blocker, theirs)] < cap:
            return run
        full.append(theirs)
        conn.execute(f"UPDATE runs SET {blocker.mark} = COALESCE({blocker.mark}, {NOW}) "
                     f"WHERE {kind.column} = ? AND {kind.mark} IS NOT NULL AND "
                     f"status = 'queued' AND {blocker.column} = ?", (key, theirs))


def hand_on(conn: sqlite3.Connection, freed: Mapping[Slot, int], enqueue: Enqueue | None, *,
            limits: Limits | None = None, most: int | None = None) -> list[str]:
    """Hand ``freed`` slots (how many of each) to waiting runs, in the caller's
    transaction; returns the dispatched run ids.

    While a freed slot is left, the oldest of the runs :func:`_pick` finds for them gets a
    dispatch (which clears its marks) and uses up the freed slots it will hold.  A freed
    slot is trusted to be free; the other limit is counted, by ``limits`` if given
    (recovery), else by the limit each waiting run was refused under.  A run over a limit
    still (one lowered at a restart) is refused and marked again by its claim: nothing
    is lost."""
    left = collections.Counter({slot: n for slot, n in freed.items() if n > 0})
    handed: collections.Counter[Slot] = collections.Counter()
    picks: dict[Slot, dict[str, Any]] = {}
    dispatched: list[str] = []
    while left and (most is None or len(dispatched) < most):
        for slot in sorted(set(left) - set(picks), key=lambda s: (s[0].column, s[1])):
            pick = _pick(conn, slot, handed, limits)
            if pick is None:
                del left[slot]  # nothing waits for it that may go (handed only grows)
            else:
                picks[slot] = pick
        if not picks:
            break
        slot = min(picks, key=lambda s: picks[s]["seq"])
        # Read again: a later pick may have marked it as waiting for its other slot too.
        run = db.as_dict(conn.execute("SELECT * FROM runs WHERE id = ?",
                                      (picks[slot]["id"],)).fetchone())
        add_dispatch(conn, run, slot[0].reason, enqueue)  # clears its marks
        dispatched.append(run["id"])
        taken = slots_of(run)
        handed.update(taken)
        left.subtract(taken)
        left = +left  # without the slots used up (and those never freed)
        # A pick stays good unless it is this run or its other limit just lost room.
        picks = {s: p for s, p in picks.items() if s in left and p["id"] != run["id"]
                 and (other(s[0]), p[other(s[0]).column]) not in taken}
    return dispatched


def waiting_columns() -> str:
    """Columns for the RETURNING of a transition that frees its run's slots: whether any
    run waits for a slot of each kind this run holds (``waiting_<column>``).  Asked in
    the transition's own statement (the waiting runs' partial index, a lookup that finds
    nothing when no limit is set), so that with nobody waiting :func:`dispatch_next`
    reads nothing more: on PostgreSQL every statement is a round trip, paid while the
    writer lock is held.  Read under the same write lock as the lookups it saves."""
    return ", ".join(
        f"EXISTS (SELECT 1 FROM runs w WHERE w.{k.column} = runs.{k.column} AND "
        f"w.{k.mark} IS NOT NULL AND w.status = 'queued') AS waiting_{k.column}"
        for k in KINDS)


def waiting_of(run: dict[str, Any]) -> set[Kind]:
    """Take the :func:`waiting_columns` answers out of a row read with them: the kinds
    whose slot some run waits for."""
    return {k for k in KINDS if run.pop(f"waiting_{k.column}")}


def dispatch_next(conn: sqlite3.Connection, run: dict[str, Any],
                  enqueue: Enqueue | None, *, waiting: Iterable[Kind] = KINDS) -> list[str]:
    """After ``run`` left running or stopping, in the same transaction: its profile's
    slot and its task's go to the runs waiting for them, if any (two indexed lookups that
    find nothing when no limit is set; none for a kind that ``waiting`` leaves out,
    which :func:`waiting_of` said nobody waits for)."""
    kinds = set(waiting)
    if not kinds:
        return []  # the common case (no run waits for a slot): nothing to look up or count
    return hand_on(conn, collections.Counter(s for s in slots_of(run) if s[0] in kinds),
                   enqueue)


def dispatch_freed(conn: sqlite3.Connection, runs: Iterable[dict[str, Any]],
                   enqueue: Enqueue | None) -> list[str]:
    """:func:`dispatch_next` for a batch of runs that all left running or stopping: one
    lookup per profile and task, not per run."""
    return hand_on(conn, collections.Counter(s for run in runs for s in slots_of(run)),
                   enqueue)


def dispatch_stranded(conn: sqlite3.Connection, limits: Limits, enqueue: Enqueue | None, *,
                      most: int) -> list[str]:
    """Recovery: hand out every free slot that runs wait for, by this process's
    ``limits`` (every waiting run of a kind with no limit), at most ``most`` runs in all;
    in the caller's transaction.

    A run dispatched by a freeing transition moments ago and not yet claimed does not
    count as holding a slot, so this may hand that slot out once more; the extra message
    loses its claim and is marked again (harmless, and once per pass at most).
    """
    free: collections.Counter[Slot] = collections.Counter()
    for kind in KINDS:
        for key, seen in conn.execute(
                f"SELECT {kind.column}, MIN({kind.seen}) FROM runs WHERE {kind.mark} IS NOT "
                "NULL AND status = 'queued' GROUP BY 1 ORDER BY 1 LIMIT ?", (most,)):
            cap = limits.of(kind, key, seen)
            free[(kind, key)] = most if cap is None else cap - running(conn, kind, key)
    return hand_on(conn, free, enqueue, limits=limits, most=most)
