"""The deliverer in-process against a real ledger file and real loopback receivers
(docs/architecture.md, "Deliveries"; docs/api.md, "Deliveries (webhooks)"): the obligation's
guarded moves, the fence, backoff, parking, the SSRF guard at the socket layer, secret
rotation, and recovery's obligation sweep."""

from __future__ import annotations

import json
import socket
import time

import pytest
from standardwebhooks.webhooks import Webhook

from runstile import queues, webhooks
from runstile.config import Settings
from runstile.ledger import admission, execution, obligations, webhook_secrets
from runstile.ledger.db import ConnectionPool
from runstile.ledger.execution import Owner
from runstile.ledger.keys import Principal
from runstile.recovery import reconcile
from runstile.workers.delivery import Deliverer
from tests.receiver import answer_with

OWNER = Owner("node-a", 1, 4242, 7)


@pytest.fixture
def connections(monkeypatch):
    """Addresses this process's sockets try to connect to, seen at the socket layer."""
    attempted: list = []
    real = socket.socket.connect

    def connect(sock, address):
        attempted.append(address)
        return real(sock, address)

    monkeypatch.setattr(socket.socket, "connect", connect)
    return attempted


def settings_for(ledger, **changes) -> Settings:
    values = dict(data_dir=ledger.data_dir, database_url=ledger.url, node_id="node-a",
                  callback_allowlist=("127.0.0.1",),
                  delivery_backoff_s=0.05, delivery_backoff_max_s=0.2,
                  delivery_read_timeout_s=0.5, delivery_connect_timeout_s=0.5)
    values.update(changes)
    return Settings(**values)


def finished_run(ledger, key, url: str) -> tuple[str, str]:
    """A run with ``callback_url`` that completed: (run id, its callback obligation id)."""
    conn = ledger.connect()
    try:
        request = admission.AdmissionRequest(
            principal=Principal(key.profile, key.key_id, key.role), key=None,
            key_is_derived=False, run_id=None, task="echo", input_json='{"x":1}',
            session_key=None, trigger_id=None, metadata_json=None, callback_url=url,
            fingerprint="f" * 64, fingerprint_version=1)
        rid = admission.admit(conn, request, refusal=None, max_active_runs=10_000).run["id"]
        assert execution.claim(conn, rid, OWNER, lease_s=60, task_known=lambda t: True).run
        assert execution.finish(conn, rid, OWNER, status="completed", result_json='{"ok":1}')
        [row] = obligations.for_run(conn, rid)
        return rid, row["id"]
    finally:
        conn.close()


def deliverer(ledger, resolver=socket.getaddrinfo, **changes) -> Deliverer:
    settings = settings_for(ledger, **changes)
    pool = ConnectionPool(settings.ledger_target, synchronous="FULL", busy_timeout_ms=5000)
    return Deliverer(settings, pool, node="node-a",
                     generation=1, resolver=resolver)


def state(ledger, obligation_id) -> tuple:
    return ledger.query("SELECT state, attempts, fence, ambiguous FROM obligations "
                        "WHERE id = ?", (obligation_id,))[0]


def test_a_terminal_transition_writes_its_callback_obligation_in_the_same_transaction(
        ledger):
    rid, oid = finished_run(ledger, ledger.key(), "http://127.0.0.1:9/hook")
    row = ledger.query("SELECT kind, type, state, url, event_seq FROM obligations "
                       "WHERE id = ?", (oid,))[0]
    seq = ledger.query("SELECT seq FROM events WHERE run_id = ? AND type = 'run.completed'",
                       (rid,))[0][0]
    assert tuple(row) == ("callback", "run.completed", "pending", "http://127.0.0.1:9/hook", seq)
    assert oid.startswith("msg_") and len(oid) == 36


def test_a_delivered_attempt_is_cleared_and_a_second_message_does_nothing(ledger, receiver):
    hook = receiver()
    _, oid = finished_run(ledger, ledger.key(), hook.url())
    d = deliverer(ledger)
    d(oid)
    d(oid)  # a duplicate message: the claim loses
    assert state(ledger, oid) == ("delivered", 1, 1, 0)
    assert len(hook.received()) == 1


def test_a_stale_deliverer_cannot_clear_an_attempt_recovery_handed_on(ledger, receiver):
    hook = receiver()
    _, oid = finished_run(ledger, ledger.key(), hook.url())
    conn = ledger.connect()
    stale = obligations.claim(conn, oid, node="node-a", generation=1, pid=1, lease_s=60).row
    # Its owner is taken for dead (an earlier generation): recovery re-arms the attempt.
    assert obligations.rearm_orphans(conn, node_id="node-a", generation=2, max_attempts=12,
                                     limit=10) == (1, 0)
    fresh = obligations.claim(conn, oid, node="node-a", generation=2, pid=2, lease_s=60).row
    assert fresh["fence"] == stale["fence"] + 1 and fresh["ambiguous"] == 1
    assert not obligations.settle_delivered(conn, stale, status=204)
    assert not obligations.settle_failed(conn, stale, status=500, error="x", delay_s=1,
                                         park=True)
    assert state(ledger, oid)[0] == "attempting"
    assert obligations.settle_delivered(conn, fresh, status=204)
    conn.close()


def test_a_redelivery_after_an_ambiguous_attempt_says_recovered_with_the_same_id(
        ledger, receiver):
    hook = receiver()
    _, oid = finished_run(ledger, ledger.key(), hook.url())
    conn = ledger.connect()
    obligations.claim(conn, oid, node="node-a", generation=1, pid=1, lease_s=60)
    obligations.rearm_orphans(conn, node_id="node-a", generation=2, max_attempts=12, limit=10)
    conn.close()
    deliverer(ledger)(oid)
    [request] = hook.received()
    assert request["headers"]["webhook-id"] == oid
    assert json.loads(request["body"])["recovered"] is True


def test_failures_back_off_honour_retry_after_and_park_after_the_last_attempt(
        ledger, receiver):
    hook = receiver(answer_with(503, {"Retry-After": "1"}))
    _, oid = finished_run(ledger, ledger.key(), hook.url())
    d = deliverer(ledger, delivery_max_attempts=2)
    d(oid)
    row = ledger.query("SELECT state, next_attempt_at - updated_at, last_status FROM "
                       "obligations WHERE id = ?", (oid,))[0]
    assert row[0] == "pending" and row[1] >= 0.99 and row[2] == 503
    d(oid)  # came too early: nothing is attempted
    assert len(hook.received()) == 1
    time.sleep(1.05)
    d(oid)
    assert state(ledger, oid)[:2] == ("parked", 2)
    types = [t for (t,) in ledger.query("SELECT type FROM events WHERE data LIKE ? ORDER BY seq",
                                        (f'%{oid}%',))]
    assert types == ["delivery.parked"]


def test_a_410_parks_at_once(ledger, receiver):
    hook = receiver(answer_with(410))
    _, oid = finished_run(ledger, ledger.key(), hook.url())
    deliverer(ledger)(oid)
    assert state(ledger, oid)[:2] == ("parked", 1)


def test_a_name_resolving_to_loopback_is_never_connected_to(ledger, connections, caplog):
    _, oid = finished_run(ledger, ledger.key(), "http://hooks.evil.test:8080/x")

    def resolver(host, port, *args, **kwargs):
        assert host == "hooks.evil.test"
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.1", port))]

    # Not allow-listed: the guard sees the resolved address and refuses it.
    caplog.set_level("INFO", logger="runstile.delivery")
    deliverer(ledger, resolver=resolver, callback_allowlist=())(oid)
    assert connections == []
    row = ledger.query("SELECT state, last_error FROM obligations WHERE id = ?", (oid,))[0]
    # last_error is shown to API clients: the host, never the address it resolved to;
    # the operator's log has the address.
    assert row[0] == "pending" and "hooks.evil.test" in row[1] and "127.0.0.1" not in row[1]
    assert "hooks.evil.test resolves to a refused address (127.0.0.1)" in caplog.text


def test_a_302_to_a_refused_address_is_not_followed(ledger, receiver, connections):
    hook = receiver(answer_with(302, {"Location": "http://169.254.169.254/latest/meta-data"}))
    _, oid = finished_run(ledger, ledger.key(), hook.url())
    deliverer(ledger)(oid)
    assert connections == [("127.0.0.1", hook.port)]
    row = ledger.query("SELECT state, last_status FROM obligations WHERE id = ?", (oid,))[0]
    assert tuple(row) == ("pending", 302)


def test_during_a_rotation_both_secrets_sign_and_each_verifies(ledger, receiver):
    hook = receiver()
    key = ledger.key()
    conn = ledger.connect()
    old = webhook_secrets.current(conn, key.profile, webhooks.new_secret)
    new = webhook_secrets.current(conn, key.profile, webhooks.new_secret, rotate=True,
                                  grace_s=3600)
    conn.close()
    assert old != new
    _, oid = finished_run(ledger, key, hook.url())
    deliverer(ledger)(oid)
    [request] = hook.received()
    for secret in (old, new):
        assert Webhook(secret).verify(request["body"], request["headers"])["type"] == \
            "run.completed"
    assert len(request["headers"]["webhook-signature"].split(" ")) == 2
    # After the grace period only the new secret signs.
    conn = ledger.connect()
    conn.execute("UPDATE webhook_secrets SET retires_at = 0 WHERE secret = ?", (old,))
    assert webhook_secrets.signing(conn, key.profile, webhooks.new_secret) == [new]
    conn.close()


def test_recovery_sends_obligations_left_without_a_message_before_reconciling_runs(
        ledger, receiver):
    hook = receiver()
    _, oid = finished_run(ledger, ledger.key(), hook.url())
    report = reconcile.run_pass(settings_for(ledger), generation=1, trigger="command")
    assert report.counts["deliveries_sent"] == 1
    # On deliveries' own broker queue, never a user queue (docs/architecture.md, "Queues
    # and thread pools").
    [body] = ledger.query("SELECT body FROM broker_messages WHERE queue_name = ?",
                          (queues.DELIVERY_QUEUE,))
    assert json.loads(body[0])["actor_name"] == "runstile_deliver"
    # A second pass does not send it again while its message is live.
    again = reconcile.run_pass(settings_for(ledger), generation=1, trigger="command")
    assert again.counts.get("deliveries_sent", 0) == 0
