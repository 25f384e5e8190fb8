"""Schedules on real nodes (docs/tasks.md, "Schedules"): ``runstile worker`` processes on
one ledger, each running its scheduler; runs counted in the ledger by their idempotency
keys ``schedule:<name>:<tick>``."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import time
from itertools import pairwise

import pytest
import requests

from runstile.ledger import db
from runstile.ticks import spell
from tests.conftest import ROOT, RUNSTILE, Workers, wait_until
from tests.workers.test_broker_contract import broker  # noqa: F401 - the fixture

TASKS = "tests.workers.schedule_tasks"


def env_for(*schedules: dict, node: str = "node-a") -> dict:
    return {"RUNSTILE_TASKS": TASKS, "RUNSTILE_NODE_ID": node,
            "SCHEDULES_UNDER_TEST": json.dumps(list(schedules))}


def every_second(name: str, catchup: str = "all") -> dict:
    return {"name": name, "task": "tick", "every_s": 1, "catchup": catchup,
            "input": {"from": name}}


def schedule_of(ledger, column: str) -> str:
    """SQL for the schedule named in a run's metadata, in the ledger's dialect."""
    conn = ledger.connect()
    try:
        return db.dialect(conn).json_text(column, "schedule")
    finally:
        conn.close()


def ticks_of(ledger, name: str) -> list[float]:
    """The ticks of ``name`` that have a run, each as often as it has one."""
    schedule = schedule_of(ledger, "r.metadata")
    rows = ledger.query(
        "SELECT k.idempotency_key FROM runs r JOIN idempotency_keys k ON k.run_id = r.id "
        f"WHERE {schedule} = ?", (name,))
    unkeyed = ledger.query(f"SELECT COUNT(*) FROM runs r WHERE {schedule} = ? AND r.id "
                           "NOT IN (SELECT run_id FROM idempotency_keys)", (name,))[0][0]
    assert unkeyed == 0, "every scheduled run has its tick's key"
    prefix = f"schedule:{name}:"
    ticks = []
    for (key,) in rows:
        assert key.startswith(prefix), key
        ticks.append(time.mktime(time.strptime(key[len(prefix):], "%Y-%m-%dT%H:%M:%SZ"))
                     - time.timezone)
    return sorted(ticks)


def watching_from(node: Workers) -> float:
    """When ``node``'s scheduler started watching (its log says so)."""
    found = wait_until(lambda: re.findall(r"watching from ([0-9.]+)", node.log()), 15, 0.05,
                       "the scheduler to start")
    return float(found[-1])


def contiguous(ticks: list[float]) -> bool:
    return all(b - a == 1 for a, b in pairwise(ticks))


def test_two_nodes_racing_admit_exactly_one_run_per_tick_for_30_consecutive_ticks(ledger):
    schedule = every_second("race")
    a = Workers(ledger.data_dir, env_for(schedule, node="node-a"), workers=1, threads=2).start()
    b = Workers(ledger.data_dir, env_for(schedule, node="node-b"), workers=1, threads=2).start()
    try:
        both = max(watching_from(a), watching_from(b))
        wait_until(lambda: len([t for t in ticks_of(ledger, "race") if t > both]) >= 30, 60,
                   0.2, "30 ticks admitted while both schedulers ran")
    finally:
        a.kill()
        b.kill()
    ticks = ticks_of(ledger, "race")
    assert len(ticks) == len(set(ticks)), "no tick has two runs"
    raced = [t for t in ticks if t > both]
    assert len(raced) >= 30 and contiguous(raced), "no tick skipped"
    assert contiguous(ticks)


def runstile_cli(ledger, *args: str, schedules: list[dict]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*RUNSTILE, "schedules", *args, "--data-dir", str(ledger.data_dir), "--tasks", TASKS],
        env={**os.environ, **env_for(*schedules)}, capture_output=True, text=True, cwd=ROOT,
        timeout=60)


def test_after_10_s_of_downtime_each_catchup_policy_admits_what_it_says_and_a_pause_holds(
        ledger):
    policies = [every_second("c-all", "all"), every_second("c-latest", "latest"),
                every_second("c-none", "none")]
    schedules = [*policies, every_second("paused", "all")]
    node = Workers(ledger.data_dir, env_for(*schedules), workers=1, threads=2).start()
    first = watching_from(node)
    wait_until(lambda: all(len(ticks_of(ledger, s["name"])) >= 2 for s in schedules), 15, 0.1,
               "two ticks of each schedule")
    paused = runstile_cli(ledger, "pause", "paused", "--json", schedules=schedules)
    assert paused.returncode == 0, paused.stderr
    shown = json.loads(paused.stdout.splitlines()[-1])
    assert shown["paused"] is True and shown["next_tick"] is None
    paused_at, paused_count = time.time(), len(ticks_of(ledger, "paused"))
    node.kill()
    before = {s["name"]: ledger.query("SELECT settled_through FROM schedules WHERE name = ?",
                                      (s["name"],))[0][0] for s in policies}
    time.sleep(10)  # the downtime under test: no scheduler runs
    node = Workers(ledger.data_dir, env_for(*schedules), workers=1, threads=2).start()
    try:
        restart = watching_from(node)
        wait_until(lambda: all(len([t for t in ticks_of(ledger, s["name"]) if t > restart]) >= 3
                               for s in policies), 15, 0.1, "three ticks after the restart")
        assert len(ticks_of(ledger, "paused")) == paused_count, "the pause held"
        resumed = runstile_cli(ledger, "resume", "paused", schedules=schedules)
        assert resumed.returncode == 0, resumed.stderr
        resumed_at = time.time()
        wait_until(lambda: len(ticks_of(ledger, "paused")) >= paused_count + 2, 15, 0.1,
                   "ticks after the resume")
    finally:
        node.kill()
    assert restart - first > 10
    missed = {name: [t for t in ticks_of(ledger, name) if settled < t <= restart]
              for name, settled in before.items()}
    every_missed = [float(t) for t in range(math.floor(before["c-all"]) + 1,
                                            math.floor(restart) + 1)]
    assert len(every_missed) >= 10
    assert missed["c-all"] == every_missed, "all: each missed tick, none twice"
    assert missed["c-latest"] == [float(math.floor(restart))], "latest: only the last one"
    assert missed["c-none"] == [], "none: no missed tick"
    for schedule in policies:
        ticks = ticks_of(ledger, schedule["name"])
        after = [t for t in ticks if t > restart]
        assert contiguous(after) and after[0] == math.floor(restart) + 1, schedule["name"]
        assert len(ticks) == len(set(ticks))
    ticks = ticks_of(ledger, "paused")
    assert not [t for t in ticks if paused_at + 1 < t < resumed_at - 1], "no tick of the pause"
    listed = runstile_cli(ledger, "list", "--json", schedules=schedules)
    assert listed.returncode == 0, listed.stderr
    objects = {o["name"]: o for o in json.loads(listed.stdout.splitlines()[-1])["data"]}
    assert set(objects) == {s["name"] for s in schedules}
    assert objects["paused"]["paused"] is False and objects["paused"]["next_tick"] is not None
    assert objects["paused"]["last_tick"] == spell(ticks[-1])


def test_pausing_a_schedule_no_task_module_declares_exits_2(ledger):
    missing = runstile_cli(ledger, "pause", "nope", schedules=[every_second("other")])
    assert missing.returncode == 2
    assert missing.stderr.strip() == ("error: schedule_not_found: no schedule 'nope' is "
                                      "declared in the task modules (--tasks)")


BAD = [
    ({"name": "bad-cron", "task": "tick", "cron": "61 * * * *"}, "invalid cron expression"),
    ({"name": "bad-zone", "task": "tick", "cron": "0 3 * * *", "timezone": "Mars/Olympus"},
     "unknown time zone"),
    ({"name": "bad-task", "task": "no_such_task", "every_s": 5}, "no task named"),
    ({"name": "bad-both", "task": "tick", "cron": "0 3 * * *", "every_s": 5}, "exactly one"),
    ({"name": "bad-catchup", "task": "tick", "every_s": 5, "catchup": "some"}, "catchup"),
]


@pytest.mark.parametrize(("declaration", "says"), BAD, ids=[d["name"] for d, _ in BAD])
def test_a_bad_schedule_declaration_stops_the_worker_with_exit_2_naming_it(ledger, declaration,
                                                                          says):
    proc = subprocess.run(
        [*RUNSTILE, "worker", "--data-dir", str(ledger.data_dir), "--workers", "1"],
        env={**os.environ, **env_for(declaration)}, capture_output=True,
        text=True, cwd=ROOT, timeout=60)
    assert proc.returncode == 2, proc.stderr
    message = proc.stderr.strip().splitlines()[-1]
    assert declaration["name"] in message and says in message
    assert "worker up" not in proc.stderr


def test_an_admin_key_lists_schedules_and_finds_a_ticks_run_by_its_key(ledger, make_server):
    schedule = every_second("lookup")
    admin, client = ledger.key(admin=True), ledger.key()
    server = make_server(web_workers=1, **env_for(schedule))
    node = Workers(ledger.data_dir, env_for(schedule), workers=1, threads=2).start()
    try:
        wait_until(lambda: ticks_of(ledger, "lookup"), 15, 0.1, "a tick")
        tick = spell(ticks_of(ledger, "lookup")[0])
        found = requests.get(f"{server.url}/v1/runs", headers=admin.headers, timeout=10,
                             params={"idempotency_key": f"schedule:lookup:{tick}"}).json()
        listed = requests.get(f"{server.url}/v1/schedules", headers=admin.headers, timeout=10)
        refused = requests.get(f"{server.url}/v1/schedules", headers=client.headers, timeout=10)
        hidden = requests.get(f"{server.url}/v1/runs", headers=client.headers, timeout=10,
                              params={"idempotency_key": f"schedule:lookup:{tick}"}).json()
    finally:
        node.kill()
    (run,) = found["data"]
    assert run["task"] == "tick" and run["metadata"] == {"schedule": "lookup"}
    assert run["input"] == {"from": "lookup"}
    assert listed.status_code == 200
    (obj,) = listed.json()["data"]
    assert obj["name"] == "lookup" and obj["every_s"] == 1 and obj["last_tick"] >= tick
    assert refused.status_code == 404 and refused.json()["error"]["code"] == "not_found"
    assert hidden["data"] == [], "a client key sees no scheduled run"


@pytest.mark.parametrize("broker", [pytest.param("redis", marks=pytest.mark.broker)],
                         indirect=True)
def test_ticks_runs_are_published_after_the_commit_and_executed_on_redis(ledger, broker):  # noqa: F811
    env = {**env_for(every_second("on-redis")), "RUNSTILE_BROKER_URL": broker.url}
    node = Workers(ledger.data_dir, env, workers=1, threads=2).start()
    schedule = schedule_of(ledger, "metadata")
    try:
        wait_until(lambda: ledger.query(
            "SELECT COUNT(*) FROM runs WHERE status = 'completed' AND "
            f"{schedule} = 'on-redis'")[0][0] >= 3, 20, 0.1,
            "three scheduled runs executed through Redis")
    finally:
        node.kill()
    unsent = ledger.query("SELECT COUNT(*) FROM dispatches d JOIN runs r ON r.id = d.run_id "
                          "WHERE d.sent_at IS NULL AND r.status = 'completed'")[0][0]
    assert unsent == 0, "each tick's dispatch was published by the scheduler's commit"
