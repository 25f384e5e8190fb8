"""Issue 4's end-to-end control flows: stop races, the approval flow through the CLI, and
the Python client across a server killed mid-submit."""

from __future__ import annotations

import collections
import json
import random
import threading
import time

from runstile import Client
from runstile.cli import main as cli_main
from tests.conftest import Api, System, wait_for_status, wait_until

TERMINAL = {"run.completed", "run.failed", "run.cancelled", "run.interrupted"}


def read_log(path):
    return path.read_text().splitlines() if path.exists() else []


def test_stop_races_end_each_run_in_exactly_one_terminal_state(make_system, ledger, tmp_path):
    system = make_system(workers=2, threads=4)
    api = Api(system, ledger.key(), ledger)
    log = tmp_path / "executions.log"
    rng = random.Random(7)
    answers: dict[str, int] = {}

    def submit_and_stop(n: int) -> None:
        own = Api(system, api.key, ledger)
        rid = own.post_run({"task": "t.session_step",
                            "input": {"log": str(log), "n": n, "hold_s": 0.05}}).json()["id"]
        time.sleep(rng.choice([0, 0, 0.005, 0.02, 0.05, 0.08, 0.2]))  # before .. after done
        answer = own.post(f"/v1/runs/{rid}/stop")
        answers[rid] = (answer.status_code, answer.json()["status"],
                        answer.json().get("finished_at"))

    threads = [threading.Thread(target=submit_and_stop, args=(n,)) for n in range(60)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for rid in answers:
        wait_for_status(api, rid, timeout_s=30)
    began = collections.Counter(line.split()[3] for line in read_log(log)
                                if line.startswith("begin"))
    for rid, (code, status, _) in answers.items():
        events = [e["type"] for e in api.get(f"/v1/runs/{rid}/events", headers={
            "Accept": "application/json"}).json()["data"]]
        assert sum(t in TERMINAL for t in events) == 1, (rid, events)
        final = api.get(f"/v1/runs/{rid}").json()["status"]
        assert final in ("cancelled", "completed")
        assert began[rid] <= 1
        if code == 200 and status == "cancelled" and "run.started" not in events:
            assert began[rid] == 0, "a run stopped while queued started"
        if code == 202:
            assert status == "stopping" and final in ("cancelled", "completed") \
                and final == "cancelled"
    assert {c for c, _, _ in answers.values()} <= {200, 202}


def test_an_approval_flow_through_the_cli(make_system, ledger, tmp_path, capsys):
    system = make_system(workers=1, threads=2)
    key = ledger.key()
    api = Api(system, key, ledger)
    base = ["--url", system.url, "--api-key", key.secret]
    assert cli_main(["runs", "submit", "t.approval", "--input",
                     json.dumps({"log": str(tmp_path / "log")}), "--json", *base]) == 0
    rid = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["id"]
    approval_id = wait_for_status(api, rid, statuses=("waiting_for_approval",))[
        "approval"]["approval_id"]
    assert cli_main(["runs", "approve", rid, approval_id, "--decision", "approve", "--json",
                     *base]) == 0
    capsys.readouterr()
    assert cli_main(["runs", "watch", rid, *base]) == 0
    assert api.get(f"/v1/runs/{rid}").json()["result"] == {"published": True}
    assert cli_main(["runs", "approve", rid, approval_id, "--decision", "deny", *base]) == 1
    assert "approval_already_resolved" in capsys.readouterr().err


def test_the_client_survives_a_server_killed_mid_submit(ledger, tmp_path):
    key = ledger.key()
    system = System(ledger.data_dir, {"RUNSTILE_CRASHPOINT": "after_admit_commit"},
                    web_workers=1, workers=1, threads=2).start()
    client = Client(system.url, key.secret, timeout_s=5, max_retries=40)
    result: dict = {}

    def submit():
        result["run"] = client.submit("echo", {"x": 1}, idempotency_key="survive-1")

    worker = threading.Thread(target=submit, daemon=True)
    worker.start()
    try:
        # The web process commits the run, then dies before answering (gunicorn restarts
        # it, and it dies again on every retry); then the whole node is killed.
        wait_until(lambda: ledger.query("SELECT COUNT(*) FROM runs")[0][0] == 1, 30, 0.02,
                   "the admission to commit")
        time.sleep(0.5)
    finally:
        system.kill()
    restarted = System(ledger.data_dir, {}, web_workers=1, workers=1, threads=2,
                       port=system.port).start()
    try:
        worker.join(timeout=120)
        assert not worker.is_alive()
        run = result["run"]
        assert run["replayed"] is True
        assert ledger.query("SELECT COUNT(*) FROM runs") == [(1,)]
        assert client.wait(run["id"], timeout_s=30)["status"] == "completed"
    finally:
        restarted.kill()
