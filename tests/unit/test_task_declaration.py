"""Declaring tasks (runstile/tasks.py): what is honoured, and a clear error for the rest."""

from __future__ import annotations

import uuid

import dramatiq
import dramatiq.broker
import pytest

import runstile
from runstile import tasks
from runstile.errors import ConfigError


def task_module(tmp_path, monkeypatch, source: str) -> str:
    name = f"tasks_{uuid.uuid4().hex}"
    (tmp_path / f"{name}.py").write_text(source, encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


def test_a_dramatiq_option_on_a_runstile_task_is_refused_naming_the_options_that_exist():
    with pytest.raises(ConfigError) as refused:
        runstile.task("with_retries_of_dramatiq", max_retries=3)
    assert "max_retries" in refused.value.message
    assert all(option in refused.value.message for option in tasks.OPTIONS)


@pytest.mark.parametrize("decorator", ["@dramatiq.actor", "@dramatiq.actor(max_retries=3)",
                                       "@dramatiq.actor(on_success='done', time_limit=5)"])
def test_a_dramatiq_actor_in_a_task_module_is_refused_when_the_module_loads(
        tmp_path, monkeypatch, decorator):
    name = task_module(tmp_path, monkeypatch,
                       f"import dramatiq\n\n{decorator}\ndef send(x):\n    pass\n")
    before = dramatiq.broker.global_broker
    with pytest.raises(ConfigError) as refused:
        tasks.load((name,))
    assert "may not declare Dramatiq actors" in refused.value.message
    assert f"{name}.send" in refused.value.message
    assert dramatiq.broker.global_broker is before  # Dramatiq's global broker is restored


def test_a_module_of_runstile_tasks_loads_and_registers_them(tmp_path, monkeypatch):
    name = task_module(tmp_path, monkeypatch,
                       "import runstile\n\n@runstile.task('loaded_" + uuid.uuid4().hex[:8]
                       + "', retries=2)\ndef body(ctx, value):\n    return value\n")
    loaded = tasks.load((name,))
    assert any(spec.fn.__module__ == name and spec.retries == 2 for spec in loaded.values())
