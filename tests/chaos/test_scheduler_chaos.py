"""Chaos for the scheduler (docs/tasks.md, "Schedules"): nodes running one
``catchup="all"`` schedule of ``every_s=1`` are SIGKILLed at random, one at a time and
sometimes all at once, and restarted after a random downtime; once they have settled,
every tick from the first to the last settled one has exactly one run."""

from __future__ import annotations

import random
import time

import pytest

from tests.chaos.harness import scaled, write_table
from tests.conftest import Workers, wait_until
from tests.workers.test_schedules import env_for, every_second, ticks_of

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(900)]

NODES = ("node-a", "node-b")
TABLE: list[tuple] = []


@pytest.fixture(scope="module", autouse=True)
def print_table(request):
    """The figures table (docs/guarantees.md quotes the full profile's)."""
    yield
    write_table(request, "scheduler nodes killed", ("scenario", "kills", "outages", "ticks",
                "runs", "skipped", "doubled"), TABLE)


def start(ledger, node: str) -> Workers:
    return Workers(ledger.data_dir, env_for(every_second("chaos"), node=node), workers=1,
                   threads=1).start()


def test_nodes_killed_at_random_never_skip_or_double_a_tick(ledger):
    rng = random.Random(16)
    nodes = {name: start(ledger, name) for name in NODES}
    kills = outages = 0
    deadline = time.monotonic() + scaled(25, 90)
    try:
        while time.monotonic() < deadline:
            time.sleep(rng.uniform(0.5, 3))
            everyone = kills == 1 or rng.random() < 0.3  # the second round: an outage
            victims = list(NODES) if everyone else [rng.choice(NODES)]
            outages += len(victims) == len(NODES)
            for name in victims:
                nodes[name].kill()
                kills += 1
            time.sleep(rng.uniform(0, 4))  # all down: these ticks are missed, then caught up
            for name in victims:
                nodes[name] = start(ledger, name)
        settled_at = time.time() + 3
        wait_until(lambda: (ledger.query("SELECT settled_through FROM schedules WHERE name = "
                                         "'chaos'")[0][0] or 0) >= settled_at, 60, 0.2,
                   "the schedule to settle past the last restart")
    finally:
        for node in nodes.values():
            node.kill()
    ticks = ticks_of(ledger, "chaos")
    settled = ledger.query("SELECT settled_through FROM schedules WHERE name = 'chaos'")[0][0]
    expected = [float(t) for t in range(int(ticks[0]), int(settled) + 1)]
    doubled = len(ticks) - len(set(ticks))
    skipped = sorted(set(expected) - set(ticks))
    TABLE.append(("scheduler nodes SIGKILLed at random, catchup=all "
                  "(`tests/chaos/test_scheduler_chaos.py::"
                  "test_nodes_killed_at_random_never_skip_or_double_a_tick`)", kills, outages,
                  len(expected), len(ticks), len(skipped), doubled))
    assert kills >= scaled(3, 10) and outages >= 1
    assert doubled == 0, "a tick with two runs"
    assert skipped == [], f"ticks without a run: {skipped[:10]}"
    assert sorted(set(ticks)) == expected
