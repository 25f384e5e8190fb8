"""RUNSTILE_MAX_RUNNING_PER_PROFILE with real workers: one tenant cannot hold every worker
thread (docs/guarantees.md, "What a hostile client cannot do").

Executions are read from a log the task bodies write (O_APPEND lines, outside the
ledger), so "at most one at a time per profile" is checked where the bodies run.  The
scheduled recovery pass is pushed out to an hour: a run that waited for a slot can only
start because the transition that freed the slot dispatched it.  The ledger-level rules
are in tests/unit/test_profile_cap.py; the same cap on Redis and RabbitMQ is in
tests/workers/test_broker_contract.py.
"""

from __future__ import annotations

import collections
import re
from pathlib import Path

from tests.conftest import Api, wait_for_status, wait_until

#: Nothing but the freeing transition may hand a slot on.
NO_SWEEP = {"RUNSTILE_RECOVERY_INTERVAL_S": "3600"}


def read_log(path: Path) -> list[list[str]]:
    return [line.split() for line in path.read_text().splitlines()] if path.exists() else []


def most_at_once(lines: list[list[str]]) -> tuple[dict[str, int], bool]:
    """Per tag, the most bodies running at once; and whether both tags ever ran at once."""
    now: collections.Counter = collections.Counter()
    peak: collections.Counter = collections.Counter()
    together = False
    for kind, tag, *_ in lines:
        now[tag] += 1 if kind == "begin" else -1
        peak[tag] = max(peak[tag], now[tag])
        together = together or (len(now) == 2 and all(now.values()))
    return dict(peak), together


def test_a_capped_profile_runs_one_body_at_a_time_and_the_other_profile_keeps_going(
        make_system, ledger, tmp_path):
    system = make_system(workers=1, threads=4, RUNSTILE_MAX_RUNNING_PER_PROFILE="1",
                         **NO_SWEEP)
    tenants = {"a": Api(system, ledger.key("tenant-a"), ledger),
               "b": Api(system, ledger.key("tenant-b"), ledger)}
    log = tmp_path / "executions.log"
    ids = {tag: [api.post_run({"task": "t.tenant_step", "input": {
        "log": str(log), "tag": tag, "hold_s": 1.0}}).json()["id"] for _ in range(4)]
        for tag, api in tenants.items()}
    for tag, api in tenants.items():
        for rid in ids[tag]:
            assert wait_for_status(api, rid, timeout_s=60)["status"] == "completed"
    lines = read_log(log)
    assert len(lines) == 16  # every run began and ended once
    peak, together = most_at_once(lines)
    # Four threads, eight runs: without the cap each tenant would run up to four at once.
    assert peak == {"a": 1, "b": 1}, peak
    assert together, "the two tenants never ran at the same time"
    # Each waiting run started when its tenant's previous run ended, not at a sweep.
    for tag in tenants:
        times = [(kind, float(at)) for kind, t, _, at in lines if t == tag]
        gaps = [b[1] - a[1] for a, b in zip(times, times[1:], strict=False)
                if (a[0], b[0]) == ("end", "begin")]
        assert len(gaps) == 3 and max(gaps) < 5, gaps
    # Every run a claim refused for the cap was handed a freed slot by a dispatch.
    refused = set(re.findall(r"run (run_[0-9a-f]{32}): claim lost \(profile_busy\)",
                             system.log()))
    assert refused & set(ids["a"]) and refused & set(ids["b"])
    handed = {rid for (rid,) in ledger.query(
        "SELECT run_id FROM dispatches WHERE reason = 'profile_slot'")}
    assert refused <= handed, refused - handed


def test_two_slow_demo_runs_no_longer_keep_another_tenants_run_waiting(make_system, ledger):
    # The reported attack: two runs of `slow` held both worker threads, and every other
    # profile's runs stayed queued for as long as the client liked.
    system = make_system(workers=1, threads=2, RUNSTILE_MAX_RUNNING_PER_PROFILE="1",
                         **NO_SWEEP)
    hog = Api(system, ledger.key("hog"), ledger)
    other = Api(system, ledger.key("other"), ledger)
    slow = [hog.post_run({"task": "slow", "input": {"seconds": 60}}).json()["id"]
            for _ in range(2)]

    def statuses():
        return [hog.get(f"/v1/runs/{rid}").json()["status"] for rid in slow]
    wait_until(lambda: "running" in statuses(), 30, 0.05, "one slow run to start")
    quick = other.post_run({"task": "echo", "input": {"hi": 1}}).json()["id"]
    assert wait_for_status(other, quick, timeout_s=10)["status"] == "completed"
    assert sorted(statuses()) == ["queued", "running"]
    # Stopping the running one hands its slot to the other at once.
    first, second = slow if statuses()[0] == "running" else slow[::-1]
    assert hog.post(f"/v1/runs/{first}/stop").status_code == 202
    wait_for_status(hog, first, statuses=("cancelled",), timeout_s=30)
    wait_for_status(hog, second, statuses=("running",), timeout_s=10)
    hog.post(f"/v1/runs/{second}/stop")
    wait_for_status(hog, second, statuses=("cancelled",), timeout_s=30)
    # And `slow` sleeps at most a minute: asking for a day fails at once, saying why.
    day = hog.post_run({"task": "slow", "input": {"seconds": 86400}}).json()["id"]
    failed = wait_for_status(hog, day, timeout_s=30)
    assert failed["status"] == "failed" and failed["error"]["code"] == "task_error"
    assert "from 0 to 60" in failed["error"]["message"], failed["error"]
