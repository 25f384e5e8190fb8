"""``runstile runs …``: an HTTP client of a running server, on ``runstile.Client``.

Submit, read, list, watch, stop, approve, resume and retry runs, and read their step
journal, over the API (docs/api.md, "Command line: `runstile runs`"); these commands
never open the ledger, and take no --data-dir or --tasks.  ``--url`` and
``--api-key`` come from ``options.client_options``.  ``runstile.cli`` adds the group to
the root command.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from .options import _emit_json, client_options, json_option


def _status_choice() -> click.Choice:
    from ..ledger.states import RunStatus
    return click.Choice([status.value for status in RunStatus])


def _json_input(ctx, param, value):
    """--input: JSON text, ``@path`` for a file, or ``-`` for stdin."""
    if value is None:
        return None
    text = value
    if value == "-":
        text = click.get_text_stream("stdin").read()
    elif value.startswith("@"):
        try:
            text = Path(value[1:]).read_text(encoding="utf-8")
        except OSError as exc:
            raise click.BadParameter(f"cannot read {value[1:]}: {exc.strerror}") from None

    def refuse(name):
        raise ValueError(f"{name} is not JSON")

    try:
        return json.loads(text, parse_constant=refuse)
    except ValueError as exc:
        raise click.BadParameter(f"not valid JSON: {exc}") from None


def _run_line(run: dict) -> str:
    line = f"{run['id']}  {run['status']:<9} {run['task']}  attempt {run['attempt']}"
    if run.get("replayed"):
        line += "  (replayed)"
    return line


def _show_run(run: dict, as_json: bool) -> None:
    if as_json:
        _emit_json(run)
        return
    click.echo(_run_line(run))
    if run.get("retry_of"):
        click.echo(f"  retry_of:    {run['retry_of']}")
    for name in ("created_at", "started_at", "finished_at"):
        if run.get(name):
            click.echo(f"  {name + ':':<13}{run[name]}")
    if run.get("result") is not None:
        click.echo(f"  result:      {json.dumps(run['result'])}")
    if run.get("error"):
        click.echo(f"  error:       {run['error']['code']}: {run['error']['message']}")
    if run.get("recovery"):
        click.echo(f"  recovery:    {json.dumps(run['recovery'])}")
    approval = run.get("approval")
    if approval and approval.get("decision") is None:
        click.echo(f"  approval:    {approval['approval_id']} pending  "
                   f"{json.dumps(approval.get('details'))}")
        click.echo(f"  decide with: runstile runs approve {run['id']} "
                   f"{approval['approval_id']} --decision approve|deny")


def _outcome(run: dict) -> int:
    """Exit code for a finished run: 0 completed, 1 anything else."""
    return 0 if run["status"] == "completed" else 1


class _Watch:
    """Renders a run's events: one line each, a bar for run.progress, message.delta text
    joined on one line."""

    #: Characters in a progress bar.
    bar_width = 20

    def __init__(self) -> None:
        self.in_text = False

    def show(self, event: dict) -> None:
        kind, data = event["type"], event.get("data")
        if kind == "message.delta" and isinstance(data, dict):
            click.echo(str(data.get("text", "")), nl=False)
            self.in_text = True
            return
        self.end_text()
        prefix = f"{event['seq']:>4} {kind}"
        pct = data.get("pct") if isinstance(data, dict) else None
        if kind == "run.progress" and isinstance(pct, (int, float)):
            pct = max(0.0, min(100.0, float(pct)))
            filled = round(pct * self.bar_width / 100)
            click.echo(f"{prefix} [{'#' * filled}{'.' * (self.bar_width - filled)}] {pct:.0f}%")
        elif data:
            click.echo(f"{prefix} {json.dumps(data, separators=(',', ':'))}")
        else:
            click.echo(prefix)

    def end_text(self) -> None:
        if self.in_text:
            click.echo()
            self.in_text = False


@click.group("runs")
def runs() -> None:
    """Submit, read, watch and control runs on a server (an HTTP client)."""


def _metadata(ctx, param, values):
    """--metadata K=V, repeatable, into the run's metadata object."""
    metadata = {}
    for value in values:
        name, sep, text = value.partition("=")
        if not sep or not name:
            raise click.BadParameter(f"{value!r} is not KEY=VALUE")
        metadata[name] = text
    return metadata or None


@runs.command("submit")
@client_options
@click.argument("task")
@click.option("--input", "input_", callback=_json_input, default=None,
              help="The task's input as JSON (or @FILE, or - for stdin).")
@click.option("--key", "idempotency_key", default=None,
              help="Idempotency-Key [default: a new uuid4, reused by the client's retries].")
@click.option("--run-id", default=None, help="Your own run id: run_ + 32 lowercase hex.")
@click.option("--session-key", default=None, help="Run one at a time with this session.")
@click.option("--metadata", "metadata", multiple=True, callback=_metadata, metavar="K=V",
              help="A label of the run (repeatable), filterable in lists.")
@click.option("--callback-url", default=None,
              help="Where the result (and notices) are delivered as webhooks.")
@click.option("--delay", "delay_s", type=click.FloatRange(0), default=None,
              help="Start no sooner than this many seconds from now.")
@click.option("--priority", type=click.IntRange(0, 9), default=None,
              help="0-9, higher starts first [server default 5].")
@click.option("--wait", is_flag=True, help="Wait for the run to end (live progress on a "
                                           "terminal); exit 0 only if completed.")
@json_option
def runs_submit(client, task, input_, idempotency_key, run_id, session_key, metadata,
                callback_url, delay_s, priority, wait, as_json):
    """Admit a run of TASK; safe to repeat with the same --key."""
    run = client.submit(task, input_, idempotency_key=idempotency_key, run_id=run_id,
                        session_key=session_key, metadata=metadata, callback_url=callback_url,
                        delay_s=delay_s, priority=priority)
    if not wait:
        _show_run(run, as_json)
        return
    if not as_json:
        click.echo(_run_line(run))
    if not as_json and sys.stdout.isatty():
        # On a terminal, the run's events as they happen (as `runs watch` shows them).
        view = _Watch()
        for event in client.events(run["id"]):
            view.show(event)
        view.end_text()
        final = client.get(run["id"])
    else:
        final = client.wait(run["id"])
    _show_run(final, as_json)
    sys.exit(_outcome(final))


@runs.command("get")
@client_options
@click.argument("run_id")
@json_option
def runs_get(client, run_id, as_json):
    """Show one run."""
    _show_run(client.get(run_id), as_json)


@runs.command("list")
@client_options
@click.option("--status", "statuses", multiple=True, type=_status_choice(),
              help="Only runs in this status (repeatable).")
@click.option("--task", "task_name", default=None, help="Only runs of this task.")
@click.option("--session-key", default=None, help="Only runs of this session.")
@click.option("--limit", type=click.IntRange(1, 200), default=20, show_default=True,
              help="Runs per page.")
@click.option("--cursor", default=None, help="A previous page's next_cursor.")
@click.option("--all", "every", is_flag=True, help="Follow the cursor through every page.")
@json_option
def runs_list(client, statuses, task_name, session_key, limit, cursor, every, as_json):
    """List runs, newest first."""
    filters = {"status": list(statuses), "task": task_name, "session_key": session_key,
               "limit": limit, "cursor": cursor}
    if every:
        page = {"object": "list", "data": list(client.iter_runs(**filters)),
                "has_more": False, "next_cursor": None}
    else:
        page = client.list(**filters)
    if as_json:
        _emit_json(page)
        return
    for run in page["data"]:
        click.echo(f"{run['id']}  {run['status']:<9} {run['task']:<16} {run['created_at']}")
    if page.get("has_more"):
        click.echo(f"more: --cursor {page['next_cursor']}")


@runs.command("steps")
@client_options
@click.argument("run_id")
@json_option
def runs_steps(client, run_id, as_json):
    """Show a run's step journal, in call order."""
    page = client.steps(run_id)
    if as_json:
        _emit_json(page)
        return
    for s in page["data"]:
        result = json.dumps(s["result"], separators=(",", ":"))
        click.echo(f"{s['position']:>4} {s['name']:<24} {s['state']:<9} attempt {s['attempt']}"
                   f"{'  idempotent' if s['idempotent'] else ''}  {result[:200]}")
    if not page["data"]:
        click.echo("no steps")


@runs.command("watch")
@client_options
@click.argument("run_id")
@json_option(help="Print the finished run as one JSON object on the last line.")
def runs_watch(client, run_id, as_json):
    """Show a run's events live until it ends; exit 0 if it completed, 1 otherwise."""
    view = _Watch()
    for event in client.events(run_id):
        view.show(event)
    view.end_text()
    final = client.get(run_id)
    _show_run(final, as_json)
    sys.exit(_outcome(final))


@runs.command("stop")
@client_options
@click.argument("run_id")
@json_option
def runs_stop(client, run_id, as_json):
    """Stop a run: cancelled at once if not running, else stopping until its body sees it."""
    _show_run(client.stop(run_id), as_json)


@runs.command("retry")
@client_options
@click.argument("run_id")
@click.option("--key", "idempotency_key", default=None,
              help="Idempotency-Key [default: a new uuid4, reused by the client's retries].")
@json_option
def runs_retry(client, run_id, idempotency_key, as_json):
    """Retry a failed, cancelled or interrupted run: a new run of its task and input."""
    _show_run(client.retry(run_id, idempotency_key=idempotency_key), as_json)


@runs.command("approve")
@client_options
@click.argument("run_id")
@click.argument("approval_id")
@click.option("--decision", type=click.Choice(["approve", "deny"]), required=True,
              help="The decision on the pending approval.")
@json_option
def runs_approve(client, run_id, approval_id, decision, as_json):
    """Decide a run's pending approval."""
    _show_run(client.approve(run_id, approval_id, decision), as_json)


@runs.command("resume")
@client_options
@click.argument("run_id")
@json_option
def runs_resume(client, run_id, as_json):
    """Resume a paused run (a person accepts the uncertainty); it runs again."""
    _show_run(client.resume(run_id), as_json)
