"""POST /v1/runs/<id>/stop: bound to the run, durable, repeatable.

See docs/api.md, "`POST /v1/runs/{run_id}/stop` — stop a run".
"""

from __future__ import annotations

import time

from tests.conftest import Api, wait_for_status, wait_until


def read_log(path):
    return path.read_text().splitlines() if path.exists() else []


def events_of(api, rid):
    return [e["type"] for e in api.get(f"/v1/runs/{rid}/events",
                                       headers={"Accept": "application/json"}).json()["data"]]


def test_a_queued_run_is_cancelled_at_once_and_never_starts(make_server, ledger, tmp_path):
    server = make_server()  # web only: nothing consumes, the run stays queued
    api = Api(server, ledger.key(), ledger)
    rid = api.post_run({"task": "echo"}).json()["id"]
    first = api.post(f"/v1/runs/{rid}/stop")
    assert first.status_code == 200 and first.json()["status"] == "cancelled"
    again = api.post(f"/v1/runs/{rid}/stop")
    assert again.status_code == 200 and again.json()["status"] == "cancelled"
    assert events_of(api, rid) == ["run.queued", "run.cancelled"]
    # Its message is still in the broker; a worker's claim must lose.
    from runstile.ledger import execution
    conn = ledger.connect()
    claim = execution.claim(conn, rid, execution.Owner("n", 1, 1, 1), lease_s=5,
                            task_known=lambda t: True)
    conn.close()
    assert claim.run is None and claim.outcome == "not_queued"


def test_a_running_body_sees_the_stop_at_its_next_checkpoint(make_system, ledger, tmp_path):
    system = make_system(workers=1, threads=2)
    api = Api(system, ledger.key(), ledger)
    log = tmp_path / "executions.log"
    rid = api.post_run({"task": "t.checkpointing", "input": {"log": str(log)}}).json()["id"]
    wait_until(lambda: any(line.startswith("start") for line in read_log(log)), 30, 0.02, "a start")
    answer = api.post(f"/v1/runs/{rid}/stop")
    assert answer.status_code == 202 and answer.json()["status"] == "stopping"
    assert api.post(f"/v1/runs/{rid}/stop").status_code == 202  # repeat while stopping
    run = wait_for_status(api, rid, statuses=("cancelled",), timeout_s=10)
    assert run["result"] is None
    assert not any(line.startswith("end") for line in read_log(log))
    assert events_of(api, rid)[-2:] == ["run.stopping", "run.cancelled"]
    final = api.post(f"/v1/runs/{rid}/stop")
    assert final.status_code == 200 and final.json()["status"] == "cancelled"


def test_a_body_that_never_checks_is_interrupted_after_the_grace(make_system, ledger, tmp_path):
    system = make_system(workers=1, threads=2, RUNSTILE_STOP_GRACE_S="0.5",
                         RUNSTILE_HEARTBEAT_S="0.2")
    api = Api(system, ledger.key(), ledger)
    log = tmp_path / "executions.log"
    rid = api.post_run({"task": "t.long", "input": {"log": str(log), "ticks": 400}}).json()["id"]
    wait_until(lambda: any(line.startswith(f"tick {rid}") for line in read_log(log)), 30, 0.02,
               "the body to tick")
    assert api.post(f"/v1/runs/{rid}/stop").status_code == 202
    began = time.monotonic()
    wait_for_status(api, rid, statuses=("cancelled",), timeout_s=10)
    assert time.monotonic() - began < 5
    def ticks():
        return sum(line.startswith(f"tick {rid}") for line in read_log(log))
    settled = ticks()
    time.sleep(0.4)
    assert ticks() <= settled + 1 and f"end {rid}" not in read_log(log)
    assert "stop grace passed" in system.log()


def test_stop_is_bound_to_the_callers_runs(make_server, ledger):
    server = make_server()
    owner, stranger = Api(server, ledger.key(), ledger), Api(server, ledger.key(), ledger)
    rid = owner.post_run({"task": "echo"}).json()["id"]
    assert stranger.post(f"/v1/runs/{rid}/stop").status_code == 404
    assert owner.get(f"/v1/runs/{rid}").json()["status"] == "queued"
