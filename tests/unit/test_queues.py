"""Queue names, a node's pools and the refusals of ``--queues`` / ``--queue-threads``
(docs/tasks.md, "Queues"; docs/configuration.md).  The command line runs in-process
through ``main(argv)``; what a deployment does with queues is proven by real servers and
worker processes in tests/workers/test_queues.py."""

from __future__ import annotations

import sqlite3

import pytest

import runstile
from runstile import dispatch, queues
from runstile import tasks as registry
from runstile.cli import main
from runstile.config import Settings
from runstile.errors import ConfigError
from runstile.ledger import db, migrations
from runstile.objects import run_object
from runstile.up import Supervisor
from runstile.workers import pools

TASKS = ["--tasks", "tests.workers.exec_tasks"]


def run(argv, capsys) -> tuple[int, str, str]:
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("name", ["", "Email", "e.mail", "1st", "-x", "a" * 65, "ü", 3, None])
def test_a_task_declared_with_an_invalid_queue_name_is_refused_naming_the_task(name):
    with pytest.raises(ConfigError, match=r"task 't\.badq': queue .* is not a queue name"):
        runstile.task("t.badq", queue=name)


def test_a_queue_name_maps_to_a_broker_queue_no_other_name_can_reach():
    assert queues.broker_queue("default") == dispatch.QUEUE == "runstile"
    assert queues.broker_queue("email") == "runstile.email"
    # Never a Dramatiq delay or dead-letter queue, never deliveries' own queue.
    for name in ("dq", "xq", "deliveries", "a", "z9_-"):
        queues.check_name(name, "queue")
        assert not queues.broker_queue(name).endswith((".DQ", ".XQ"))
        assert queues.broker_queue(name) != queues.DELIVERY_QUEUE
    assert registry.DEFAULT_QUEUE == queues.DEFAULT_QUEUE


def test_a_runs_message_goes_to_its_queue_and_names_it():
    message = dispatch.message_for("run_x", 7, 9, "email")
    assert message.queue_name == "runstile.email"
    assert message.kwargs == {"dispatch_id": 7, "queue": "email"}
    # The default queue's message is the one runstile always wrote.
    assert dispatch.message_for("run_x", 7).kwargs == {"dispatch_id": 7}
    assert dispatch.delivery_message("obl_x").queue_name == queues.DELIVERY_QUEUE


def test_the_registered_queues_always_hold_the_default_queue():
    registry.load(("tests.workers.exec_tasks",))
    assert registry.queue_of("t.slow_gate") == "slow"
    assert registry.queue_of("t.gate") == registry.queue_of("no-such-task") == "default"
    assert {"default", "slow"} <= set(registry.queues())


def plan(**settings) -> list[tuple[str, tuple[str, ...], int]]:
    made = pools.plan(Settings(threads=4, **settings), ["default", "email", "slow"])
    return [(p.name, p.queues, p.threads) for p in made]


def test_a_node_shares_one_pool_among_its_queues_and_gives_deliveries_their_own():
    assert plan() == [("shared", ("default", "email", "slow"), 4), ("deliveries", (), 4)]
    assert plan(queue_threads=(("slow", 2),)) == [
        ("shared", ("default", "email"), 4), ("slow", ("slow",), 2), ("deliveries", (), 4)]
    # Every consumed queue with threads of its own: no shared pool at all.
    assert plan(queues=("email",), queue_threads=(("email", 1),)) == [
        ("email", ("email",), 1), ("deliveries", (), 4)]
    assert pools.Pool("deliveries", (), 1).broker_queues == {queues.DELIVERY_QUEUE}
    assert pools.Pool("x", ("default", "slow"), 1).broker_queues == {"runstile",
                                                                    "runstile.slow"}


def test_queues_no_registered_task_uses_are_refused_naming_the_registered_ones():
    with pytest.raises(ConfigError, match="--queues names 'mail', which no registered task "
                                          "uses; the registered queues are default, email, "
                                          "slow"):
        plan(queues=("email", "mail"))
    with pytest.raises(ConfigError, match="--queue-threads names 'slow', which this node "
                                          "does not consume; it consumes email"):
        plan(queues=("email",), queue_threads=(("slow", 1),))


@pytest.mark.parametrize("spec, message", [
    ("slow", "'slow' is not QUEUE=THREADS"), ("slow=0", "from 1 to 256"),
    ("slow=many", "is not QUEUE=THREADS"), ("slow=1,slow=2", "given threads twice"),
    ("=2", "is not QUEUE=THREADS"), ("Slow=2", "'Slow' is not a queue name"),
    ("nope=2", "--queue-threads names 'nope', which this node does not consume"),
])
def test_queue_threads_with_a_bad_spec_is_exit_2_with_one_line(tmp_path, capsys, spec,
                                                               message):
    code, out, err = run(["worker", "--data-dir", str(tmp_path), *TASKS,
                          "--queue-threads", spec], capsys)
    assert code == 2 and out == ""
    assert err.startswith("error: --queue-threads") and err.count("\n") == 1, err
    assert message in err
    assert not (tmp_path / "ledger.db").exists()  # refused before anything started


def test_up_with_a_queue_no_task_uses_is_exit_2_naming_the_registered_queues(tmp_path,
                                                                            capsys):
    code, _, err = run(["up", "--data-dir", str(tmp_path), *TASKS, "--queues",
                        "slow,emial"], capsys)
    assert code == 2 and err.count("\n") == 1
    assert "--queues names 'emial', which no registered task uses; the registered " \
           "queues are default, slow" in err
    code, _, err = run(["up", "--data-dir", str(tmp_path), *TASKS, "--queues", "Slow"],
                       capsys)
    assert code == 2 and "'Slow' is not a queue name" in err and err.count("\n") == 1


def test_the_supervisor_hands_the_nodes_queues_to_every_worker_process():
    settings = Settings(queues=("slow", "default"), queue_threads=(("slow", 2),))
    argv = Supervisor(settings, web=False).plan_workers(3)[0].argv
    assert argv[-4:] == ["--queues", "slow,default", "--queue-threads", "slow=2"]
    assert "--queues" not in Supervisor(Settings(), web=False).plan_workers(3)[0].argv


def test_runstile_queues_and_queue_threads_are_read_from_the_environment():
    settings = Settings.from_env({"RUNSTILE_QUEUES": "slow, default,slow",
                                  "RUNSTILE_QUEUE_THREADS": "slow=2"})
    assert settings.queues == ("slow", "default")
    assert settings.queue_threads == (("slow", 2),)
    with pytest.raises(ConfigError, match="RUNSTILE_QUEUES='a.b' is invalid"):
        Settings.from_env({"RUNSTILE_QUEUES": "a.b"})


def test_migration_9_puts_every_existing_run_on_the_default_queue(tmp_path):
    path = tmp_path / "ledger.db"
    conn = sqlite3.connect(path)
    for version, script in migrations.MIGRATIONS:
        if version < 9:
            for statement in migrations.split_statements(script()):
                conn.execute(statement)
    conn.execute("PRAGMA user_version = 8")
    conn.execute("INSERT INTO profiles (id, created_at) VALUES ('p', 0)")
    conn.execute("INSERT INTO api_keys (id, profile_id, role, secret_hash, created_at) "
                 "VALUES ('key_1', 'p', 'client', 'h', 0)")
    conn.execute("INSERT INTO runs (id, profile_id, key_id, task, input, fingerprint, "
                 "fingerprint_version, status, attempt, created_at, updated_at) VALUES "
                 "('run_old', 'p', 'key_1', 'echo', 'null', 'f', 1, 'queued', 1, 0, 0)")
    conn.commit()
    conn.close()
    assert migrations.migrate(path) == 8
    conn = db.connect(path)
    try:
        row = dict(conn.execute("SELECT * FROM runs").fetchone())
        assert row["queue"] == "default" and queues.queue_of(row) == "default"
        assert run_object(row)["queue"] == "default"
    finally:
        conn.close()
