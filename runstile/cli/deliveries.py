"""``runstile deliveries list|retry|discard``: delivery obligations, for operators.

An operator reads obligations, re-arms a parked one (and sends it now) or settles one for
good.  Two ways, the same commands: with an API key (``--api-key`` or RUNSTILE_API_KEY,
and ``--url``) over HTTP, seeing what that key sees, the decision recorded as
``key:<key id>``; without one on the local ledger (``--data-dir``), seeing every
obligation, the decision recorded as ``cli:<user>``.  ``runstile.cli`` adds the group to
the root command.
"""

from __future__ import annotations

import re

import click

from .options import (
    _emit_json,
    _fail,
    _ledger,
    client_or_ledger_options,
    json_option,
)

STATES = ("pending", "attempting", "delivered", "parked", "discarded")


@click.group("deliveries")
def deliveries() -> None:
    """Delivery obligations of runs, for operators (over HTTP with an API key, else on
    the local ledger).

    See docs/api.md, "Deliveries (webhooks)".
    """


def _line(d: dict) -> str:
    error = f"  {d['last_error']}" if d["last_error"] and d["state"] != "delivered" else ""
    return (f"{d['id']}  {d['run_id']}  {d['state']:<10} {d['type']:<20} "
            f"attempts={d['attempts']:<3} {d['url']}{error}")


def _local_list(settings, run_id: str | None, states: tuple[str, ...], limit: int) -> dict:
    from ..ledger import obligations
    from ..objects import delivery_object
    conn = _ledger(settings)
    if run_id is not None:
        if obligations.run_row(conn, run_id) is None:
            _fail(f"run_not_found: no run {run_id}")
        rows = [r for r in obligations.for_run(conn, run_id) if not states or r["state"] in states]
        return {"object": "list", "data": [delivery_object(r) for r in rows],
                "has_more": False, "next_cursor": None}
    rows, more = obligations.list_all(conn, states=states, limit=limit)
    return {"object": "list", "data": [delivery_object(r) for r in rows], "has_more": more,
            "next_cursor": None}


@deliveries.command("list")
@client_or_ledger_options
@click.argument("run_id", required=False)
@click.option("--state", "states", multiple=True, type=click.Choice(STATES),
              help="Only obligations in this state (repeatable).")
@click.option("--limit", type=click.IntRange(1, 200), default=50, show_default=True,
              help="Most obligations to show (newest first) when no RUN_ID is given.")
@json_option
def deliveries_list(client, settings, run_id, states, limit, as_json):
    """A run's obligations (RUN_ID), or the newest of every run (--state parked: what
    waits on a person)."""
    if run_id is not None and not re.fullmatch(r"run_[0-9a-f]{32}", run_id):
        raise click.BadParameter("a run id is run_ + 32 lowercase hex", param_hint="RUN_ID")
    if client is None:
        page = _local_list(settings, run_id, states, limit)
    elif run_id is not None:
        page = client.deliveries(run_id)
        page["data"] = [d for d in page["data"] if not states or d["state"] in states]
    else:
        page = client.deliveries(state=list(states), limit=limit)
    if as_json:
        _emit_json(page)
        return
    for d in page["data"]:
        click.echo(_line(d))
    if not page["data"]:
        click.echo("no deliveries")
    elif page.get("has_more"):
        click.echo(f"(newest {limit} shown; --limit for more)")


def _settle_local(settings, delivery_id: str, action: str) -> dict:
    import getpass

    from ..ledger import obligations
    from ..objects import delivery_object
    conn = _ledger(settings)
    done = (obligations.rearm if action == "retry" else obligations.discard)(
        conn, delivery_id, by=f"cli:{getpass.getuser()}")
    if done is None:
        _fail(f"delivery_not_found: no delivery {delivery_id}")
    row, changed = done
    if not changed and (row["state"] == "delivered" or
                        (action == "retry" and row["state"] == "discarded")):
        _fail(f"delivery_settled: the delivery is {row['state']}")
    if not changed and action == "discard" and row["state"] == "attempting":
        _fail("delivery_in_flight: an attempt is under way; try again in a few seconds")
    current = obligations.get(conn, delivery_id)
    if current is None:  # not expected: retention keeps a run that owes a delivery
        _fail(f"delivery_not_found: no delivery {delivery_id}")
    return delivery_object(current)


def _settle(client, settings, delivery_id: str, action: str, as_json: bool) -> None:
    if not re.fullmatch(r"msg_[0-9a-f]{32}", delivery_id):
        raise click.BadParameter("a delivery id is msg_ + 32 lowercase hex",
                                 param_hint="DELIVERY_ID")
    if client is None:
        delivery = _settle_local(settings, delivery_id, action)
    elif action == "retry":
        delivery = client.retry_delivery(delivery_id)
    else:
        delivery = client.discard_delivery(delivery_id)
    if as_json:
        _emit_json(delivery)
    else:
        click.echo(_line(delivery))


@deliveries.command("retry")
@client_or_ledger_options
@click.argument("delivery_id")
@json_option
def deliveries_retry(client, settings, delivery_id, as_json):
    """Re-arm a parked obligation with fresh attempts and send it now."""
    _settle(client, settings, delivery_id, "retry", as_json)


@deliveries.command("discard")
@client_or_ledger_options
@click.argument("delivery_id")
@json_option
def deliveries_discard(client, settings, delivery_id, as_json):
    """Settle a pending or parked obligation for good (a person's decision, recorded)."""
    _settle(client, settings, delivery_id, "discard", as_json)
