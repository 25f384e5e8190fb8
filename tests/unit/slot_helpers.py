"""What the ledger-level tests of slots share (ledger/slots.py: tests/unit/test_profile_cap.py
and tests/unit/test_task_concurrency.py): runs admitted and claimed on a real SQLite file
with the embedded broker's messages, what a hand-over wrote, and every way a running run
leaves its slots."""

from __future__ import annotations

from dataclasses import dataclass

from runstile import dispatch
from runstile import tasks as registry
from runstile.config import Settings
from runstile.ledger import admission, approvals, db, execution, keys, recovery
from runstile.ledger.execution import Owner
from runstile.ledger.keys import Principal

registry.load(("tests.workers.exec_tasks",))

ENQUEUE = dispatch.Dispatcher(Settings()).enqueue
OWNER = Owner("node-a", 1, 4242, 1)


def admit(conn, profile: str, *, task: str = "t.hold", session_key: str | None = None) -> str:
    key_id = conn.execute("SELECT id FROM api_keys WHERE profile_id = ?", (profile,)).fetchone()
    key_id = key_id[0] if key_id else keys.create(conn, profile)[0]
    request = admission.AdmissionRequest(
        principal=Principal(profile, key_id, "client"), key=None, key_is_derived=False,
        run_id=None, task=task, input_json="{}", session_key=session_key, trigger_id=None,
        metadata_json=None, callback_url=None, fingerprint="f" * 64, fingerprint_version=1)
    return admission.admit(conn, request, refusal=None, max_active_runs=100,
                           enqueue=ENQUEUE).run["id"]


def claim(conn, run_id: str, *, cap: int | None = None, thread: int = 1,
          task_limit=registry.concurrency_of) -> execution.Claim:
    """The claim as a worker makes it: the cap its setting, each task's concurrency what
    its registry says (unless ``task_limit`` says otherwise)."""
    owner = Owner(OWNER.node, OWNER.generation, OWNER.pid, thread)
    return execution.claim(conn, run_id, owner, lease_s=60, task_known=lambda t: True,
                           enqueue=ENQUEUE, max_running_per_profile=cap, task_limit=task_limit)


def handed(conn, run_id: str, reason: str | None = None) -> int:
    """Dispatches that handed ``run_id`` a freed slot (of ``reason``'s kind, or either)."""
    reasons = (reason,) if reason else ("profile_slot", "task_slot")
    return conn.execute(f"SELECT COUNT(*) FROM dispatches WHERE run_id = ? AND reason IN "
                        f"({', '.join('?' for _ in reasons)})", (run_id, *reasons)).fetchone()[0]


def live_messages(conn, run_id: str) -> int:
    return conn.execute("SELECT COUNT(*) FROM broker_messages WHERE run_id = ? AND "
                        "state = 'ready'", (run_id,)).fetchone()[0]


def waiting(conn, run_id: str, mark: str = "slot_wait_since") -> bool:
    """Marked as waiting for a slot: of its profile (slot_wait_since) or its task
    (task_wait_since)."""
    return conn.execute(f"SELECT {mark} IS NOT NULL FROM runs WHERE id = ?",
                        (run_id,)).fetchone()[0] == 1


def status(conn, run_id: str) -> str:
    return conn.execute("SELECT status FROM runs WHERE id = ?", (run_id,)).fetchone()[0]


# Every way a running run leaves its slots: leave(conn, holder, waiter).  ``waiter`` is a
# run waiting for one of the holder's slots (checked where the holder keeps its slot).

def _finish(conn, rid, waiter):
    execution.finish(conn, rid, OWNER, status="failed", error_code="task_error",
                     error_message="x", enqueue=ENQUEUE)


def _stop_then_finish(conn, rid, waiter):
    execution.stop(conn, rid, enqueue=ENQUEUE)  # running -> stopping keeps the slot
    assert handed(conn, waiter) == 0
    execution.finish(conn, rid, OWNER, status="completed", result_json="1", enqueue=ENQUEUE)


def _pause(conn, rid, waiter):
    execution.pause(conn, rid, OWNER, "nondeterministic_replay", enqueue=ENQUEUE)


def _retry(conn, rid, waiter):
    """A raising body with retries left: re-queued by its owner (docs/tasks.md)."""
    execution.requeue(conn, rid, from_statuses=("running",), reason="retry", owner=OWNER,
                      enqueue=ENQUEUE)


def _approval(conn, rid, waiter):
    approvals.request(conn, rid, OWNER, position=1, args_hash="h", details={},
                      enqueue=ENQUEUE)


def _recovery(conn, rid, waiter):
    """The owner died: recovery classifies the run (on_crash interrupt)."""
    conn.execute("UPDATE runs SET lease_expires_at = 0 WHERE id = ?", (rid,))
    with db.transaction(conn):
        (orphan,) = recovery.orphaned(conn, node_id="node-a", generation=1, limit=10)
        assert recovery.apply_terminal_many(conn, [(orphan, "interrupted", "owner_lost")],
                                            ENQUEUE) == [rid]


def _drain_then_recovery(conn, rid, waiter):
    """A drain marks the run and releases its lease; the next pass re-queues it."""
    assert recovery.mark_drained(conn, node="node-a", generation=1, pid=OWNER.pid) == [rid]
    assert handed(conn, waiter) == 0  # still running: the slot is held
    with db.transaction(conn):
        (orphan,) = recovery.orphaned(conn, node_id="node-a", generation=1, limit=10)
        assert recovery.apply(conn, orphan, "requeued", "drained", ENQUEUE)


LEAVES = [_finish, _stop_then_finish, _pause, _retry, _approval, _recovery,
          _drain_then_recovery]
#: Those after which the holder is queued again (and competes for its slot like any run).
REQUEUED = (_retry, _drain_then_recovery)


def leave_id(leave) -> str:
    return leave.__name__.strip("_")


@dataclass(frozen=True)
class Limit:
    """One kind of limit as a test sets it up (a task to admit, a cap to claim with), and
    what the ledger answers and writes for it (ledger/slots.py, ``Kind``)."""

    name: str
    task: str
    cap: int | None
    #: The profile of a second run that meets the limit (the task's holds across profiles).
    other_profile: str
    refusal: str
    mark: str
    reason: str


PROFILE_CAP = Limit("profile_cap", "t.hold", 1, "a", "profile_busy", "slot_wait_since",
                    "profile_slot")
TASK_CONCURRENCY = Limit("task_concurrency", "t.one_at_a_time", None, "b", "task_busy",
                         "task_wait_since", "task_slot")
LIMITS = [PROFILE_CAP, TASK_CONCURRENCY]
