"""RUNSTILE_DATABASE_URL / --database-url: which ledger a command opens, validated, its
password kept out of every message (docs/configuration.md), and the refusal of a command
that does not run on a PostgreSQL ledger yet."""

from __future__ import annotations

import json

import pytest

from runstile.cli import main
from runstile.config import Settings
from runstile.errors import ConfigError, redact_url
from tests import postgres

SECRET = "hunter2-secret"


def run(argv, capsys) -> tuple[int, str, str]:
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def test_unset_the_ledger_is_the_sqlite_file_in_the_data_directory(tmp_path):
    settings = Settings.from_env({"RUNSTILE_DATA_DIR": str(tmp_path)})
    assert settings.database_url is None and settings.ledger_target == tmp_path / "ledger.db"


def test_a_postgresql_url_is_the_ledger_and_its_password_stays_out_of_the_repr():
    url = f"postgresql://app:{SECRET}@db.example:5433/runs"
    settings = Settings.from_env({"RUNSTILE_DATABASE_URL": url})
    assert settings.ledger_target == url
    assert SECRET not in repr(settings)
    assert settings.ledger_name == "postgresql://app:***@db.example:5433/runs"


@pytest.mark.parametrize("value", ["mysql://app:hunter2-secret@db/runs", "sqlite:///x.db",
                                   "postgresql://app:hunter2-secret@db:99999/runs"])
def test_another_scheme_or_a_bad_port_is_refused_without_showing_the_password(value):
    with pytest.raises(ConfigError, match="RUNSTILE_DATABASE_URL") as refused:
        Settings.from_env({"RUNSTILE_DATABASE_URL": value})
    assert SECRET not in refused.value.message


def test_a_bad_flag_is_one_line_and_exit_2_without_the_password(tmp_path, capsys):
    code, out, err = run(["db", "migrate", "--data-dir", str(tmp_path),
                          "--database-url", f"mysql://app:{SECRET}@db/runs"], capsys)
    assert code == 2 and SECRET not in out + err
    assert "--database-url='mysql://app:***@db/runs' is invalid" in err


def test_a_url_without_a_password_is_shown_as_it_is():
    assert redact_url("postgresql://app@db/runs") == "postgresql://app@db/runs"
    assert redact_url("postgresql://:pw@[::1]:5432/runs") == "postgresql://:***@[::1]:5432/runs"


def test_db_migrate_and_check_run_on_postgresql(tmp_path, capsys):
    with postgres.fresh_database() as url:
        code, out, _ = run(["db", "migrate", "--json", "--data-dir", str(tmp_path),
                            "--database-url", url], capsys)
        assert code == 0 and json.loads(out)["from_version"] == 0
        code, out, _ = run(["db", "check", "--json", "--data-dir", str(tmp_path),
                            "--database-url", url], capsys)
        report = json.loads(out)
        assert code == 0 and report["ok"], report
        assert report["synchronous_commit"] == "on"  # left as the server has it
        code, out, _ = run(["db", "check", "--data-dir", str(tmp_path), "--database-url", url],
                           capsys)
        assert code == 0 and out.startswith("schema version") and "synchronous_commit on" in out
    assert not (tmp_path / "ledger.db").exists()


def test_an_unreachable_server_is_one_line_and_exit_2_without_the_password(tmp_path, capsys):
    code, out, err = run(["db", "migrate", "--data-dir", str(tmp_path), "--database-url",
                          f"postgresql://app:{SECRET}@127.0.0.1:1/runs"], capsys)
    assert code == 2 and err.startswith("error: the PostgreSQL ledger postgresql://app:***@")
    assert "the server does not answer (Connection refused)" in err
    assert SECRET not in out + err and len(err.strip().splitlines()) == 1
