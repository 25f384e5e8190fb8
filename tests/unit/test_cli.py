"""The ``runstile`` command line, run in-process through ``main(argv)`` and as a process."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys

from runstile.cli import main


def run(argv, capsys) -> tuple[int, str, str]:
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def last_json(out: str) -> dict:
    return json.loads(out.strip().splitlines()[-1])


def test_keys_create_makes_the_profile_and_prints_the_secret_once(tmp_path, capsys):
    code, out, _ = run(["keys", "create", "--profile", "acme", "--label", "ci", "--json",
                        "--data-dir", str(tmp_path)], capsys)
    assert code == 0
    key = last_json(out)
    assert set(key) == {"key_id", "secret", "profile", "role"}
    assert key["profile"] == "acme" and key["role"] == "client"
    assert key["secret"].startswith("rsk_") and len(key["secret"]) >= 43
    conn = sqlite3.connect(tmp_path / "ledger.db")
    stored = conn.execute("SELECT secret_hash FROM api_keys").fetchone()[0]
    assert key["secret"] not in stored and len(stored) == 64
    assert conn.execute("SELECT id FROM profiles").fetchall() == [("acme",)]


def test_data_dir_and_tasks_are_accepted_anywhere_after_the_subcommand(tmp_path, capsys):
    code, out, _ = run(["keys", "create", "--data-dir", str(tmp_path), "--tasks",
                        "runstile.demo", "--profile", "p", "--admin", "--json"], capsys)
    assert code == 0 and last_json(out)["role"] == "admin"


def test_keys_list_revoke_and_rotate(tmp_path, capsys):
    d = ["--data-dir", str(tmp_path)]
    _, out, _ = run(["keys", "create", "--profile", "a", "--json", *d], capsys)
    key_id = last_json(out)["key_id"]
    code, out, _ = run(["keys", "list", "--json", *d], capsys)
    listed = last_json(out)["data"]
    assert code == 0 and [k["id"] for k in listed] == [key_id]
    assert "secret" not in json.dumps(listed) and "secret_hash" not in listed[0]
    code, out, _ = run(["keys", "rotate", key_id, "--json", *d], capsys)
    assert code == 0 and last_json(out)["key_id"] == key_id
    assert run(["keys", "revoke", key_id, *d], capsys)[0] == 0
    code, out, _ = run(["keys", "list", "--json", *d], capsys)
    assert last_json(out)["data"][0]["revoked_at"] is not None
    assert run(["keys", "rotate", key_id, *d], capsys)[0] == 1  # revoked keys stay dead


def test_unknown_keys_are_a_failure_and_bad_usage_is_exit_2(tmp_path, capsys):
    d = ["--data-dir", str(tmp_path)]
    assert run(["db", "migrate", *d], capsys)[0] == 0
    code, _, err = run(["keys", "revoke", "key_0000000000000000", *d], capsys)
    assert code == 1 and "no key" in err
    assert run(["keys", "create", *d], capsys)[0] == 2                      # --profile missing
    assert run(["keys", "create", "--profile", "bad name!", *d], capsys)[0] == 2
    assert run(["no-such-command"], capsys)[0] == 2


def test_an_invalid_environment_value_is_a_usage_error_naming_it(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("RUNSTILE_BUSY_TIMEOUT_MS", "soon")
    code, _, err = run(["db", "migrate", "--data-dir", str(tmp_path)], capsys)
    assert code == 2 and "RUNSTILE_BUSY_TIMEOUT_MS" in err


def test_db_migrate_check_and_backup(tmp_path, capsys):
    d = ["--data-dir", str(tmp_path)]
    code, out, _ = run(["db", "migrate", "--json", *d], capsys)
    assert code == 0 and last_json(out)["version"] >= 1
    run(["keys", "create", "--profile", "x", *d], capsys)
    code, out, _ = run(["db", "check", "--json", *d], capsys)
    report = last_json(out)
    assert code == 0 and report["ok"] is True and report["journal_mode"] == "wal"
    target = tmp_path / "copy.db"
    code, out, _ = run(["db", "backup", str(target), "--json", *d], capsys)
    assert code == 0 and last_json(out)["pages"] > 0
    copy = sqlite3.connect(target)
    assert copy.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    assert copy.execute("SELECT COUNT(*) FROM api_keys").fetchone()[0] == 1
    assert run(["db", "backup", str(target), *d], capsys)[0] == 1          # exists, no --force
    assert run(["db", "backup", str(target), "--force", *d], capsys)[0] == 0


def test_db_check_reports_a_broken_invariant(tmp_path, capsys):
    d = ["--data-dir", str(tmp_path)]
    run(["keys", "create", "--profile", "x", *d], capsys)
    conn = sqlite3.connect(tmp_path / "ledger.db")
    conn.execute("UPDATE profiles SET active_runs = 5")
    conn.commit()
    code, out, _ = run(["db", "check", "--json", *d], capsys)
    assert code == 1 and any("active_runs" in p for p in last_json(out)["problems"])


def test_db_check_without_a_ledger_fails_clearly(tmp_path, capsys):
    code, _, err = run(["db", "check", "--data-dir", str(tmp_path / "none")], capsys)
    assert code == 1 and "no ledger" in err


def test_the_console_script_runs_as_a_process(tmp_path):
    result = subprocess.run([sys.executable, "-m", "runstile", "keys", "create", "--profile",
                             "proc", "--json", "--data-dir", str(tmp_path)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert last_json(result.stdout)["profile"] == "proc"


def test_webhooks_secret_is_stable_until_rotated_and_refuses_a_bad_profile(tmp_path, capsys):
    from runstile import webhooks
    assert run(["keys", "create", "--profile", "acme", "--data-dir", str(tmp_path)],
               capsys)[0] == 0
    args = ["webhooks", "secret", "--profile", "acme", "--data-dir", str(tmp_path)]
    code, first, _ = run(args, capsys)
    assert code == 0
    secret = first.strip().splitlines()[-1]
    webhooks.secret_key(secret)  # whsec_ + base64 of at least 24 bytes
    assert run(args, capsys)[1].strip().splitlines()[-1] == secret
    code, rotated, err = run([*args, "--rotate"], capsys)
    assert code == 0 and rotated.strip().splitlines()[-1] != secret and "keeps signing" in err
    assert run(args, capsys)[1].strip().splitlines()[-1] == rotated.strip().splitlines()[-1]
    assert run(["webhooks", "secret", "--profile", "no spaces!", "--data-dir",
                str(tmp_path)], capsys)[0] == 2


def test_webhooks_secret_for_a_profile_that_does_not_exist_is_refused_and_makes_nothing(
        tmp_path, capsys):
    assert run(["keys", "create", "--profile", "acme", "--data-dir", str(tmp_path)],
               capsys)[0] == 0
    for extra in ([], ["--rotate"]):
        code, out, err = run(["webhooks", "secret", "--profile", "nosuch", *extra,
                              "--data-dir", str(tmp_path)], capsys)
        assert code == 1 and out == ""
        assert "error: profile_not_found: no profile 'nosuch'" in err
    conn = sqlite3.connect(tmp_path / "ledger.db")
    assert conn.execute("SELECT COUNT(*) FROM webhook_secrets").fetchone()[0] == 0
    assert conn.execute("SELECT id FROM profiles").fetchall() == [("acme",)]


def test_deliveries_commands_validate_ids_and_report_unknown_ones(tmp_path, capsys):
    base = ["--data-dir", str(tmp_path)]
    assert run(["db", "migrate", *base], capsys)[0] == 0
    assert run(["deliveries", "list", "run_123", *base], capsys)[0] == 2
    assert run(["deliveries", "retry", "dlv_x", *base], capsys)[0] == 2
    code, _, err = run(["deliveries", "discard", "msg_" + "0" * 32, *base], capsys)
    assert code == 1 and "delivery_not_found" in err
    code, _, err = run(["deliveries", "list", "run_" + "0" * 32, *base], capsys)
    assert code == 1 and "run_not_found" in err


def test_a_command_that_reads_a_missing_ledger_says_so_and_creates_none(tmp_path, capsys):
    missing = tmp_path / "nowhere"
    d = ["--data-dir", str(missing)]
    for argv in (["keys", "list"], ["keys", "revoke", "key_x"], ["webhooks", "secret",
                 "--profile", "p"], ["deliveries", "list"], ["recover"],
                 ["deliveries", "discard", "msg_" + "0" * 32]):
        code, out, err = run([*argv, *d], capsys)
        assert code == 1, argv
        assert f"no ledger at {missing / 'ledger.db'}" in err and out == ""
        assert not (missing / "ledger.db").exists(), argv
    assert run(["keys", "create", "--profile", "p", *d], capsys)[0] == 0
    assert (missing / "ledger.db").exists()


def test_an_invalid_log_format_is_a_usage_error(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("RUNSTILE_LOG_FORMAT", "yaml")
    code, _, err = run(["keys", "list", "--data-dir", str(tmp_path)], capsys)
    assert code == 2 and "RUNSTILE_LOG_FORMAT='yaml' is invalid: must be one of text, json" in err


def test_up_on_a_taken_port_fails_clearly_before_printing_a_url_or_making_a_key(tmp_path):
    import socket
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run(
            [sys.executable, "-m", "runstile", "up", "--port", str(port), "--data-dir",
             str(tmp_path / "data")], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2, result.stderr
    assert result.stdout == ""
    assert f"cannot listen on 127.0.0.1:{port}" in result.stderr and "--port" in result.stderr
    assert not (tmp_path / "data" / "ledger.db").exists()
