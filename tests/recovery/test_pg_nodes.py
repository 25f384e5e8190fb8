"""Nodes on a PostgreSQL ledger, with real processes (docs/operations.md, "Node lock and
generations"): `runstile worker` holds the node's advisory lock for life, a second live
node of the same name is refused, a SIGKILLed node's lock is free again at once, and the
scheduled recovery of the survivors takes over a dead node's runs long before their
leases lapse, each run classified once.  Runs travel on the embedded broker, which lives
in each test's own PostgreSQL database: no broker state is shared with another test or
another run of the suite (a fixed Redis database was, under parallel runs)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import pytest

from runstile import dispatch
from runstile.config import Settings
from runstile.ledger import admission, migrations
from runstile.ledger.keys import Principal
from tests import postgres
from tests.conftest import (
    ROOT,
    STARTED,
    Ledger,
    Workers,
    child_pids,
    kill_group,
    wait_until,
)

#: Runs once, on the PostgreSQL pass (tests/postgres.py).
pytestmark = pytest.mark.postgresql

PASSWORD = "s3cret-of-the-ledger"  # trust auth ignores it; it must show nowhere
LEASE_S, INTERVAL_S = 30.0, 1.0
#: The embedded broker's enqueue: a run's message is written in its admission's transaction.
ENQUEUE = dispatch.Dispatcher(Settings()).enqueue


@pytest.fixture
def pg(tmp_path):
    with postgres.fresh_database(required=True) as url:
        parts = urlsplit(url)
        url = urlunsplit(parts._replace(netloc=f"{parts.username}:{PASSWORD}@"
                                               f"{parts.hostname}:{parts.port}"))
        migrations.migrate(url)
        yield Ledger(tmp_path / "data", url=url)


def env_of(ledger: Ledger, node_id: str) -> dict:
    return {"RUNSTILE_DATABASE_URL": ledger.url, "RUNSTILE_NODE_ID": node_id,
            "RUNSTILE_BROKER_URL": "sqlite",
            "RUNSTILE_TASKS": "tests.workers.exec_tasks", "RUNSTILE_LEASE_S": str(LEASE_S),
            "RUNSTILE_HEARTBEAT_S": "1", "RUNSTILE_RECOVERY_INTERVAL_S": str(INTERVAL_S)}


def node(ledger: Ledger, tmp_path: Path, node_id: str, threads: int = 4) -> Workers:
    """A `runstile worker` of its own data directory, on the shared PostgreSQL ledger."""
    return Workers(tmp_path / f"dir-{node_id}", env_of(ledger, node_id), workers=1,
                   threads=threads).start()


def generation(ledger: Ledger, node_id: str) -> int:
    return ledger.query("SELECT generation FROM nodes WHERE id = ?", (node_id,))[0][0]


def admit(ledger: Ledger, key, task: str, log: Path, ticks: int = 4000) -> str:
    conn = ledger.connect()
    try:
        request = admission.AdmissionRequest(
            principal=Principal(key.profile, key.key_id, key.role), key=None,
            key_is_derived=False, run_id=None, task=task,
            input_json=json.dumps({"log": str(log), "ticks": ticks}), session_key=None,
            trigger_id=None, metadata_json=None, callback_url=None, fingerprint="f" * 64,
            fingerprint_version=1)
        return admission.admit(conn, request, refusal=None, max_active_runs=10_000,
                               enqueue=ENQUEUE).run["id"]
    finally:
        conn.close()


def argv_of_tree(pid: int) -> list[str]:
    """What `ps` shows of the process and its children (their /proc/<pid>/cmdline)."""
    shown = []
    for p in [pid, *child_pids(pid)]:
        try:
            shown.append(Path(f"/proc/{p}/cmdline").read_bytes().replace(b"\0", b" ").decode())
        except FileNotFoundError:
            pass
    return shown


def test_a_second_worker_of_the_same_node_id_is_refused_and_another_id_starts(pg, tmp_path):
    first = node(pg, tmp_path, "n1", threads=1)
    second = subprocess.run(
        [sys.executable, "-m", "runstile", "worker", "--data-dir", str(tmp_path / "other")],
        env={**os.environ, **env_of(pg, "n1")}, capture_output=True, text=True, timeout=60,
        cwd=ROOT)
    assert second.returncode == 2, second.stderr
    [line] = second.stderr.strip().splitlines()
    assert line.startswith("error: node 'n1' is already running on postgresql://")
    assert f"pid {first.proc.pid}" in line and PASSWORD not in line
    other = node(pg, tmp_path, "n2", threads=1)
    assert first.proc.poll() is None and other.proc.poll() is None
    assert (generation(pg, "n1"), generation(pg, "n2")) == (1, 1)
    shown = argv_of_tree(first.proc.pid)
    assert any("worker-process" in argv for argv in shown), shown
    assert not any("postgresql" in argv or PASSWORD in argv for argv in shown), shown
    assert PASSWORD not in first.log()


def test_the_lock_of_a_sigkilled_node_is_free_at_once_and_its_next_boot_is_one_more(
        pg, tmp_path):
    first = node(pg, tmp_path, "n1", threads=1)
    assert generation(pg, "n1") == 1
    session = f"runstile node n1 pid {first.proc.pid}"
    first.kill(signal.SIGKILL)
    # The server ends the dead process's session (and so frees its lock) as soon as it
    # reads the closed connection: a moment, not a timeout.
    wait_until(lambda: not pg.query("SELECT 1 FROM pg_stat_activity WHERE "
                                    "application_name = ?", (session,)), 5, 0.01,
               "the server to end the killed node's session")
    again = node(pg, tmp_path, "n1", threads=1)
    assert generation(pg, "n1") == 2
    assert again.proc.poll() is None


def test_survivors_take_over_a_sigkilled_nodes_runs_before_their_leases_lapse(pg, tmp_path):
    log, key = tmp_path / "executions.log", pg.key()
    tasks = {"t.hold": 2, "t.hold_pause": 1, "t.hold_resume": 1}
    runs = {admit(pg, key, task, log): task for task, n in tasks.items() for _ in range(n)}
    a = node(pg, tmp_path, "node-a")  # its 4 threads hold the runs
    wait_until(lambda: pg.query("SELECT COUNT(*) FROM runs WHERE status = 'running' AND "
                                "owner_node = 'node-a'")[0][0] == len(runs), 30, 0.1,
               "node-a to hold every run")
    survivors = [node(pg, tmp_path, "node-b"), node(pg, tmp_path, "node-c")]
    time.sleep(2 * INTERVAL_S)  # their passes see node-a alive: nothing to take
    assert pg.query("SELECT COUNT(*) FROM runs WHERE owner_node = 'node-a'")[0][0] == len(runs)
    killed_at = time.monotonic()
    a.kill(signal.SIGKILL)  # the whole process group: supervisor and worker
    wait_until(lambda: not pg.query("SELECT 1 FROM runs WHERE owner_node = 'node-a'"),
               LEASE_S + INTERVAL_S, 0.1, "the survivors to take over node-a's runs")
    taken_s = time.monotonic() - killed_at
    print(f"node-a's runs taken over {taken_s:.2f}s after its SIGKILL")
    assert taken_s < LEASE_S / 2, f"{taken_s:.1f}s: that was the leases lapsing, not takeover"
    by_task = {}
    for rid, task in runs.items():
        [(status, reason)] = pg.query("SELECT status, recovery_reason FROM runs WHERE id = ?",
                                      (rid,))
        moves = [t for (t,) in pg.query(
            "SELECT type FROM events WHERE run_id = ? AND type IN ('run.interrupted', "
            "'run.paused', 'run.requeued') ORDER BY seq", (rid,))]
        assert len(moves) == 1, (rid, moves)  # classified once, by one survivor
        by_task.setdefault(task, set()).add((moves[0], reason))
    assert by_task == {"t.hold": {("run.interrupted", "owner_lost")},
                       "t.hold_pause": {("run.paused", "owner_lost")},
                       "t.hold_resume": {("run.requeued", "owner_lost")}}
    reports = pg.query("SELECT node_id, counts, taken_over FROM recovery_reports WHERE "
                       "taken_over IS NOT NULL")
    assert {r[0] for r in reports} <= {"node-b", "node-c"}
    assert all(json.loads(r[2]) == {"node-a": 1} for r in reports)
    assert sum(json.loads(r[1])["taken_over"] for r in reports) == len(runs)
    assert all(survivor.proc.poll() is None for survivor in survivors)
    assert any("node node-a (generation 1) is gone (its node lock is free)" in survivor.log()
               for survivor in survivors)


def test_a_node_whose_lock_session_ends_kills_its_workers_and_takes_the_lock_again(
        pg, tmp_path):
    """The lock lives in a server session: once that session is gone (here ended by the
    server, as a cut connection or a restart would), the node is no longer provably
    alive and another may take over its runs, so it kills its workers at once; then it
    takes the lock again on a new session, boots generation + 1, recovers and starts new
    workers, which run what comes next."""
    log, key = tmp_path / "executions.log", pg.key()
    held = admit(pg, key, "t.hold", log)
    n1 = node(pg, tmp_path, "n1", threads=1)
    wait_until(lambda: pg.query("SELECT status FROM runs WHERE id = ?", (held,)) ==
               [("running",)], 30, 0.1, "the worker to hold the run")
    workers = child_pids(n1.proc.pid)
    assert workers and generation(pg, "n1") == 1
    [(ended,)] = pg.query("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE "
                          "application_name = ?", (f"runstile node n1 pid {n1.proc.pid}",))
    assert ended
    wait_until(lambda: not any(Path(f"/proc/{p}").exists() for p in workers), 10, 0.05,
               "the node's old worker processes to be gone")
    wait_until(lambda: generation(pg, "n1") == 2, 20, 0.1, "the node to boot generation 2")
    wait_until(lambda: "recovered; 1 worker processes up" in n1.log(), 30, 0.1,
               "the node's new workers")
    assert n1.proc.poll() is None
    text = n1.log()
    assert "lost the node lock" in text and "took the node lock again: generation 2" in text
    # The held run was the dead generation's: the boot pass classified it (owner_lost).
    assert pg.query("SELECT status, recovery_reason FROM runs WHERE id = ?", (held,)) == \
        [("interrupted", "owner_lost")]
    # The new workers are of generation 2, and run a run to its end.
    assert set(child_pids(n1.proc.pid)).isdisjoint(workers)
    after = admit(pg, key, "t.hold", log, ticks=1)
    wait_until(lambda: pg.query("SELECT status FROM runs WHERE id = ?", (after,)) ==
               [("completed",)], 30, 0.1, "the new generation to complete a run")
    [(started,)] = pg.query("SELECT data FROM events WHERE run_id = ? AND type = "
                            "'run.started'", (after,))
    assert json.loads(started)["owner"]["generation"] == 2, started
    n1.kill(signal.SIGTERM)


def test_a_node_that_finds_its_name_taken_after_losing_its_lock_waits_and_says_so_once(
        pg, tmp_path):
    n1 = node(pg, tmp_path, "n1", threads=1)
    [(ended,)] = pg.query("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE "
                          "application_name = ?", (f"runstile node n1 pid {n1.proc.pid}",))
    assert ended
    # This test takes the name first: n1 needs a moment to see its session gone.
    lock = wait_until(lambda: _try_lock(pg, tmp_path, "n1"), 5, 0.01, "the lock of n1")
    try:
        wait_until(lambda: "waiting for it to stop" in n1.log(), 20, 0.1,
                   "n1 to say its name is taken")
        time.sleep(3)  # three more tries of n1's, said once
        assert n1.log().count("waiting for it to stop") == 1
        assert n1.proc.poll() is None and generation(pg, "n1") == 1
        assert PASSWORD not in n1.log()
    finally:
        lock.release()
    wait_until(lambda: generation(pg, "n1") == 2, 20, 0.1, "n1 to take its lock again")
    wait_until(lambda: "recovered; 1 worker processes up" in n1.log(), 30, 0.1,
               "n1's new workers")


def _try_lock(ledger: Ledger, tmp_path: Path, node_id: str):
    from runstile.errors import NodeLocked
    from runstile.ledger import nodes
    try:
        return nodes.node_lock(ledger.url, data_dir=tmp_path / "taker", node_id=node_id,
                               busy_timeout_ms=5000).acquire()
    except NodeLocked:
        return None


def test_runstile_recover_on_postgresql_takes_over_a_dead_nodes_runs_and_says_so(
        pg, tmp_path):
    log, key = tmp_path / "executions.log", pg.key()
    runs = [admit(pg, key, "t.hold", log) for _ in range(2)]
    a = node(pg, tmp_path, "node-a", threads=2)
    wait_until(lambda: pg.query("SELECT COUNT(*) FROM runs WHERE status = 'running'")[0][0]
               == len(runs), 30, 0.1, "node-a to hold both runs")
    alive = subprocess.run(
        [sys.executable, "-m", "runstile", "recover", "--json", "--data-dir",
         str(tmp_path / "ops")], env={**os.environ, **env_of(pg, "ops")},
        capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert alive.returncode == 0, alive.stderr
    assert json.loads(alive.stdout)["taken_over"] == {}
    a.kill(signal.SIGKILL)

    def recover() -> dict | None:
        done = subprocess.run(
            [sys.executable, "-m", "runstile", "recover", "--json", "--data-dir",
             str(tmp_path / "ops")], env={**os.environ, **env_of(pg, "ops")},
            capture_output=True, text=True, timeout=60, cwd=ROOT)
        assert done.returncode == 0, done.stderr
        report = json.loads(done.stdout)
        return report if report["taken_over"] else None

    report = wait_until(recover, 20, 0.2, "`runstile recover` to find node-a dead")
    assert report["taken_over"] == {"node-a": 1}
    assert report["counts"]["taken_over"] == report["counts"]["interrupted"] == len(runs)
    assert PASSWORD not in json.dumps(report)


def test_a_url_given_by_flag_reaches_the_workers_through_the_environment_not_argv(
        pg, tmp_path):
    env = {k: v for k, v in {**os.environ, **env_of(pg, "n1")}.items()
           if k != "RUNSTILE_DATABASE_URL"}
    log_path = tmp_path / "flag.log"
    rid = admit(pg, pg.key(), "t.hold", tmp_path / "executions.log", ticks=1)
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "runstile", "worker", "--data-dir", str(tmp_path / "d"),
             "--workers", "1", "--threads", "1", "--database-url", pg.url], env=env,
            stdout=log, stderr=log, start_new_session=True, cwd=ROOT)
    STARTED.append(proc)
    wait_until(lambda: "] worker up: node n1" in log_path.read_text(), 30, 0.05,
               "the worker process to consume")
    children = argv_of_tree(proc.pid)[1:]
    assert children and all("worker-process" in argv for argv in children), children
    assert not any("postgresql" in argv or PASSWORD in argv for argv in children), children
    assert generation(pg, "n1") == 1
    # The run is claimed and finished in the flag's database: a worker process without
    # the URL would look for it in <data-dir>/ledger.db.
    wait_until(lambda: pg.query("SELECT status FROM runs WHERE id = ?", (rid,)) ==
               [("completed",)], 30, 0.1, "the worker to complete the run")
    kill_group(proc, signal.SIGTERM)
    assert PASSWORD not in log_path.read_text()
