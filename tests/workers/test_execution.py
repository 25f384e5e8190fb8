"""Admitted runs execute at most once, in real worker processes.

See docs/guarantees.md, "3. At-most-once execution"; docs/architecture.md, "Run lifecycle", and
"Worker processes".
"""

from __future__ import annotations

import collections
import json
import time

import requests

from runstile.ledger import db, execution
from runstile.ledger.execution import Owner
from tests.conftest import Api, wait_for_status, wait_until


def read_log(path) -> list[str]:
    try:
        return path.read_text().splitlines()
    except FileNotFoundError:
        return []


def starts_by_run(path) -> collections.Counter:
    return collections.Counter(line.split()[1] for line in read_log(path)
                               if line.startswith("start "))


def all_terminal(ledger, expected: int) -> bool:
    rows = ledger.query("SELECT status, COUNT(*) FROM runs GROUP BY status")
    counts = dict(rows)
    return sum(counts.values()) == expected and set(counts) <= {"completed", "failed"}


def test_500_runs_on_2_processes_each_complete_with_exactly_one_start(make_system, ledger,
                                                                      tmp_path):
    system = make_system(workers=2, threads=4)
    api = Api(system, ledger.key(), ledger)
    log = tmp_path / "executions.log"
    ids = []
    for i in range(500):
        response = api.post_run({"task": "t.log_start", "input": {"log": str(log), "n": i}})
        assert response.status_code == 202
        ids.append(response.json()["id"])
    wait_until(lambda: all_terminal(ledger, 500), 120, 0.2, "500 runs to finish")
    assert dict(ledger.query("SELECT status, COUNT(*) FROM runs GROUP BY status")) == \
        {"completed": 500}
    starts = starts_by_run(log)
    assert set(starts) == set(ids)
    assert max(starts.values()) == 1
    owners = {json.loads(d)["owner"]["pid"] for (d,) in ledger.query(
        "SELECT data FROM events WHERE type = 'run.started'")}
    assert len(owners) == 2, "both worker processes took part"


def test_duplicate_broker_delivery_still_executes_each_run_once(make_system, ledger, tmp_path):
    system = make_system(workers=2, threads=4)
    api = Api(system, ledger.key(), ledger)
    log = tmp_path / "executions.log"
    ids = [api.post_run({"task": "t.log_start", "input": {"log": str(log), "n": i}}).json()["id"]
           for i in range(60)]
    wait_until(lambda: all_terminal(ledger, 60), 60, 0.1, "first deliveries")
    # Re-insert every message as the broker delivered it, twice more: already-delivered
    # rows coming back, and every message sent twice.
    conn = ledger.connect()
    from runstile import dispatch
    from runstile.ledger import broker_queue
    with db.transaction(conn):
        for rid in ids:
            for _ in range(2):
                message = dispatch.message_for(rid)
                broker_queue.insert_message(conn, dispatch.QUEUE, message.message_id,
                                            message.encode())
    conn.close()
    wait_until(lambda: ledger.query("SELECT COUNT(*) FROM broker_messages")[0][0] == 0, 60, 0.1,
               "the duplicates to be consumed")
    assert max(starts_by_run(log).values()) == 1 and len(starts_by_run(log)) == 60
    assert ledger.query("SELECT COUNT(*) FROM events WHERE type = 'run.started'")[0][0] == 60
    wait_until(lambda: system.log().count("claim lost (not_queued)") >= 120, 10, 0.1,
               "the losing claims to be logged as no-ops")


def admitted(ledger, conn) -> str:
    """The id of a new queued run of t.log_start, admitted through the ledger API."""
    from runstile.fingerprint import fingerprint
    from runstile.ledger import admission
    from runstile.ledger.keys import Principal
    request = admission.AdmissionRequest(
        principal=Principal("default", ledger.key().key_id, "client"), key=None,
        key_is_derived=False, run_id=None, task="t.log_start", input_json="{}",
        session_key=None, trigger_id=None, metadata_json=None, callback_url=None,
        fingerprint=fingerprint({"task": "x"}), fingerprint_version=1)
    return admission.admit(conn, request, refusal=None, max_active_runs=10).run["id"]


def test_a_stale_owner_can_record_no_outcome_and_start_no_step(ledger):
    conn = ledger.connect()
    from runstile.errors import LeaseLost
    from runstile.ledger import journal
    rid = admitted(ledger, conn)
    stale, fresh = Owner("n", 1, 100, 1), Owner("n", 2, 200, 2)
    def known(name):
        return True
    assert execution.claim(conn, rid, stale, lease_s=30, task_known=known).run is not None
    assert execution.claim(conn, rid, fresh, lease_s=30, task_known=known).outcome == "not_queued"
    conn.execute("UPDATE runs SET lease_expires_at = 0 WHERE id = ?", (rid,))  # lease lapses
    assert execution.finish(conn, rid, stale, status="completed", result_json="1") is None
    assert execution.heartbeat(conn, "n", 1, 100, 30, [rid]) == {}
    # Recovery would hand the run on; re-queue through the ledger and let another claim win.
    assert execution.requeue(conn, rid, from_statuses=("running",), reason="test") is not None
    assert execution.claim(conn, rid, fresh, lease_s=30, task_known=known).run is not None
    try:
        journal.start_step(conn, rid, stale, position=1, name="s", args_hash="h",
                           idempotent=False, restart=False)
        raise AssertionError("a stale owner started a step")
    except LeaseLost:
        pass
    assert execution.finish(conn, rid, stale, status="failed", error_code="x") is None
    assert execution.finish(conn, rid, fresh, status="completed", result_json="2") is not None
    assert ledger.query("SELECT status, result FROM runs WHERE id = ?", (rid,)) == [
        ("completed", "2")]
    assert ledger.query("SELECT COUNT(*) FROM journal WHERE run_id = ?", (rid,)) == [(0,)]


def test_a_body_reads_its_runs_journal_only_when_it_journals_and_then_once(ledger):
    conn = ledger.connect()
    from runstile.workers.context import RunContext
    rid = admitted(ledger, conn)
    owner = Owner("n", 1, 100, 1)
    run = execution.claim(conn, rid, owner, lease_s=30, task_known=lambda name: True).run
    assert run is not None
    reads: list[str] = []
    conn.set_trace_callback(lambda sql: reads.append(sql) if "FROM journal" in sql else None)
    ctx = RunContext(run, owner, conn)
    assert reads == []  # a body that journals nothing (a no-op) costs no read
    ctx.emit("progress.one", {"n": 1})
    ctx.emit("progress.two", {"n": 2})
    assert len(reads) == 1
    conn.set_trace_callback(None)
    # A second execution of the body replays what the first one journaled.
    again = RunContext(run, owner, conn)
    again.emit("progress.one", {"n": 1})
    assert ledger.query("SELECT COUNT(*) FROM events WHERE run_id = ? AND type = "
                        "'progress.one'", (rid,)) == [(1,)]
    conn.close()


def requeue_running(ledger, rid: str) -> dict:
    """Re-queue a running run through the ledger API, as recovery does for a lost owner."""
    from runstile import dispatch
    from runstile.config import Settings
    conn = ledger.connect()
    try:
        return execution.requeue(conn, rid, from_statuses=("running",), reason="test_rerun",
                                 enqueue=dispatch.Dispatcher(Settings()).enqueue)
    finally:
        conn.close()


def test_a_re_run_body_replays_completed_steps_without_calling_them(make_system, ledger,
                                                                    tmp_path):
    system = make_system(workers=1, threads=2)
    api = Api(system, ledger.key(), ledger)
    log, release = tmp_path / "executions.log", tmp_path / "release"
    rid = api.post_run({"task": "t.steps", "input": {"log": str(log),
                                                     "release": str(release)}}).json()["id"]
    wait_until(lambda: sum(line.startswith("call") for line in read_log(log)) == 2, 30, 0.02,
               "both steps of the first execution")
    again = requeue_running(ledger, rid)
    assert again is not None and again["attempt"] == 2
    wait_until(lambda: starts_by_run(log)[rid] == 2, 30, 0.02, "the second execution to start")
    release.touch()
    run = wait_until(lambda: (lambda r: r if r["status"] == "completed" else None)(
        api.get(f"/v1/runs/{rid}").json()), 30, 0.05, "the re-run to complete")
    assert run["attempt"] == 2
    calls = [line for line in read_log(log) if line.startswith("call")]
    assert calls == [f"call a {rid}", f"call b {rid}"], "a completed step ran again"
    assert ledger.query("SELECT position, state, starts FROM journal WHERE run_id = ? AND "
                        "kind = 'step' ORDER BY position", (rid,)) == [
        (1, "completed", 1), (3, "completed", 1)]
    events = [e["type"] for e in api.get(f"/v1/runs/{rid}/events",
                                         headers={"Accept": "application/json"}).json()["data"]]
    assert events.count("run.progress") == 1, "a replayed emit was written twice"
    assert events.count("run.completed") == 1
    assert events.index("run.requeued") < max(i for i, t in enumerate(events)
                                               if t == "run.started")
    assert "no longer owned by this worker" in system.log()


def test_a_changed_step_argument_on_a_re_run_pauses_the_run(make_system, ledger, tmp_path):
    system = make_system(workers=1, threads=2)
    api = Api(system, ledger.key(), ledger)
    release = tmp_path / "release"
    rid = api.post_run({"task": "t.changing_args",
                        "input": {"release": str(release)}}).json()["id"]
    wait_until(lambda: ledger.query("SELECT COUNT(*) FROM journal WHERE run_id = ?",
                                    (rid,))[0][0] == 1, 30, 0.02, "the first step")
    requeue_running(ledger, rid)
    run = wait_for_status(api, rid, statuses=("paused",))
    release.touch()
    assert run["recovery"]["reason"] == "nondeterministic_replay"
    time.sleep(0.5)
    assert api.get(f"/v1/runs/{rid}").json()["status"] == "paused"


def test_task_failures_limits_and_bad_results_end_the_run_with_a_code(make_system, ledger,
                                                                      tmp_path):
    system = make_system(workers=1, threads=4, RUNSTILE_MAX_RESULT_BYTES="1000")
    api = Api(system, ledger.key(), ledger)
    log = tmp_path / "executions.log"
    cases = {
        "fail": ("failed", "task_error"),
        "t.big_result": ("failed", "result_too_large"),
        "t.reserved": ("failed", "invalid_event"),
        "t.sleepy": ("failed", "time_limit_exceeded"),
        "t.not_json": ("failed", "invalid_result"),
        "t.async": ("completed", None),
        "t.exit": ("failed", "task_error"),
    }
    ids = {task: api.post_run({"task": task, "input": {"log": str(log), "size": 5000}}).json()["id"]
           for task in cases}
    for task, (status, code) in cases.items():
        run = wait_for_status(api, ids[task])
        assert run["status"] == status, (task, run)
        assert (run["error"] or {}).get("code") == code, (task, run["error"])
        if run["error"]:
            assert "Traceback" not in run["error"]["message"]
    assert api.get(f"/v1/runs/{ids['t.async']}").json()["result"] == {"async": True}
    time.sleep(0.3)
    assert f"end {ids['t.sleepy']}" not in read_log(log), "the time limit did not stop the body"


def test_a_value_a_task_nests_deeper_than_64_levels_fails_the_run_and_reads_fine(make_system,
                                                                                   ledger):
    system = make_system(workers=1, threads=4)
    api = Api(system, ledger.key(), ledger)
    cases = [("result", 64, "completed", None), ("result", 100, "failed", "result_too_deep"),
             ("result", 5000, "failed", "result_too_deep"),
             ("step", 100, "failed", "result_too_deep"), ("emit", 100, "failed", "invalid_event"),
             ("deliver", 100, "failed", "invalid_event"),
             ("approval", 100, "failed", "invalid_event"),
             ("emit", 64, "completed", None),
             ("approval", 64, "waiting_for_approval", None)]
    ids = [api.post_run({"task": "t.deep", "input": {"via": via, "depth": depth}}).json()["id"]
           for via, depth, _, _ in cases]
    for rid, (via, _depth, status, code) in zip(ids, cases, strict=True):
        run = wait_for_status(api, rid, ("completed", "failed", "waiting_for_approval"))
        assert (run["status"], (run["error"] or {}).get("code")) == (status, code), (via, run)
        if code is not None:
            assert "64 levels" in run["error"]["message"], run["error"]
            assert run["result"] is None
    deepest_allowed = json.loads("[" * 64 + "1" + "]" * 64)
    assert api.get(f"/v1/runs/{ids[0]}").json()["result"] == deepest_allowed
    # runstile wraps what it admitted a level deeper (the approval object, its event):
    # still shown in full.
    assert api.get(f"/v1/runs/{ids[-1]}").json()["approval"]["details"] == deepest_allowed
    emitted, requested = (api.get(f"/v1/runs/{rid}/events", headers={
        "Accept": "application/json"}).json()["data"] for rid in ids[-2:])
    assert deepest_allowed in [e["data"] for e in emitted if e["type"] == "deep"]
    assert deepest_allowed in [e["data"]["details"] for e in requested
                               if e["type"] == "approval.requested"]
    page = api.get("/v1/runs", params={"limit": 200})
    assert page.status_code == 200 and {r["id"] for r in page.json()["data"]} == set(ids)


def test_a_run_whose_task_is_gone_fails_unknown_task_at_claim(make_system, ledger):
    system = make_system(workers=1, threads=1)
    api = Api(system, ledger.key(), ledger)
    conn = ledger.connect()
    rid = api.post_run({"task": "echo"}).json()["id"]
    wait_for_status(api, rid)
    # A run queued for a task the workers no longer register (edited in while queued).
    from runstile import dispatch
    from runstile.config import Settings
    from runstile.fingerprint import fingerprint
    from runstile.ledger import admission
    from runstile.ledger.keys import Principal
    request = admission.AdmissionRequest(
        principal=Principal("default", api.key.key_id, "client"), key=None, key_is_derived=False,
        run_id=None, task="retired.task", input_json="null", session_key=None, trigger_id=None,
        metadata_json=None, callback_url=None, fingerprint=fingerprint({"task": "retired"}),
        fingerprint_version=1)
    gone = admission.admit(conn, request, refusal=None, max_active_runs=100,
                      enqueue=dispatch.Dispatcher(Settings()).enqueue).run["id"]
    conn.close()
    run = wait_for_status(api, gone)
    assert run["status"] == "failed" and run["error"]["code"] == "unknown_task"


def test_sse_resume_from_last_event_id_returns_exactly_the_later_events(make_system, ledger):
    system = make_system(workers=1, threads=2)
    api = Api(system, ledger.key(), ledger)
    rid = api.post_run({"task": "t.stream", "input": {"count": 30, "delay_s": 0.05}}).json()["id"]
    wait_until(lambda: len(api.get(f"/v1/runs/{rid}/events", headers={
        "Accept": "application/json"}).json()["data"]) >= 6, 20, 0.02, "some events")
    response = requests.get(system.url + f"/v1/runs/{rid}/events",
                            headers={**api.key.headers, "Last-Event-ID": "5"}, stream=True,
                            timeout=30)
    ids, types = [], []
    for line in response.iter_lines(decode_unicode=True):
        if line.startswith("id: "):
            ids.append(int(line[4:]))
        elif line.startswith("event: "):
            types.append(line[7:])
    assert ids == list(range(6, ids[-1] + 1)), "events missing, repeated or out of order"
    assert types[-1] == "run.completed"
    assert types.count("message.delta") + ids[0] - 1 >= 30
    everything = api.get(f"/v1/runs/{rid}/events", headers={"Accept": "application/json"}).json()
    assert [e["seq"] for e in everything["data"]][5:] == ids


def test_two_nodes_of_the_same_id_on_one_data_dir_refuse(make_system, ledger):
    system = make_system(workers=1, threads=1)
    import subprocess
    import sys
    second = subprocess.run([sys.executable, "-m", "runstile", "worker", "--data-dir",
                             str(ledger.data_dir)], capture_output=True, text=True, timeout=60)
    assert second.returncode == 2, second.stderr
    assert "already running" in second.stderr
    assert system.proc.poll() is None


def test_a_heartbeat_that_renews_nothing_interrupts_the_body(make_system, ledger, tmp_path):
    system = make_system(workers=1, threads=2, RUNSTILE_HEARTBEAT_S="0.2", RUNSTILE_LEASE_S="3")
    api = Api(system, ledger.key(), ledger)
    log = tmp_path / "executions.log"
    rid = api.post_run({"task": "t.long", "input": {"log": str(log), "ticks": 200}}).json()["id"]
    wait_until(lambda: any(line.startswith(f"tick {rid}") for line in read_log(log)), 30, 0.02,
               "the body to run")
    # Someone else (recovery, after this owner looked dead) took the lease away.
    conn = ledger.connect()
    conn.execute("UPDATE runs SET lease_expires_at = 0 WHERE id = ?", (rid,))
    conn.close()
    wait_until(lambda: "lease lost; interrupting its body" in system.log(), 10, 0.05,
               "the heartbeat to notice")
    def ticks():
        return sum(line.startswith(f"tick {rid}") for line in read_log(log))
    settled = ticks()
    time.sleep(0.5)
    assert ticks() <= settled + 1, "the body kept running after its lease was lost"
    assert f"end {rid}" not in read_log(log)
    # The stale owner wrote no outcome: the run is still 'running' for recovery to judge.
    assert api.get(f"/v1/runs/{rid}").json()["status"] == "running"


def test_task_retries_requeue_through_the_ledger_until_they_run_out(make_system, ledger,
                                                                   tmp_path):
    system = make_system(workers=1, threads=2)
    api = Api(system, ledger.key(), ledger)
    log = tmp_path / "executions.log"
    flaky = api.post_run({"task": "t.flaky", "input": {"log": str(log)}}).json()["id"]
    hopeless = api.post_run({"task": "t.always_fails", "input": {"log": str(log)}}).json()["id"]
    done = wait_for_status(api, flaky, statuses=("completed",))
    assert done["attempt"] == 3 and done["result"] == {"attempt": 3}
    failed = wait_for_status(api, hopeless, statuses=("failed",))
    assert failed["attempt"] == 2 and failed["error"]["code"] == "task_error"
    assert starts_by_run(log)[flaky] == 3 and starts_by_run(log)[hopeless] == 2
    # The step completed on attempt 1 is replayed on 2 and 3, not called again.
    assert [line for line in read_log(log) if line.startswith("call")] == [f"call {flaky}"]
    types = [e["type"] for e in api.get(f"/v1/runs/{flaky}/events",
                                        headers={"Accept": "application/json"}).json()["data"]]
    assert types.count("run.requeued") == 2 and types.count("run.started") == 3
    assert types.count("run.failed") == 0 and types[-1] == "run.completed"
