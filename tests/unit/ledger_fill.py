"""A real SQLite ledger full of varied rows, written by the ledger's own functions (the
ones the web tier, the workers and recovery call): runs in every status, steps, events,
obligations written by the event trigger, idempotency keys, tombstones, schedules, keys
rotated and revoked, broker messages with binary bodies, nodes, recovery reports,
webhook secrets.  For `runstile db copy` (tests/unit/test_db_copy.py)."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

from runstile.ledger import (
    admission,
    approvals,
    broker_queue,
    db,
    execution,
    journal,
    keys,
    migrations,
    nodes,
    obligations,
    recovery,
    retention,
    schedules,
    webhook_secrets,
)
from runstile.ledger.execution import Owner
from runstile.ledger.keys import Principal

OWNER = Owner("node-a", 1, 4242, 7)
#: Every byte value, NUL first: a body that only survives as bytes.
BINARY = bytes(range(256)) * 3


@dataclass
class Filled:
    """What the filler made that a test reads back."""

    secrets: dict[str, str] = field(default_factory=dict)  # key id -> secret (live keys)
    runs: dict[str, str] = field(default_factory=dict)  # status -> one run id in it


def request(principal: Principal, task: str = "t.work", *, key: str | None = None,
            callback: str | None = None, **fields) -> admission.AdmissionRequest:
    return admission.AdmissionRequest(
        principal=principal, key=key, key_is_derived=False, run_id=None, task=task,
        input_json=json.dumps({"n": 1.0000000000000002, "s": "é\u2603", "x": [1, None]}),
        session_key=fields.pop("session_key", None), trigger_id=None,
        metadata_json=json.dumps({"team": "a"}), callback_url=callback,
        fingerprint=(key or task).ljust(64, "0")[:64], fingerprint_version=1, **fields)


def admit(conn, principal: Principal, **kwargs) -> str:
    return admission.admit(conn, request(principal, **kwargs), refusal=None,
                           max_active_runs=10_000).run["id"]


def claimed(conn, principal: Principal, lease_s: float = 60.0, **kwargs) -> str:
    run_id = admit(conn, principal, **kwargs)
    assert execution.claim(conn, run_id, OWNER, lease_s=lease_s,
                           task_known=lambda t: True).run, run_id
    return run_id


def fill(data_dir: Path) -> Filled:
    """Migrate ``data_dir``/ledger.db and fill it; the same rows each call, ids aside."""
    path = data_dir / "ledger.db"
    migrations.migrate(path)
    conn = db.connect(path)
    try:
        made = Filled()
        principal = _keys(conn, made)
        _runs(conn, principal, made)
        _the_rest(conn)
    finally:
        conn.close()
    return made


def _keys(conn, made: Filled) -> Principal:
    key_id, secret = keys.create(conn, "acme", label="ci")
    made.secrets[key_id] = secret
    admin_id, admin_secret = keys.create(conn, "acme", label="ops", role="admin")
    made.secrets[admin_id] = admin_secret
    rotated = keys.create(conn, "other")[0]
    rotation = keys.rotate(conn, rotated)
    assert rotation is not None
    made.secrets[rotated] = rotation[0]
    assert keys.revoke(conn, keys.create(conn, "other", label="gone")[0])
    webhook_secrets.current(conn, "acme", lambda: "whsec_" + "a" * 40)
    webhook_secrets.current(conn, "acme", lambda: "whsec_" + "b" * 40, rotate=True, grace_s=60)
    return Principal("acme", key_id, "client")


def _runs(conn, p: Principal, made: Filled) -> None:
    hook = "https://hooks.example.com/runstile"
    made.runs["queued"] = admit(conn, p, key="queued-1", priority=9, session_key="s1")
    admit(conn, p, key="delayed-1", delay_s=3600.0)
    made.runs["running"] = running = claimed(conn, p, key="running-1")
    journal.start_step(conn, running, OWNER, position=0, name="fetch", args_hash="h0",
                       idempotent=True, restart=False)
    journal.settle_step(conn, running, OWNER, position=0, state="completed",
                        result_json=json.dumps({"bytes": 1234, "ratio": 0.1 + 0.2}))
    journal.start_step(conn, running, OWNER, position=1, name="charge", args_hash="h1",
                       idempotent=False, restart=False)
    made.runs["stopping"] = stopping = claimed(conn, p)
    execution.stop(conn, stopping)
    made.runs["completed"] = done = claimed(conn, p, key="done-1", callback=hook)
    execution.finish(conn, done, OWNER, status="completed", result_json='{"ok": true}')
    failed = claimed(conn, p, callback=hook)
    execution.finish(conn, failed, OWNER, status="failed", error_code="boom",
                     error_message="it broke")
    made.runs["failed"] = failed
    made.runs["cancelled"] = cancelled = admit(conn, p, key="cancel-1", callback=hook)
    execution.stop(conn, cancelled)
    made.runs["paused"] = paused = claimed(conn, p, callback=hook)
    execution.pause(conn, paused, OWNER, "uncertain_side_effect")
    waiting = claimed(conn, p, callback=hook)
    approvals.request(conn, waiting, OWNER, position=0, args_hash="ha",
                      details={"amount": 12.5})
    made.runs["waiting_for_approval"] = waiting
    with db.transaction(conn):
        obligations.insert_deliver(conn, dict(conn.execute(
            "SELECT * FROM runs WHERE id = ?", (running,)).fetchone()),
            url=hook + "/deliver", payload_json='{"part": 1}')
    made.runs["interrupted"] = _interrupted(conn, p)
    _purged(conn, p)


def _interrupted(conn, p: Principal) -> str:
    run_id = claimed(conn, p, lease_s=0.05, callback="https://hooks.example.com/x")
    time.sleep(0.1)
    orphans = [r for r in recovery.orphaned(conn, node_id="node-b", generation=1, limit=10)
               if r["id"] == run_id]
    with db.transaction(conn):
        assert recovery.apply(conn, orphans[0], "interrupted", "owner_lost", None)
    return run_id


def _purged(conn, p: Principal) -> None:
    """Two finished runs purged by retention: their tombstones stay."""
    for n in range(2):
        run_id = admit(conn, p, key=f"purged-{n}")
        execution.stop(conn, run_id)
    time.sleep(0.01)
    report = retention.purge(conn, run_retention_s=0.005, key_tombstone_s=3600)
    assert report.runs >= 2, report


def _the_rest(conn) -> None:
    schedules.ensure(conn, [("nightly", "acme"), ("hourly", "other")])
    assert schedules.pause(conn, "hourly")
    assert nodes.boot(conn, "node-a") == 1 and nodes.boot(conn, "node-a") == 2
    recovery.record_report(conn, node_id="node-a", generation=2, trigger="boot",
                           started_at=time.time() - 1.5, counts={"requeued": 1, "ms": 0.25})
    with db.transaction(conn):
        for n in range(5):
            broker_queue.insert_message(conn, "default", f"m{n}", BINARY + bytes([n]),
                                        eta=None if n % 2 else time.time() + 1e-3 * n,
                                        priority=n)
        last = broker_queue.insert_message(conn, "default.DQ", "m-last", b"\x00")
    broker_queue.register_consumer(conn, broker_queue.ConsumerInfo(
        "c1", "default", 4242, "host-a", 30.0))
    rows = broker_queue.claim(conn, "default", "c1", limit=2)
    assert broker_queue.dead_letter(conn, rows[0]["id"], "c1")
    # The newest message acknowledged: SQLite's AUTOINCREMENT counter stays above max(id).
    claimed_last = broker_queue.claim(conn, "default.DQ", "c1", limit=1)
    assert claimed_last[0]["id"] == last and broker_queue.ack(conn, last, "c1")
