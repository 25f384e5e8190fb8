"""The embedded broker on a PostgreSQL ledger: what only that engine has
(docs/architecture.md, "The embedded broker").

test_sqlite_broker.py runs the whole broker contract on both engines; here are the
parts SQLite has no twin of: the NOTIFY trigger (migration 11) and the watcher's LISTEN
session with its fallback look; claims that skip each other's rows (``FOR UPDATE SKIP
LOCKED``) and, in two processes, never share one; the claim and ack outside the
ledger-wide writer lock; and a runstile worker process (workers/process.py) running
runs admitted on PostgreSQL.
Each test gets a fresh database (tests/postgres.py); without RUNSTILE_TEST_DATABASE_URL
they skip, and fail under CI.  Nothing is decided by timing: a wait's bound is only how
long to wait before failing, and which path woke a consumer is read from the watcher's
count of wake-ups.
"""

from __future__ import annotations

import collections
import os
import subprocess
import sys
from pathlib import Path

import psycopg
import pytest
from dramatiq import Message

from runstile import dispatch
from runstile.config import Settings
from runstile.errors import LedgerUnavailable
from runstile.ledger import admission, broker_queue, db, keys, migrations
from runstile.ledger.db_postgresql import WRITER_LOCK
from runstile.workers.sqlite_broker import SQLiteBroker, enqueue_in
from tests import postgres
from tests.conftest import ROOT, Ledger, wait_until

#: Runs once, on the PostgreSQL pass (tests/postgres.py).
pytestmark = pytest.mark.postgresql

HERE = Path(__file__).resolve().parent
#: One runstile worker process (workers/process.py) as `runstile worker` starts it.
WORKER = "from runstile.config import Settings; from runstile.workers import process; " \
         "process.run(Settings.from_env(), 1)"


@pytest.fixture
def pg_ledger(tmp_path):
    with postgres.fresh_database(required=True) as url:
        migrations.migrate(url)
        yield Ledger(tmp_path / "data", url=url)


@pytest.fixture
def make_broker(pg_ledger):
    brokers: list[SQLiteBroker] = []

    def make(**options) -> SQLiteBroker:
        options.setdefault("consumer_timeout_s", 5.0)
        options.setdefault("heartbeat_interval_s", 0.5)
        broker = SQLiteBroker(pg_ledger.url, **options)
        broker.declare_queue("default")
        brokers.append(broker)
        return broker

    yield make
    for broker in brokers:
        broker.close()


def message(*args, queue: str = "default") -> Message:
    return Message(queue_name=queue, actor_name="noop", args=args, kwargs={}, options={})


def insert(ledger: Ledger, *messages: Message, notify: bool = True) -> None:
    """Commit ``messages`` from a connection of the test's own (no broker, so no local
    wake-up).  ``notify=False``: through a session whose triggers do not fire, as if
    the notification were lost."""
    conn = ledger.connect()
    try:
        if not notify:
            conn.execute("SET session_replication_role = replica")
        with db.transaction(conn):
            for m in messages:
                enqueue_in(conn, m)
    finally:
        conn.close()


def idle_consumer(broker: SQLiteBroker):
    """A consumer with nothing to do, its watcher LISTENing; its event cleared."""
    consumer = broker.consume("default", prefetch=1, timeout=50)
    assert next(consumer) is None
    watcher = broker.watcher()
    wait_until(lambda: watcher.mode, 10, 0.01, "the watcher to LISTEN")
    assert watcher.mode == "listen"
    consumer.woken.clear()
    return consumer, watcher


def test_an_idle_consumer_is_woken_by_the_ledgers_notification_not_by_the_fallback(
        make_broker, pg_ledger):
    # The fallback look would come only after an hour: a wake-up now is the notification's.
    consumer, watcher = idle_consumer(make_broker(fallback_poll_s=3600))
    sent = message("hello")
    insert(pg_ledger, sent)
    assert consumer.woken.wait(30), "the notification never woke the consumer"
    assert watcher.wakeups == {"notify": 1}
    proxy = next(consumer)
    assert proxy is not None and proxy.message_id == sent.message_id
    consumer.ack(proxy)
    consumer.close()


def test_a_message_whose_notification_is_lost_is_still_delivered_by_the_fallback_look(
        make_broker, pg_ledger):
    consumer, watcher = idle_consumer(make_broker(fallback_poll_s=0.2))
    sent = message("quiet")
    insert(pg_ledger, sent, notify=False)
    assert consumer.woken.wait(30), "the fallback look never woke the consumer"
    assert watcher.wakeups["fallback"] >= 1 and watcher.wakeups["notify"] == 0
    proxy = next(consumer)
    assert proxy is not None and proxy.message_id == sent.message_id
    consumer.ack(proxy)
    consumer.close()


def listening_pids(ledger: Ledger) -> set[int]:
    return {pid for (pid,) in ledger.query(
        "SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
        f"AND query = 'LISTEN {broker_queue.CHANNEL}'")}


def test_a_watcher_whose_listening_session_is_killed_listens_again_and_still_wakes(
        make_broker, pg_ledger):
    consumer, watcher = idle_consumer(make_broker(fallback_poll_s=3600))
    (first,) = wait_until(lambda: listening_pids(pg_ledger), 10, 0.02, "the LISTEN session")
    pg_ledger.query("SELECT pg_terminate_backend(?)", (first,))
    wait_until(lambda: listening_pids(pg_ledger) - {first}, 30, 0.02,
               "the watcher to LISTEN on a new session")
    consumer.woken.clear()
    sent = message("after the reconnect")
    insert(pg_ledger, sent)
    assert consumer.woken.wait(30), "the new session's notification never woke the consumer"
    assert watcher.wakeups["notify"] == 1
    proxy = next(consumer)
    assert proxy is not None and proxy.message_id == sent.message_id
    consumer.ack(proxy)
    consumer.close()


def received(listener, until: str) -> list[str]:
    """The payloads ``listener`` receives up to and including the first ``until``."""
    got: list[str] = []
    wait_until(lambda: got.extend(p for _, p in listener.notifications()) or until in got,
               30, 0.01, f"a notification for {until!r}")
    return got


def test_a_ready_row_notifies_its_queue_at_commit_once_per_transaction_never_on_rollback(
        pg_ledger):
    listener, writer = pg_ledger.connect(), pg_ledger.connect()
    try:
        assert broker_queue.listen(listener)
        with db.transaction(writer):
            for n in range(3):
                broker_queue.insert_message(writer, "a", f"a{n}", b"body")
            broker_queue.insert_message(writer, "a.DQ", "later", b"body", eta=1e10)
            assert listener.notifications() == []  # nothing before COMMIT
        with pytest.raises(RuntimeError), db.transaction(writer):
            broker_queue.insert_message(writer, "rolled_back", "r", b"body")
            raise RuntimeError("roll back")
        with db.transaction(writer):
            broker_queue.insert_message(writer, "mark", "m", b"body")
        # Notifications arrive in commit order: "mark" comes after everything before it.
        assert collections.Counter(received(listener, "mark")) == {"a": 1, "a.DQ": 1,
                                                                   "mark": 1}
        # A row made ready again (a release, a reap) notifies too; a claim does not.
        broker_queue.register_consumer(writer, broker_queue.ConsumerInfo(
            "c1", "a", os.getpid(), "host", 60.0))
        claimed = broker_queue.claim(writer, "a", "c1", 1)
        assert type(claimed[0]["body"]) is bytes and claimed[0]["body"] == b"body"  # bytea
        broker_queue.release(writer, "c1", [claimed[0]["id"]])
        assert received(listener, "a") == ["a"]
    finally:
        listener.close()
        writer.close()


def test_claims_and_acks_go_on_while_another_session_holds_the_writer_lock(pg_ledger):
    conn = db.connect(pg_ledger.url, busy_timeout_ms=300)
    info = broker_queue.ConsumerInfo("c1", "default", os.getpid(), "host", 60.0)
    broker_queue.register_consumer(conn, info)
    with db.transaction(conn):
        for n in range(2):
            broker_queue.insert_message(conn, "default", f"m{n}", b"body")
    holder = psycopg.connect(pg_ledger.url)  # not autocommit: the lock lasts until rollback
    try:
        holder.execute("SELECT pg_advisory_xact_lock(%s)", (WRITER_LOCK,))
        first, second = broker_queue.claim(conn, "default", "c1", 2)
        assert broker_queue.ack(conn, first["id"], "c1")
        assert broker_queue.dead_letter(conn, second["id"], "c1")
        # The heartbeat keeps the writer lock, so it waits, and times out: the lock held
        # above really is the ledger's writer lock.
        with pytest.raises(LedgerUnavailable):
            broker_queue.heartbeat(conn, [info])
    finally:
        holder.rollback()
        holder.close()
        conn.close()
    assert [tuple(r) for r in pg_ledger.query(
        "SELECT message_id, state FROM broker_messages")] == [("m1", "dead")]


def test_a_claim_takes_the_next_row_instead_of_waiting_for_one_another_session_locked(
        pg_ledger):
    conn = db.connect(pg_ledger.url, busy_timeout_ms=300)
    broker_queue.register_consumer(conn, broker_queue.ConsumerInfo(
        "c1", "default", os.getpid(), "host", 60.0))
    with db.transaction(conn):
        first = broker_queue.insert_message(conn, "default", "first", b"body")
        broker_queue.insert_message(conn, "default", "second", b"body")
    holder = psycopg.connect(pg_ledger.url)  # as another claim holds the row it picked
    try:
        holder.execute("SELECT id FROM broker_messages WHERE id = %s FOR UPDATE", (first,))
        # Waiting on the lock would end in LedgerUnavailable after 300 ms.
        assert [r["message_id"] for r in broker_queue.claim(conn, "default", "c1", 2)] \
            == ["second"]
    finally:
        holder.rollback()
        holder.close()
    assert [r["message_id"] for r in broker_queue.claim(conn, "default", "c1", 2)] == ["first"]
    conn.close()


def test_two_consumer_processes_on_one_database_never_both_get_one_message(
        pg_ledger, tmp_path):
    sent = [message(n) for n in range(600)]
    insert(pg_ledger, *sent)
    go = tmp_path / "go"
    env = {**os.environ, "CONSUMER_LEDGER": pg_ledger.url}
    children = []
    for name in ("one", "two"):
        ready, out = tmp_path / f"{name}.ready", tmp_path / f"{name}.out"
        proc = subprocess.Popen(
            [sys.executable, "-m", "tests.workers.ledger_broker_consumer", str(ready), str(go),
             str(out)], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        children.append((proc, ready, out))
    try:
        def started() -> bool:
            for proc, _, _ in children:
                if proc.poll() is not None:  # died before it was ready: say why
                    raise AssertionError(proc.stdout.read().decode(errors="replace"))
            return all(ready.exists() for _, ready, _ in children)
        wait_until(started, 60, 0.05, "both consumers to start")
        go.write_text("go\n")  # both claim from the same backlog at once
        for proc, _, _ in children:
            assert proc.wait(timeout=120) == 0, proc.stdout.read().decode(errors="replace")
    finally:
        for proc, _, _ in children:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    got = [out.read_text().split() for _, _, out in children]
    deliveries = collections.Counter(got[0] + got[1])
    assert set(deliveries) == {m.message_id for m in sent}
    assert set(deliveries.values()) == {1}, [m for m, n in deliveries.items() if n > 1]
    assert got[0] and got[1], "one process took every message: the claims never raced"
    assert pg_ledger.query("SELECT COUNT(*) FROM broker_messages") == [(0,)]


def admit(conn, enqueue, key_id: str, log: Path, n: int) -> str:
    request = admission.AdmissionRequest(
        principal=keys.Principal("p", key_id, "client"), key=None, key_is_derived=False,
        run_id=None, task="t.log_start", input_json=f'{{"log": "{log}", "n": {n}}}',
        session_key=None, trigger_id=None, metadata_json=None, callback_url=None,
        fingerprint="f" * 64, fingerprint_version=1)
    return admission.admit(conn, request, refusal=None, max_active_runs=100,
                           enqueue=enqueue).run["id"]


def test_a_worker_process_runs_each_run_admitted_on_a_postgresql_ledger_once(
        pg_ledger, tmp_path):
    # The URL goes to the child through the environment, as runstile's own children get it.
    env = {**os.environ, "RUNSTILE_DATABASE_URL": pg_ledger.url,
           "RUNSTILE_DATA_DIR": str(tmp_path), "RUNSTILE_TASKS": "tests.workers.exec_tasks"}
    dispatcher = dispatch.Dispatcher(Settings.from_env(env))
    conn = dispatcher.pool().get()
    key_id = keys.create(conn, "p")[0]
    log = tmp_path / "log.txt"
    # Each run's message is a broker row of its admission's own transaction.
    ids = [admit(conn, dispatcher.in_transaction, key_id, log, n) for n in range(20)]
    assert pg_ledger.query("SELECT COUNT(*) FROM broker_messages WHERE state = 'ready'") \
        == [(20,)]
    worker = subprocess.Popen([sys.executable, "-c", WORKER], cwd=ROOT, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        wait_until(lambda: pg_ledger.query(
            "SELECT status, COUNT(*) FROM runs GROUP BY status") == [("completed", 20)],
            90, 0.1, "the worker to complete every run")
        more = admit(conn, dispatcher.in_transaction, key_id, log, 20)  # an idle worker wakes
        wait_until(lambda: pg_ledger.query("SELECT status FROM runs WHERE id = ?", (more,))
                   == [("completed",)], 60, 0.05, "the run admitted while the worker idled")
    finally:
        worker.terminate()
        worker.wait(timeout=60)
    starts = collections.Counter(line.split()[1] for line in log.read_text().splitlines())
    assert starts == {run_id: 1 for run_id in [*ids, more]}
    assert pg_ledger.query("SELECT COUNT(*) FROM broker_messages") == [(0,)]
