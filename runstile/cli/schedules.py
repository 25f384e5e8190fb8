"""``runstile schedules list|pause|resume``: the declared schedules and their durable state,
for operators (docs/operations.md, "Pausing a schedule").

The declarations come from the task modules (``--tasks``), the state from the ledger;
pause and resume are one guarded write each, seen by every node's scheduler at its next
look (docs/tasks.md, "Schedules").  ``runstile.cli`` adds the group to the root command.
"""

from __future__ import annotations

import click

from .options import _emit_json, _fail, _ledger, json_option, settings_options


@click.group("schedules")
def schedules() -> None:
    """Schedules declared in the task modules, and their state.

    See docs/tasks.md, "Schedules".
    """


def _line(obj: dict) -> str:
    rule = f"cron {obj['cron']!r} {obj['timezone']}" if obj["cron"] else f"every {obj['every_s']}s"
    state = "paused" if obj["paused"] else "active"
    return (f"{obj['name']}  {state:<6} task={obj['task']} profile={obj['profile']} {rule} "
            f"catchup={obj['catchup']} last={obj['last_tick'] or '-'} "
            f"next={obj['next_tick'] or '-'}")


@schedules.command("list")
@settings_options
@json_option
def schedules_list(settings, as_json):
    """Each schedule with its last and next tick."""
    from .. import tasks as registry
    from ..ledger import schedules as ledger
    from ..web.schedules import schedule_objects
    registry.load(settings.tasks)
    objects = schedule_objects(ledger.states(_ledger(settings)))
    if as_json:
        _emit_json({"object": "list", "data": objects})
        return
    for obj in objects:
        click.echo(_line(obj))
    if not objects:
        click.echo("no schedules declared in the task modules (--tasks)")


def _set(settings, name: str, paused: bool, as_json: bool) -> None:
    import time

    from .. import tasks as registry
    from ..ledger import schedules as ledger
    from ..web.schedules import schedule_object
    registry.load(settings.tasks)
    spec = registry.schedules().get(name)
    if spec is None:
        _fail(f"schedule_not_found: no schedule {name!r} is declared in the task modules "
              f"(--tasks)", 2)
    conn = _ledger(settings)
    ledger.ensure(conn, [(spec.name, spec.profile)])
    (ledger.pause if paused else ledger.resume)(conn, name)
    obj = schedule_object(spec, ledger.states(conn).get(name), time.time())
    if as_json:
        _emit_json(obj)
    else:
        click.echo(_line(obj))


@schedules.command("pause")
@settings_options
@click.argument("name")
@json_option
def schedules_pause(settings, name, as_json):
    """Pause a schedule, durably: no tick is admitted until it is resumed."""
    _set(settings, name, True, as_json)


@schedules.command("resume")
@settings_options
@click.argument("name")
@json_option
def schedules_resume(settings, name, as_json):
    """Resume a paused schedule: its next tick after now is its next run."""
    _set(settings, name, False, as_json)
