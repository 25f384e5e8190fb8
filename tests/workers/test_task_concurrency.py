"""``@runstile.task(name, concurrency=N)`` with real workers (docs/tasks.md, "Registering a
task"): at most N bodies of the task at once across every worker process.

Executions are read from a log the task bodies write (O_APPEND lines with the process id
and the time, outside the ledger), so "one at a time" is checked where the bodies run.
The scheduled recovery pass is pushed out to an hour: a run that waited for its task's
slot can only start because the transition that freed the slot dispatched it.  The
ledger-level rules are in tests/unit/test_task_concurrency.py.
"""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor

from tests.conftest import Api, wait_for_status

#: Nothing but the freeing transition may hand a slot on.
NO_SWEEP = {"RUNSTILE_RECOVERY_INTERVAL_S": "3600"}
CLIENTS, RUNS_EACH = 8, 3


def test_a_concurrency_1_task_runs_one_body_at_a_time_across_processes_under_8_clients(
        make_system, ledger, tmp_path):
    # Two worker processes of four threads: eight threads that could run the task at once.
    system = make_system(workers=2, threads=4, **NO_SWEEP)
    log = tmp_path / "executions.log"
    clients = [Api(system, ledger.key(f"client-{n}"), ledger) for n in range(CLIENTS)]

    def submit(api: Api) -> list[str]:
        return [api.post_run({"task": "t.one_at_a_time", "input": {
            "log": str(log), "hold_s": 0.15}}).json()["id"] for _ in range(RUNS_EACH)]

    with ThreadPoolExecutor(CLIENTS) as pool:
        submitted = list(pool.map(submit, clients))
    # Runs waiting for the task's slot hold no worker thread: another task goes at once.
    other = clients[0].post_run({"task": "echo", "input": {"hi": 1}}).json()["id"]
    assert wait_for_status(clients[0], other, timeout_s=10)["status"] == "completed"
    assert ledger.query("SELECT COUNT(*) FROM runs WHERE task = 't.one_at_a_time' AND "
                        "status = 'queued'")[0][0] > 0
    for api, ids in zip(clients, submitted, strict=True):
        for rid in ids:
            assert wait_for_status(api, rid, timeout_s=60)["status"] == "completed"

    lines = [line.split() for line in log.read_text().splitlines()]
    every = {rid for ids in submitted for rid in ids}
    assert len(every) == CLIENTS * RUNS_EACH and len(lines) == 2 * len(every)
    # In the order the bodies wrote them: each start is followed by its own end, in the
    # same process, before any other body starts; and by the clock, no two overlap.
    for (began, rid, pid, _), (ended, rid2, pid2, _) in zip(lines[::2], lines[1::2],
                                                            strict=True):
        assert (began, ended, rid2, pid2) == ("start", "end", rid, pid), lines
    times = [float(at) for *_, at in lines]
    assert times == sorted(times), "two bodies overlapped"
    assert sorted(rid for kind, rid, _, _ in lines if kind == "start") == sorted(every)
    # Across processes: either both ran bodies (and the clock says none overlapped), or
    # a process that ran none had claims refused for the limit, which only the other's
    # bodies can have held.  (The process that frees the slot is usually the first to
    # see the run it hands on, so all bodies may well run in one process.)
    bodies_in = {pid for *_, pid, _ in lines}
    refused_in = set(re.findall(r"\[worker (\d+)\][^\n]*claim lost \(task_busy\)",
                                system.log()))
    assert len(bodies_in) == 2 or refused_in - bodies_in, (bodies_in, refused_in)
    # Every run a claim refused for the limit was handed a freed slot by a dispatch.
    refused = set(re.findall(r"run (run_[0-9a-f]{32}): claim lost \(task_busy\)",
                             system.log()))
    assert refused, "no claim met the limit"
    handed = {rid for (rid,) in ledger.query(
        "SELECT run_id FROM dispatches WHERE reason = 'task_slot'")}
    assert refused <= handed, refused - handed
