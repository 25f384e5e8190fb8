"""POST /v1/runs/{run_id}/retry against a real server on loopback and a real ledger
(docs/api.md, "`POST /v1/runs/{run_id}/retry` — retry a finished run").

The module's server (``runstile serve``) runs no workers, so an admitted run stays queued
until a test moves it: over HTTP where the API can (``/stop`` cancels a queued run and
makes a running one ``stopping``), else through the ledger's own transitions on the
server's ledger file (claim, pause, approval request, finish, recovery's interrupt), as a
worker or recovery would write them — a live worker cannot be held in ``running`` or
``paused`` for a test without a long body.  A retry run by a real worker, to completed, is
``tests/api/test_client.py::test_a_failed_run_retried_gets_a_new_run_that_names_it_and_completes``.
"""

from __future__ import annotations

import json

from runstile.ledger import admission, approvals, db, execution, recovery
from runstile.ledger.execution import Owner
from runstile.ledger.keys import Principal
from tests.conftest import Api

#: A worker that does not exist; its leases outlast the test.
OWNER = Owner("retry-node", 1, 4343, 7)
LEASE_S = 3600.0
BODY = {"task": "echo", "input": {"text": "again", "n": [1.5, -0.0]},
        "session_key": "retry-session", "trigger_id": "trg-1", "metadata": {"team": "docs"},
        "callback_url": "https://hooks.example.com/retry"}
KEPT = ("task", "input", "session_key", "trigger_id", "metadata", "callback_url")


def on_ledger(api: Api, fn):
    conn = api.ledger.connect()
    try:
        return fn(conn)
    finally:
        conn.close()


def admitted(api: Api, **body) -> str:
    response = api.post_run({"task": "echo", "input": {"n": 1}, **body})
    assert response.status_code == 202, response.text
    return response.json()["id"]


def cancelled(api: Api, **body) -> str:
    """A run cancelled for real: admitted, then stopped while queued."""
    rid = admitted(api, **body)
    assert api.post(f"/v1/runs/{rid}/stop").json()["status"] == "cancelled"
    return rid


def claimed(api: Api) -> str:
    """A queued run claimed by OWNER, as a worker's claim writes it."""
    rid = admitted(api)
    assert on_ledger(api, lambda c: execution.claim(c, rid, OWNER, lease_s=LEASE_S,
                                                    task_known=lambda t: True)).run
    return rid


def retry(api: Api, rid: str, key: str | None = None):
    return api.post(f"/v1/runs/{rid}/retry",
                    headers={} if key is None else {"Idempotency-Key": key})


def error(response) -> dict:
    return response.json()["error"]


def writes(api: Api) -> tuple:
    """What a refused retry must leave as it was: the scope's runs, keys and dispatches."""
    return (api.runs_in_scope(), api.keys_in_scope(),
            api.ledger.query("SELECT COUNT(*) FROM dispatches")[0][0])


def test_a_cancelled_run_retried_gets_a_new_queued_run_that_names_it_and_keeps_its_fields(api):
    original = cancelled(api, **BODY)
    response = retry(api, original)
    assert response.status_code == 202, response.text
    run = response.json()
    assert run["id"] != original and run["retry_of"] == original
    assert (run["status"], run["attempt"], run["replayed"]) == ("queued", 1, False)
    assert response.headers["Location"] == f"/v1/runs/{run['id']}"
    assert "Idempotency-Replayed" not in response.headers
    assert {k: run[k] for k in KEPT} == {k: v for k, v in BODY.items()}
    # Admitted like any run: its own scope row, dispatch record and first event.
    assert api.ledger.query("SELECT profile_id, key_id, retry_of FROM runs WHERE id = ?",
                            (run["id"],)) == [("default", api.key.key_id, original)]
    assert api.ledger.query("SELECT reason FROM dispatches WHERE run_id = ?",
                            (run["id"],)) == [("admitted",)]
    assert api.ledger.query("SELECT seq, type FROM events WHERE run_id = ?",
                            (run["id"],)) == [(1, "run.queued")]
    kept = api.get(f"/v1/runs/{original}").json()
    assert (kept["status"], kept["retry_of"]) == ("cancelled", None)
    listed = {r["id"]: r["retry_of"] for r in api.get("/v1/runs").json()["data"]}
    assert listed == {run["id"]: original, original: None}


def test_failed_and_interrupted_runs_are_retryable_too(api):
    # Set up through the ledger's transitions: a worker's outcome, and recovery's
    # on_crash="interrupt" of a run whose owner is gone.
    failed = claimed(api)
    assert on_ledger(api, lambda c: execution.finish(
        c, failed, OWNER, status="failed", error_code="task_error", error_message="boom"))
    interrupted = claimed(api)

    def interrupt(conn):
        row = dict(conn.execute("SELECT * FROM runs WHERE id = ?", (interrupted,)).fetchone())
        with db.transaction(conn):
            return recovery.apply(conn, row, "interrupted", "owner_lost", None)
    assert on_ledger(api, interrupt)
    for rid, status in ((failed, "failed"), (interrupted, "interrupted")):
        assert api.get(f"/v1/runs/{rid}").json()["status"] == status
        response = retry(api, rid)
        assert response.status_code == 202, response.text
        assert response.json()["retry_of"] == rid and response.json()["attempt"] == 1


def test_every_other_status_is_run_not_retryable_naming_it_and_writes_nothing(api):
    # queued and stopping are reached over HTTP (admission; /stop of a claimed run);
    # running, paused, waiting_for_approval and completed through the ledger's own
    # transitions, as the worker writes them (the server has no workers).
    runs = {"queued": admitted(api), "running": claimed(api)}
    runs["stopping"] = claimed(api)
    assert api.post(f"/v1/runs/{runs['stopping']}/stop").json()["status"] == "stopping"
    runs["paused"] = claimed(api)
    assert on_ledger(api, lambda c: execution.pause(c, runs["paused"], OWNER,
                                                    "uncertain_side_effect"))
    runs["waiting_for_approval"] = claimed(api)
    assert on_ledger(api, lambda c: approvals.request(
        c, runs["waiting_for_approval"], OWNER, position=1, args_hash="h", details={}))
    runs["completed"] = claimed(api)
    assert on_ledger(api, lambda c: execution.finish(c, runs["completed"], OWNER,
                                                     status="completed", result_json="1"))
    before = writes(api)
    for status, rid in runs.items():
        assert api.get(f"/v1/runs/{rid}").json()["status"] == status
        for key in (None, f"not-{status}"):
            response = retry(api, rid, key)
            assert response.status_code == 409, (status, response.text)
            assert error(response) == {
                "code": "run_not_retryable", "run_status": status,
                "message": f"the run is {status}; only a failed, cancelled or interrupted "
                           "run can be retried"}
    assert writes(api) == before


def test_the_same_key_replays_the_retry_and_conflicts_on_another_run_or_a_plain_admission(
        api):
    first, second = cancelled(api), cancelled(api)
    made = retry(api, first, "rk-1")
    again = retry(api, first, "rk-1")
    assert made.status_code == again.status_code == 202
    assert again.json()["id"] == made.json()["id"] and again.json()["replayed"] is True
    assert again.headers["Idempotency-Replayed"] == "true"
    assert again.headers["Location"] == f"/v1/runs/{made.json()['id']}"
    assert api.ledger.query("SELECT COUNT(*) FROM dispatches WHERE run_id = ?",
                            (made.json()["id"],)) == [(1,)]
    before = writes(api)
    other = retry(api, second, "rk-1")
    assert other.status_code == 409 and error(other)["code"] == "idempotency_key_conflict"
    # The retry's fingerprint names retry_of: the original's own body is another request,
    # both ways round.
    plain = api.post_run({"task": "echo", "input": {"n": 1}}, idempotency_key="rk-1")
    assert plain.status_code == 409 and error(plain)["code"] == "idempotency_key_conflict"
    assert api.post_run({"task": "echo", "input": {"n": 1}},
                        idempotency_key="rk-2").status_code == 202
    crossed = retry(api, first, "rk-2")
    assert crossed.status_code == 409 and error(crossed)["code"] == "idempotency_key_conflict"
    assert writes(api)[0] == before[0] + 1  # only rk-2's plain run
    assert [r["id"] for r in api.get("/v1/runs", params={
        "idempotency_key": "rk-1"}).json()["data"]] == [made.json()["id"]]
    bare = [retry(api, first).json() for _ in range(2)]
    assert bare[0]["id"] != bare[1]["id"] and not bare[1]["replayed"]
    assert {r["retry_of"] for r in bare} == {first}


def test_a_run_another_key_may_not_see_is_a_404_and_an_admin_retry_stays_in_its_scope(
        api, shared_server, shared_ledger):
    original = cancelled(api)
    before = writes(api)
    for outsider in (shared_ledger.key("default"), shared_ledger.key("other", admin=True)):
        response = retry(Api(shared_server, outsider, shared_ledger), original, "x-1")
        assert response.status_code == 404 and error(response)["code"] == "run_not_found"
        assert original not in response.text
    assert retry(api, "run_" + "0" * 32).status_code == 404
    assert writes(api) == before
    admin = Api(shared_server, shared_ledger.key("default", admin=True), shared_ledger)
    made = retry(admin, original, "admin-1")
    assert made.status_code == 202 and made.json()["retry_of"] == original
    # The original's scope, so its own key sees the new run (and the admin's key is there).
    assert api.get(f"/v1/runs/{made.json()['id']}").status_code == 200
    assert retry(admin, original, "admin-1").json()["replayed"] is True
    assert api.keys_in_scope() == before[1] + 1


def test_a_task_no_longer_registered_is_unknown_task_and_a_bad_key_is_refused_first(api):
    # A run of a task this server does not register can only be written at the ledger
    # (admission refuses it over HTTP); it is then cancelled for real.
    request = admission.AdmissionRequest(
        principal=Principal("default", api.key.key_id, "client"), key=None,
        key_is_derived=False, run_id=None, task="t.gone", input_json="null",
        session_key=None, trigger_id=None, metadata_json=None, callback_url=None,
        fingerprint="f" * 64, fingerprint_version=1)
    rid = on_ledger(api, lambda c: admission.admit(c, request, refusal=None,
                                                   max_active_runs=10_000).run["id"])
    assert api.post(f"/v1/runs/{rid}/stop").json()["status"] == "cancelled"
    before = writes(api)
    for key in (None, "gone-1"):
        response = retry(api, rid, key)
        assert response.status_code == 400, response.text
        assert error(response)["code"] == "unknown_task" and error(response)["field"] == "task"
    bad = retry(api, "run_" + "0" * 32, "has space")
    assert bad.status_code == 400 and error(bad)["code"] == "invalid_idempotency_key"
    assert writes(api) == before


def test_a_retry_is_a_new_run_for_the_profiles_capacity(make_server, ledger):
    api = Api(make_server(web_workers=1, RUNSTILE_MAX_ACTIVE_RUNS="1"), ledger.key(), ledger)
    original = cancelled(api, input={"n": 2})
    made = retry(api, original, "cap-1")
    assert made.status_code == 202
    full = retry(api, original, "cap-2")
    assert full.status_code == 429 and error(full)["code"] == "capacity_exceeded"
    assert int(full.headers["Retry-After"]) >= 1
    replay = retry(api, original, "cap-1")
    assert replay.status_code == 202 and replay.json()["id"] == made.json()["id"]
    assert json.loads(ledger.query("SELECT input FROM runs WHERE id = ?",
                                   (made.json()["id"],))[0][0]) == {"n": 2}
    assert api.runs_in_scope() == 2
