"""The chaos checker must catch what it claims to catch: each class of anomaly, made on
purpose in a real ledger, is reported (and a clean history reports nothing)."""

from __future__ import annotations

from runstile.ledger import admission, execution
from runstile.ledger.execution import Owner
from runstile.ledger.keys import Principal
from tests.chaos.harness import History, check

OWNER = Owner("node-a", 1, 1, 1)


def admit(ledger, key, idempotency_key: str) -> str:
    conn = ledger.connect()
    try:
        request = admission.AdmissionRequest(
            principal=Principal(key.profile, key.key_id, key.role), key=idempotency_key,
            key_is_derived=False, run_id=None, task="chaos.resume", input_json="{}",
            session_key=None, trigger_id=None, metadata_json=None, callback_url=None,
            fingerprint=idempotency_key.ljust(64, "0")[:64], fingerprint_version=1)
        return admission.admit(conn, request, refusal=None, max_active_runs=10_000).run["id"]
    finally:
        conn.close()


def completed(ledger, rid: str) -> None:
    conn = ledger.connect()
    assert execution.claim(conn, rid, OWNER, lease_s=60, task_known=lambda t: True).run
    assert execution.finish(conn, rid, OWNER, status="completed", result_json="1")
    conn.close()


def test_a_clean_history_has_no_anomalies(ledger, tmp_path):
    key, history, log = ledger.key(), History(), tmp_path / "log"
    rid = admit(ledger, key, "k1")
    completed(ledger, rid)
    history.record(phase="invoke", key="k1")
    history.record(phase="ok", key="k1", run_id=rid)
    log.write_text(f"start {rid} 1 9\nend {rid} 1 9\n")
    report = check(ledger.target, history, log)
    assert report.problems() == {} and report.acknowledged == 1


def test_each_anomaly_is_reported(ledger, tmp_path):
    key, history, log = ledger.key(), History(), tmp_path / "log"
    done = admit(ledger, key, "done")
    completed(ledger, done)
    stuck = admit(ledger, key, "stuck")          # never executed: stranded
    stray = admit(ledger, key, "never-asked")    # no client invoked it: unexpected
    completed(ledger, stray)
    for k, rid in (("done", done), ("stuck", stuck)):
        history.record(phase="invoke", key=k)
        history.record(phase="ok", key=k, run_id=rid)
    history.record(phase="invoke", key="gone")
    history.record(phase="ok", key="gone", run_id="run_" + "0" * 32)  # acknowledged, lost
    # Two body starts for one claim, and a step run with no journal start: duplicated.
    log.write_text(f"start {done} 1 9\nstart {done} 1 9\nstep {done} s0 9\n"
                   f"start {stray} 1 9\n")
    # A second terminal event: a lifecycle violation.
    ledger.query("INSERT INTO events (run_id, seq, type, data, created_at) "
                 "VALUES (?, 99, 'run.failed', '{}', 0)", (done,))
    report = check(ledger.target, history, log)
    assert [e["key"] for e in report.lost] == ["gone"]
    assert report.unexpected == [stray]
    assert {rid for rid, _ in report.duplicated} == {done}
    assert len(report.duplicated) == 2
    assert report.stranded == [(stuck, "queued")]
    assert [rid for rid, *_ in report.lifecycle] == [done]
