"""Sessions: one run at a time per (scope, session_key), in admission order.

See ``session_key`` in docs/api.md, "`POST /v1/runs` — admit a run".
"""

from __future__ import annotations

from tests.conftest import Api, wait_for_status, wait_until


def read_log(path):
    return path.read_text().splitlines() if path.exists() else []


def test_runs_of_a_session_execute_one_at_a_time_in_admission_order(make_system, ledger,
                                                                    tmp_path):
    system = make_system(workers=2, threads=4)
    api = Api(system, ledger.key(), ledger)
    log = tmp_path / "executions.log"
    ids = []
    for n in range(6):
        for session in ("alpha", "beta"):
            ids.append(api.post_run({"task": "t.session_step", "session_key": session,
                                     "input": {"log": str(log), "n": n, "hold_s": 0.1}}
                                    ).json()["id"])
    for rid in ids:
        assert wait_for_status(api, rid)["status"] == "completed"
    lines = [line.split() for line in read_log(log)]
    for session in ("alpha", "beta"):
        mine = [(kind, int(n)) for kind, s, n, _ in lines if s == session]
        # begin n, finish n, begin n+1, ...: never two at once, always in order.
        assert mine == [(kind, n) for n in range(6) for kind in ("begin", "finish")]
    # Sessions do not wait for each other: their runs interleave.
    sessions_in_order = [s for kind, s, _, _ in lines if kind == "begin"]
    assert sessions_in_order != sorted(sessions_in_order)


def test_a_paused_or_stopped_head_does_not_block_its_session(make_system, ledger, tmp_path):
    system = make_system(workers=1, threads=4)
    api = Api(system, ledger.key(), ledger)
    log = tmp_path / "executions.log"
    head = api.post_run({"task": "t.checkpointing", "session_key": "s",
                         "input": {"log": str(log)}}).json()["id"]
    nxt = api.post_run({"task": "t.session_step", "session_key": "s",
                        "input": {"log": str(log), "n": 1}}).json()["id"]
    wait_until(lambda: any(line.startswith(f"start {head}") for line in read_log(log)), 30, 0.02,
               "the head to run")
    assert api.get(f"/v1/runs/{nxt}").json()["status"] == "queued"  # waits behind its head
    assert api.post(f"/v1/runs/{head}/stop").status_code == 202
    wait_for_status(api, head, statuses=("cancelled",))
    assert wait_for_status(api, nxt)["status"] == "completed"


def test_the_same_session_key_in_another_scope_is_another_session(make_system, ledger,
                                                                  tmp_path):
    system = make_system(workers=1, threads=4)
    a, b = Api(system, ledger.key(), ledger), Api(system, ledger.key(), ledger)
    log = tmp_path / "executions.log"
    blocker = a.post_run({"task": "t.checkpointing", "session_key": "shared",
                          "input": {"log": str(log)}}).json()["id"]
    wait_until(lambda: any(line.startswith(f"start {blocker}") for line in read_log(log)), 30, 0.02,
               "a's head to run")
    other = b.post_run({"task": "t.session_step", "session_key": "shared",
                        "input": {"log": str(log), "n": 1}}).json()["id"]
    assert wait_for_status(b, other)["status"] == "completed"
    a.post(f"/v1/runs/{blocker}/stop")
