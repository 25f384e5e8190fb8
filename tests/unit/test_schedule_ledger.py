"""A tick's admission at the ledger (runstile/ledger/schedules.py): one transaction that
reads the pause, reserves the run through admission's own reservation and settles the
schedule through the tick (docs/architecture.md, "The scheduler")."""

from __future__ import annotations

from dataclasses import replace

import pytest

from runstile import tasks as registry
from runstile.ledger import schedules
from runstile.ledger.admission import Reservation
from runstile.ledger.keys import authenticate, schedule_key_id
from runstile.tasks import ScheduleSpec
from runstile.ticks import Ticks, spell
from runstile.workers.scheduler import template

SPEC = ScheduleSpec("nightly", "echo", Ticks(every_s=60), {"n": 1}, "default", "all")
TICK = 1_700_000_040.0  # 2023: before any resume a test makes


@pytest.fixture
def ledger(dual_ledger):
    """Every test here runs on both engines (tests/postgres.py)."""
    return dual_ledger


def reservation(spec: ScheduleSpec = SPEC, tick: float = TICK) -> Reservation:
    key = schedules.idempotency_key(spec.name, spell(tick))
    return Reservation(replace(template(spec), key=key), None, 10_000, None)


def state(conn) -> dict:
    return schedules.states(conn)["nightly"]


def test_a_tick_admitted_twice_is_one_run_and_the_second_admission_a_replay(conn):
    schedules.ensure(conn, [("nightly", "default")])
    first = schedules.admit_tick(conn, "nightly", TICK, reservation())
    assert first is not None and not first.replayed
    # A node racing the first reserves the same key: a replay, decided by the key alone.
    again = schedules.admit_tick(conn, "nightly", TICK, reservation())
    assert again is not None and again.replayed and again.run["id"] == first.run["id"]
    row = state(conn)
    assert (row["settled_through"], row["last_tick"], row["last_run_id"]) == (
        TICK, TICK, first.run["id"])
    run = first.run
    assert (run["profile_id"], run["key_id"], run["task"]) == (
        "default", schedule_key_id("default"), "echo")
    assert run["metadata"] == '{"schedule":"nightly"}' and run["input"] == '{"n":1}'
    assert conn.execute("SELECT COUNT(*) FROM runs").fetchone()[0] == 1
    # A tick older than the one the schedule is settled through is never admitted.
    assert schedules.admit_tick(conn, "nightly", TICK - 60, reservation(tick=TICK - 60)) is None
    assert conn.execute("SELECT COUNT(*) FROM runs").fetchone()[0] == 1


def test_a_paused_schedule_admits_nothing_and_a_resume_skips_the_ticks_of_the_pause(conn):
    schedules.ensure(conn, [("nightly", "default")])
    assert schedules.pause(conn, "nightly") and not schedules.pause(conn, "nightly")
    assert schedules.admit_tick(conn, "nightly", TICK, reservation()) is None
    assert schedules.resume(conn, "nightly") and not schedules.resume(conn, "nightly")
    # resumed_at is now, long after TICK: that tick fell inside the pause.
    assert schedules.admit_tick(conn, "nightly", TICK, reservation()) is None
    assert conn.execute("SELECT COUNT(*) FROM runs").fetchone()[0] == 0


def test_a_tick_whose_key_holds_another_input_is_settled_without_a_second_run(conn):
    schedules.ensure(conn, [("nightly", "default")])
    assert schedules.admit_tick(conn, "nightly", TICK, reservation()) is not None
    changed = replace(SPEC, input={"n": 2})
    assert schedules.admit_tick(conn, "nightly", TICK, reservation(changed)) is None
    assert state(conn)["settled_through"] == TICK
    assert conn.execute("SELECT COUNT(*) FROM runs").fetchone()[0] == 1


def test_the_schedule_key_is_revoked_and_has_no_secret(conn):
    schedules.ensure(conn, [("nightly", "default")])
    row = conn.execute("SELECT * FROM api_keys WHERE id = ?",
                       (schedule_key_id("default"),)).fetchone()
    assert row["revoked_at"] is not None and row["role"] == "client"
    forged = f"rsk_{schedule_key_id('default').removeprefix('key_')}_{'A' * 43}"
    assert authenticate(conn, forged) is None


def test_a_schedules_runs_travel_on_their_tasks_queue(conn):
    registry.load(("tests.workers.exec_tasks",))  # t.slow_gate is declared on queue "slow"
    spec = replace(SPEC, task="t.slow_gate")
    assert template(spec).queue == "slow"
    schedules.ensure(conn, [("nightly", "default")])
    admitted = schedules.admit_tick(conn, "nightly", TICK, reservation(spec))
    assert admitted is not None and admitted.run["queue"] == "slow"
