"""Admissions written together (ledger.admission.reserve_many, one group commit) get exactly the
answers and rows they would get one after another (docs/api.md, "Reservation";
docs/architecture.md, "The writer gate and group commit")."""

from __future__ import annotations

import dataclasses
import secrets

import pytest

from runstile import dispatch
from runstile.config import Settings
from runstile.errors import (
    CapacityExceeded,
    IdempotencyKeyConflict,
    InvalidCallbackUrl,
    RunIdConflict,
)
from runstile.ledger import admission, db, group_commit, keys, migrations
from runstile.ledger.keys import Principal

ENQUEUE = dispatch.Dispatcher(Settings()).enqueue


@pytest.fixture
def ledger(ledger_target):
    """A ledger on each engine (tests/postgres.py)."""
    path = ledger_target
    migrations.migrate(path)
    conn = db.connect(path)
    key_id, _ = keys.create(conn, "p")
    yield conn, Principal("p", key_id, "client")
    conn.close()


def request(principal, *, key=None, run_id=None, task="echo", fp="a", derived=False):
    if key is None and run_id is not None:
        key, derived = "legacy-run:" + run_id, True
    return admission.AdmissionRequest(
        principal=principal, key=key, key_is_derived=derived, run_id=run_id, task=task,
        input_json="null", session_key=None, trigger_id=None, metadata_json=None,
        callback_url=None, fingerprint=fp * 64, fingerprint_version=1)


def batch(conn, *reqs, refusal=None, max_active_runs=1000, enqueue=ENQUEUE):
    reservations = [admission.Reservation(r, refusal, max_active_runs, enqueue) for r in reqs]
    with db.transaction(conn):
        return admission.reserve_many(conn, reservations)


def count(conn, sql, *args):
    return conn.execute(sql, args).fetchone()[0]


def test_fresh_admissions_in_one_batch_each_get_their_run_key_dispatch_event_and_message(ledger):
    conn, who = ledger
    outcomes = batch(conn, *(request(who, key=f"k{i}", fp=str(i)) for i in range(5)))
    assert all(error is None and not admitted.replayed for admitted, error in outcomes)
    ids = [admitted.run["id"] for admitted, _ in outcomes]
    assert len(set(ids)) == 5
    for admitted, _ in outcomes:
        run_id = admitted.run["id"]
        stored = dict(conn.execute("SELECT * FROM runs WHERE id = ?", (run_id,)).fetchone())
        assert stored == admitted.run   # the answer is the row, as RETURNING * gave it
        assert count(conn, "SELECT COUNT(*) FROM events WHERE run_id = ? AND seq = 1 "
                           "AND type = 'run.queued' AND data = '{\"attempt\":1}'", run_id) == 1
        assert [tuple(row) for row in conn.execute(
            "SELECT id, sent_at IS NOT NULL FROM dispatches WHERE run_id = ?", (run_id,))
        ] == [(admitted.dispatch_id, 1)]
        body = conn.execute("SELECT body FROM broker_messages WHERE run_id = ?",
                            (run_id,)).fetchone()[0]
        assert f'"dispatch_id":{admitted.dispatch_id}'.encode() in bytes(body)
    assert count(conn, "SELECT COUNT(*) FROM idempotency_keys") == 5
    assert count(conn, "SELECT active_runs FROM profiles WHERE id = 'p'") == 5


def test_two_identical_requests_in_one_batch_give_one_run_and_one_replay(ledger):
    conn, who = ledger
    (first, e1), (second, e2) = batch(conn, request(who, key="same"), request(who, key="same"))
    assert e1 is e2 is None
    assert (first.replayed, second.replayed) == (False, True)
    assert first.run["id"] == second.run["id"]
    assert count(conn, "SELECT COUNT(*) FROM runs") == 1
    assert count(conn, "SELECT COUNT(*) FROM dispatches") == 1


def test_the_same_key_with_another_body_in_one_batch_is_a_conflict(ledger):
    conn, who = ledger
    (first, _), (_, error) = batch(conn, request(who, key="k", fp="a"),
                                   request(who, key="k", fp="b"))
    assert not first.replayed
    assert isinstance(error, IdempotencyKeyConflict)
    assert count(conn, "SELECT COUNT(*) FROM runs") == 1


def test_a_client_run_id_taken_earlier_in_the_batch_replays_or_conflicts_as_in_sequence(ledger):
    conn, who = ledger
    rid = "run_" + secrets.token_hex(16)
    (first, _), (again, e2), (other, e3), (keyed, e4) = batch(
        conn, request(who, run_id=rid), request(who, run_id=rid),
        request(who, run_id=rid, fp="b"), request(who, run_id=rid, key="header-key"))
    assert not first.replayed and again.replayed and again.run["id"] == rid
    assert other is None and isinstance(e3, RunIdConflict)
    # The same body under a new header key binds that key to the run.
    assert e4 is None and keyed.replayed and keyed.run["id"] == rid
    assert count(conn, "SELECT COUNT(*) FROM idempotency_keys WHERE run_id = ?", rid) == 2


def test_capacity_counts_the_new_runs_before_it_in_the_batch(ledger):
    conn, who = ledger
    outcomes = batch(conn, *(request(who, key=f"k{i}", fp=str(i)) for i in range(4)),
                     max_active_runs=2)
    assert [error is None for _, error in outcomes] == [True, True, False, False]
    assert all(isinstance(error, CapacityExceeded) for _, error in outcomes[2:])
    assert count(conn, "SELECT active_runs FROM profiles WHERE id = 'p'") == 2
    assert count(conn, "SELECT COUNT(*) FROM idempotency_keys") == 2


def test_a_refusal_for_new_runs_still_lets_a_replay_in_the_same_batch_answer(ledger):
    conn, who = ledger
    batch(conn, request(who, key="known"))
    (replay, e1), (_, e2) = batch(conn, request(who, key="known"), request(who, key="new"),
                                  refusal=InvalidCallbackUrl("no", field="callback_url"))
    assert e1 is None and replay.replayed
    assert isinstance(e2, InvalidCallbackUrl)
    assert count(conn, "SELECT COUNT(*) FROM runs") == 1


def test_a_batch_without_an_in_transaction_enqueue_leaves_its_dispatches_unsent(ledger):
    conn, who = ledger
    outcomes = batch(conn, request(who, key="a"), request(who), enqueue=None)
    assert count(conn, "SELECT COUNT(*) FROM dispatches WHERE sent_at IS NULL") == 2
    assert count(conn, "SELECT COUNT(*) FROM broker_messages") == 0
    assert sorted(a.dispatch_id for a, _ in outcomes) == [
        row[0] for row in conn.execute("SELECT id FROM dispatches ORDER BY id")]


def test_a_batch_of_waiting_admissions_runs_through_one_reserve_many(ledger, ledger_target):
    conn, who = ledger
    batches = group_commit.Batches(lambda: db.connect(ledger_target))
    units = [group_commit.Unit(admission.Reservation(request(who, key=k), None, 1000, ENQUEUE))
             for k in ("x", "y", "x")]
    batches.settle(units)
    assert [u.error for u in units] == [None, None, None]
    assert [u.result.replayed for u in units] == [False, False, True]
    assert units[0].result.run["id"] == units[2].result.run["id"]


def test_the_row_a_batch_returns_names_every_column_of_runs_in_order(ledger):
    """A batch builds the new run's row itself (what SELECT * would return): a column a
    migration adds must be named there too, or every batched admission answers without it."""
    from runstile.ledger.admission_rows import _RUN_COLUMNS
    conn, _ = ledger
    columns = conn.execute("SELECT * FROM runs LIMIT 0").description
    assert _RUN_COLUMNS == tuple(c[0] for c in columns)


def test_a_retrys_run_names_the_run_it_retries_whether_batched_or_alone(ledger):
    """retry_of (POST /v1/runs/{run_id}/retry) is written by both of admission's paths: a
    batch's multi-row INSERT (admission_rows) and a reservation alone (admission._reserve)."""
    conn, who = ledger
    original = "run_" + "e" * 32
    retry = dataclasses.replace(request(who, key="r1", fp="r"), retry_of=original)
    [(batched, error)] = batch(conn, retry)
    assert error is None and batched.run["retry_of"] == original
    alone = admission.admit(conn, dataclasses.replace(retry, key="r2"), refusal=None,
                            max_active_runs=1000)
    assert alone.run["retry_of"] == original
    for admitted in (batched, alone):
        stored = dict(conn.execute("SELECT * FROM runs WHERE id = ?",
                                   (admitted.run["id"],)).fetchone())
        assert stored == admitted.run and stored["retry_of"] == original
    [(plain, _)] = batch(conn, request(who, key="r3"))
    assert plain.run["retry_of"] is None
