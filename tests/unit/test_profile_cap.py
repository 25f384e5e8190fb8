"""The per-profile cap on running runs, at the ledger (RUNSTILE_MAX_RUNNING_PER_PROFILE;
ledger/slots.py), on a real SQLite file with the embedded broker's messages.

The claim refuses a run over its profile's cap and marks it waiting; every transition
that moves a run of that profile out of running or stopping hands the slot to the oldest
waiting run in its own transaction (a dispatch and its broker message); recovery hands
out the slots it finds free.  What it shares with per-task concurrency (every way out of
running, a busy session) is tested for both in tests/unit/test_slots.py; the same cap with
real workers is in tests/workers/test_profile_cap.py.
"""

from __future__ import annotations

import pytest

from runstile.config import Settings
from runstile.ledger import execution, slots
from runstile.recovery import reconcile
from tests import postgres
from tests.unit import slot_helpers
from tests.unit.slot_helpers import ENQUEUE, OWNER, admit, live_messages


@pytest.fixture
def ledger(dual_ledger):
    """Every test here runs on both engines (tests/postgres.py)."""
    return dual_ledger


def claim(conn, run_id: str, cap: int | None = 1, thread: int = 1) -> execution.Claim:
    return slot_helpers.claim(conn, run_id, cap=cap, thread=thread)


def slot_dispatches(conn, run_id: str) -> int:
    return slot_helpers.handed(conn, run_id, "profile_slot")


def waiting(conn, run_id: str) -> bool:
    return slot_helpers.waiting(conn, run_id, "slot_wait_since")


def test_a_claim_over_the_profile_cap_waits_and_the_finish_that_frees_the_slot_dispatches_it(
        conn):
    first, second, third = admit(conn, "a"), admit(conn, "a"), admit(conn, "a")
    other = admit(conn, "b")
    assert claim(conn, first).outcome == "claimed"
    for rid in (second, third):
        refused = claim(conn, rid)
        assert (refused.outcome, refused.run) == ("profile_busy", None)
        assert waiting(conn, rid)
    assert conn.execute("SELECT status FROM runs WHERE id = ?", (second,)).fetchone()[0] == \
        "queued"
    assert claim(conn, other, thread=2).outcome == "claimed"  # another tenant is not held
    # The message the refusals consumed is gone (the test inserts none); the finish hands
    # the slot to the oldest waiting run only, in its own transaction.
    conn.execute("DELETE FROM broker_messages")
    assert execution.finish(conn, first, OWNER, status="completed", result_json="1",
                            enqueue=ENQUEUE) is not None
    assert (slot_dispatches(conn, second), live_messages(conn, second)) == (1, 1)
    assert (slot_dispatches(conn, third), live_messages(conn, third)) == (0, 0)
    assert not waiting(conn, second) and waiting(conn, third)
    assert claim(conn, second).outcome == "claimed"
    assert claim(conn, third).outcome == "profile_busy"
    # Without a cap nothing is refused or marked.
    assert claim(conn, third, cap=None, thread=3).outcome == "claimed"


def settings_for(ledger, cap: int | None, **changes) -> Settings:
    return Settings(data_dir=ledger.data_dir, database_url=ledger.url, node_id="node-a",
                    max_running_per_profile=cap,
                    **changes)


def test_recovery_hands_out_free_slots_to_waiting_runs_and_leaves_held_ones_alone(ledger,
                                                                                  conn):
    holder, first, second = admit(conn, "a"), admit(conn, "a"), admit(conn, "a")
    assert claim(conn, holder, thread=1).outcome == "claimed"
    assert claim(conn, first).outcome == "profile_busy"
    assert claim(conn, second).outcome == "profile_busy"
    # Long idle, no message: the embedded broker's "stranded queued" sweep would re-publish
    # them every pass; a run waiting for a slot is left to the slot hand-over instead.
    conn.execute("DELETE FROM broker_messages")
    conn.execute("UPDATE runs SET updated_at = updated_at - 3600 WHERE status = 'queued'")
    report = reconcile.run_pass(settings_for(ledger, 1), generation=1, trigger="command")
    assert report.counts["republished"] == 0 and report.counts["slot_waiters"] == 0
    assert waiting(conn, first) and waiting(conn, second)
    # Restarted with a cap of 2: one slot is free, and the oldest waiting run gets it.
    report = reconcile.run_pass(settings_for(ledger, 2), generation=1, trigger="command")
    assert report.counts["slot_waiters"] == 1
    assert (slot_dispatches(conn, first), live_messages(conn, first)) == (1, 1)
    assert waiting(conn, second)
    # Restarted without a cap: every waiting run goes.
    report = reconcile.run_pass(settings_for(ledger, None), generation=1, trigger="command")
    assert report.counts["slot_waiters"] == 1 and live_messages(conn, second) == 1


def test_the_claim_counts_a_profiles_running_runs_from_its_own_index(conn):
    postgres.sqlite_only(conn, "it reads EXPLAIN QUERY PLAN; PostgreSQL plans from table "
                                "statistics, a sequential scan on a table this small")
    plan = " ".join(r[3] for r in conn.execute(
        "EXPLAIN QUERY PLAN SELECT COUNT(*) FROM runs WHERE profile_id = ? AND status IN "
        f"{slots.HOLDING}", ("a",)))
    assert "runs_running_by_profile" in plan
