"""Approvals: park, decide once, replay the body from its journal.

See docs/api.md, "`POST /v1/runs/{run_id}/approval` — decide a pending approval", and
docs/tasks.md, "What replays and what re-runs".
"""

from __future__ import annotations

import time

from tests.conftest import Api, wait_for_status


def read_log(path):
    return path.read_text().splitlines() if path.exists() else []


def decide(api, rid, approval_id, decision):
    return api.post(f"/v1/runs/{rid}/approval",
                    json={"approval_id": approval_id, "decision": decision})


def test_50_waiting_runs_do_not_starve_8_worker_threads(make_system, ledger, tmp_path):
    system = make_system(workers=2, threads=4)
    api = Api(system, ledger.key(), ledger)
    log = tmp_path / "executions.log"
    waiting = [api.post_run({"task": "t.approval", "input": {"log": str(log), "n": n}}
                            ).json()["id"] for n in range(50)]
    runs = [wait_for_status(api, rid, statuses=("waiting_for_approval",)) for rid in waiting]
    assert all(r["approval"]["decision"] is None and r["approval"]["approval_id"].startswith(
        "apr_") for r in runs)
    # Threads are free while 50 runs wait: ordinary runs complete at once.
    began = time.monotonic()
    quick = [api.post_run({"task": "echo", "input": i}).json()["id"] for i in range(10)]
    for rid in quick:
        assert wait_for_status(api, rid, timeout_s=15)["status"] == "completed"
    assert time.monotonic() - began < 15
    for n, run in enumerate(runs):
        answer = decide(api, run["id"], run["approval"]["approval_id"],
                        "approve" if n % 2 == 0 else "deny")
        assert answer.status_code == 200 and answer.json()["status"] in ("queued", "running",
                                                                         "completed")
    for n, rid in enumerate(waiting):
        done = wait_for_status(api, rid)
        assert done["status"] == "completed" and done["attempt"] == 1
        assert done["result"] == {"published": n % 2 == 0}
        assert done["approval"]["decision"] == ("approve" if n % 2 == 0 else "deny")
    calls = read_log(log)
    # Each body ran twice (before and after the decision); its steps ran once each.
    for n, rid in enumerate(waiting):
        assert sum(line.startswith(f"start {rid}") for line in calls) == 2
        assert calls.count(f"call prepare {rid}") == 1
        assert calls.count(f"call publish {rid}") == (1 if n % 2 == 0 else 0)
    types = [e["type"] for e in api.get(f"/v1/runs/{waiting[0]}/events",
                                        headers={"Accept": "application/json"}).json()["data"]]
    assert types.count("approval.requested") == 1 and types.count("run.progress") == 1
    assert types.index("approval.resolved") < max(i for i, t in enumerate(types)
                                                   if t == "run.started")


def test_decision_rules(make_system, ledger, tmp_path):
    system = make_system(workers=1, threads=2)
    api = Api(system, ledger.key(), ledger)
    log = tmp_path / "executions.log"
    rid = api.post_run({"task": "t.approval", "input": {"log": str(log)}}).json()["id"]
    approval_id = wait_for_status(api, rid, statuses=("waiting_for_approval",))[
        "approval"]["approval_id"]
    assert decide(api, rid, "apr_unknown", "approve").json()["error"]["code"] == \
        "approval_not_pending"
    assert decide(api, rid, approval_id, "maybe").status_code == 400
    assert decide(api, rid, approval_id, "approve").status_code == 200
    assert decide(api, rid, approval_id, "approve").status_code == 200   # same again: fine
    clash = decide(api, rid, approval_id, "deny")
    assert clash.status_code == 409 and clash.json()["error"]["code"] == "approval_already_resolved"
    wait_for_status(api, rid)
    assert decide(api, rid, approval_id, "approve").status_code == 200   # any later time
    assert decide(api, rid, approval_id, "deny").status_code == 409
    other = Api(system, ledger.key(), ledger)
    assert other.post(f"/v1/runs/{rid}/approval",
                      json={"approval_id": approval_id, "decision": "approve"}).status_code == 404


def test_stopping_a_waiting_run_cancels_it(make_system, ledger, tmp_path):
    system = make_system(workers=1, threads=2)
    api = Api(system, ledger.key(), ledger)
    rid = api.post_run({"task": "t.approval", "input": {"log": str(tmp_path / "l")}}).json()["id"]
    approval_id = wait_for_status(api, rid, statuses=("waiting_for_approval",))[
        "approval"]["approval_id"]
    assert api.post(f"/v1/runs/{rid}/stop").json()["status"] == "cancelled"
    assert decide(api, rid, approval_id, "approve").json()["error"]["code"] == \
        "approval_not_pending"
