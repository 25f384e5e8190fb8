"""Queues (docs/tasks.md, "Queues"; docs/architecture.md, "Queues and thread pools"): a
task's runs travel on its queue, a node consumes the queues it is given, and a queue
with threads of its own cannot starve another — on the embedded broker, Redis and
RabbitMQ.

``t.slow_gate`` (tests/workers/exec_tasks.py) is a task of the queue ``slow`` that holds
its worker thread until the test creates a release file; executions are read from the
tasks' own log, never from the ledger.
"""

from __future__ import annotations

import json
import time

import pytest

from tests.conftest import Api, wait_for_status, wait_until
from tests.workers import test_broker_contract as contract
from tests.workers.test_priority import starts

#: The broker contract's deployments, one per broker (embedded, Redis, RabbitMQ).
ALL, broker, deploy = contract.ALL, contract.broker, contract.deploy
#: Worker processes x shared threads of a deployment (conftest's System and Workers).
SHARED_THREADS = 2 * 4


def slow_runs(api: Api, log, release, count: int) -> list[str]:
    ids = []
    for n in range(count):
        run = api.post_run({"task": "t.slow_gate", "input": {
            "log": str(log), "tag": f"slow{n}", "release": str(release)}}).json()
        assert run["queue"] == "slow"
        ids.append(run["id"])
    return ids


@pytest.mark.parametrize("broker", ALL, indirect=True)
def test_a_slow_queue_leaves_the_default_queue_flowing(deploy, ledger, tmp_path):
    """More sleeping runs of ``slow`` than the node has shared threads: with one thread
    of its own per worker process, ``slow`` runs two at a time and the default queue's
    runs complete meanwhile (sharing the pool, the sleepers would take every thread)."""
    deployment = deploy({"RUNSTILE_QUEUE_THREADS": "slow=1"})
    api = deployment.api
    log, release = tmp_path / "executions.log", tmp_path / "release"
    sleeping = slow_runs(api, log, release, SHARED_THREADS + 2)
    wait_until(lambda: len(starts(log)) == 2, 30, 0.05, "both slow threads to be busy")
    flowing = [api.post_run({"task": "t.gate", "input": {"log": str(log), "tag": f"d{n}"}}
                            ).json() for n in range(10)]
    assert {run["queue"] for run in flowing} == {"default"}
    for run in flowing:
        assert wait_for_status(api, run["id"])["status"] == "completed"
    # Still two slow runs at a time, the rest queued behind them on their own queue.
    assert len([tag for tag in starts(log) if tag.startswith("slow")]) == 2
    queued = [rid for rid in sleeping
              if api.get(f"/v1/runs/{rid}").json()["status"] == "queued"]
    assert len(queued) == len(sleeping) - 2
    release.touch()
    for rid in sleeping:
        assert wait_for_status(api, rid)["status"] == "completed"


def test_a_node_given_queues_consumes_only_those(make_system, ledger, tmp_path):
    """``RUNSTILE_QUEUES=slow`` (what ``--queues slow`` sets): the runs of ``slow``
    complete, a default-queue run stays queued, through recovery passes too."""
    system = make_system(workers=1, threads=2, RUNSTILE_QUEUES="slow",
                         RUNSTILE_RECOVERY_INTERVAL_S="0.5", RUNSTILE_LEASE_S="2",
                         RUNSTILE_HEARTBEAT_S="0.5")
    api = Api(system, ledger.key(), ledger)
    log = tmp_path / "executions.log"
    left = api.post_run({"task": "t.gate", "input": {"log": str(log), "tag": "left"}}).json()
    taken = api.post_run({"task": "t.slow_gate", "input": {"log": str(log), "tag": "taken"}}
                         ).json()
    assert (left["queue"], taken["queue"]) == ("default", "slow")
    assert wait_for_status(api, taken["id"])["status"] == "completed"
    # Recovery re-publishes a run left queued long after its dispatch (2 leases: 4 s);
    # it goes back to its own queue, which nobody here consumes.
    time.sleep(5)
    run = api.get(f"/v1/runs/{left['id']}").json()
    assert (run["status"], run["started_at"]) == ("queued", None)
    assert starts(log) == ["taken"]


def test_a_webhook_is_delivered_while_every_run_thread_is_busy(make_system, ledger, receiver,
                                                               tmp_path):
    """Deliveries have threads of their own: one worker thread, held by a run that
    started right after a run with a callback, still leaves the callback going out."""
    system = make_system(workers=1, threads=1, RUNSTILE_CALLBACK_ALLOWLIST="127.0.0.1")
    api = Api(system, ledger.key(), ledger)
    hook = receiver()
    log, release = tmp_path / "executions.log", tmp_path / "release"
    called = api.post_run({"task": "t.gate", "callback_url": hook.url(),
                           "input": {"log": str(log), "tag": "called"}}).json()
    holder = api.post_run({"task": "t.gate", "input": {"log": str(log), "tag": "holder",
                                                        "release": str(release)}}).json()
    wait_until(lambda: starts(log) == ["called", "holder"], 30, 0.05,
               "the holder to take the only thread")
    wait_until(hook.received, 30, 0.05, "the callback of the first run")
    assert json.loads(hook.received()[0]["body"])["data"]["id"] == called["id"]
    assert api.get(f"/v1/runs/{holder['id']}").json()["status"] == "running"
    release.touch()
    assert wait_for_status(api, holder["id"])["status"] == "completed"


@pytest.mark.parametrize("broker", ALL, indirect=True)
def test_lost_messages_of_a_queue_are_republished_to_that_queue(deploy, broker, ledger,
                                                                tmp_path):
    """Recovery re-publishes a run to the queue stored on it: a node that consumes only
    ``slow`` completes ``slow`` runs whose messages the broker lost (one sent to the
    default queue instead would never be consumed here)."""
    deployment = deploy({"RUNSTILE_QUEUES": "slow"})
    deployment.stop_workers()
    log = tmp_path / "executions.log"
    ids = [deployment.api.post_run({"task": "t.slow_gate", "input": {
        "log": str(log), "tag": f"lost{n}"}}).json()["id"] for n in range(5)]
    broker.lose_messages()  # Redis restarted without persistence; RabbitMQ purged
    deployment.start_workers()
    for rid in ids:
        assert wait_for_status(deployment.api, rid, timeout_s=60)["status"] == "completed"
    assert sorted(starts(log)) == [f"lost{n}" for n in range(5)]
    assert ledger.query("SELECT COUNT(DISTINCT run_id) FROM dispatches "
                        "WHERE reason = 'republished'")[0][0] == 5
