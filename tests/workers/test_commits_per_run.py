"""A run on the embedded broker costs two durable commits on the worker side: its claim
(which also acks its message) and its finish.

See docs/guarantees.md, "Commits per run".  Counted where durability is paid: the
fdatasync/fsync calls of a real ``runstile worker`` (supervisor and worker processes) on
the ledger's WAL, seen by strace while it executes runs admitted by this test's process.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time

import pytest

from runstile import dispatch
from runstile.config import Settings
from runstile.ledger import admission, db
from runstile.ledger.keys import Principal
from tests.conftest import ROOT, RUNSTILE, STARTED, kill_group, wait_until

#: Runs measured: enough that a commit of one more per run would show many times over
#: the few periodic commits (heartbeats) that land during the count.
RUNS = 200
#: The worker's threads.  Each waits for its claim to commit before it starts the body,
#: but hands its finish over without waiting and goes on to its next claim (``GroupCommitter
#: .hand_over``), and the committer settles units in order: so a group commit holds at
#: most two units per thread, a finish and the claim that followed it.
THREADS = 4
#: Seconds between two heartbeats of one kind (RUNSTILE_HEARTBEAT_S, the consumers'
#: MAX_HEARTBEAT_INTERVAL_S): each kind commits once per period, durably.
HEARTBEAT_S = 5.0
#: The kinds of periodic durable commit a worker makes: the leases' heartbeat, the
#: consumers' heartbeat, the node's heartbeat, and one spare for a period boundary.
PERIODIC_KINDS = 4
#: The embedded broker's enqueue: each run's message commits with its admission, as the
#: web tier writes it (without it the runs would wait for recovery to publish them).
ENQUEUE = dispatch.Dispatcher(Settings()).enqueue


def wal_and_checkpoint_syncs(trace: str) -> tuple[int, int]:
    """(syncs of the -wal file, syncs of the ledger file itself) in strace's output.

    Every durable COMMIT syncs the WAL once.  A checkpoint, which any commit may run,
    syncs the WAL before copying it back and the ledger file after; the first commit
    after it restarts the WAL and, at synchronous=FULL, syncs the new WAL header too.
    So each sync of the ledger file stands for two WAL syncs that are not commits."""
    wal = len(re.findall(r"sync\(\d+</[^>]*ledger\.db-wal>\)", trace))
    main = len(re.findall(r"sync\(\d+</[^>]*ledger\.db>\)", trace))
    return wal, main


def admit(conn, key, count: int) -> None:
    """``count`` runs in one transaction of this (untraced) process."""
    with db.transaction(conn):
        _admit_each(conn, key, count)


def _admit_each(conn, key, count: int) -> None:
    for _ in range(count):
        request = admission.AdmissionRequest(
            principal=Principal(key.profile, key.key_id, key.role), key=None,
            key_is_derived=False, run_id=None, task="echo", input_json="{}",
            session_key=None, trigger_id=None, metadata_json=None, callback_url=None,
            fingerprint="f" * 64, fingerprint_version=1)
        admission.admit(conn, request, refusal=None, max_active_runs=100_000,
                        enqueue=ENQUEUE)


@pytest.mark.skipif(shutil.which("strace") is None and not os.environ.get("CI"),
                    reason="strace is not installed: it counts the worker's fsyncs")
def test_a_no_op_run_costs_at_most_two_durable_commits_on_the_worker_side(ledger, tmp_path):
    ledger_file = ledger.path  # SQLite's fsyncs: skips on the PostgreSQL pass
    key = ledger.key()
    trace_path = tmp_path / "fsyncs.trace"
    log_path = tmp_path / "worker.log"
    env = {**os.environ, "RUNSTILE_BROKER_URL": "sqlite"}
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    with open(log_path, "ab") as log:
        # --seccomp-bpf: only the traced calls stop the process, so strace barely slows it.
        proc = subprocess.Popen(
            ["strace", "-f", "--seccomp-bpf", "-qq", "-y", "-e", "trace=fsync,fdatasync",
             "-o", str(trace_path), *RUNSTILE, "worker", "--data-dir", str(ledger.data_dir),
             "--workers", "1", "--threads", str(THREADS)],
            env=env, stdout=log, stderr=log, start_new_session=True, cwd=ROOT)
    STARTED.append(proc)
    try:
        wait_until(lambda: "] worker up: node" in log_path.read_text(errors="replace"),
                   30, 0.05, "runstile worker to boot")
        time.sleep(0.5)  # boot recovery's and registration's commits are before the count
        before = wal_and_checkpoint_syncs(trace_path.read_text())
        started = time.monotonic()
        conn = ledger.connect()
        try:
            admit(conn, key, RUNS)
        finally:
            conn.close()
        wait_until(lambda: ledger.query(
            "SELECT COUNT(*) FROM runs WHERE status = 'completed'")[0][0] == RUNS,
            120, 0.1, f"{RUNS} runs to complete")
        time.sleep(0.3)  # the last finish's sync is written to the trace
        after = wal_and_checkpoint_syncs(trace_path.read_text())
        elapsed = time.monotonic() - started
    finally:
        kill_group(proc)
    wal, checkpoints = after[0] - before[0], after[1] - before[1]
    commits = wal - 2 * checkpoints
    periodic = PERIODIC_KINDS * (int(elapsed / HEARTBEAT_S) + 1)
    assert ledger_file.exists()
    # The trace sees the runs' commits: their 2 x RUNS claims and finishes, two per
    # thread at most to a commit (a run's commits alone can be fewer than RUNS when the
    # threads' units share them).
    assert commits >= 2 * RUNS // (2 * THREADS), (
        f"the count sees the runs' commits: {commits} WAL syncs")
    assert commits <= 2 * RUNS + periodic, (
        f"{commits} durable commits for {RUNS} runs in {elapsed:.1f} s "
        f"({commits / RUNS:.2f} per run; {checkpoints} checkpoints left out, "
        f"{periodic} periodic commits allowed)")
