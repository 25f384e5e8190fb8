"""Ledger functions whose SQL the engines spell differently (JSON members, the larger of
two values, upserts, retention's row-value deletes), each run on both engines
(docs/architecture.md, "Two dialects, one ledger")."""

from __future__ import annotations

import itertools
import json

import pytest

from runstile import dispatch
from runstile.config import Settings
from runstile.ledger import (
    admission,
    execution,
    keys,
    obligations,
    retention,
    runs,
    webhook_secrets,
)
from runstile.ledger.execution import Owner
from runstile.ledger.keys import Principal

ENQUEUE = dispatch.Dispatcher(Settings()).enqueue
OWNER = Owner("node-a", 1, 4242, 1)


@pytest.fixture
def ledger(dual_ledger):
    """Every test here runs on both engines (tests/postgres.py)."""
    return dual_ledger


@pytest.fixture
def who(conn) -> Principal:
    return Principal("p", keys.create(conn, "p")[0], "client")


def admit(conn, who, *, metadata=None, callback_url=None, key=None) -> str:
    request = admission.AdmissionRequest(
        principal=who, key=key, key_is_derived=False, run_id=None, task="t",
        input_json="{}", session_key=None, trigger_id=None,
        metadata_json=None if metadata is None else json.dumps(metadata),
        callback_url=callback_url, fingerprint="f" * 64, fingerprint_version=1)
    return admission.admit(conn, request, refusal=None, max_active_runs=100,
                           enqueue=ENQUEUE).run["id"]


def finish(conn, run_id: str, status: str = "completed") -> None:
    assert execution.claim(conn, run_id, OWNER, lease_s=60, task_known=lambda t: True,
                           enqueue=ENQUEUE).run is not None
    assert execution.finish(conn, run_id, OWNER, status=status, result_json="1",
                            enqueue=ENQUEUE) is not None


def listed(conn, who, **filters) -> list[str]:
    rows, _ = runs.list_visible(conn, who, runs.RunFilter(**filters), before_seq=None,
                                limit=10, timeout_s=5)
    return [r["id"] for r in rows]


def test_a_list_filters_on_a_string_member_of_the_runs_metadata(conn, who):
    blue = admit(conn, who, metadata={"team": "blue", "n": 1})
    admit(conn, who, metadata={"team": "red"})
    admit(conn, who, metadata={"team": 7})
    admit(conn, who)
    assert listed(conn, who, metadata=(("team", "blue"),)) == [blue]
    assert listed(conn, who, metadata=(("n", "1"),)) == []  # a number is not the string
    assert listed(conn, who, metadata=(("team", "blue"), ("team", "red"))) == []
    assert listed(conn, who, statuses=("queued",), task="t")[-1] == blue


def test_a_finished_runs_callback_is_one_obligation_claimed_retried_and_delivered(conn, who):
    run_id = admit(conn, who, callback_url="https://example.com/hook")
    finish(conn, run_id)
    [owed] = obligations.for_run(conn, run_id)
    snapshot = json.loads(owed["snapshot"])
    stored = conn.execute("SELECT updated_at FROM runs WHERE id = ?", (run_id,)).fetchone()[0]
    assert (owed["type"], snapshot["status"]) == ("run.completed", "completed")
    assert float(snapshot["updated_at"]) == stored  # no millisecond lost on the way
    assert obligations.unsent(conn) == [owed["id"]]
    assert obligations.mark_sent(conn, [owed["id"]]) == 1 and obligations.unsent(conn) == []
    claim = obligations.claim(conn, owed["id"], node="node-a", generation=1, pid=1, lease_s=30)
    assert claim.row is not None and claim.row["fence"] == 1
    assert obligations.settle_failed(conn, claim.row, status=503, error="busy", delay_s=60,
                                     park=False)
    early = obligations.claim(conn, owed["id"], node="node-a", generation=1, pid=1, lease_s=30)
    assert early.row is None and 50 < early.wait_s <= 60
    conn.execute("UPDATE obligations SET next_attempt_at = 0")
    again = obligations.claim(conn, owed["id"], node="node-a", generation=1, pid=1, lease_s=30)
    assert not obligations.settle_delivered(conn, claim.row, status=200)  # a stale fence
    assert obligations.settle_delivered(conn, again.row, status=200)
    assert obligations.get(conn, owed["id"])["state"] == "delivered"


def test_a_rotated_webhook_secret_keeps_signing_beside_the_new_one(conn, who):
    made = (f"whsec_{n}" for n in itertools.count())
    first = webhook_secrets.current(conn, "p", lambda: next(made))
    assert webhook_secrets.current(conn, "p", lambda: next(made)) == first
    second = webhook_secrets.current(conn, "p", lambda: next(made), rotate=True, grace_s=60)
    assert second != first
    assert webhook_secrets.signing(conn, "p", lambda: next(made)) == [second, first]
    assert webhook_secrets.current(conn, "nobody", lambda: next(made)) is None


def test_retention_purges_a_finished_run_and_leaves_tombstones_that_expire(conn, who):
    old = admit(conn, who, key="k-old")
    kept = admit(conn, who, key="k-kept")
    finish(conn, old, "failed")
    conn.execute("UPDATE runs SET finished_at = 0 WHERE id = ?", (old,))
    report = retention.purge(conn, run_retention_s=3600, key_tombstone_s=3600)
    assert report.runs == 1
    assert [r[0] for r in conn.execute("SELECT id FROM runs")] == [kept]
    assert [r[0] for r in conn.execute("SELECT idempotency_key FROM key_tombstones")] == ["k-old"]
    conn.execute("UPDATE key_tombstones SET expires_at = 0")
    conn.execute("UPDATE run_tombstones SET expires_at = 0")
    assert retention.purge(conn, run_retention_s=3600, key_tombstone_s=3600).tombstones == 2
