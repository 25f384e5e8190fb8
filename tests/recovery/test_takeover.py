"""Takeover at the ledger (docs/operations.md, "Node lock and generations"): on a
PostgreSQL ledger a pass also classifies the runs of other nodes whose node lock no
session holds, at once, each run once however many passes race for them; a node whose
lock is held keeps its runs.  On SQLite nothing changes: another node's runs wait for
their leases."""

from __future__ import annotations

import threading

import pytest

from runstile import tasks as registry
from runstile.config import Settings
from runstile.errors import NodeLocked
from runstile.ledger import db, migrations, nodes
from runstile.ledger import recovery as ledger_recovery
from runstile.recovery import reconcile
from tests import postgres
from tests.conftest import Api, Ledger, Server
from tests.recovery.test_recovery import crashed_run

#: Runs once, on the PostgreSQL pass (tests/postgres.py).
pytestmark = pytest.mark.postgresql

registry.load(("tests.workers.exec_tasks",))


@pytest.fixture
def pg_ledger(tmp_path):
    with postgres.fresh_database(required=True) as url:
        migrations.migrate(url)
        yield Ledger(tmp_path / "data", url=url)


def lock_of(ledger: Ledger, node_id: str):
    return nodes.node_lock(ledger.target, data_dir=ledger.data_dir, node_id=node_id,
                           busy_timeout_ms=5000)


def boot(ledger: Ledger, node_id: str) -> int:
    conn = ledger.connect()
    try:
        return nodes.boot(conn, node_id)
    finally:
        conn.close()


def settings_of(ledger: Ledger, node_id: str) -> Settings:
    return Settings(data_dir=ledger.data_dir, node_id=node_id, database_url=ledger.url)


def live_runs_of_node_a(ledger: Ledger, n: int) -> list[str]:
    """``n`` runs that node-a (generation 1) holds with leases a minute long."""
    key = ledger.key()
    return [crashed_run(ledger, key, "t.hold", expire=False, node="node-a")[0]
            for _ in range(n)]


def test_a_node_whose_lock_is_held_keeps_its_runs_and_one_whose_lock_is_free_loses_them(
        pg_ledger):
    lock = lock_of(pg_ledger, "node-a").acquire()
    assert boot(pg_ledger, "node-a") == 1
    runs = live_runs_of_node_a(pg_ledger, 3)
    conn = pg_ledger.connect()
    assert ledger_recovery.dead_nodes(conn, node_id="node-b") == {}
    report = reconcile.run_pass(settings_of(pg_ledger, "node-b"), generation=0,
                                trigger="command")
    assert report.taken_over == {}
    assert {s for (s,) in pg_ledger.query("SELECT status FROM runs")} == {"running"}
    lock.release()  # node-a lets go, as the server does when its process dies
    assert ledger_recovery.dead_nodes(conn, node_id="node-b") == {"node-a": 1}
    assert ledger_recovery.dead_nodes(conn, node_id="node-a") == {}, "never itself"
    conn.close()
    report = reconcile.run_pass(settings_of(pg_ledger, "node-b"), generation=0,
                                trigger="command")
    assert report.taken_over == {"node-a": 1}
    assert report.counts["taken_over"] == 3 and report.counts["interrupted"] == 3
    assert pg_ledger.query("SELECT id, status, recovery_reason FROM runs ORDER BY id") == \
        sorted((rid, "interrupted", "owner_lost") for rid in runs)
    conn = pg_ledger.connect()
    [latest] = ledger_recovery.latest_reports(conn, limit=1)
    conn.close()
    assert latest["node_id"] == "node-b" and latest["taken_over"] == {"node-a": 1}


def test_passes_racing_for_a_dead_nodes_runs_classify_each_run_once(pg_ledger):
    lock = lock_of(pg_ledger, "node-a").acquire()
    boot(pg_ledger, "node-a")
    runs = live_runs_of_node_a(pg_ledger, 40)
    lock.release()
    start = threading.Barrier(3)
    reports: list[reconcile.Report] = []

    def survivor(node_id: str) -> None:
        start.wait()
        reports.append(reconcile.run_pass(settings_of(pg_ledger, node_id), generation=0,
                                          trigger="command"))

    threads = [threading.Thread(target=survivor, args=(n,)) for n in ("node-b", "node-c",
                                                                      "node-d")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(reports) == 3
    assert sum(r.counts["taken_over"] for r in reports) == len(runs)
    assert sum(r.counts["interrupted"] for r in reports) == len(runs)
    assert all(r.taken_over in ({}, {"node-a": 1}) for r in reports)
    assert pg_ledger.query(
        "SELECT run_id, COUNT(*) FROM events WHERE type = 'run.interrupted' GROUP BY run_id "
        "ORDER BY run_id") == sorted((rid, 1) for rid in runs)


def test_a_dead_nodes_runs_of_a_later_generation_than_the_one_read_are_left_alone(pg_ledger):
    """The generation bound: runs are judged dead only up to the generation read before
    the lock was seen free (a node that boots after that look owns later ones)."""
    lock = lock_of(pg_ledger, "node-a").acquire()
    boot(pg_ledger, "node-a")
    key = pg_ledger.key()
    old = crashed_run(pg_ledger, key, "t.hold", expire=False, node="node-a")[0]
    newer = crashed_run(pg_ledger, key, "t.hold", expire=False, node="node-a",
                        generation=2)[0]
    lock.release()
    conn = pg_ledger.connect()
    with db.transaction(conn):
        batch = ledger_recovery.orphaned_of(conn, node_id="node-a", generation=1, limit=10)
    conn.close()
    assert [run["id"] for run in batch] == [old]
    assert newer not in {run["id"] for run in batch}


def test_a_second_holder_of_one_node_name_is_refused_and_another_name_is_not(pg_ledger):
    first = lock_of(pg_ledger, "node-a").acquire()
    with pytest.raises(NodeLocked, match="node 'node-a' is already running on .*pid"):
        lock_of(pg_ledger, "node-a").acquire()
    other = lock_of(pg_ledger, "node-b").acquire()
    assert first.held() and other.held()
    keys = pg_ledger.query("SELECT id, lock_key FROM nodes ORDER BY id")
    assert [k for _, k in keys] == [1, 2], "each name its own key"
    first.release()
    again = lock_of(pg_ledger, "node-a").acquire()
    assert again.held() and not first.held()
    again.release()
    other.release()


def test_on_sqlite_another_nodes_live_runs_wait_for_their_leases(ledger):
    key = ledger.key()
    rid = crashed_run(ledger, key, "t.hold", expire=False, node="node-a")[0]
    conn = ledger.connect()
    assert ledger_recovery.dead_nodes(conn, node_id="node-b") == {}
    conn.close()
    reconcile.run_pass(Settings(data_dir=ledger.data_dir, node_id="node-b"), generation=0,
                       trigger="command")
    assert ledger.query("SELECT status FROM runs WHERE id = ?", (rid,)) == [("running",)]


def test_get_v1_recovery_shows_which_dead_nodes_a_pass_took_over(pg_ledger):
    lock = lock_of(pg_ledger, "node-a").acquire()
    boot(pg_ledger, "node-a")
    live_runs_of_node_a(pg_ledger, 2)
    lock.release()
    reconcile.run_pass(settings_of(pg_ledger, "node-b"), generation=0, trigger="command")
    server = Server(pg_ledger.data_dir, {"RUNSTILE_DATABASE_URL": pg_ledger.url}).start()
    try:
        [taking, *_] = Api(server, pg_ledger.key(admin=True), pg_ledger).get(
            "/v1/recovery").json()["data"]
    finally:
        server.kill()
    assert taking["node_id"] == "node-b" and taking["taken_over"] == {"node-a": 1}
    assert taking["counts"]["taken_over"] == 2
