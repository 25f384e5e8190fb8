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


@pytest.mark.parametrize("value", [0, -1, 1.5, 2.0, "2", True, [1]])
def test_a_concurrency_that_is_not_a_whole_number_of_at_least_1_is_refused_naming_the_task(
        value):
    with pytest.raises(ConfigError) as refused:
        runstile.task("capped_badly", concurrency=value)
    assert "'capped_badly'" in refused.value.message
    assert "concurrency must be a whole number >= 1" in refused.value.message
    assert repr(value) in refused.value.message
    assert tasks.get("capped_badly") is None  # nothing was registered


def test_a_concurrency_is_recorded_on_the_task_and_none_means_no_limit():
    capped, free = (f"{kind}_{uuid.uuid4().hex[:8]}" for kind in ("capped", "free"))

    @runstile.task(capped, concurrency=3)
    def capped_body(ctx, value):
        return value

    @runstile.task(free)
    def free_body(ctx, value):
        return value

    assert tasks.get(capped).concurrency == 3 and tasks.get(free).concurrency is None
    assert tasks.concurrency_of(capped) == 3 and tasks.concurrency_of("no_such_task") is None
    assert {capped: 3, free: None}.items() <= tasks.concurrencies().items()
