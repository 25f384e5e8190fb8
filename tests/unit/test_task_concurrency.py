"""Per-task concurrency at the ledger (``@runstile.task(name, concurrency=N)``; ledger/slots.py),
on a real SQLite file with the embedded broker's messages.

The claim refuses a run over its task's concurrency and marks it waiting; every transition
that moves a run of that task out of running or stopping hands the slot to the oldest
waiting run whose session may go and whose profile's cap allows it, in its own
transaction; recovery hands out the slots it finds free.  The tasks are
tests/workers/exec_tasks.py's ``t.one_at_a_time`` (concurrency=1) and ``t.two_at_a_time``
(concurrency=2); the claims learn that from the registry, as a worker's do.  What the limit
shares with the per-profile cap (every way out of running hands the slot on in that
transaction, a busy session) is tested for both in tests/unit/test_slots.py; the same limit
with real workers is in tests/workers/test_task_concurrency.py.
"""

from __future__ import annotations

import pytest

from runstile.config import Settings
from runstile.ledger import execution, slots
from runstile.recovery import reconcile
from tests import postgres
from tests.unit.slot_helpers import (
    ENQUEUE,
    OWNER,
    admit,
    claim,
    handed,
    live_messages,
    status,
    waiting,
)

ONE = "t.one_at_a_time"


@pytest.fixture
def ledger(dual_ledger):
    """Every test here runs on both engines (tests/postgres.py)."""
    return dual_ledger


def task_slots(conn, run_id: str) -> int:
    return handed(conn, run_id, "task_slot")


def finish(conn, run_id: str) -> None:
    assert execution.finish(conn, run_id, OWNER, status="completed", result_json="1",
                            enqueue=ENQUEUE) is not None


def test_a_second_run_of_a_concurrency_1_task_is_refused_and_waits_while_other_tasks_go(
        conn):
    first, second = admit(conn, "a", task=ONE), admit(conn, "a", task=ONE)
    elsewhere, other_task = admit(conn, "b", task=ONE), admit(conn, "a")
    assert claim(conn, first).outcome == "claimed"
    for rid in (second, elsewhere):  # the limit holds across profiles
        refused = claim(conn, rid, thread=2)
        assert (refused.outcome, refused.run) == ("task_busy", None)
        assert status(conn, rid) == "queued"
        assert waiting(conn, rid, "task_wait_since") and not waiting(conn, rid)
    assert conn.execute("SELECT wait_task_limit FROM runs WHERE id = ?",
                        (second,)).fetchone()[0] == 1
    assert claim(conn, other_task, thread=3).outcome == "claimed"  # another task goes
    # A duplicate message of the waiting run changes nothing; a worker whose registry
    # has no limit for the task lets it through (the claiming worker's registry decides).
    assert claim(conn, second, thread=4).outcome == "task_busy"
    assert claim(conn, second, thread=4, task_limit=lambda t: None).outcome == "claimed"
    assert not waiting(conn, second, "task_wait_since")


def test_a_freed_task_slot_goes_to_the_oldest_waiting_run_and_keeps_each_sessions_order(
        conn):
    holder = admit(conn, "a", task=ONE)
    head, loose = admit(conn, "a", task=ONE, session_key="s"), admit(conn, "a", task=ONE)
    behind = admit(conn, "a", task=ONE, session_key="s")
    assert claim(conn, holder).outcome == "claimed"
    assert claim(conn, head).outcome == "task_busy"
    assert claim(conn, loose).outcome == "task_busy"
    # Behind its session's head: refused for that, not marked (the session hands it on).
    assert claim(conn, behind).outcome == "not_session_head"
    assert not waiting(conn, behind, "task_wait_since")
    finish(conn, holder)
    assert (task_slots(conn, head), task_slots(conn, loose), handed(conn, behind)) == (1, 0, 0)
    assert claim(conn, head).outcome == "claimed"
    # Its finish hands its session on to `behind` and the task's slot to `loose`, the
    # older of the two; the one whose claim comes second waits again.
    finish(conn, head)
    assert task_slots(conn, loose) == 1 and waiting(conn, behind) is False
    assert claim(conn, loose).outcome == "claimed"
    assert claim(conn, behind).outcome == "task_busy"
    finish(conn, loose)
    assert task_slots(conn, behind) == 1 and claim(conn, behind).outcome == "claimed"


def test_a_run_over_its_profiles_cap_and_its_tasks_limit_goes_only_when_both_have_room(conn):
    """Cap 1 per profile and concurrency 1: a run may wait for both at once."""
    busy_profile, busy_task = admit(conn, "a"), admit(conn, "b", task=ONE)
    both, same_profile = admit(conn, "a", task=ONE), admit(conn, "b", task=ONE)
    task_only = admit(conn, "c", task=ONE)
    assert claim(conn, busy_profile, cap=1).outcome == "claimed"
    assert claim(conn, busy_task, cap=1).outcome == "claimed"
    assert claim(conn, both, cap=1).outcome == "profile_busy"
    assert waiting(conn, both) and waiting(conn, both, "task_wait_since")
    assert claim(conn, same_profile, cap=1).outcome == "profile_busy"
    assert claim(conn, task_only, cap=1).outcome == "task_busy"
    assert waiting(conn, task_only, "task_wait_since") and not waiting(conn, task_only)
    # The task's slot frees, and profile b's: `both` is older but profile a is still full,
    # so the slot goes to `same_profile`, the oldest run that may go (it takes b's slot too).
    finish(conn, busy_task)
    assert handed(conn, both) == 0 and handed(conn, task_only) == 0
    assert handed(conn, same_profile) == 1
    assert waiting(conn, both) and waiting(conn, both, "task_wait_since")
    assert claim(conn, same_profile, cap=1).outcome == "claimed"
    # Profile a's slot frees, but the task's is taken: `both` still waits.
    finish(conn, busy_profile)
    assert handed(conn, both) == 0 and waiting(conn, both, "task_wait_since")
    # Now the last of its two slots frees: it goes, before the younger `task_only`.
    finish(conn, same_profile)
    assert (handed(conn, both), handed(conn, task_only)) == (1, 0)
    assert claim(conn, both, cap=1).outcome == "claimed"
    assert claim(conn, task_only, cap=1).outcome == "task_busy"


def test_a_claim_that_lost_its_profile_slot_passes_the_task_slot_it_was_handed_on(conn):
    holder, first, second = (admit(conn, profile, task=ONE) for profile in ("a", "b", "c"))
    assert claim(conn, holder, cap=1).outcome == "claimed"
    assert claim(conn, first, cap=1, thread=2).outcome == "task_busy"
    assert claim(conn, second, cap=1, thread=3).outcome == "task_busy"
    finish(conn, holder)
    assert task_slots(conn, first) == 1 and task_slots(conn, second) == 0
    # Before its claim, a new run of its profile takes profile b's only slot.
    quicker = admit(conn, "b")
    assert claim(conn, quicker, cap=1, thread=4).outcome == "claimed"
    conn.execute("DELETE FROM broker_messages")
    assert claim(conn, first, cap=1, thread=2).outcome == "profile_busy"
    # The task's slot it did not take goes on, in that claim's transaction.
    assert task_slots(conn, second) == 1 and live_messages(conn, second) == 1
    assert claim(conn, second, cap=1, thread=3).outcome == "claimed"
    assert waiting(conn, first) and not waiting(conn, first, "task_wait_since")


def settings_for(ledger) -> Settings:
    return Settings(data_dir=ledger.data_dir, database_url=ledger.url, node_id="node-a")


def test_recovery_hands_the_slots_of_a_raised_limit_to_the_oldest_waiting_runs(ledger, conn):
    """Claimed by workers whose registry said concurrency=1 for t.two_at_a_time; recovery
    (a restart with the new code) has concurrency=2."""
    holder, first, second = (admit(conn, "a", task="t.two_at_a_time") for _ in range(3))
    said_one = {"task_limit": lambda t: 1}
    assert claim(conn, holder, **said_one).outcome == "claimed"
    assert claim(conn, first, thread=2, **said_one).outcome == "task_busy"
    assert claim(conn, second, thread=3, **said_one).outcome == "task_busy"
    # Long idle, no message: not for the "stranded queued" sweep, for the slot hand-out.
    conn.execute("DELETE FROM broker_messages")
    conn.execute("UPDATE runs SET updated_at = updated_at - 3600 WHERE status = 'queued'")
    report = reconcile.run_pass(settings_for(ledger), generation=1, trigger="command")
    assert report.counts["republished"] == 0 and report.counts["slot_waiters"] == 1
    assert (task_slots(conn, first), live_messages(conn, first)) == (1, 1)
    assert waiting(conn, second, "task_wait_since") and live_messages(conn, second) == 0
    # Its claim (by a worker of the new code) takes the second slot; nothing more is free,
    # so the next pass hands nothing out.
    assert claim(conn, first, thread=2).outcome == "claimed"
    report = reconcile.run_pass(settings_for(ledger), generation=1, trigger="command")
    assert report.counts["slot_waiters"] == 0 and task_slots(conn, second) == 0


def test_the_claim_counts_a_tasks_running_runs_and_finds_its_waiting_runs_by_index(conn):
    postgres.sqlite_only(conn, "it reads EXPLAIN QUERY PLAN; PostgreSQL plans from table "
                                "statistics, a sequential scan on a table this small")
    def plan(sql: str) -> str:
        return " ".join(r[3] for r in conn.execute(f"EXPLAIN QUERY PLAN {sql}", (ONE,)))
    assert "runs_running_by_task" in plan(
        f"SELECT COUNT(*) FROM runs WHERE task = ? AND status IN {slots.HOLDING}")
    assert "runs_waiting_for_task" in plan(
        "SELECT * FROM runs r WHERE r.task = ? AND r.task_wait_since IS NOT NULL AND "
        "r.status = 'queued' ORDER BY r.seq LIMIT 1")
