"""A Hypothesis state machine over the ledger's own functions (issue #7).

Admissions (keys, client run ids, sessions, callbacks, capacity), claims by owners of several
generations and nodes, heartbeats, outcomes, stops, pauses, retries, /resume, approval
requests and decisions, journaled steps, drains, leases that lapse (moved into the past in
SQL, to simulate time), node boots and recovery passes (``reconcile.run_pass``), in any
order, on a real SQLite file.  Each call's answer is checked against the rule the docs
give for the ledger as it stood just before (docs/api.md, "Reservation" and the sections
of the stop, approval and resume routes; docs/architecture.md, "Run lifecycle"); after
every step the invariants hold:

- a terminal run never changes;
- every run's events are a path through the lifecycle of docs/architecture.md, "Run
  lifecycle" (``states.TRANSITIONS``)
  ending in its status, with at most one terminal event, the last of its run events, and
  ``attempt`` = 1 + the re-queues and resumes;
- at most one running, stopping or waiting run per session;
- at most MAX_RUNNING_PER_PROFILE running or stopping runs per profile, at most a task's
  concurrency per task, and a run is marked as waiting for a slot only while it is queued
  (or after it ended);
- a run is running or stopping only with a whole owner and a lease, and holds a lease
  only then;
- ``profiles.active_runs`` is the count of non-terminal runs;
- each (scope, idempotency key) names one run, for ever;
- each entry into ``queued`` wrote one dispatch record, born sent with its message, and
  each event that owes a callback (docs/api.md, "Deliveries (webhooks)") is one obligation;
- ``runstile db check`` finds nothing wrong.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from runstile import dispatch
from runstile import tasks as registry
from runstile.config import Settings
from runstile.errors import (
    ApprovalAlreadyResolved,
    ApprovalNotPending,
    CapacityExceeded,
    IdempotencyKeyConflict,
    LeaseLost,
    RunIdConflict,
    RunStopping,
)
from runstile.ledger import (
    admission,
    approvals,
    db,
    execution,
    journal,
    keys,
    maintenance,
    migrations,
    nodes,
)
from runstile.ledger import recovery as ledger_recovery
from runstile.ledger.execution import Owner
from runstile.ledger.keys import Principal
from runstile.ledger.states import NON_TERMINAL, TERMINAL, RunStatus, can_transition
from runstile.recovery import reconcile
from tests import postgres

registry.load(("tests.workers.exec_tasks",))

NODE, OTHER_NODE = "node-a", "node-b"
#: Tasks by on_crash policy (interrupt, resume, pause), one with concurrency=1, and one
#: no worker knows.
TASKS = ("t.hold", "t.hold_resume", "t.hold_pause", "t.one_at_a_time", "t.gone")
RUN_IDS = ("run_" + "a" * 32, "run_" + "b" * 32)
#: Per profile: small, so that admissions meet the limit now and then.
MAX_ACTIVE_RUNS = 5
#: Per profile, so that claims meet the cap (RUNSTILE_MAX_RUNNING_PER_PROFILE) now and then.
MAX_RUNNING_PER_PROFILE = 1
LONG_LEASE_S = 3600.0
CALLBACK_URL = "https://hooks.example/runs"
HOLDING = ("running", "stopping", "waiting_for_approval")
#: Events that owe the run's callback_url a delivery (docs/api.md, "Deliveries (webhooks)").
NOTIFYING = ("run.paused", "approval.requested", *(f"run.{s.value}" for s in TERMINAL))
#: Event type -> the status it moves a run to (the events of
#: docs/api.md, "`GET /v1/runs/{run_id}/events` — the event log", on the edges of
#: docs/architecture.md, "Run lifecycle").
EVENT_STATUS = {"run.queued": "queued", "run.started": "running", "run.requeued": "queued",
                "run.resumed": "queued", "approval.resolved": "queued",
                "approval.requested": "waiting_for_approval", "run.stopping": "stopping",
                "run.paused": "paused", **{f"run.{s.value}": s.value for s in TERMINAL}}


def task_known(name: str) -> bool:
    return registry.get(name) is not None


def has_runs(machine: LedgerMachine) -> bool:
    return machine.conn.execute("SELECT 1 FROM runs LIMIT 1").fetchone() is not None


def has_runs_in_flight(machine: LedgerMachine) -> bool:
    return machine.conn.execute("SELECT 1 FROM runs WHERE status IN ('running', 'stopping') "
                                "LIMIT 1").fetchone() is not None


def has_orphans(machine: LedgerMachine) -> bool:
    """Some run in flight whose owner is gone: its lease lapsed, or it is an earlier
    generation of this node.  (Rules without arguments are drawn far more often than the
    others; guarding them keeps the machine busy with runs, not with empty passes.)"""
    return machine.conn.execute(
        "SELECT 1 FROM runs WHERE status IN ('running', 'stopping') AND "
        f"(lease_expires_at <= {db.NOW} OR (owner_node = ? AND owner_generation < ?)) LIMIT 1",
        (NODE, machine.generation)).fetchone() is not None


class LedgerMachine(RuleBasedStateMachine):
    #: A PostgreSQL database to run on instead of a new SQLite file (emptied per example).
    database_url: str | None = None

    def __init__(self) -> None:
        super().__init__()
        self.folder = Path(tempfile.mkdtemp(prefix="ledger-machine-"))
        self.settings = Settings(data_dir=self.folder, node_id=NODE, synchronous="OFF",
                                 max_active_runs=MAX_ACTIVE_RUNS, recovery_budget=2,
                                 max_running_per_profile=MAX_RUNNING_PER_PROFILE,
                                 database_url=self.database_url)
        migrations.migrate(self.settings.ledger_target, synchronous="OFF")
        self.conn = db.connect(self.settings.ledger_target, synchronous="OFF")
        if self.database_url:
            empty_postgresql_ledger(self.conn)
        self.enqueue = dispatch.Dispatcher(self.settings).enqueue
        self.principals = []
        for profile in ("p1", "p1", "p2"):
            key_id, _ = keys.create(self.conn, profile)
            self.principals.append(Principal(profile, key_id, "client"))
        self.generation = nodes.boot(self.conn, NODE)
        self.threads = 0
        self.owner_of: dict[str, Owner] = {}
        self.approvals: dict[str, list[str]] = {}
        self.positions: dict[str, int] = {}
        self.started_steps: dict[str, list[int]] = {}
        self.terminal_rows: dict[str, dict] = {}
        self.bound: dict[tuple, str] = {}

    def teardown(self) -> None:
        self.conn.close()
        shutil.rmtree(self.folder, ignore_errors=True)

    # ------------------------------------------------------------------ reading

    def row(self, run_id: str) -> dict:
        return dict(self.conn.execute("SELECT * FROM runs WHERE id = ?", (run_id,)).fetchone())

    def all_runs(self) -> list[dict]:
        return [dict(r) for r in self.conn.execute("SELECT * FROM runs ORDER BY seq")]

    def now(self) -> float:
        return self.conn.execute(f"SELECT {db.NOW}").fetchone()[0]

    def holds(self, run: dict, owner: Owner) -> bool:
        """``owner`` holds ``run``'s live lease (what every owner's write is fenced on)."""
        return (run["status"] in ("running", "stopping")
                and (run["owner_node"], run["owner_generation"], run["owner_pid"],
                     run["owner_thread"]) == (owner.node, owner.generation, owner.pid,
                                              owner.thread)
                and run["lease_expires_at"] is not None
                and run["lease_expires_at"] > self.now())

    def event_types(self, run_id: str) -> list[str]:
        return [t for (t,) in self.conn.execute(
            "SELECT type FROM events WHERE run_id = ? ORDER BY seq", (run_id,))]

    def may_claim(self, run: dict) -> bool:
        """The session rule (``session_key`` in docs/api.md, "`POST /v1/runs` — admit a run"),
        read independently of sessions.claim_refusal."""
        if run["session_key"] is None:
            return True
        scope = (run["profile_id"], run["key_id"], run["session_key"])
        same = [r for r in self.all_runs()
                if (r["profile_id"], r["key_id"], r["session_key"]) == scope]
        if any(r["status"] in HOLDING for r in same):
            return False
        queued = sorted((r for r in same if r["status"] == "queued"),
                        key=lambda r: (r["recovery_reason"] != "resumed", r["seq"]))
        return queued[0]["id"] == run["id"]

    def pick(self, data, statuses: tuple[str, ...] | None = None,
             among: set[str] | None = None) -> str:
        """A run for the next call: mostly one it applies to (in ``statuses``, or
        ``among``), sometimes any run at all, to see it refused."""
        rows = self.all_runs()
        wanted = [r["id"] for r in rows if (statuses is None or r["status"] in statuses)
                  and (among is None or r["id"] in among)]
        if not wanted or data.draw(st.integers(0, 4), label="any run") == 0:
            wanted = [r["id"] for r in rows]
        return data.draw(st.sampled_from(wanted), label="run")

    def owner(self, run_id: str, holder: bool) -> Owner:
        """The run's recorded holder, or a stranger of this node's current generation."""
        if holder and run_id in self.owner_of:
            return self.owner_of[run_id]
        return Owner(NODE, self.generation, 99, 99)

    # ------------------------------------------------------------------ admission

    @rule(who=st.integers(0, 2), header_key=st.sampled_from([None, "k1", "k2"]),
          run_id=st.sampled_from([None, *RUN_IDS]), task=st.sampled_from(TASKS),
          value=st.integers(0, 1), session=st.sampled_from([None, "s1", "s2"]),
          callback=st.booleans())
    def admit(self, who, header_key, run_id, task, value, session, callback):
        principal = self.principals[who]
        scope = (principal.profile_id, principal.key_id)
        callback_url = CALLBACK_URL if callback else None
        body = {"task": task, "input": value, "run_id": run_id, "session_key": session,
                "callback_url": callback_url}
        fp = hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()
        key, derived = (header_key, False) if header_key else \
            (None, False) if run_id is None else (f"legacy-run:{run_id}", True)
        request = admission.AdmissionRequest(
            principal=principal, key=key, key_is_derived=derived, run_id=run_id, task=task,
            input_json=json.dumps(value), session_key=session, trigger_id=None,
            metadata_json=None, callback_url=callback_url, fingerprint=fp,
            fingerprint_version=1)
        # What the table of docs/api.md, "Reservation" says, read from the ledger as it stands.
        bound = None if key is None else self.conn.execute(
            "SELECT run_id, fingerprint FROM idempotency_keys WHERE profile_id = ? AND "
            "key_id = ? AND idempotency_key = ?", (*scope, key)).fetchone()
        existing = None if run_id is None else self.conn.execute(
            "SELECT * FROM runs WHERE id = ?", (run_id,)).fetchone()
        if bound is not None:
            expected = ("replay", bound[0]) if bound[1] == fp else \
                ("conflict", RunIdConflict if derived else IdempotencyKeyConflict)
        elif existing is not None:
            same = (existing["profile_id"], existing["key_id"]) == scope and \
                existing["fingerprint"] == fp
            expected = ("replay", run_id) if same else ("conflict", RunIdConflict)
        else:
            active = self.conn.execute("SELECT active_runs FROM profiles WHERE id = ?",
                                       (principal.profile_id,)).fetchone()[0]
            expected = ("conflict", CapacityExceeded) if active >= MAX_ACTIVE_RUNS else \
                ("new", run_id)
        count = self.conn.execute("SELECT COUNT(*) FROM runs").fetchone()[0]
        if expected[0] == "conflict":
            with pytest.raises(expected[1]):
                admission.admit(self.conn, request, refusal=None, max_active_runs=MAX_ACTIVE_RUNS,
                           enqueue=self.enqueue)
            assert self.conn.execute("SELECT COUNT(*) FROM runs").fetchone()[0] == count
            return
        admitted = admission.admit(self.conn, request, refusal=None,
                              max_active_runs=MAX_ACTIVE_RUNS, enqueue=self.enqueue)
        rid = admitted.run["id"]
        if expected[0] == "replay":
            assert admitted.replayed and rid == expected[1]
            assert self.conn.execute("SELECT COUNT(*) FROM runs").fetchone()[0] == count
        else:
            assert not admitted.replayed and (expected[1] is None or rid == expected[1])
            assert self.event_types(rid) == ["run.queued"]
            assert (admitted.run["status"], admitted.run["attempt"]) == ("queued", 1)
        if key is not None:
            self.bound.setdefault((*scope, key), rid)

    # ------------------------------------------------------------------ execution

    @precondition(has_runs)
    @rule(data=st.data(), node=st.sampled_from([NODE, NODE, OTHER_NODE]),
          pid=st.integers(1, 2), known=st.sampled_from([True, True, False]))
    def claim(self, data, node, pid, known):
        """A worker that got the run's message (or a duplicate) claims it; ``known`` is
        whether that worker has the run's task."""
        self._claim(self.pick(data, ("queued",)), node, pid, known)

    @precondition(lambda m: m.queued_of_busy_profiles())
    @rule(data=st.data(), pid=st.integers(1, 2))
    def claim_in_a_busy_profile(self, data, pid):
        """A queued run of a profile that already runs something: the cap is met."""
        run = data.draw(st.sampled_from(self.queued_of_busy_profiles()), label="run")
        self._claim(run, NODE, pid, True)

    def queued_of_busy_profiles(self) -> list[str]:
        return [r[0] for r in self.conn.execute(
            "SELECT q.id FROM runs q WHERE q.status = 'queued' AND EXISTS (SELECT 1 FROM "
            "runs r WHERE r.profile_id = q.profile_id AND r.status IN ('running', "
            "'stopping')) ORDER BY q.seq")]

    def _claim(self, run: str, node: str, pid: int, known: bool) -> None:
        before = self.row(run)
        allowed = before["status"] == "queued" and self.may_claim(before)
        holding = [r for r in self.all_runs() if r["status"] in ("running", "stopping")]
        running = sum(1 for r in holding if r["profile_id"] == before["profile_id"])
        limit = registry.concurrency_of(before["task"])
        of_task = sum(1 for r in holding if r["task"] == before["task"])
        self.threads += 1
        owner = Owner(node, self.generation if node == NODE else 1, pid, self.threads)
        outcome = execution.claim(self.conn, run, owner, lease_s=LONG_LEASE_S,
                                  task_known=lambda t: known and task_known(t),
                                  enqueue=self.enqueue, task_limit=registry.concurrency_of,
                                  max_running_per_profile=MAX_RUNNING_PER_PROFILE)
        if before["status"] != "queued":
            assert outcome.outcome == "not_queued" and outcome.run is None
        elif not allowed:
            assert outcome.outcome in ("session_busy", "not_session_head")
        elif not (known and task_known(before["task"])):
            assert outcome.outcome == "unknown_task"
            assert self.row(run)["status"] == "failed"
        elif running >= MAX_RUNNING_PER_PROFILE or (limit is not None and of_task >= limit):
            assert outcome.outcome == ("profile_busy" if running >= MAX_RUNNING_PER_PROFILE
                                       else "task_busy")
            after = self.row(run)
            assert after["status"] == "queued"
            assert (after["slot_wait_since"] is not None) == (running >= MAX_RUNNING_PER_PROFILE)
            assert (after["task_wait_since"] is not None) == (limit is not None
                                                              and of_task >= limit)
        else:
            assert outcome.outcome == "claimed" and outcome.run["status"] == "running"
            self.owner_of[run] = owner
        if outcome.outcome != "claimed":
            assert outcome.run is None

    @precondition(has_runs_in_flight)
    @rule(pid=st.integers(1, 2))
    def heartbeat(self, pid):
        mine = [rid for rid, o in self.owner_of.items()
                if (o.node, o.generation, o.pid) == (NODE, self.generation, pid)]
        expected = {rid for rid in mine if self.holds(self.row(rid), self.owner_of[rid])}
        renewed = execution.heartbeat(self.conn, NODE, self.generation, pid, LONG_LEASE_S, mine)
        assert set(renewed) == expected

    @precondition(has_runs)
    @rule(data=st.data(), holder=st.booleans(), status=st.sampled_from(["completed", "failed"]))
    def finish(self, data, holder, status):
        run = self.pick(data, ("running", "stopping"))
        before, owner = self.row(run), self.owner(run, holder)
        finished = execution.finish(self.conn, run, owner, status=status,
                                    result_json="1" if status == "completed" else None,
                                    error_code=None if status == "completed" else "task_error",
                                    error_message=None if status == "completed" else "boom",
                                    enqueue=self.enqueue)
        if not self.holds(before, owner):
            assert finished is None
        else:
            assert finished["status"] == ("cancelled" if before["status"] == "stopping"
                                          else status)

    @precondition(has_runs)
    @rule(data=st.data())
    def stop(self, data):
        run = self.pick(data)
        before = self.row(run)
        stopped, settled = execution.stop(self.conn, run, enqueue=self.enqueue)
        expected = {"queued": ("cancelled", True), "paused": ("cancelled", True),
                    "waiting_for_approval": ("cancelled", True),
                    "running": ("stopping", False), "stopping": ("stopping", False)}
        assert (stopped["status"], settled) == expected.get(before["status"],
                                                            (before["status"], True))

    @precondition(has_runs)
    @rule(data=st.data(), holder=st.booleans())
    def pause(self, data, holder):
        run = self.pick(data, ("running",))
        before, owner = self.row(run), self.owner(run, holder)
        paused = execution.pause(self.conn, run, owner, "nondeterministic_replay",
                                 enqueue=self.enqueue)
        if self.holds(before, owner) and before["status"] == "running":
            assert paused["status"] == "paused"
        else:
            assert paused is None

    @precondition(has_runs)
    @rule(data=st.data(), holder=st.booleans())
    def retry(self, data, holder):
        """A raising body with retries left: running -> queued, attempt + 1."""
        run = self.pick(data, ("running",))
        before, owner = self.row(run), self.owner(run, holder)
        requeued = execution.requeue(self.conn, run, from_statuses=("running",),
                                     reason="retry", owner=owner, enqueue=self.enqueue)
        if self.holds(before, owner) and before["status"] == "running":
            assert (requeued["status"], requeued["attempt"]) == ("queued",
                                                                 before["attempt"] + 1)
        else:
            assert requeued is None

    @precondition(has_runs)
    @rule(data=st.data())
    def resume(self, data):
        run = self.pick(data, ("paused",))
        before = self.row(run)
        resumed = execution.requeue(self.conn, run, from_statuses=("paused",),
                                    reason="resumed", event_type="run.resumed",
                                    enqueue=self.enqueue)
        if before["status"] == "paused":
            assert (resumed["status"], resumed["attempt"]) == ("queued", before["attempt"] + 1)
        else:
            assert resumed is None

    def next_position(self, run: str) -> int:
        self.positions[run] = self.positions.get(run, 0) + 1
        return self.positions[run]

    @precondition(has_runs)
    @rule(data=st.data(), holder=st.booleans())
    def request_approval(self, data, holder):
        run = self.pick(data, ("running",))
        before, owner = self.row(run), self.owner(run, holder)
        approval = approvals.request(self.conn, run, owner, position=self.next_position(run),
                                     args_hash="h", details={"n": 1})
        if self.holds(before, owner) and before["status"] == "running":
            assert self.row(run)["status"] == "waiting_for_approval"
            self.approvals.setdefault(run, []).append(approval["approval_id"])
        else:
            assert approval is None

    @precondition(has_runs)
    @rule(data=st.data(), pick=st.integers(0, 2), decision=st.sampled_from(approvals.DECISIONS))
    def decide(self, data, pick, decision):
        run = self.pick(data, among=set(self.approvals))
        known = self.approvals.get(run, [])
        approval_id = known[pick] if pick < len(known) else "apr_unknown"
        before = self.row(run)
        entry = self.conn.execute(
            "SELECT result FROM journal WHERE run_id = ? AND kind = 'approval' AND "
            f"{db.dialect(self.conn).json_text('result', 'approval_id')} = ?",
            (run, approval_id)).fetchone()
        recorded = None if entry is None else json.loads(entry[0]).get("decision")
        pending = before["status"] == "waiting_for_approval" and \
            json.loads(before["approval"])["approval_id"] == approval_id
        if entry is None or (recorded is None and not pending):
            with pytest.raises(ApprovalNotPending):
                approvals.decide(self.conn, run, approval_id, decision, self.enqueue)
        elif recorded is not None and recorded != decision:
            with pytest.raises(ApprovalAlreadyResolved):
                approvals.decide(self.conn, run, approval_id, decision, self.enqueue)
        else:
            decided = approvals.decide(self.conn, run, approval_id, decision, self.enqueue)
            if recorded is None:  # the first decision: waiting -> queued, same attempt
                assert (decided["status"], decided["attempt"]) == ("queued",
                                                                   before["attempt"])
            else:
                assert decided == self.row(run)

    @precondition(has_runs)
    @rule(data=st.data(), holder=st.booleans(), idempotent=st.booleans())
    def start_step(self, data, holder, idempotent):
        run = self.pick(data, ("running", "stopping"))
        before, owner = self.row(run), self.owner(run, holder)
        position = self.next_position(run)
        if not self.holds(before, owner):
            with pytest.raises(LeaseLost):
                journal.start_step(self.conn, run, owner, position=position, name="charge",
                                   args_hash="a", idempotent=idempotent, restart=False)
        elif before["status"] == "stopping":
            with pytest.raises(RunStopping):
                journal.start_step(self.conn, run, owner, position=position, name="charge",
                                   args_hash="a", idempotent=idempotent, restart=False)
        else:
            journal.start_step(self.conn, run, owner, position=position, name="charge",
                               args_hash="a", idempotent=idempotent, restart=False)
            self.started_steps.setdefault(run, []).append(position)

    @precondition(lambda self: any(self.started_steps.values()))
    @rule(data=st.data(), holder=st.booleans())
    def settle_step(self, data, holder):
        run = self.pick(data, among={r for r, p in self.started_steps.items() if p})
        if not self.started_steps.get(run):
            return
        before, owner = self.row(run), self.owner(run, holder)
        position = self.started_steps[run][-1]
        settled = journal.settle_step(self.conn, run, owner, position=position,
                                      state="completed", result_json="1")
        if settled:
            self.started_steps[run].pop()
        assert settled == (self.holds(before, owner) and self.conn.execute(
            "SELECT state FROM journal WHERE run_id = ? AND position = ?",
            (run, position)).fetchone()[0] == "completed")

    # ------------------------------------------------------------------ time and crashes

    @precondition(has_runs_in_flight)
    @rule(data=st.data())
    def lease_lapses(self, data):
        """Time passes for this run: its lease is now in the past."""
        run = self.pick(data, ("running", "stopping"))
        with db.transaction(self.conn):
            self.conn.execute(f"UPDATE runs SET lease_expires_at = {db.NOW} - 1 WHERE id = ? "
                              "AND lease_expires_at IS NOT NULL", (run,))

    @precondition(has_runs_in_flight)
    @rule(pid=st.integers(1, 2))
    def drain(self, pid):
        marked = ledger_recovery.mark_drained(self.conn, node=NODE, generation=self.generation,
                                              pid=pid)
        for rid in marked:
            assert self.row(rid)["interruption"] == "drain"

    @precondition(has_runs_in_flight)
    @rule(recovered=st.booleans())
    def node_boots(self, recovered):
        """The node restarts: every earlier generation's owner is dead by definition.  Its
        boot recovery runs (docs/guarantees.md, "4. Recovery barrier"), or is killed before
        it starts (``recovered``)."""
        self.generation = nodes.boot(self.conn, NODE)
        if recovered:
            reconcile.boot(self.settings, self.generation)
            self.no_orphans_are_left()

    @precondition(has_orphans)
    @rule()
    def recover(self):
        """A scheduled pass, or `runstile recover`."""
        reconcile.run_pass(self.settings, generation=self.generation, trigger="command")
        self.no_orphans_are_left()

    def no_orphans_are_left(self) -> None:
        now = self.now()
        for run in self.all_runs():
            if run["status"] in ("running", "stopping"):
                assert run["lease_expires_at"] > now, f"recovery left {run['id']} orphaned"
                assert not (run["owner_node"] == NODE and
                            run["owner_generation"] < self.generation), run["id"]

    # ------------------------------------------------------------------ invariants

    @invariant()
    def a_terminal_run_never_changes(self):
        for run in self.all_runs():
            if run["id"] in self.terminal_rows:
                assert run == self.terminal_rows[run["id"]], run["id"]
            elif run["status"] in {s.value for s in TERMINAL}:
                self.terminal_rows[run["id"]] = run
        present = {r["id"] for r in self.all_runs()}
        assert set(self.terminal_rows) <= present

    @invariant()
    def events_are_a_lifecycle_path_ending_in_the_runs_status(self):
        for run in self.all_runs():
            rows = self.conn.execute("SELECT seq, type FROM events WHERE run_id = ? "
                                     "ORDER BY seq", (run["id"],)).fetchall()
            assert [seq for seq, _ in rows] == list(range(1, len(rows) + 1))
            path = [EVENT_STATUS[t] for _, t in rows if t in EVENT_STATUS]
            assert rows[0][1] == "run.queued" and path[0] == "queued", run["id"]
            for source, target in zip(path, path[1:], strict=False):
                assert can_transition(source, target), (run["id"], source, target, rows)
            assert path[-1] == run["status"], (run["id"], rows, run["status"])
            terminal = [t for _, t in rows if t in {f"run.{s.value}" for s in TERMINAL}]
            assert len(terminal) <= 1 and (not terminal or RunStatus(path[-1]).terminal)
            types = [t for _, t in rows]
            assert run["attempt"] == 1 + types.count("run.requeued") + \
                types.count("run.resumed"), (run["id"], types)

    @invariant()
    def each_entry_into_queued_wrote_one_dispatch_with_its_message(self):
        """Admission, re-queue, resume and approval each dispatch in their transaction
        (session hand-overs and recovery's re-publishing add more, of their own reasons)."""
        for run in self.all_runs():
            entries = self.conn.execute(
                "SELECT COUNT(*) FROM events WHERE run_id = ? AND type IN ('run.queued', "
                "'run.requeued', 'run.resumed', 'approval.resolved')", (run["id"],)).fetchone()[0]
            dispatched = self.conn.execute(
                "SELECT COUNT(*) FROM dispatches WHERE run_id = ? AND reason NOT IN "
                "('session_next', 'republished', 'profile_slot', 'task_slot')",
                (run["id"],)).fetchone()[0]
            assert dispatched == entries, (run["id"], dispatched, entries)
        assert self.conn.execute("SELECT COUNT(*) FROM dispatches WHERE sent_at IS NULL"
                                 ).fetchone()[0] == 0

    @invariant()
    def each_notice_a_callback_is_owed_is_one_obligation(self):
        marks = ", ".join("?" for _ in NOTIFYING)
        for run in self.all_runs():
            owed = self.conn.execute(f"SELECT COUNT(*) FROM events WHERE run_id = ? AND type "
                                     f"IN ({marks})", (run["id"], *NOTIFYING)).fetchone()[0]
            held = self.conn.execute("SELECT COUNT(*) FROM obligations WHERE run_id = ? AND "
                                     "kind = 'callback'", (run["id"],)).fetchone()[0]
            assert held == (owed if run["callback_url"] else 0), (run["id"], held, owed)

    @invariant()
    def at_most_one_run_holds_each_session(self):
        held = self.conn.execute(
            "SELECT profile_id, key_id, session_key, COUNT(*) FROM runs WHERE session_key IS "
            f"NOT NULL AND status IN {HOLDING} GROUP BY 1, 2, 3 HAVING COUNT(*) > 1").fetchall()
        assert not held, [tuple(r) for r in held]

    @invariant()
    def neither_a_profile_nor_a_task_runs_more_than_its_limit(self):
        over = self.conn.execute(
            "SELECT profile_id, COUNT(*) FROM runs WHERE status IN ('running', 'stopping') "
            "GROUP BY 1 HAVING COUNT(*) > ?", (MAX_RUNNING_PER_PROFILE,)).fetchall()
        assert not over, [tuple(r) for r in over]
        for task in TASKS:
            limit = registry.concurrency_of(task)
            held = self.conn.execute("SELECT COUNT(*) FROM runs WHERE task = ? AND status IN "
                                     "('running', 'stopping')", (task,)).fetchone()[0]
            assert limit is None or held <= limit, (task, held)
        marked = self.conn.execute(
            "SELECT id, status FROM runs WHERE (slot_wait_since IS NOT NULL OR "
            "task_wait_since IS NOT NULL) AND status IN "
            "('running', 'stopping', 'waiting_for_approval', 'paused')").fetchall()
        assert not marked, [tuple(r) for r in marked]

    @invariant()
    def only_a_run_in_flight_has_an_owner_and_a_lease(self):
        for run in self.all_runs():
            owner = (run["owner_node"], run["owner_generation"], run["owner_pid"],
                     run["owner_thread"])
            if run["status"] in ("running", "stopping"):
                assert None not in owner and run["lease_expires_at"] is not None, run
            else:
                assert run["lease_expires_at"] is None, run

    @invariant()
    def active_runs_counts_the_non_terminal_runs(self):
        counted = dict(self.conn.execute(
            "SELECT p.id, COUNT(r.seq) FROM profiles p LEFT JOIN runs r ON r.profile_id = p.id "
            f"AND r.status IN ({', '.join(repr(s.value) for s in NON_TERMINAL)}) "
            "GROUP BY p.id").fetchall())
        assert dict(self.conn.execute("SELECT id, active_runs FROM profiles").fetchall()) == \
            counted

    @invariant()
    def each_idempotency_key_names_one_run_for_ever(self):
        rows = self.conn.execute("SELECT profile_id, key_id, idempotency_key, run_id "
                                 "FROM idempotency_keys").fetchall()
        assert {tuple(r[:3]): r[3] for r in rows} == self.bound

    @invariant()
    def db_check_finds_nothing_wrong(self):
        report = maintenance.check(self.conn)
        assert report["ok"], report["problems"]


def test_any_sequence_of_transitions_crashes_and_recoveries_keeps_the_ledgers_invariants():
    run_state_machine_as_test(LedgerMachine, settings=settings(
        max_examples=100, stateful_step_count=30, deadline=None, derandomize=True,
        database=None, suppress_health_check=[HealthCheck.too_slow,
                                              HealthCheck.filter_too_much]))


def empty_postgresql_ledger(conn) -> None:
    """A new database per example would cost a CREATE DATABASE each: empty it instead."""
    tables = [r[0] for r in conn.execute(
        "SELECT tablename FROM pg_tables WHERE schemaname = current_schema() "
        "AND tablename <> 'ledger_meta'")]
    conn.execute(f"TRUNCATE {', '.join(tables)} RESTART IDENTITY CASCADE")


class PostgresLedgerMachine(LedgerMachine):
    """LedgerMachine on the database the test below sets (a subclass: the SQLite one's
    ``database_url`` stays None)."""


@pytest.mark.postgresql
def test_the_same_sequences_keep_the_invariants_of_a_postgresql_ledger():
    """The machine above on PostgreSQL: fewer examples, as each costs about a second
    there, and no shrinking, which replays hundreds of them (past the test's timeout): a
    failure is reported as found."""
    with postgres.fresh_database() as url:
        PostgresLedgerMachine.database_url = url
        run_state_machine_as_test(PostgresLedgerMachine, settings=settings(
            max_examples=15, stateful_step_count=30, phases=[Phase.generate], deadline=None,
            derandomize=True, database=None, suppress_health_check=[HealthCheck.too_slow,
                                                  HealthCheck.filter_too_much]))
