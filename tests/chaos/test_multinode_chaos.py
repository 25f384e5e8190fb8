"""Many machines under chaos (`make chaos`; CI runs RUNSTILE_CHAOS_PROFILE=short): three
nodes on one PostgreSQL ledger, each with its own name and data directory (web on two,
workers on all three), and a whole node SIGKILLed again and again under load.

While a killed node stays dead, the runs it held must be classified by a survivor
within RUNSTILE_LEASE_S + RUNSTILE_RECOVERY_INTERVAL_S (plus the time a pass takes on a
loaded machine); then it comes back under the same name (a new generation).  At the end
the checker (tests/chaos/harness.py) must find 0 lost, 0 duplicated, 0 stranded."""

from __future__ import annotations

import random
import time

import pytest

from tests import postgres
from tests.chaos.chaos_tasks import TASKS
from tests.chaos.harness import Clients, History, scaled, write_table
from tests.chaos.test_chaos import CHAOS_TASKS, ENV, settle_and_check
from tests.conftest import Ledger, System, Workers

pytestmark = [pytest.mark.chaos, pytest.mark.postgresql, pytest.mark.timeout(900)]

LEASE_S = float(ENV["RUNSTILE_LEASE_S"])
INTERVAL_S = float(ENV["RUNSTILE_RECOVERY_INTERVAL_S"])
#: What a recovery pass and the processes' start-up may add on two loaded CPUs.
PASS_SLACK_S = 2.0
TABLE: list[tuple] = []


@pytest.fixture
def pg_ledger(tmp_path):
    """A PostgreSQL ledger of this test's own, on either pass of the suite."""
    with postgres.fresh_database(required=True, migrated=True) as url:
        yield Ledger(tmp_path / "ledger-home", url=url)


def body_for(log):
    def make(key: str) -> dict:
        rng = random.Random(key)
        # Some bodies long enough that a killed node is holding runs when it dies.
        return {"task": rng.choice(TASKS), "input": {
            "log": str(log), "steps": rng.randint(1, 3),
            "sleep_s": rng.choice([0, 0.02, 0.2, 0.5]), "idempotent": rng.random() < 0.5}}
    return make


def held_by(ledger: Ledger, node: str) -> set[str]:
    """The runs ``node`` holds: running or stopping under its name."""
    return {row[0] for row in ledger.query(
        "SELECT id FROM runs WHERE owner_node = ? AND status IN ('running', 'stopping')",
        (node,))}


def wait_taken_over(ledger: Ledger, node: str, runs: set[str], limit_s: float,
                    started: float) -> float:
    """Seconds from ``started`` (the kill) until none of ``runs`` is held by ``node`` any
    more (the node is dead, so only a survivor's recovery can have moved them); fails
    past ``limit_s``."""
    while runs & held_by(ledger, node):
        elapsed = time.monotonic() - started
        assert elapsed < limit_s, (f"{node}'s runs {sorted(runs & held_by(ledger, node))} "
                                   f"still held {elapsed:.1f}s after it died")
        time.sleep(0.1)
    return time.monotonic() - started


def start_nodes(ledger: Ledger, tmp_path) -> dict[str, System | Workers]:
    env = {**ENV, "RUNSTILE_DATABASE_URL": ledger.url}
    nodes: dict[str, System | Workers] = {}
    for name in ("node-a", "node-b"):
        nodes[name] = System(tmp_path / name, {**env, "RUNSTILE_NODE_ID": name},
                             web_workers=1, workers=1, threads=4, tasks=(CHAOS_TASKS,))
    nodes["node-c"] = Workers(tmp_path / "node-c", {**env, "RUNSTILE_NODE_ID": "node-c"},
                              workers=1, threads=4)
    for node in nodes.values():
        node.start()
    return nodes


def test_three_nodes_on_postgresql_with_whole_nodes_killed_lose_and_duplicate_nothing(
        pg_ledger, tmp_path, request):
    ledger = pg_ledger
    key = ledger.key()
    log = tmp_path / "executions.log"
    nodes = start_nodes(ledger, tmp_path)
    history = History()
    clients = [Clients(nodes[name].url, key.secret, history, body_for(log), threads=4,
                       prefix=f"{name}-", give_up_s=60).start()
               for name in ("node-a", "node-b")]
    rng = random.Random(7)
    kills, taken_over, slowest = scaled(3, 9), 0, 0.0
    try:
        for _ in range(kills):
            time.sleep(rng.uniform(1.0, 3.0))  # load builds up on every node
            name = rng.choice(sorted(nodes))
            # Read just before the kill: the kill waits for the whole tree to be reaped,
            # and a survivor may well have taken the runs over by then.  A run that
            # finishes between the read and the kill is simply not held any more.
            held, killed_at = held_by(ledger, name), time.monotonic()
            nodes[name].kill()  # the whole process tree, at once
            slowest = max(slowest, wait_taken_over(ledger, name, held,
                                                   LEASE_S + INTERVAL_S + PASS_SLACK_S,
                                                   killed_at))
            taken_over += len(held)
            nodes[name].start()  # back under the same name: a new generation
    finally:
        for group in clients:
            group.stop()
    generations = dict(ledger.query("SELECT id, generation FROM nodes ORDER BY id"))
    try:
        assert taken_over > 0, "no killed node held a run: the takeover was never tested"
        report = settle_and_check(ledger, history, log,
                                  f"3 nodes on PostgreSQL, whole node SIGKILL, "
                                  f"{taken_over} runs taken over", kills)
        TABLE.append((kills, taken_over, f"{slowest:.1f}", report.acknowledged,
                      len(report.lost), len(report.duplicated), len(report.stranded)))
        assert sum(generations[n] for n in ("node-a", "node-b", "node-c")) == 3 + kills
    finally:
        for node in nodes.values():
            node.kill()
        write_table(request, "nodes killed on PostgreSQL", (
            "kills", "runs taken over", "slowest takeover (s)", "acknowledged", "lost",
            "duplicated", "stranded"), TABLE)

