"""`runstile runs …` and `runstile deliveries …` against a real `runstile up` (docs/api.md,
"Command line: `runstile runs`"; docs/operations.md, "Command line"): every admission
field from the command line, the step journal, a pending approval's id, live progress on
a terminal, and delivery decisions over HTTP and on the local ledger alike."""

from __future__ import annotations

import json
import os
import pty
import select
import subprocess

import pytest

from runstile.cli import main
from tests.conftest import ROOT, RUNSTILE, Api, System, new_ledger, wait_for_status, wait_until
from tests.receiver import Receiver, answer_with

ENV = {"RUNSTILE_CALLBACK_ALLOWLIST": "127.0.0.1", "RUNSTILE_DELIVERY_MAX_ATTEMPTS": "1",
       "RUNSTILE_DELIVERY_BACKOFF_S": "0.05", "RUNSTILE_DELIVERY_READ_TIMEOUT_S": "1"}


@pytest.fixture(scope="module")
def system(tmp_path_factory):
    with new_ledger(tmp_path_factory.mktemp("operator")) as ledger:
        system = System(ledger.data_dir, ENV, web_workers=1, workers=1, threads=4).start()
        system.ledger = ledger
        yield system
        system.kill()


@pytest.fixture
def key(system):
    return system.ledger.key("default")


def cli(argv, capsys, system, key) -> tuple[int, str, str]:
    code = main([*argv, "--url", system.url, "--api-key", key.secret])
    out, err = capsys.readouterr()
    return code, out, err


def last_json(out: str) -> dict:
    return json.loads(out.strip().splitlines()[-1])


def test_runs_submit_takes_every_admission_field_and_steps_shows_the_journal(
        system, key, capsys):
    run_id = "run_" + "ab" * 16
    code, out, err = cli(["runs", "submit", "steps", "--run-id", run_id, "--session-key", "s1",
                          "--metadata", "team=red", "--metadata", "env=ci", "--priority", "7",
                          "--delay", "0.2", "--json"], capsys, system, key)
    assert code == 0, err
    run = last_json(out)
    assert run["id"] == run_id and run["session_key"] == "s1" and run["priority"] == 7
    assert run["metadata"] == {"team": "red", "env": "ci"} and run["not_before"] is not None
    wait_for_status(Api(system, key), run_id)
    code, out, _ = cli(["runs", "steps", run_id, "--json"], capsys, system, key)
    assert code == 0
    assert [(s["name"], s["state"]) for s in last_json(out)["data"]] == [
        ("fetch", "completed"), ("record", "completed")]
    code, out, _ = cli(["runs", "steps", run_id], capsys, system, key)
    assert code == 0 and "fetch" in out and "idempotent" in out and "record" in out
    assert cli(["runs", "submit", "steps", "--metadata", "novalue"], capsys, system, key)[0] == 2


def test_http_only_commands_take_no_data_dir_or_tasks(system, key, capsys, tmp_path):
    for extra in (["--data-dir", str(tmp_path)], ["--tasks", "runstile.demo"]):
        code, _, err = cli(["runs", "get", "run_" + "0" * 32, *extra], capsys, system, key)
        assert code == 2 and "No such option" in err
    assert not (tmp_path / "ledger.db").exists()


def test_refusals_name_what_fixes_them(system, key, capsys):
    code, _, err = cli(["runs", "submit", "no.such.task"], capsys, system, key)
    assert code == 1 and "unknown_task" in err and "echo" in err and "steps" in err
    for url in ("http://localhost:9/hook", "http://10.1.2.3/hook"):
        code, _, err = cli(["runs", "submit", "echo", "--callback-url", url], capsys,
                           system, key)
        assert code == 1 and "invalid_callback_url" in err
        assert "RUNSTILE_CALLBACK_ALLOWLIST" in err


def test_runs_get_shows_a_pending_approvals_id(system, key, capsys, tmp_path):
    code, out, _ = cli(["runs", "submit", "t.approval", "--input",
                        json.dumps({"log": str(tmp_path / "log")}), "--json"], capsys, system,
                       key)
    run_id = last_json(out)["id"]
    run = wait_for_status(Api(system, key), run_id, statuses=("waiting_for_approval",))
    approval_id = run["approval"]["approval_id"]
    code, out, _ = cli(["runs", "get", run_id], capsys, system, key)
    assert code == 0 and f"approval:    {approval_id} pending" in out
    assert f"runstile runs approve {run_id} {approval_id}" in out
    assert cli(["runs", "stop", run_id], capsys, system, key)[0] == 0


def read_all(fd: int, proc: subprocess.Popen) -> str:
    chunks = []
    while True:
        ready, _, _ = select.select([fd], [], [], 30)
        if not ready:
            break
        try:
            data = os.read(fd, 4096)
        except OSError:  # the terminal closed: the process is gone
            break
        if not data:
            break
        chunks.append(data)
    proc.wait(timeout=30)
    return b"".join(chunks).decode(errors="replace")


def test_submit_wait_shows_live_progress_on_a_terminal_and_plain_lines_otherwise(system, key):
    argv = [*RUNSTILE, "runs", "submit", "progress", "--input", '{"steps": 2, "delay_s": 0.05}',
            "--wait", "--url", system.url, "--api-key", key.secret]
    leader, follower = pty.openpty()
    proc = subprocess.Popen(argv, stdout=follower, stderr=follower, cwd=ROOT)
    os.close(follower)
    shown = read_all(leader, proc)
    os.close(leader)
    assert proc.returncode == 0, shown
    assert "run.started" in shown and "[####################] 100%" in shown
    plain = subprocess.run(argv, capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert plain.returncode == 0, plain.stderr
    assert "run.started" not in plain.stdout and " completed " in plain.stdout


def test_deliveries_are_listed_retried_and_discarded_over_http_and_on_the_local_ledger(
        system, key, capsys):
    hook = Receiver(answer_with(500))
    try:
        code, out, _ = cli(["runs", "submit", "echo", "--callback-url", hook.url(), "--json"],
                           capsys, system, key)
        run_id = last_json(out)["id"]
        api = Api(system, key)
        parked = wait_until(lambda: api.get("/v1/deliveries", params={
            "state": "parked"}).json()["data"], 20, 0.05, "the delivery to park")
        delivery_id = parked[0]["id"]
        code, out, _ = cli(["deliveries", "list", "--state", "parked", "--json"], capsys,
                           system, key)
        assert code == 0 and [d["id"] for d in last_json(out)["data"]] == [delivery_id]
        code, out, _ = cli(["deliveries", "retry", delivery_id, "--json"], capsys, system, key)
        assert code == 0 and last_json(out)["settled_by"] == f"key:{key.key_id}"
        wait_until(lambda: len(hook.received()) >= 2, 20, 0.05, "the re-armed attempt")
        wait_until(lambda: api.get(f"/v1/runs/{run_id}/deliveries").json()["data"][0][
            "state"] == "parked", 20, 0.05, "the delivery to park again")
        local = ["--data-dir", str(system.ledger.data_dir)]
        assert main(["deliveries", "discard", delivery_id, "--json", *local]) == 0
        assert last_json(capsys.readouterr().out)["state"] == "discarded"
        assert main(["deliveries", "list", run_id, "--state", "discarded", "--json",
                     *local]) == 0
        assert [d["id"] for d in last_json(capsys.readouterr().out)["data"]] == [delivery_id]
        code, _, err = cli(["deliveries", "retry", delivery_id], capsys, system, key)
        assert code == 1 and "delivery_settled" in err
        other = system.ledger.key("default")
        code, _, err = cli(["deliveries", "discard", delivery_id], capsys, system, other)
        assert code == 1 and "delivery_not_found" in err
    finally:
        hook.close()
