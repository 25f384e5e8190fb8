"""SIGKILL at named crash points in real processes, restart, and check the outcome the
classification table gives (docs/tasks.md, "When the worker is gone") against an external
execution log: nothing is re-executed blindly (docs/guarantees.md, "3. At-most-once
execution")."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from runstile.ledger import migrations
from tests.conftest import ROOT, Api, Ledger, System, wait_for_status
from tests.recovery.test_recovery import crashed_run

#: point -> task -> (final status, attempt, starts logged, side-effect calls logged)
EXPECTED = {
    "after_claim": {"t.crash_default": ("interrupted", 1, 0, 0),
                    "t.crash_resume": ("completed", 2, 1, 1)},
    "after_step_start": {"t.crash_default": ("paused", 1, 1, 0),
                         "t.crash_resume": ("paused", 1, 1, 0)},
    "after_body": {"t.crash_default": ("interrupted", 1, 1, 1),
                   "t.crash_resume": ("completed", 2, 2, 1)},
}


def lines(log, prefix, rid):
    return [line for line in (log.read_text().splitlines() if log.exists() else [])
            if line.startswith(f"{prefix} {rid}")]


@pytest.mark.parametrize("task", ["t.crash_default", "t.crash_resume"])
@pytest.mark.parametrize("point", list(EXPECTED))
def test_a_sigkill_at_each_crash_point_recovers_to_the_table_outcome(ledger, tmp_path, point,
                                                                     task):
    log = tmp_path / "executions.log"
    system = System(ledger.data_dir, {"RUNSTILE_CRASHPOINT": point}, web_workers=1, workers=1,
                    threads=2).start()
    try:
        api = Api(system, ledger.key(), ledger)
        rid = api.post_run({"task": task, "input": {"log": str(log)}}).json()["id"]
        # The worker process dies at the point; the supervisor then stops the tree.
        assert system.proc.wait(timeout=60) == 1
    finally:
        system.kill()
    system = System(ledger.data_dir, {}, web_workers=1, workers=1, threads=2).start()
    try:
        api = Api(system, api.key, ledger)
        status, attempt, starts, calls = EXPECTED[point][task]
        run = wait_for_status(api, rid, statuses=(status,), timeout_s=30)
        assert run["attempt"] == attempt
        if status == "paused":
            assert run["recovery"]["reason"] == "uncertain_side_effect"
        assert len(lines(log, "start", rid)) == starts
        assert len(lines(log, "call", rid)) == calls, "a side effect was executed blindly"
    finally:
        system.kill()


def test_killing_recovery_again_and_again_converges_to_one_clean_pass(tmp_path):
    seeded = Ledger(tmp_path / "seeded")
    migrations.migrate(seeded.path)
    key = seeded.key()
    for i in range(600):  # three batches; an attempt at one survives 200 draws at p=0.02 only 2% of the time
        crashed_run(seeded, key, ("t.hold", "t.hold_resume", "t.hold_pause")[i % 3])
    reference = Ledger(tmp_path / "reference")
    reference.data_dir.mkdir()
    shutil.copy(seeded.path, reference.path)

    def recover(ledger, crashpoint=None):
        env = {"RUNSTILE_NODE_ID": "node-a", "PATH": "/usr/bin:/bin"}
        if crashpoint:
            env["RUNSTILE_CRASHPOINT"] = crashpoint
        return subprocess.run([sys.executable, "-m", "runstile", "recover", "--json",
                               "--data-dir", str(ledger.data_dir), "--tasks",
                               "tests.workers.exec_tasks"], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=120).returncode

    killed = 0
    for _ in range(60):
        if recover(seeded, "mid_recovery:0.02") == -9:
            killed += 1
        if killed >= 10:
            break
    assert killed >= 10, "the crash point never fired"
    assert recover(seeded) == 0
    assert recover(reference) == 0

    def state(ledger):
        return ledger.query("SELECT id, status, attempt, recovery_reason FROM runs ORDER BY id")

    def event_counts(ledger):
        return ledger.query("SELECT run_id, type, COUNT(*) FROM events GROUP BY run_id, type "
                            "ORDER BY run_id, type")

    assert state(seeded) == state(reference)
    assert event_counts(seeded) == event_counts(reference)
    assert seeded.query("SELECT COUNT(*) FROM broker_messages") == \
        reference.query("SELECT COUNT(*) FROM broker_messages")
