"""Recovery (docs/operations.md, "Recovery"): every row of the classification table
(docs/tasks.md, "When the worker is gone"), idempotence, the barrier, drain and resume — by
editing the ledger into a crashed state and sweeping once, and by SIGKILLing a real
``runstile up`` and starting it again."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time

from runstile import tasks as registry
from runstile.config import Settings
from runstile.errors import LedgerUnavailable
from runstile.ledger import (
    admission,
    db,
    events,
    execution,
    journal,
    maintenance,
    migrations,
    nodes,
)
from runstile.ledger import recovery as ledger_recovery
from runstile.ledger.execution import Owner
from runstile.ledger.keys import Principal
from runstile.recovery import reconcile
from tests.conftest import ROOT, Api, wait_for_status, wait_until

registry.load(("tests.workers.exec_tasks",))


def admit(ledger, key, task: str) -> str:
    conn = ledger.connect()
    try:
        request = admission.AdmissionRequest(
            principal=Principal(key.profile, key.key_id, key.role), key=None,
            key_is_derived=False, run_id=None, task=task, input_json="{}", session_key=None,
            trigger_id=None, metadata_json=None, callback_url=None, fingerprint="f" * 64,
            fingerprint_version=1)
        return admission.admit(conn, request, refusal=None, max_active_runs=10_000).run["id"]
    finally:
        conn.close()


def crashed_run(ledger, key, task: str, *, generation: int = 1, lease_s: float = 60,
                expire: bool = True, node: str = "node-a") -> tuple[str, Owner]:
    """A run claimed by an owner that then died (its lease lapsed unless expire=False)."""
    rid = admit(ledger, key, task)
    owner = Owner(node, generation, 4242, 7)
    conn = ledger.connect()
    assert execution.claim(conn, rid, owner, lease_s=lease_s, task_known=lambda t: True).run
    if expire:
        conn.execute("UPDATE runs SET lease_expires_at = 0 WHERE id = ?", (rid,))
    conn.close()
    return rid, owner


def settings_for(ledger, **changes) -> Settings:
    return Settings(data_dir=ledger.data_dir, database_url=ledger.url, node_id="node-a", **changes)


def status(ledger, rid):
    return ledger.query("SELECT status, attempt, recovery_reason, recovery_attempts FROM runs "
                        "WHERE id = ?", (rid,))[0]


def event_types(ledger, rid):
    return [t for (t,) in ledger.query("SELECT type FROM events WHERE run_id = ? ORDER BY seq",
                                       (rid,))]


def test_every_row_of_the_classification_table(ledger):
    key = ledger.key()
    stopping, _ = crashed_run(ledger, key, "t.hold")
    ledger.query("SELECT 1")
    conn = ledger.connect()
    conn.execute("UPDATE runs SET status = 'stopping' WHERE id = ?", (stopping,))
    uncertain, owner = crashed_run(ledger, key, "t.hold_resume", expire=False)
    journal.start_step(conn, uncertain, owner, position=1, name="charge", args_hash="h",
                       idempotent=False, restart=False)
    idempotent_only, owner2 = crashed_run(ledger, key, "t.hold", expire=False)
    journal.start_step(conn, idempotent_only, owner2, position=1, name="fetch", args_hash="h",
                       idempotent=True, restart=False)
    conn.execute("UPDATE runs SET lease_expires_at = 0 WHERE id IN (?, ?)",
                 (uncertain, idempotent_only))
    drained, _ = crashed_run(ledger, key, "t.hold")
    conn.execute("UPDATE runs SET interruption = 'drain' WHERE id = ?", (drained,))
    resumable, _ = crashed_run(ledger, key, "t.hold_resume")
    pausable, _ = crashed_run(ledger, key, "t.hold_pause")
    plain, _ = crashed_run(ledger, key, "t.hold")
    exhausted, _ = crashed_run(ledger, key, "t.hold_resume")
    conn.execute("UPDATE runs SET recovery_attempts = 3 WHERE id = ?", (exhausted,))
    conn.close()

    report = reconcile.run_pass(settings_for(ledger), generation=1, trigger="command")

    assert status(ledger, stopping)[0] == "cancelled"
    assert status(ledger, uncertain)[:3] == ("paused", 1, "uncertain_side_effect")
    assert status(ledger, idempotent_only)[:3] == ("interrupted", 1, "owner_lost")
    assert status(ledger, drained)[:3] == ("queued", 2, "drained")
    assert status(ledger, resumable)[:3] == ("queued", 2, "owner_lost")
    assert status(ledger, pausable)[:3] == ("paused", 1, "owner_lost")
    assert status(ledger, plain)[:3] == ("interrupted", 1, "owner_lost")
    assert status(ledger, exhausted)[:3] == ("paused", 1, "recovery_budget_exhausted")
    assert event_types(ledger, resumable)[-1] == "run.requeued"
    assert event_types(ledger, plain)[-1] == "run.interrupted"
    assert event_types(ledger, uncertain)[-1] == "run.paused"
    assert event_types(ledger, stopping)[-1] == "run.cancelled"
    assert {k: v for k, v in report.counts.items() if v} == {
        "cancelled": 1, "paused": 3, "interrupted": 2, "requeued": 2}
    # Re-queued runs go back through the queue: each got a dispatch and a broker message
    # (the test admitted them without one, so exactly one: recovery's).
    for rid in (drained, resumable):
        assert ledger.query("SELECT COUNT(*) FROM broker_messages WHERE run_id = ?",
                            (rid,))[0][0] == 1
        assert ledger.query("SELECT reason FROM dispatches WHERE run_id = ? ORDER BY id",
                            (rid,)) == [("admitted",), ("recovered",)]
    # Recovery is idempotent: a second pass finds nothing to do.
    again = reconcile.run_pass(settings_for(ledger), generation=1, trigger="command")
    assert not {k: v for k, v in again.counts.items() if v and k in
                ("cancelled", "paused", "interrupted", "requeued")}


def test_a_live_lease_is_never_touched(ledger):
    key = ledger.key()
    rid, _ = crashed_run(ledger, key, "t.hold", expire=False)
    reconcile.run_pass(settings_for(ledger), generation=1, trigger="command")
    assert status(ledger, rid)[0] == "running"


def test_an_earlier_generation_of_this_node_is_dead_at_once(ledger):
    key = ledger.key()
    mine, _ = crashed_run(ledger, key, "t.hold", expire=False, generation=1)
    other_node, _ = crashed_run(ledger, key, "t.hold", expire=False, generation=1,
                                node="node-b")
    reconcile.run_pass(settings_for(ledger), generation=2, trigger="boot")
    assert status(ledger, mine)[0] == "interrupted"
    assert status(ledger, other_node)[0] == "running", "another node's live lease was taken"


def test_a_recovery_that_loses_the_race_to_a_renewing_owner_changes_nothing(ledger):
    key = ledger.key()
    rid, owner = crashed_run(ledger, key, "t.hold")
    conn = ledger.connect()
    [run] = ledger_recovery.orphaned(conn, node_id="node-a", generation=1, limit=10)
    conn.execute("UPDATE runs SET lease_expires_at = lease_expires_at + 1 WHERE id = ?", (rid,))
    with db.transaction(conn):
        assert ledger_recovery.apply(conn, run, "interrupted", "owner_lost", None) is False
    conn.close()
    assert status(ledger, rid)[0] == "running"


def test_a_batch_moves_only_the_runs_whose_guard_still_holds(ledger):
    key = ledger.key()
    renewed, _ = crashed_run(ledger, key, "t.hold")
    lost, _ = crashed_run(ledger, key, "t.hold")
    conn = ledger.connect()
    batch = ledger_recovery.orphaned(conn, node_id="node-a", generation=1, limit=10)
    assert {run["id"] for run in batch} == {renewed, lost}
    conn.execute("UPDATE runs SET lease_expires_at = lease_expires_at + 1 WHERE id = ?",
                 (renewed,))
    with db.transaction(conn):
        won = ledger_recovery.apply_terminal_many(
            conn, [(run, "interrupted", "owner_lost") for run in batch], None)
    conn.close()
    assert won == [lost]
    assert status(ledger, renewed)[0] == "running"
    assert event_types(ledger, renewed)[-1] == "run.started"
    assert status(ledger, lost)[:3] == ("interrupted", 1, "owner_lost")
    assert event_types(ledger, lost)[-1] == "run.interrupted"


def test_each_run_of_a_batch_gets_its_event_after_its_own_last_one(ledger):
    key = ledger.key()
    crashed = [crashed_run(ledger, key, "t.hold")[0] for _ in range(5)]
    stopping = crashed_run(ledger, key, "t.hold")[0]
    conn = ledger.connect()
    with db.transaction(conn):
        for extra, rid in enumerate(crashed):       # 0 to 4 more events each
            for _ in range(extra):
                events.append(conn, rid, "run.progress", {"pct": extra})
        conn.execute("UPDATE runs SET status = 'stopping' WHERE id = ?", (stopping,))
    conn.close()
    before = dict(ledger.query("SELECT run_id, MAX(seq) FROM events GROUP BY run_id"))

    report = reconcile.run_pass(settings_for(ledger), generation=1, trigger="command")

    assert {k: v for k, v in report.counts.items() if v} == {"interrupted": 5, "cancelled": 1}
    for rid in crashed + [stopping]:
        [(seq, type_)] = ledger.query("SELECT seq, type FROM events WHERE run_id = ? AND "
                                      "seq > ?", (rid, before[rid]))
        assert seq == before[rid] + 1
        assert type_ == ("run.cancelled" if rid == stopping else "run.interrupted")
    conn = ledger.connect()
    try:
        assert maintenance.check(conn)["ok"], "profiles.active_runs is no longer exact"
    finally:
        conn.close()


def test_a_pass_copies_its_writes_back_into_the_ledger_file(ledger, tmp_path):
    key = ledger.key()
    rid, _ = crashed_run(ledger, key, "t.hold")
    # A connection left open elsewhere: closing the pass's own connection is then not
    # the last close, which would checkpoint by itself.
    bystander = ledger.connect()
    bystander.execute("SELECT 1").fetchone()
    try:
        reconcile.run_pass(settings_for(ledger), generation=1, trigger="command")
        copy = tmp_path / "without-wal.db"
        copy.write_bytes(ledger.path.read_bytes())  # the main file alone, no -wal
        check = db.connect(copy)
        try:
            assert check.execute("SELECT status FROM runs WHERE id = ?",
                                 (rid,)).fetchone()[0] == "interrupted"
        finally:
            check.close()
    finally:
        bystander.close()


def test_a_checkpoint_that_fails_does_not_fail_the_pass(ledger, monkeypatch):
    key = ledger.key()
    rid, _ = crashed_run(ledger, key, "t.hold")

    def disk_full(conn):
        raise LedgerUnavailable("the ledger is unavailable: database or disk is full")
    monkeypatch.setattr(ledger_recovery, "checkpoint", disk_full)
    report = reconcile.run_pass(settings_for(ledger), generation=1, trigger="command")
    assert report.counts["interrupted"] == 1 and report.report_id is not None
    assert status(ledger, rid)[0] == "interrupted"


def test_a_pass_on_a_data_directory_without_a_ledger_creates_it(tmp_path):
    settings = Settings(data_dir=tmp_path / "fresh", node_id="node-a")
    report = reconcile.run_pass(settings, generation=0, trigger="command")
    assert report.report_id is not None
    conn = db.connect(settings.ledger_path)
    try:
        assert migrations.is_current(conn)
    finally:
        conn.close()


def test_a_queued_run_whose_message_was_lost_is_republished(ledger):
    key = ledger.key()
    rid = admit(ledger, key, "t.hold")
    conn = ledger.connect()
    conn.execute("UPDATE runs SET updated_at = updated_at - 3600 WHERE id = ?", (rid,))
    conn.close()
    report = reconcile.run_pass(settings_for(ledger), generation=1, trigger="command")
    assert report.counts["republished"] == 1
    assert ledger.query("SELECT COUNT(*) FROM broker_messages WHERE run_id = ?", (rid,)) == [(1,)]
    assert reconcile.run_pass(settings_for(ledger), generation=1,
                              trigger="command").counts["republished"] == 0


def test_retention_runs_inside_recovery(ledger):
    key = ledger.key()
    rid = admit(ledger, key, "t.hold")
    conn = ledger.connect()
    conn.execute("UPDATE runs SET status = 'completed', finished_at = 0 WHERE id = ?", (rid,))
    conn.close()
    report = reconcile.run_pass(settings_for(ledger, run_retention_s=10), generation=1,
                                trigger="scheduled")
    assert report.counts["purged"] == 1
    assert ledger.query("SELECT COUNT(*) FROM run_tombstones WHERE run_id = ?", (rid,)) == [(1,)]


def seed_reports(ledger, count: int, *, age_s: float) -> None:
    """``count`` recovery reports of passes that finished ``age_s`` seconds ago."""
    conn = ledger.connect()
    with db.transaction(conn):
        conn.executemany(
            "INSERT INTO recovery_reports (node_id, generation, trigger, started_at, "
            f"finished_at, counts) VALUES ('node-a', 1, 'scheduled', {db.NOW} - ?1, "
            f"{db.NOW} - ?1, '{{}}')", [(age_s,)] * count)
    conn.close()


def report_ages(ledger, retention_s: float) -> tuple[int, int]:
    """(reports older than ``retention_s``, younger ones)."""
    return ledger.query(f"SELECT COUNT(*) FILTER (WHERE finished_at <= {db.NOW} - ?), "
                        f"COUNT(*) FILTER (WHERE finished_at > {db.NOW} - ?) "
                        "FROM recovery_reports", (retention_s, retention_s))[0]


def test_a_pass_keeps_the_newest_1000_recovery_reports_and_every_younger_one(ledger):
    day = 24 * 3600.0
    settings = settings_for(ledger, run_retention_s=day)
    seed_reports(ledger, 1500, age_s=3 * day)  # a scheduled pass every 10 s for 4 hours
    newest = ledger.query("SELECT MIN(id) FROM (SELECT id FROM recovery_reports "
                          "ORDER BY id DESC LIMIT 1000) AS newest")[0][0]
    report = reconcile.run_pass(settings, generation=1, trigger="scheduled")
    assert report.counts["reports_pruned"] == 500
    # The newest 1,000 old ones stay, and the pass's own (young) report.
    assert report_ages(ledger, day) == (1000, 1)
    assert ledger.query("SELECT MIN(id) FROM recovery_reports")[0][0] == newest
    # Young reports are kept however many there are; the old ones now fall outside the
    # newest 1,000 and go.
    seed_reports(ledger, 1200, age_s=60)
    report = reconcile.run_pass(settings, generation=1, trigger="scheduled")
    assert report.counts["reports_pruned"] == 1000
    assert report_ages(ledger, day) == (0, 1202)
    assert reconcile.run_pass(settings, generation=1,
                              trigger="scheduled").counts["reports_pruned"] == 0


def test_a_scheduled_pass_logs_at_info_only_when_it_did_something(ledger, caplog):
    caplog.set_level(logging.DEBUG, logger="runstile.recovery")

    def pass_lines(trigger: str) -> list[tuple[int, str]]:
        caplog.clear()
        reconcile.run_pass(settings_for(ledger), generation=1, trigger=trigger)
        return [(r.levelno, r.getMessage()) for r in caplog.records
                if r.getMessage().startswith("recovery (")]

    quiet = pass_lines("scheduled")
    assert [level for level, _ in quiet] == [logging.DEBUG], quiet
    assert "nothing to do" in quiet[0][1]
    assert [level for level, _ in pass_lines("boot")] == [logging.INFO]
    assert [level for level, _ in pass_lines("command")] == [logging.INFO]
    crashed_run(ledger, ledger.key(), "t.hold")
    busy = pass_lines("scheduled")
    assert [level for level, _ in busy] == [logging.INFO] and "interrupted" in busy[0][1]


def test_the_barrier_opens_only_when_this_boots_recovery_finished(ledger):
    conn = ledger.connect()
    assert ledger_recovery.barrier_is_open(conn, "node-a")  # never booted: nothing to wait for
    generation = nodes.boot(conn, "node-a")
    assert not ledger_recovery.barrier_is_open(conn, "node-a")
    reconcile.boot(settings_for(ledger), generation)
    assert ledger_recovery.barrier_is_open(conn, "node-a")
    nodes.boot(conn, "node-a")
    assert not ledger_recovery.barrier_is_open(conn, "node-a")
    conn.close()


def test_recovery_reports_are_for_admin_keys(make_server, ledger):
    reconcile.run_pass(settings_for(ledger), generation=0, trigger="command")
    server = make_server()
    admin = Api(server, ledger.key(admin=True), ledger)
    client = Api(server, ledger.key(), ledger)
    reports = admin.get("/v1/recovery").json()["data"]
    assert reports[0]["trigger"] == "command" and "counts" in reports[0]
    assert reports[0]["taken_over"] == {}  # no other node found dead
    assert client.get("/v1/recovery").status_code == 404


def test_runstile_recover_is_a_one_shot_pass(ledger):
    key = ledger.key()
    rid, _ = crashed_run(ledger, key, "t.hold")
    out = subprocess.run([sys.executable, "-m", "runstile", "recover", "--json", "--data-dir",
                          str(ledger.data_dir), "--tasks", "tests.workers.exec_tasks"],
                         capture_output=True, text=True, cwd=ROOT, timeout=60,
                         env={**os.environ, "RUNSTILE_NODE_ID": "node-a"})
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["counts"] == {"interrupted": 1}
    assert report["trigger"] == "command"
    assert status(ledger, rid)[0] == "interrupted"
    assert ledger.query("SELECT generation FROM nodes WHERE id = 'node-a'") == []


# ---------------------------------------------------------------- real processes

def read_log(path):
    return path.read_text().splitlines() if path.exists() else []


def test_sigkill_of_the_whole_node_then_restart_applies_on_crash_policies(make_system, ledger,
                                                                          tmp_path):
    system = make_system(workers=1, threads=4)
    api = Api(system, ledger.key(), ledger)
    log = tmp_path / "executions.log"
    ids = {task: api.post_run({"task": task, "input": {"log": str(log)}}).json()["id"]
           for task in ("t.hold", "t.hold_resume", "t.hold_pause", "t.side_effect")}
    wait_until(lambda: sum(line.startswith("start") for line in read_log(log)) == 4
               and any(line.startswith("charge") for line in read_log(log)), 30, 0.05,
               "all four bodies running")
    system.kill(signal.SIGKILL)  # the whole tree, mid-run: no drain, no goodbye
    assert all(status(ledger, rid)[0] == "running" for rid in ids.values())
    system.start()  # a new generation: the dead one's leases count as expired at once
    assert wait_for_status(api, ids["t.hold"], statuses=("interrupted",), timeout_s=10)
    assert wait_for_status(api, ids["t.hold_pause"], statuses=("paused",))["recovery"][
        "reason"] == "owner_lost"
    paused = wait_for_status(api, ids["t.side_effect"], statuses=("paused",))
    assert paused["recovery"]["reason"] == "uncertain_side_effect"
    resumed = wait_for_status(api, ids["t.hold_resume"], statuses=("completed",))
    assert resumed["attempt"] == 2 and resumed["result"] == {"attempt": 2}
    # The barrier, from the recorded history: the new generation's boot recovery ended
    # before any of its workers started a body.
    [(generation, recovered_at)] = ledger.query(
        "SELECT generation, finished_at FROM recovery_reports WHERE trigger = 'boot' "
        "ORDER BY id DESC LIMIT 1")
    starts = [created for data, created in ledger.query(
        "SELECT data, created_at FROM events WHERE type = 'run.started'")
        if json.loads(data)["owner"]["generation"] == generation]
    assert generation == 2 and starts and recovered_at <= min(starts)
    types = [e["type"] for e in api.get(f"/v1/runs/{ids['t.hold_resume']}/events",
                                        headers={"Accept": "application/json"}).json()["data"]]
    assert types.index("run.requeued") < len(types) - 1 - types[::-1].index("run.started")
    # The uncertain side effect ran once; nothing re-ran it blindly.
    charges = [line for line in read_log(log) if line.startswith(f"charge {ids['t.side_effect']}")]
    assert charges == [f"charge {ids['t.side_effect']} 1"]
    # A person accepts the uncertainty: the step runs again, journaled as a new start.
    response = api.post(f"/v1/runs/{ids['t.side_effect']}/resume")
    assert response.status_code == 200 and response.json()["attempt"] == 2
    done = wait_for_status(api, ids["t.side_effect"], statuses=("completed",))
    assert done["result"] == {"charged": True}
    assert ledger.query("SELECT starts, state FROM journal WHERE run_id = ?",
                        (ids["t.side_effect"],)) == [(2, "completed")]
    again = api.post(f"/v1/runs/{ids['t.side_effect']}/resume")
    assert again.status_code == 409 and again.json()["error"]["code"] == "run_not_paused"
    assert api.post(f"/v1/runs/run_{'0' * 32}/resume").status_code == 404


def test_sigterm_drains_within_the_timeout_and_the_next_boot_requeues(make_system, ledger,
                                                                      tmp_path):
    system = make_system(workers=1, threads=2, RUNSTILE_DRAIN_TIMEOUT_S="1")
    api = Api(system, ledger.key(), ledger)
    log = tmp_path / "executions.log"
    rid = api.post_run({"task": "t.hold", "input": {"log": str(log), "ticks": 400}}).json()["id"]
    wait_until(lambda: any(line.startswith("start") for line in read_log(log)), 30, 0.05, "a start")
    began = time.monotonic()
    os.killpg(system.proc.pid, signal.SIGTERM)
    system.proc.wait(timeout=30)
    assert time.monotonic() - began < 1 + 5, "the tree outlived the drain timeout + 5 s"
    assert ledger.query("SELECT status, interruption FROM runs WHERE id = ?", (rid,)) == [
        ("running", "drain")]
    system.kill()
    system.start()
    run = wait_for_status(api, rid, statuses=("running", "completed"), timeout_s=15)
    assert run["attempt"] == 2 and run["recovery"]["reason"] == "drained"
    assert [line.split()[2] for line in read_log(log) if line.startswith("start")] == ["1", "2"]
