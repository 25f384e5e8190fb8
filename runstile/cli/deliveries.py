"""``runstile deliveries list|retry|discard``: a run's delivery obligations, for operators.

An operator reads a run's obligations from the ledger, re-arms a parked one (and sends it
now) or settles one for good; the decision is recorded as ``cli:<user>``.  ``runstile.cli``
adds the group to the root command.
"""

from __future__ import annotations

import click

from .options import _emit_json, _fail, _ledger, json_option, settings_options


@click.group("deliveries")
def deliveries() -> None:
    """Delivery obligations of runs, for operators.

    See docs/api.md, "Deliveries (webhooks)".
    """


def _delivery_row(row: dict) -> str:
    from ..objects import delivery_object
    d = delivery_object(row)
    error = f"  {d['last_error']}" if d["last_error"] and d["state"] != "delivered" else ""
    return (f"{d['id']}  {d['state']:<10} {d['type']:<20} attempts={d['attempts']:<3} "
            f"{d['url']}{error}")


@deliveries.command("list")
@settings_options
@click.argument("run_id")
@json_option
def deliveries_list(settings, run_id, as_json):
    """List a run's obligations."""
    import re

    from ..ledger import obligations
    from ..objects import delivery_object
    if not re.fullmatch(r"run_[0-9a-f]{32}", run_id):
        raise click.BadParameter("a run id is run_ + 32 lowercase hex", param_hint="RUN_ID")
    conn = _ledger(settings)
    if obligations.run_row(conn, run_id) is None:
        _fail(f"run_not_found: no run {run_id}")
    rows = obligations.for_run(conn, run_id)
    if as_json:
        _emit_json({"object": "list", "data": [delivery_object(r) for r in rows]})
        return
    for row in rows:
        click.echo(_delivery_row(row))
    if not rows:
        click.echo("no deliveries")


def _settle_delivery(settings, delivery_id: str, action: str, as_json: bool) -> None:
    import getpass
    import re

    from ..ledger import obligations
    from ..objects import delivery_object
    if not re.fullmatch(r"msg_[0-9a-f]{32}", delivery_id):
        raise click.BadParameter("a delivery id is msg_ + 32 lowercase hex",
                                 param_hint="DELIVERY_ID")
    conn = _ledger(settings)
    by = f"cli:{getpass.getuser()}"
    done = (obligations.rearm if action == "retry" else obligations.discard)(
        conn, delivery_id, by=by)
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
    if as_json:
        _emit_json(delivery_object(current))
    else:
        click.echo(_delivery_row(current))


@deliveries.command("retry")
@settings_options
@click.argument("delivery_id")
@json_option
def deliveries_retry(settings, delivery_id, as_json):
    """Re-arm a parked obligation with fresh attempts and send it now."""
    _settle_delivery(settings, delivery_id, "retry", as_json)


@deliveries.command("discard")
@settings_options
@click.argument("delivery_id")
@json_option
def deliveries_discard(settings, delivery_id, as_json):
    """Settle a pending or parked obligation for good (a person's decision, recorded)."""
    _settle_delivery(settings, delivery_id, "discard", as_json)
