"""What a commit owes (docs/architecture.md, "What a commit owes"), on a real SQLite file.

The ledger writes down what a transaction owes as it writes the rows; after the COMMIT
the connection's ``after_commit`` gets it once; a rollback owes nothing.  The end-to-end
payment (a Redis publish, a deliverer message) is proven by the broker and delivery
tests; here the ledger's side of the contract.
"""

from __future__ import annotations

import pytest

from runstile import dispatch
from runstile.config import Settings
from runstile.ledger import admission, db, execution, keys, obligations
from runstile.ledger.execution import Owner
from runstile.ledger.keys import Principal
from runstile.ledger.owed import Owed, owe_deliveries, owe_publish

#: Redis or RabbitMQ: dispatch records are written unsent and their publish is owed.
AFTER_COMMIT = dispatch.Dispatcher(Settings(broker_url="redis://127.0.0.1:1/0")).enqueue
OWNER = Owner("node-a", 1, 4242, 1)


@pytest.fixture
def ledger(dual_ledger):
    """Every test here runs on both engines (tests/postgres.py)."""
    return dual_ledger


class Ledger:
    """A pool connection whose debts are recorded instead of paid."""

    def __init__(self, path):
        self.paid: list[Owed] = []
        self.pool = db.ConnectionPool(path, synchronous="OFF", busy_timeout_ms=5000,
                                      after_commit=lambda conn, owed: self.paid.append(owed))
        self.conn = self.pool.get()
        self.key_id = keys.create(self.conn, "p")[0]

    def admit(self, *, session_key: str | None = None, callback_url: str | None = None) -> str:
        request = admission.AdmissionRequest(
            principal=Principal("p", self.key_id, "client"), key=None, key_is_derived=False,
            run_id=None, task="t", input_json="{}", session_key=session_key, trigger_id=None,
            metadata_json=None, callback_url=callback_url, fingerprint="f" * 64,
            fingerprint_version=1)
        # Admission passes no enqueue on Redis/RabbitMQ: its web process publishes itself.
        return admission.admit(self.conn, request, refusal=None, max_active_runs=100,
                               enqueue=None).run["id"]


@pytest.fixture
def owing(ledger):
    return Ledger(ledger.target)


def claim_then_finish(owing: Ledger, run_id: str) -> None:
    """Claim ``run_id`` and complete it; ``owing.paid`` then holds what the finish owed."""
    assert execution.claim(owing.conn, run_id, OWNER, lease_s=60, task_known=lambda t: True,
                           enqueue=AFTER_COMMIT).run is not None
    owing.paid.clear()
    execution.finish(owing.conn, run_id, OWNER, status="completed", result_json="1",
                     enqueue=AFTER_COMMIT)


def test_a_finish_that_frees_a_session_owes_the_next_runs_publish_and_pays_it_once(owing):
    first = owing.admit(session_key="s")
    second = owing.admit(session_key="s")
    claim_then_finish(owing, first)
    assert len(owing.paid) == 1
    [(dispatch_id, run_id, delay_s, priority, queue)] = owing.paid[0].publish
    assert (run_id, delay_s, priority, queue) == (second, 0.0, 5, "default")
    sent_at = owing.conn.execute("SELECT sent_at FROM dispatches WHERE id = ?",
                                 (dispatch_id,)).fetchone()[0]
    assert sent_at is None  # unsent until a publisher marks it
    # A run without a callback_url gets no obligation from its completed event: its
    # finish owes no delivery, and its settlement looks nothing up.
    assert owing.paid[0].deliveries == []


def test_a_finish_of_a_run_with_a_callback_owes_its_delivery(owing):
    run_id = owing.admit(callback_url="https://hooks.example/done")
    claim_then_finish(owing, run_id)
    # The completed event created a callback obligation: a delivery is owed.
    assert [owed.deliveries for owed in owing.paid] == [[run_id]]
    assert owing.conn.execute("SELECT COUNT(*) FROM obligations WHERE run_id = ?",
                              (run_id,)).fetchone()[0] == 1


def test_a_transaction_that_rolls_back_owes_nothing(owing):
    with pytest.raises(RuntimeError), db.transaction(owing.conn):
        owe_publish(owing.conn, 1, "run_gone")
        raise RuntimeError("rolled back")
    with db.transaction(owing.conn):
        owe_deliveries(owing.conn, "run_kept")
    assert [(o.publish, o.deliveries) for o in owing.paid] == [([], ["run_kept"])]


def test_a_savepoint_that_rolls_back_takes_back_only_its_own_debts(owing):
    with db.transaction(owing.conn):
        owe_deliveries(owing.conn, "run_outer")
        with pytest.raises(RuntimeError), db.transaction(owing.conn):
            owe_deliveries(owing.conn, "run_inner")
            raise RuntimeError("inner rolled back")
    assert [o.deliveries for o in owing.paid] == [["run_outer"]]


def test_a_commit_that_owes_nothing_calls_no_one(owing):
    owing.admit()  # admission on Redis/RabbitMQ publishes its own record
    with db.transaction(owing.conn):
        owing.conn.execute("SELECT 1")
    assert owing.paid == []


def test_what_after_commit_commits_itself_is_not_handed_back_to_it(ledger):
    calls: list[Owed] = []

    def pay(conn, owed):
        calls.append(owed)
        with db.transaction(conn):  # as a publisher marking its record sent does
            owe_deliveries(conn, "run_from_the_payment")

    conn = db.ConnectionPool(ledger.target, synchronous="OFF", busy_timeout_ms=5000,
                             after_commit=pay).get()
    with db.transaction(conn):
        owe_deliveries(conn, "run_a")
    assert [o.deliveries for o in calls] == [["run_a"]]


def test_re_arming_a_parked_delivery_owes_its_message(owing):
    run_id = owing.admit(callback_url="https://example.com/hook")
    owing.conn.execute(
        "INSERT INTO obligations (id, run_id, profile_id, kind, type, url, occurred_at, "
        "state, next_attempt_at, created_at, updated_at, settled_at) VALUES "
        "(?, ?, 'p', 'callback', 'run.failed', 'https://example.com/hook', 0, 'parked', "
        "0, 0, 0, 0)", (obligations.new_id(), run_id))
    [obligation_id] = [row["id"] for row in obligations.for_run(owing.conn, run_id)]
    owing.paid.clear()
    assert obligations.rearm(owing.conn, obligation_id, by="test")[1] is True
    assert [o.deliveries for o in owing.paid] == [[run_id]]
    owing.paid.clear()
    assert obligations.rearm(owing.conn, obligation_id, by="test")[1] is False  # a repeat
    assert owing.paid == []
