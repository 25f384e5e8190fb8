"""Admission across several server processes, and under storage faults and SIGKILL.

Real gunicorn processes, a real ledger file, real locks, a real full disk.
"""

from __future__ import annotations

import json
import secrets
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from runstile.ledger import db
from tests.conftest import Api, Ledger, Server, fill, wait_until

SIMULTANEOUS = 24


def fire_together(api: Api, body: dict, headers: dict, n: int = SIMULTANEOUS) -> list:
    """n identical POSTs released at one instant from n threads, each its own connection."""
    barrier = threading.Barrier(n)

    def one(_):
        session = requests.Session()
        barrier.wait()
        return session.post(api.server.url + "/v1/runs", data=json.dumps(body),
                            headers={**api.key.headers, "Content-Type": "application/json",
                                     **headers}, timeout=60)

    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(one, range(n)))


def served_by_several_processes(server: Server) -> bool:
    return len(server.web_pids()) >= 2  # (the admission writer is not a web process)


@pytest.mark.parametrize("mode", ["header", "body_run_id"])
def test_simultaneous_identical_requests_across_processes_make_one_run(make_server, ledger, mode):
    server = make_server(web_workers=3)
    # /readyz answers once one worker is up; the others may still be forking under load.
    wait_until(lambda: served_by_several_processes(server), 15, 0.05, "3 web workers")
    api = Api(server, ledger.key(), ledger)
    if mode == "header":
        body, headers = {"task": "echo", "input": {"same": True}}, {"Idempotency-Key": "race-1"}
    else:
        body, headers = {"task": "echo", "run_id": "run_" + secrets.token_hex(16)}, {}
    responses = fire_together(api, body, headers)
    assert [r.status_code for r in responses] == [202] * SIMULTANEOUS
    ids = {r.json()["id"] for r in responses}
    assert len(ids) == 1
    originals = [r for r in responses if "Idempotency-Replayed" not in r.headers]
    assert len(originals) == 1 and originals[0].json()["replayed"] is False
    assert all(r.json()["replayed"] is True for r in responses if r is not originals[0])
    (rid,) = ids
    assert ledger.query("SELECT COUNT(*) FROM runs")[0][0] == 1
    assert ledger.query("SELECT COUNT(*) FROM dispatches WHERE run_id = ?", (rid,))[0][0] == 1
    assert ledger.query("SELECT COUNT(*) FROM events WHERE run_id = ?", (rid,))[0][0] == 1


def test_a_ledger_locked_past_the_timeout_answers_503_and_writes_nothing(make_server, ledger):
    server = make_server(RUNSTILE_BUSY_TIMEOUT_MS="300")
    api = Api(server, ledger.key(), ledger)
    holder = ledger.connect()
    try:
        # Another writer holds the ledger's write lock (SQLite: the writer gate and
        # BEGIN IMMEDIATE; PostgreSQL: the ledger's advisory writer lock).
        with db.transaction(holder):
            response = api.post_run({"task": "echo"}, idempotency_key="while-locked")
            assert response.status_code == 503
            assert response.json()["error"]["code"] == "run_storage_unavailable"
            assert int(response.headers["Retry-After"]) >= 1
    finally:
        holder.close()
    assert ledger.query("SELECT COUNT(*) FROM runs")[0][0] == 0
    retry = api.post_run({"task": "echo"}, idempotency_key="while-locked")
    assert retry.status_code == 202 and retry.json()["replayed"] is False


def test_a_full_disk_answers_503_and_service_resumes_when_space_returns(tiny_disk):
    from runstile.ledger import migrations
    from tests import postgres
    if postgres.on_postgresql():
        pytest.skip("SQLite only: the disk under the ledger file fills up; a PostgreSQL "
                    "ledger's disk is its server's (tests/chaos/test_postgresql_restart.py "
                    "covers a server that goes away)")
    ledger = Ledger(tiny_disk / "data")
    migrations.migrate(ledger.path)
    server = Server(ledger.data_dir, {"RUNSTILE_BUSY_TIMEOUT_MS": "500"}, web_workers=1).start()
    try:
        api = Api(server, ledger.key(), ledger)
        assert api.post_run({"task": "echo", "input": "before"}).status_code == 202
        filler = fill(tiny_disk)
        statuses = []
        # Each admission grows the WAL; keep going until the disk refuses a commit.
        for i in range(200):
            response = api.post_run({"task": "echo", "input": "x" * 20000},
                                    idempotency_key=f"full-{i}")
            statuses.append(response.status_code)
            if response.status_code != 202:
                break
        assert statuses[-1] == 503, statuses
        assert response.json()["error"]["code"] == "run_storage_unavailable"
        assert int(response.headers["Retry-After"]) >= 1
        refused_key = f"full-{len(statuses) - 1}"
        filler.unlink()
        retry = api.post_run({"task": "echo", "input": "x" * 20000}, idempotency_key=refused_key)
        assert retry.status_code == 202 and retry.json()["replayed"] is False
        assert api.get(f"/v1/runs/{retry.json()['id']}").status_code == 200
        conn = ledger.connect()
        assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        conn.close()
    finally:
        server.kill()


def test_sigkill_right_after_commit_loses_no_admitted_run(ledger):
    server = Server(ledger.data_dir, {"RUNSTILE_CRASHPOINT": "after_admit_commit"},
                    web_workers=1).start()
    api = Api(server, ledger.key(), ledger)
    with pytest.raises(requests.ConnectionError):
        api.post_run({"task": "echo", "input": "doomed"}, idempotency_key="crash-1")
    server.kill()
    # The crashed request committed before the process died: the run is in the ledger.
    assert ledger.query("SELECT COUNT(*) FROM runs")[0][0] == 1
    server = Server(ledger.data_dir, {}, web_workers=2).start()
    try:
        api = Api(server, api.key, ledger)
        retry = api.post_run({"task": "echo", "input": "doomed"}, idempotency_key="crash-1")
        assert retry.status_code == 202 and retry.json()["replayed"] is True
        assert ledger.query("SELECT COUNT(*) FROM dispatches")[0][0] == 1
    finally:
        server.kill()


def test_sigkill_of_the_whole_server_keeps_every_acknowledged_run(ledger):
    server = Server(ledger.data_dir, {}, web_workers=2).start()
    api = Api(server, ledger.key(), ledger)
    acknowledged = {}
    for i in range(40):
        response = api.post_run({"task": "echo", "input": i}, idempotency_key=f"ack-{i}")
        assert response.status_code == 202
        acknowledged[f"ack-{i}"] = response.json()["id"]
    server.kill()  # SIGKILL the master and every worker at once
    server = Server(ledger.data_dir, {}, web_workers=2).start()
    try:
        api = Api(server, api.key, ledger)
        for i in range(40):
            replay = api.post_run({"task": "echo", "input": i}, idempotency_key=f"ack-{i}")
            assert replay.status_code == 202 and replay.json()["replayed"] is True
            assert replay.json()["id"] == acknowledged[f"ack-{i}"]
    finally:
        server.kill()
