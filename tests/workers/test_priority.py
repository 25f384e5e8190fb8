"""Run priority on the embedded broker (docs/api.md, "POST /v1/runs"; docs/architecture.md,
"The embedded broker"): among a queue's claimable runs a higher priority starts first, and
priority never overtakes a session's order.

The order is read from the tasks' own execution log, never from the ledger.  One worker
thread, held by a blocking run, and a queue prefetch of 1 (Dramatiq's
``dramatiq_queue_prefetch``): nothing is claimed early, so every later run waits in the
ledger, where the consumer's fetch orders it (docs/operations.md, "Run priority and
prefetch").
"""

from __future__ import annotations

from tests.conftest import Api, wait_for_status, wait_until

ONE_AT_A_TIME = {"dramatiq_queue_prefetch": "1"}


def starts(log) -> list[str]:
    lines = log.read_text().splitlines() if log.exists() else []
    return [line.split()[2] for line in lines if line.startswith("start ") and
            len(line.split()) > 2]


def blocked_system(make_system, ledger, tmp_path):
    system = make_system(workers=1, threads=1, **ONE_AT_A_TIME)
    api = Api(system, ledger.key(), ledger)
    log, release = tmp_path / "executions.log", tmp_path / "release"
    blocker = api.post_run({"task": "t.gate", "input": {"log": str(log), "tag": "blocker",
                                                         "release": str(release)}}).json()["id"]
    wait_until(lambda: starts(log) == ["blocker"], 30, 0.02, "the blocking run to start")
    return api, log, release, blocker


def test_runs_of_priority_9_admitted_after_runs_of_priority_0_start_before_them(
        make_system, ledger, tmp_path):
    api, log, release, _ = blocked_system(make_system, ledger, tmp_path)
    ids = []
    for tag, priority in [("low0", 0), ("low1", 0), ("mid", None), ("high0", 9),
                          ("high1", 9)]:
        body = {"task": "t.gate", "input": {"log": str(log), "tag": tag}}
        if priority is not None:
            body["priority"] = priority
        run = api.post_run(body).json()
        assert run["priority"] == (5 if priority is None else priority)
        ids.append(run["id"])
    release.touch()
    for rid in ids:
        assert wait_for_status(api, rid)["status"] == "completed"
    # Higher first; arrival order within one priority.
    assert starts(log) == ["blocker", "high0", "high1", "mid", "low0", "low1"]


def test_a_later_run_of_a_session_waits_for_its_head_even_with_a_higher_priority(
        make_system, ledger, tmp_path):
    api, log, release, _ = blocked_system(make_system, ledger, tmp_path)
    ids = []
    for tag, priority, session in [("head", 0, "s"), ("other", 5, None), ("next", 9, "s")]:
        body = {"task": "t.gate", "priority": priority,
                "input": {"log": str(log), "tag": tag}}
        if session is not None:
            body["session_key"] = session
        ids.append(api.post_run(body).json()["id"])
    release.touch()
    for rid in ids:
        assert wait_for_status(api, rid)["status"] == "completed"
    order = starts(log)
    # "next" (9) may not start before its session's head (0), whatever "other" does.
    assert order.index("head") < order.index("next")
    assert order[0] == "blocker" and sorted(order[1:]) == ["head", "next", "other"]
