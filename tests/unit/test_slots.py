"""What the per-profile cap and per-task concurrency share at the ledger (ledger/slots.py:
one mechanism for both kinds of slot), each test run for both, on a real SQLite file with
the embedded broker's messages.  What is particular to each is in
tests/unit/test_profile_cap.py and tests/unit/test_task_concurrency.py.
"""

from __future__ import annotations

import re

import pytest

from runstile.ledger import execution, slots
from runstile.ledger.runs import SLOT_MARKS
from tests.unit.slot_helpers import (
    ENQUEUE,
    LEAVES,
    LIMITS,
    OWNER,
    REQUEUED,
    admit,
    claim,
    handed,
    leave_id,
    live_messages,
    waiting,
)


@pytest.fixture
def ledger(dual_ledger):
    """Every test here runs on both engines (tests/postgres.py)."""
    return dual_ledger


def transactions(statements: list[str]) -> list[str]:
    """The write transactions a connection's trace shows, each as its statements' text."""
    found, current = [], None
    for sql in statements:
        if sql.startswith("BEGIN"):  # IMMEDIATE on SQLite
            current = []
        elif sql.startswith(("COMMIT", "ROLLBACK")) and current is not None:
            found.append("\n".join(current))
            current = None
        elif current is not None:
            current.append(sql)
    return found


@pytest.mark.parametrize("limit", LIMITS, ids=lambda limit: limit.name)
@pytest.mark.parametrize("leave", LEAVES, ids=leave_id)
def test_every_way_out_of_running_hands_the_slot_to_the_waiter_in_that_same_transaction(
        conn, limit, leave):
    holder = admit(conn, "a", task=limit.task)
    waiter = admit(conn, limit.other_profile, task=limit.task)
    assert claim(conn, holder, cap=limit.cap).outcome == "claimed"
    refused = claim(conn, waiter, cap=limit.cap, thread=2)
    assert (refused.outcome, refused.run) == (limit.refusal, None)
    assert waiting(conn, waiter, limit.mark)
    conn.execute("DELETE FROM broker_messages")  # the refusal consumed its message
    statements: list[str] = []
    conn.set_trace_callback(statements.append)
    leave(conn, holder, waiter)
    conn.set_trace_callback(None)
    assert handed(conn, waiter, limit.reason) == 1 and live_messages(conn, waiter) == 1
    assert not waiting(conn, waiter, limit.mark)
    # The transaction that moved the holder out of running/stopping is the one that wrote
    # the waiter's dispatch and its broker message.
    moved = re.compile(rf"UPDATE runs SET .*'{holder}'", re.S)
    freeing = [t for t in transactions(statements) if moved.search(t)]
    assert freeing and "INSERT INTO dispatches (run_id, attempt, reason, created_at, " \
        f"sent_at) VALUES ('{waiter}'" in freeing[-1], freeing
    assert "INSERT INTO broker_messages" in freeing[-1]
    if leave not in REQUEUED:
        assert claim(conn, waiter, cap=limit.cap, thread=2).outcome == "claimed"


@pytest.mark.parametrize("limit", LIMITS, ids=lambda limit: limit.name)
def test_a_freed_slot_passes_over_a_waiting_run_whose_session_is_busy_now(conn, limit):
    holder = admit(conn, "a", task=limit.task)
    head = admit(conn, "a", task=limit.task, session_key="s")
    other = admit(conn, "a", task=limit.task)
    assert claim(conn, holder, cap=limit.cap).outcome == "claimed"
    # Its session's turn, over the limit.
    assert claim(conn, head, cap=limit.cap).outcome == limit.refusal
    assert claim(conn, other, cap=limit.cap).outcome == limit.refusal
    # Meanwhile its session got a holder (by hand here: a resumed run overtaking it and
    # parking on an approval would do the same), so the head could not go now.
    blocker = admit(conn, "a", session_key="s")
    conn.execute("UPDATE runs SET status = 'waiting_for_approval' WHERE id = ?", (blocker,))
    execution.finish(conn, holder, OWNER, status="completed", result_json="1",
                     enqueue=ENQUEUE)
    assert handed(conn, head) == 0 and waiting(conn, head, limit.mark)
    assert handed(conn, other, limit.reason) == 1


def test_the_marks_every_dispatch_and_claim_clear_are_those_of_every_kind_of_slot():
    assert tuple(kind.mark for kind in slots.KINDS) == SLOT_MARKS
    assert {limit.mark for limit in LIMITS} == set(SLOT_MARKS)
    assert {limit.reason for limit in LIMITS} == {kind.reason for kind in slots.KINDS}
