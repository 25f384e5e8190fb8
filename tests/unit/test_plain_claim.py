"""The plain claim (ledger/execution.py, ``_start_plain``): a run nothing can refuse is
claimed by one guarded UPDATE, without reading it first.  It must decide exactly as the
full claim does: every kind of run is claimed both ways in the same ledger state (the
first way rolled back), and the outcome and every row written must be the same."""

from __future__ import annotations

import json
import time

import pytest

from runstile import tasks as registry
from runstile.ledger import admission, db, execution, keys
from runstile.ledger.execution import Owner
from runstile.ledger.keys import Principal
from tests.unit import slot_helpers
from tests.unit.slot_helpers import ENQUEUE, admit

OWNER = Owner("node-a", 1, 4242, 99)
#: What a worker with this registry passes: every task it knows that has no limit.
UNLIMITED = json.dumps(sorted(n for n, c in registry.concurrencies().items() if c is None))
#: Columns that hold the ledger clock's reading: the two claims run moments apart.
CLOCK = {"created_at", "updated_at", "started_at", "lease_expires_at", "available_at",
         "eta", "claimed_at", "enqueued_at", "sent_at", "finished_at", "dead_at", "slot_wait_since",
         "task_wait_since"}


@pytest.fixture
def ledger(dual_ledger):
    """Every test here runs on both engines (tests/postgres.py)."""
    return dual_ledger


class _Undo(Exception):
    """Rolls back the claim whose writes were just read."""


def writes(conn) -> dict:
    """Every row a claim may write, without the clock's readings, the broker's random
    message ids and bodies, and its row ids (PostgreSQL's identity does not roll back)."""
    def rows(sql: str, drop: tuple[str, ...] = ()) -> list:
        return [{k: v for k, v in dict(row).items() if k not in CLOCK and k not in drop}
                for row in conn.execute(sql).fetchall()]
    return {"runs": rows("SELECT * FROM runs ORDER BY seq"),
            "events": rows("SELECT run_id, seq, type, data FROM events ORDER BY run_id, seq"),
            "dispatches": rows("SELECT * FROM dispatches ORDER BY id"),
            "messages": rows("SELECT * FROM broker_messages ORDER BY id",
                             drop=("id", "message_id", "body"))}


def claimed_both_ways(conn, run_id: str, *, cap: int | None = None) -> tuple:
    """(outcome, writes) of the full claim and of the plain one, from the same state."""
    results = []
    for unlimited in (None, UNLIMITED):
        try:
            with db.transaction(conn):
                claim = execution.claim(
                    conn, run_id, OWNER, lease_s=60, task_known=lambda t: registry.get(t)
                    is not None, enqueue=ENQUEUE, max_running_per_profile=cap,
                    task_limit=registry.concurrency_of, unlimited_tasks=unlimited)
                results.append((claim.outcome, claim.run is not None, writes(conn)))
                raise _Undo
        except _Undo:
            pass
    return results[0], results[1]


def reads_of_the_run(conn, run_id: str) -> int:
    """How many times the plain claim of ``run_id`` reads the run before deciding."""
    seen: list[str] = []
    conn.set_trace_callback(seen.append)
    try:
        with db.transaction(conn):
            execution.claim(conn, run_id, OWNER, lease_s=60, task_known=lambda t: True,
                            enqueue=ENQUEUE, unlimited_tasks=UNLIMITED)
    finally:
        conn.set_trace_callback(None)
    return sum(1 for sql in seen if sql.startswith("SELECT * FROM runs WHERE id"))


def delayed(conn, profile: str, not_before: float) -> str:
    key_id = keys.create(conn, profile)[0]
    request = admission.AdmissionRequest(
        principal=Principal(profile, key_id, "client"), key=None, key_is_derived=False,
        run_id=None, task="t.hold", input_json="{}", session_key=None, trigger_id=None,
        metadata_json=None, callback_url=None, fingerprint="f" * 64, fingerprint_version=1,
        not_before=not_before)
    return admission.admit(conn, request, refusal=None, max_active_runs=100,
                           enqueue=ENQUEUE).run["id"]


def test_a_run_nothing_can_refuse_is_claimed_the_same_in_one_statement(conn):
    run = admit(conn, "a")
    full, plain = claimed_both_ways(conn, run)
    assert full == plain and plain[:2] == ("claimed", True)
    assert reads_of_the_run(conn, run) == 0


@pytest.mark.parametrize("kind", [
    "already_running", "missing", "session_head", "session_behind", "not_due", "due",
    "limited_and_free", "limited_and_full", "unknown_task", "capped_profile", "was_waiting"])
def test_every_other_run_is_decided_as_the_full_claim_decides_it(conn, kind):
    cap = None
    if kind == "already_running":
        run = admit(conn, "a")
        assert slot_helpers.claim(conn, run).run
    elif kind == "missing":
        run = "run_" + "0" * 32
    elif kind in ("session_head", "session_behind"):
        head, behind = admit(conn, "a", session_key="s"), admit(conn, "a", session_key="s")
        run = head if kind == "session_head" else behind
    elif kind in ("not_due", "due"):
        run = delayed(conn, "a", time.time() + (3600 if kind == "not_due" else -3600))
    elif kind in ("limited_and_free", "limited_and_full"):
        if kind == "limited_and_full":
            assert slot_helpers.claim(conn, admit(conn, "b", task="t.one_at_a_time")).run
        run = admit(conn, "a", task="t.one_at_a_time")
    elif kind == "unknown_task":
        run = admit(conn, "a", task="t.gone")
    elif kind == "capped_profile":
        assert slot_helpers.claim(conn, admit(conn, "a")).run
        run, cap = admit(conn, "a"), 1
    else:  # refused once for its profile's cap, now claimed by a worker without one
        assert slot_helpers.claim(conn, admit(conn, "a")).run
        run = admit(conn, "a")
        assert slot_helpers.claim(conn, run, cap=1).outcome == "profile_busy"
        assert slot_helpers.waiting(conn, run)
    full, plain = claimed_both_ways(conn, run, cap=cap)
    assert full == plain, kind
    expected = {"already_running": "not_queued", "missing": "missing",
                "session_head": "claimed", "session_behind": "not_session_head",
                "not_due": "not_due", "due": "claimed", "limited_and_free": "claimed",
                "limited_and_full": "task_busy", "unknown_task": "unknown_task",
                "capped_profile": "profile_busy", "was_waiting": "claimed"}[kind]
    assert plain[0] == expected
