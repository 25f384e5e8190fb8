"""Units handed over without waiting (ledger/group_commit.py, ``hand_over``): committed like
any other unit, in the order they were handed over, and their follow-up is told on the
committer thread only after the COMMIT, or of the failure.  A worker thread hands over
its run's finish this way (workers/actors.py).  On each engine, with real connections."""

from __future__ import annotations

import threading

import pytest

from runstile.ledger import db, group_commit
from runstile.workers.lease import Executions
from tests.unit.commit_helpers import (
    WriteLockHolder,
    counting_transactions,
    handed_rows,
    insert,
)

#: Seconds any wait of these tests may take before it counts as a hang.
WAIT_S = 10


class FollowUps:
    """What each follow-up was told, and what another connection saw at that moment."""

    def __init__(self, target) -> None:
        self.target = target
        self.told: list[tuple[object, BaseException | None, list[int]]] = []
        self.threads: list[str] = []
        self.done = threading.Event()

    def then(self, unit: group_commit.Unit) -> None:
        self.told.append((unit.result, unit.error, handed_rows(self.target)))
        self.threads.append(threading.current_thread().name)
        self.done.set()


def test_a_unit_handed_over_commits_and_its_follow_up_is_told_after_the_commit(handed_ledger):
    target, _ = handed_ledger
    committer = group_commit.GroupCommitter(lambda: db.connect(target))
    follow = FollowUps(target)
    committer.hand_over(insert(7), then=follow.then)
    assert follow.done.wait(WAIT_S)
    # Told its result, on the committer thread, once another connection sees the row.
    assert follow.told == [(7, None, [7])]
    assert follow.threads == ["runstile-group-commit"]


def test_a_handed_over_unit_that_fails_is_told_its_error_and_writes_nothing(handed_ledger):
    target, _ = handed_ledger
    committer = group_commit.GroupCommitter(lambda: db.connect(target))
    follow = FollowUps(target)

    def broken(conn):
        conn.execute("INSERT INTO handed (n) VALUES (1)")
        raise ValueError("a bug after writing")

    committer.hand_over(broken, then=follow.then)
    assert follow.done.wait(WAIT_S)
    [(result, error, seen)] = follow.told
    assert result is None and isinstance(error, ValueError) and seen == []
    # The committer goes on.
    assert committer.run(insert(2)) == 2
    assert handed_rows(target) == [2]


def test_a_follow_up_that_raises_does_not_stop_the_committer(handed_ledger, caplog):
    target, _ = handed_ledger
    committer = group_commit.GroupCommitter(lambda: db.connect(target))

    def then(unit):
        raise RuntimeError("a broken follow-up")

    committer.hand_over(insert(1), then=then)
    assert committer.run(insert(2)) == 2
    assert handed_rows(target) == [1, 2]
    assert "a committed unit's follow-up failed" in caplog.text


def test_a_unit_handed_over_and_a_later_one_waited_for_share_one_commit_in_order(handed_ledger):
    """A finish handed over, then the same thread's next claim, waited for: while another
    writer holds the lock both queue up, then commit in one transaction, the finish first;
    the follow-up of the first is told before the second's waiter wakes."""
    target, _ = handed_ledger
    begun: list[int] = []
    committer = group_commit.GroupCommitter(
        counting_transactions(lambda: db.connect(target), begun))
    committer.run(insert(0))  # the committer's thread and connection exist
    begun.clear()
    order: list[str] = []
    finish_told = threading.Event()

    def then(unit):
        order.append(f"told {unit.result}")
        finish_told.set()

    def claim(conn):
        order.append(f"claim sees {[r[0] for r in conn.execute('SELECT n FROM handed')]}")
        conn.execute("INSERT INTO handed (n) VALUES (2)")
        return 2

    with WriteLockHolder(target):
        committer.hand_over(insert(1), then=then)
        waiter = threading.Thread(target=lambda: order.append(f"claimed {committer.run(claim)}"))
        waiter.start()
        # Both are with the committer (the first waits for the lock); nothing settled.
        assert not finish_told.wait(0.3)
    waiter.join(WAIT_S)
    assert order == ["claim sees [0, 1]", "told 1", "claimed 2"]
    assert handed_rows(target) == [0, 1, 2]
    assert len(begun) == 1, f"{len(begun)} write transactions for the two units"


def test_a_drain_waits_for_the_outcomes_of_ended_bodies_not_for_running_ones():
    """workers/lease.py: what ``drain`` waits for before the process exits."""
    executions = Executions()
    executions.outcome_owed()          # a run whose body still runs
    running = executions.begin("run_a", None, None)  # type: ignore[arg-type]
    assert executions.wait_for_outcomes(0)
    executions.outcome_owed()          # a second run: its body ended, its finish is queued
    ended = executions.begin("run_b", None, None)  # type: ignore[arg-type]
    executions.end(ended)
    assert not executions.wait_for_outcomes(0.05)
    settle = threading.Timer(0.1, executions.outcome_settled)
    settle.start()
    assert executions.wait_for_outcomes(WAIT_S)
    settle.join()
    executions.end(running)            # the first body ends too: its outcome is owed now
    assert not executions.wait_for_outcomes(0)
    executions.outcome_settled()
    assert executions.wait_for_outcomes(0)


@pytest.mark.parametrize("units", [1, 20])
def test_every_unit_handed_over_is_told_exactly_once(handed_ledger, units):
    target, _ = handed_ledger
    committer = group_commit.GroupCommitter(lambda: db.connect(target))
    told: list[int] = []
    all_told = threading.Event()

    def then(unit):
        told.append(unit.result)
        if len(told) == units:
            all_told.set()

    for n in range(units):
        committer.hand_over(insert(n), then=then)
    assert all_told.wait(WAIT_S)
    assert committer.run(insert(units)) == units  # after every one of them
    assert told == list(range(units))
    assert handed_rows(target) == list(range(units + 1))
