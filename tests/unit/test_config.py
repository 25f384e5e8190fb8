"""Settings are read once, validated, and name the variable at fault."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from runstile.config import ENV_VARIABLES, Settings
from runstile.errors import ConfigError


def test_defaults_match_the_spec():
    s = Settings.from_env({})
    assert s.data_dir == Path("./runstile-data") and s.ledger_path == Path("./runstile-data/ledger.db")
    assert s.tasks == ("runstile.demo",) and s.broker_url == "sqlite"
    assert s.synchronous == "FULL" and s.busy_timeout_ms == 5000
    assert s.max_body_bytes == 1024 * 1024 and s.max_active_runs == 10_000
    assert s.run_retention_s == 7 * 24 * 3600 and s.key_tombstone_s == 30 * 24 * 3600
    assert s.lease_s == 15 and s.heartbeat_s == 5 and s.recovery_interval_s == 10
    assert s.recovery_budget == 3 and s.drain_timeout_s == 30 and s.stop_grace_s == 10
    assert s.max_result_bytes == 1024 * 1024 and s.stream_max_s == 300
    assert s.delivery_backoff_s == 1 and s.delivery_max_attempts == 12
    assert s.callback_allowlist == () and s.default_task is None and s.node_id


def test_environment_values_are_parsed():
    s = Settings.from_env({"RUNSTILE_DATA_DIR": "/tmp/x", "RUNSTILE_TASKS": "a.b, c",
                           "RUNSTILE_SYNCHRONOUS": "normal", "RUNSTILE_MAX_ACTIVE_RUNS": "7",
                           "RUNSTILE_CALLBACK_ALLOWLIST": "hooks.internal, 10.0.0.0/8",
                           "RUNSTILE_BROKER_URL": "sqlite"})
    assert s.data_dir == Path("/tmp/x") and s.tasks == ("a.b", "c")
    assert s.synchronous == "NORMAL" and s.max_active_runs == 7
    assert s.callback_allowlist == ("hooks.internal", "10.0.0.0/8")
    assert s.broker_url == "sqlite"


def test_the_admission_writer_is_a_process_unless_inline_is_asked_for():
    assert Settings.from_env({}).admission_writer == "process"
    assert Settings.from_env({"RUNSTILE_ADMISSION_WRITER": " Inline "}).admission_writer \
        == "inline"


def test_the_admission_writer_lingers_only_when_asked_to():
    assert Settings.from_env({}).admission_linger_ms == 0
    assert Settings.from_env({"RUNSTILE_ADMISSION_LINGER_MS": "1.5"}).admission_linger_ms == 1.5


def test_flags_override_the_environment():
    s = Settings.from_env({"RUNSTILE_PORT": "9000"}, port=9100)
    assert s.port == 9100


@pytest.mark.parametrize("name,value", [
    ("RUNSTILE_BUSY_TIMEOUT_MS", "0"), ("RUNSTILE_BUSY_TIMEOUT_MS", "fast"),
    ("RUNSTILE_SYNCHRONOUS", "sometimes"), ("RUNSTILE_BROKER_URL", "kafka://x"),
    ("RUNSTILE_LEASE_S", "-1"), ("RUNSTILE_LEASE_S", "nan"), ("RUNSTILE_PORT", "70000"),
    ("RUNSTILE_TASKS", " , "), ("RUNSTILE_CALLBACK_ALLOWLIST", "10.0.0.0/99"),
    ("RUNSTILE_NODE_ID", "has space"), ("RUNSTILE_CRASHPOINT", "nowhere"),
    ("RUNSTILE_RUN_RETENTION_S", "-5"), ("RUNSTILE_MAX_BODY_BYTES", "1.5"),
    ("RUNSTILE_HOST", " "), ("RUNSTILE_DATA_DIR", ""),
    ("RUNSTILE_BROKER_URL", "redis://"), ("RUNSTILE_BROKER_URL", "redis://h:99999"),
    ("RUNSTILE_BROKER_URL", "amqp://h;redis://h"), ("RUNSTILE_ADMISSION_WRITER", "thread"),
    ("RUNSTILE_ADMISSION_WRITER", ""), ("RUNSTILE_ADMISSION_LINGER_MS", "21"),
    ("RUNSTILE_ADMISSION_LINGER_MS", "-1"), ("RUNSTILE_ADMISSION_LINGER_MS", "nan"),
])
def test_an_invalid_value_is_refused_naming_the_variable(name, value):
    with pytest.raises(ConfigError) as info:
        Settings.from_env({name: value})
    assert name in info.value.message


@pytest.mark.parametrize("url", ["redis://127.0.0.1:6379/0", "rediss://cache.internal:6380",
                                 "amqp://guest:guest@127.0.0.1:5672/%2F",
                                 "amqps://mq.internal", "amqp://a:5672;amqp://b:5672"])
def test_redis_and_rabbitmq_urls_are_accepted(url):
    # Published to after commit and re-published by recovery (docs/architecture.md,
    # "Redis and RabbitMQ").
    assert Settings.from_env({"RUNSTILE_BROKER_URL": f" {url} "}).broker_url == url


def test_the_heartbeat_must_be_shorter_than_the_lease():
    with pytest.raises(ConfigError, match="HEARTBEAT"):
        Settings.from_env({"RUNSTILE_LEASE_S": "5", "RUNSTILE_HEARTBEAT_S": "5"})


def test_every_variable_maps_to_a_setting():
    fields = set(Settings.__dataclass_fields__)
    for name in ENV_VARIABLES:
        assert name.removeprefix("RUNSTILE_").lower() in fields, name


def test_a_new_metrics_folder_removes_those_whose_owner_is_gone(tmp_path, monkeypatch):
    import subprocess
    import sys
    import tempfile

    from runstile.config import new_metrics_folder
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    for name, owner in (("runstile-metrics-dead", str(gone.pid)),
                        ("runstile-metrics-live", str(os.getpid()))):
        (tmp_path / name).mkdir()
        (tmp_path / name / "owner").write_text(owner)
    (tmp_path / "runstile-metrics-older").mkdir()  # no owner file: not ours to judge
    folder = Path(new_metrics_folder())
    assert folder.parent == tmp_path and (folder / "owner").read_text() == str(os.getpid())
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [folder.name, "runstile-metrics-live", "runstile-metrics-older"])
