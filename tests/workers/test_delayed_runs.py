"""Delayed runs (docs/api.md, "Delayed runs") on real worker processes: not claimed before
their not_before, started within about a second after it, across a SIGKILL of the whole
system and a restart, and an early message is a logged no-op that leaves a message due
at the run's time."""

from __future__ import annotations

import signal
import time

from runstile import dispatch
from runstile.ledger import broker_queue, db
from runstile.objects import parse_rfc3339, rfc3339
from tests.conftest import Api, wait_for_status, wait_until

#: How long after its not_before a delayed run may start (docs/api.md, "Delayed runs").
LATE_S = 1.0


def body_starts(path) -> dict[str, float]:
    """run id -> wall-clock time the task's own body logged at its start."""
    lines = path.read_text().splitlines() if path.exists() else []
    return {line.split()[1]: float(line.split()[3]) for line in lines if line.startswith("start")}


def assert_started_in_its_window(api: Api, run_id: str, log, not_before: float) -> dict:
    run = wait_for_status(api, run_id, statuses=("completed",), timeout_s=20)
    started = parse_rfc3339(run["started_at"])
    body = body_starts(log)[run_id]
    # rfc3339 truncates to milliseconds: allow that much below not_before.
    assert not_before - 0.001 <= started <= not_before + LATE_S, (started, not_before)
    assert not_before <= body <= not_before + LATE_S + 0.5, (body, not_before)
    return run


def test_a_delayed_run_does_not_start_before_its_time_and_starts_just_after(make_system,
                                                                           ledger, tmp_path):
    system = make_system(workers=1, threads=2)
    api = Api(system, ledger.key(), ledger)
    log = tmp_path / "executions.log"
    before = time.time()
    created = api.post_run({"task": "t.log_time", "input": {"log": str(log)}, "delay_s": 2})
    assert created.status_code == 202
    run = created.json()
    assert run["status"] == "queued" and run["not_before"] is not None
    not_before = parse_rfc3339(run["not_before"])
    assert before + 2 - 0.01 <= not_before <= time.time() + 2
    # Sleeping only to let time pass while asserting nothing started.
    time.sleep(max(0.0, not_before - time.time() - 0.3))
    assert api.get(f"/v1/runs/{run['id']}").json()["status"] == "queued"
    assert run["id"] not in body_starts(log)
    assert_started_in_its_window(api, run["id"], log, not_before)


def test_a_delayed_run_survives_a_sigkill_of_the_whole_system_and_a_restart(make_system,
                                                                           ledger, tmp_path):
    system = make_system(workers=1, threads=2)
    api = Api(system, ledger.key(), ledger)
    log = tmp_path / "executions.log"
    run = api.post_run({"task": "t.log_time", "input": {"log": str(log)},
                        "delay_s": 10}).json()
    not_before = parse_rfc3339(run["not_before"])
    # The worker holds the delayed message in memory until its eta: kill it there.
    wait_until(lambda: ledger.query(
        "SELECT COUNT(*) FROM broker_messages WHERE run_id = ? AND state = 'claimed'",
        (run["id"],))[0][0] == 1, 10, 0.02, "a worker to hold the delayed message")
    system.kill(signal.SIGKILL)
    assert ledger.query("SELECT status FROM runs WHERE id = ?", (run["id"],)) == [("queued",)]
    system.start()
    # 10 s: a SIGKILL and a restart take ~2.6 s on a quiet machine, ~5 s under load.
    assert time.time() < not_before - 0.2, "the restart took longer than the delay"
    assert api.get(f"/v1/runs/{run['id']}").json()["status"] == "queued"
    assert_started_in_its_window(api, run["id"], log, not_before)
    assert list(body_starts(log)) == [run["id"]]


def test_a_not_before_in_the_past_starts_at_once(make_system, ledger, tmp_path):
    system = make_system(workers=1, threads=2)
    api = Api(system, ledger.key(), ledger)
    log = tmp_path / "executions.log"
    sent = time.time()
    run = api.post_run({"task": "t.log_time", "input": {"log": str(log)},
                        "not_before": "2001-02-03T04:05:06Z"}).json()
    assert run["not_before"] == "2001-02-03T04:05:06.000Z"
    done = wait_for_status(api, run["id"], statuses=("completed",), timeout_s=10)
    assert parse_rfc3339(done["started_at"]) - sent < LATE_S


def test_an_early_message_is_a_no_op_and_the_run_still_starts_at_its_time(make_system,
                                                                          ledger, tmp_path):
    """A message that reaches a worker before the run's time (a duplicate, a clock step):
    the claim refuses it, logs it, and the run gets a message due at its not_before."""
    system = make_system(workers=1, threads=2)
    api = Api(system, ledger.key(), ledger)
    log = tmp_path / "executions.log"
    run = api.post_run({"task": "t.log_time", "input": {"log": str(log)},
                        "delay_s": 2.5}).json()
    not_before = parse_rfc3339(run["not_before"])
    conn = ledger.connect()
    with db.transaction(conn):  # an undelayed duplicate of the run's message
        message = dispatch.message_for(run["id"])
        broker_queue.insert_message(conn, dispatch.QUEUE, message.message_id,
                                    message.encode(), run_id=run["id"])
    conn.close()
    wait_until(lambda: "claim lost (not_due)" in system.log(), 10, 0.05,
               "the early claim to be logged as a no-op")
    assert api.get(f"/v1/runs/{run['id']}").json()["status"] == "queued"
    assert ledger.query("SELECT COUNT(*) FROM dispatches WHERE run_id = ? AND "
                        "reason = 'not_due'", (run["id"],)) == [(1,)]
    assert_started_in_its_window(api, run["id"], log, not_before)
    assert rfc3339(not_before) == run["not_before"]


def test_a_delayed_head_of_a_session_holds_back_the_runs_after_it(make_system, ledger,
                                                                  tmp_path):
    system = make_system(workers=1, threads=2)
    api = Api(system, ledger.key(), ledger)
    log = tmp_path / "executions.log"
    head = api.post_run({"task": "t.log_time", "input": {"log": str(log)},
                         "session_key": "s", "delay_s": 1.5}).json()
    later = api.post_run({"task": "t.log_time", "input": {"log": str(log)},
                          "session_key": "s"}).json()
    not_before = parse_rfc3339(head["not_before"])
    assert_started_in_its_window(api, head["id"], log, not_before)
    wait_for_status(api, later["id"], statuses=("completed",), timeout_s=10)
    starts = body_starts(log)
    assert list(starts) == [head["id"], later["id"]]
    assert starts[later["id"]] >= not_before
