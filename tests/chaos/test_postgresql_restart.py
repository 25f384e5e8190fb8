"""PostgreSQL itself stopped and started under load (`make chaos`; CI runs the short
profile): a server of the test's own (tests/postgres.py OwnServer, never the machine's),
stopped in immediate mode, which is a crash as far as runstile can tell.  While it is
down, admissions answer 503 `run_storage_unavailable`; once it is back they go on, and
the checker must find nothing acknowledged lost, nothing duplicated, nothing stranded."""

from __future__ import annotations

import collections
import time

import psycopg
import pytest
import requests

from runstile.ledger import migrations
from tests import postgres
from tests.chaos.harness import Clients, History, scaled, write_table
from tests.chaos.test_chaos import CHAOS_TASKS, ENV, body_for, settle_and_check
from tests.conftest import Ledger, System, free_port, wait_until

pytestmark = [pytest.mark.chaos, pytest.mark.postgresql, pytest.mark.timeout(900)]
TABLE: list[tuple] = []


@pytest.fixture
def own_server():
    server = postgres.OwnServer(free_port()).start()
    yield server
    server.close()


def database_on(server: postgres.OwnServer) -> str:
    with psycopg.connect(server.url, autocommit=True) as conn:
        conn.execute('CREATE DATABASE "runstile"')
    url = server.url.rsplit("/", 1)[0] + "/runstile"
    migrations.migrate(url)
    return url


def test_postgresql_crashing_and_coming_back_under_load_loses_nothing_acknowledged(
        own_server, tmp_path, request):
    ledger = Ledger(tmp_path / "data", url=database_on(own_server))
    key = ledger.key()
    log = tmp_path / "executions.log"
    system = System(ledger.data_dir, {**ENV, "RUNSTILE_DATABASE_URL": ledger.url},
                    web_workers=2, workers=2, threads=4, tasks=(CHAOS_TASKS,)).start()
    down_answers: collections.Counter = collections.Counter()
    history = History()
    clients = Clients(system.url, key.secret, history, body_for(log), threads=6,
                      give_up_s=60).start()
    restarts = scaled(2, 5)
    try:
        for _ in range(restarts):
            time.sleep(2.0)
            own_server.stop("immediate")
            # What a client sees while the server is down: 503, never a 500 or a 202.
            deadline = time.monotonic() + 3.0
            while time.monotonic() < deadline:
                answer = requests.post(f"{system.url}/v1/runs", timeout=15, headers={
                    **key.headers, "Idempotency-Key": f"down-{time.monotonic_ns()}"},
                    json={"task": "chaos.interrupt", "input": {"log": str(log)}})
                down_answers[answer.status_code] += 1
                if answer.status_code == 503:
                    assert answer.json()["error"]["code"] == "run_storage_unavailable"
                time.sleep(0.2)
            own_server.start()
            wait_until(lambda: requests.get(system.url + "/readyz", timeout=5).status_code
                       == 200, 60, 0.2, "the node to be ready again")
    finally:
        clients.stop()
    try:
        assert set(down_answers) == {503}, down_answers
        report = settle_and_check(ledger, history, log,
                                  "PostgreSQL stopped (immediate) and started", restarts)
        TABLE.append((restarts, sum(down_answers.values()), report.acknowledged,
                      len(report.lost), len(report.duplicated), len(report.stranded)))
        # The runs answered 503 while the server was down were never acknowledged, and
        # none of them exists.
        assert not ledger.query("SELECT run_id FROM idempotency_keys WHERE idempotency_key "
                                "LIKE 'down-%'")
    finally:
        system.kill()
        write_table(request, "PostgreSQL restarted under load", (
            "restarts", "requests while down", "acknowledged", "lost", "duplicated",
            "stranded"), TABLE)
