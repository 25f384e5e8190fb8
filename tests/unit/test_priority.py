"""Run priority in the ledger (docs/api.md, "POST /v1/runs"; docs/architecture.md, "The
embedded broker"): the fingerprint keeps its old form without it, migration 8 adds it to
existing ledgers, and the consumer's fetch claims by priority through its index."""

from __future__ import annotations

import sqlite3

from runstile.fingerprint import FIELDS, PRIORITY_FIELDS, admission_fields, fingerprint
from runstile.ledger import broker_queue, db, migrations
from tests import postgres
from tests.api.test_priority import OLD_FINGERPRINT

NORMALISED = {"task": "echo", "input": {"n": 1}, "run_id": None, "session_key": "s1",
              "trigger_id": None, "callback_url": None, "metadata": {"a": "b"}}


def test_a_request_without_priority_keeps_its_fingerprint_from_before_priorities():
    body = {**NORMALISED, "priority": None}
    assert admission_fields(body) == FIELDS
    assert fingerprint(body, admission_fields(body)) == OLD_FINGERPRINT


def test_a_present_priority_takes_part_as_the_integer_so_5_is_not_absent():
    body = {**NORMALISED, "priority": 5}
    assert admission_fields(body) == PRIORITY_FIELDS
    assert fingerprint(body, admission_fields(body)) != OLD_FINGERPRINT
    assert fingerprint(body, PRIORITY_FIELDS) != fingerprint({**body, "priority": 6},
                                                             PRIORITY_FIELDS)


def test_migration_8_gives_existing_runs_and_messages_the_default_priority(tmp_path):
    path = tmp_path / "ledger.db"
    conn = sqlite3.connect(path)
    for version, script in migrations.MIGRATIONS:
        if version < 8:
            for statement in migrations.split_statements(script()):
                conn.execute(statement)
    conn.execute("PRAGMA user_version = 7")
    conn.execute("INSERT INTO broker_messages (queue_name, message_id, body, enqueued_at) "
                 "VALUES ('q', 'm', x'00', 0)")
    conn.commit()
    conn.close()
    assert migrations.migrate(path) == 7
    conn = db.connect(path)
    try:
        assert conn.execute("SELECT priority FROM broker_messages").fetchall()[0][0] == 5
        names = {row[0] for row in conn.execute(
            "SELECT name FROM pragma_table_info('runs')")}
        assert "priority" in names
    finally:
        conn.close()


def test_the_fetch_claims_by_priority_then_arrival_through_its_index(ledger):
    conn = ledger.connect()
    postgres.sqlite_only(conn, "it reads EXPLAIN QUERY PLAN; PostgreSQL plans from table "
                               "statistics, a sequential scan on a table this small")
    try:
        with db.transaction(conn):
            for n, priority in enumerate([0, 5, 9, 0, 9]):
                broker_queue.insert_message(conn, "q", f"m{n}", b"x", priority=priority)
        plan = " ".join(row[-1] for row in conn.execute(
            "EXPLAIN QUERY PLAN SELECT id FROM broker_messages WHERE queue_name = ? AND "
            "state = 'ready' ORDER BY eta, priority DESC, id LIMIT 2", ("q",)))
        assert "broker_messages_ready_by_priority" in plan and "TEMP B-TREE" not in plan
        broker_queue.register_consumer(conn, broker_queue.ConsumerInfo("c", "q", 1, "h", 60))
        claimed = [row["message_id"] for row in broker_queue.claim(conn, "q", "c", 3)]
        assert claimed == ["m2", "m4", "m1"]
        assert [row["message_id"] for row in broker_queue.claim(conn, "q", "c", 5)] == [
            "m0", "m3"]
    finally:
        conn.close()
