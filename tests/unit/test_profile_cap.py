"""The per-profile cap on running runs, at the ledger (RUNSTILE_MAX_RUNNING_PER_PROFILE;
ledger/profile_slots.py), on a real SQLite file with the embedded broker's messages.

The claim refuses a run over its profile's cap and marks it waiting; every transition
that moves a run of that profile out of running or stopping hands the slot to the oldest
waiting run in its own transaction (a dispatch and its broker message); recovery hands
out the slots it finds free.  The same cap with real workers is in
tests/workers/test_profile_cap.py.
"""

from __future__ import annotations

import pytest

from runstile import dispatch
from runstile import tasks as registry
from runstile.config import Settings
from runstile.ledger import admission, approvals, db, execution, keys, profile_slots, recovery
from runstile.ledger.execution import Owner
from runstile.ledger.keys import Principal
from runstile.recovery import reconcile

registry.load(("tests.workers.exec_tasks",))

ENQUEUE = dispatch.Dispatcher(Settings()).enqueue
OWNER = Owner("node-a", 1, 4242, 1)


@pytest.fixture
def conn(ledger):
    c = ledger.connect()
    yield c
    c.close()


def admit(conn, profile: str, *, session_key: str | None = None) -> str:
    key_id = conn.execute("SELECT id FROM api_keys WHERE profile_id = ?", (profile,)).fetchone()
    key_id = key_id[0] if key_id else keys.create(conn, profile)[0]
    request = admission.AdmissionRequest(
        principal=Principal(profile, key_id, "client"), key=None, key_is_derived=False,
        run_id=None, task="t.hold", input_json="{}", session_key=session_key, trigger_id=None,
        metadata_json=None, callback_url=None, fingerprint="f" * 64, fingerprint_version=1)
    return admission.admit(conn, request, refusal=None, max_active_runs=100,
                      enqueue=ENQUEUE).run["id"]


def claim(conn, run_id: str, cap: int | None = 1, thread: int = 1) -> execution.Claim:
    owner = Owner(OWNER.node, OWNER.generation, OWNER.pid, thread)
    return execution.claim(conn, run_id, owner, lease_s=60, task_known=lambda t: True,
                           enqueue=ENQUEUE, max_running_per_profile=cap)


def slot_dispatches(conn, run_id: str) -> int:
    return conn.execute("SELECT COUNT(*) FROM dispatches WHERE run_id = ? AND "
                        "reason = 'profile_slot'", (run_id,)).fetchone()[0]


def live_messages(conn, run_id: str) -> int:
    return conn.execute("SELECT COUNT(*) FROM broker_messages WHERE run_id = ? AND "
                        "state = 'ready'", (run_id,)).fetchone()[0]


def waiting(conn, run_id: str) -> bool:
    return conn.execute("SELECT slot_wait_since IS NOT NULL FROM runs WHERE id = ?",
                        (run_id,)).fetchone()[0] == 1


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


def _finish(conn, rid, queued):
    execution.finish(conn, rid, OWNER, status="failed", error_code="task_error",
                     error_message="x", enqueue=ENQUEUE)


def _stop_then_finish(conn, rid, queued):
    execution.stop(conn, rid, enqueue=ENQUEUE)  # running -> stopping keeps the slot
    assert slot_dispatches(conn, queued) == 0
    execution.finish(conn, rid, OWNER, status="completed", result_json="1", enqueue=ENQUEUE)


def _pause(conn, rid, queued):
    execution.pause(conn, rid, OWNER, "nondeterministic_replay", enqueue=ENQUEUE)


def _retry(conn, rid, queued):
    execution.requeue(conn, rid, from_statuses=("running",), reason="retry", owner=OWNER,
                      enqueue=ENQUEUE)


def _approval(conn, rid, queued):
    approvals.request(conn, rid, OWNER, position=1, args_hash="h", details={},
                      enqueue=ENQUEUE)


def _recovery(conn, rid, queued):
    """The owner died: recovery classifies the run (t.hold: on_crash interrupt)."""
    conn.execute("UPDATE runs SET lease_expires_at = 0 WHERE id = ?", (rid,))
    with db.transaction(conn):
        (orphan,) = recovery.orphaned(conn, node_id="node-a", generation=1, limit=10)
        assert recovery.apply_terminal_many(conn, [(orphan, "interrupted", "owner_lost")],
                                            ENQUEUE) == [rid]


def _drain_then_recovery(conn, rid, queued):
    """A drain marks the run and releases its lease; the next pass re-queues it."""
    assert recovery.mark_drained(conn, node="node-a", generation=1, pid=OWNER.pid) == [rid]
    assert slot_dispatches(conn, queued) == 0  # still running: the slot is held
    with db.transaction(conn):
        (orphan,) = recovery.orphaned(conn, node_id="node-a", generation=1, limit=10)
        assert recovery.apply(conn, orphan, "requeued", "drained", ENQUEUE)


@pytest.mark.parametrize("leave", [_finish, _stop_then_finish, _pause, _retry, _approval,
                                   _recovery, _drain_then_recovery],
                         ids=lambda f: f.__name__.strip("_"))
def test_every_way_out_of_running_hands_the_slot_to_the_waiting_run(conn, leave):
    holder, queued = admit(conn, "a"), admit(conn, "a")
    assert claim(conn, holder).outcome == "claimed"
    assert claim(conn, queued).outcome == "profile_busy"
    leave(conn, holder, queued)
    assert slot_dispatches(conn, queued) == 1 and not waiting(conn, queued)
    if leave is not _retry and leave is not _drain_then_recovery:
        assert claim(conn, queued).outcome == "claimed"


def test_a_freed_slot_skips_a_waiting_run_whose_session_is_busy_now(conn):
    holder = admit(conn, "a")
    head, other = admit(conn, "a", session_key="s"), admit(conn, "a")
    assert claim(conn, holder).outcome == "claimed"
    assert claim(conn, head).outcome == "profile_busy"  # its session's turn, over the cap
    assert claim(conn, other).outcome == "profile_busy"
    # Meanwhile its session got a holder (by hand here: a resumed run overtaking it and
    # parking on an approval would do the same), so the head could not go now.
    blocker = admit(conn, "a", session_key="s")
    conn.execute("UPDATE runs SET status = 'waiting_for_approval' WHERE id = ?", (blocker,))
    execution.finish(conn, holder, OWNER, status="completed", result_json="1",
                     enqueue=ENQUEUE)
    assert slot_dispatches(conn, head) == 0 and waiting(conn, head)
    assert slot_dispatches(conn, other) == 1


def settings_for(ledger, cap: int | None, **changes) -> Settings:
    return Settings(data_dir=ledger.data_dir, node_id="node-a", max_running_per_profile=cap,
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
    plan = " ".join(r[3] for r in conn.execute(
        "EXPLAIN QUERY PLAN SELECT COUNT(*) FROM runs WHERE profile_id = ? AND status IN "
        f"{profile_slots.HOLDING}", ("a",)))
    assert "runs_running_by_profile" in plan
