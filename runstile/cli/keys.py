"""``runstile keys …`` and ``runstile webhooks secret``: a profile's credentials.

API keys (create, list, revoke, rotate) and the profile's webhook signing secret, written
straight into the ledger; ``runstile.cli`` adds the two groups to the root command.  The
secrets are printed once, here, and never again.
"""

from __future__ import annotations

import click

from .options import _emit_json, _fail, _ledger, json_option, settings_options


@click.group("keys")
def keys() -> None:
    """Create, list, revoke and rotate API keys."""


def _check_profile(profile: str) -> None:
    from ..ledger import keys as ledger_keys
    if not ledger_keys.valid_profile(profile):
        raise click.BadParameter("1-64 letters, digits, '_', '.' or '-', starting with a "
                                 "letter or digit", param_hint="--profile")


def _key_json(key_id: str, secret: str, profile: str, role: str) -> dict:
    return {"key_id": key_id, "secret": secret, "profile": profile, "role": role}


@keys.command("create")
@settings_options
@click.option("--profile", required=True, help="Profile (tenant); created if new.")
@click.option("--label", default=None, help="Free text to recognise the key by.")
@click.option("--admin", is_flag=True, help="An admin key sees every run of its profile.")
@json_option
def keys_create(settings, profile, label, admin, as_json):
    """Create a key (and its profile if new); prints the secret once."""
    from ..ledger import keys as ledger_keys
    _check_profile(profile)
    if label is not None and len(label) > 200:
        raise click.BadParameter("at most 200 characters", param_hint="--label")
    role = "admin" if admin else "client"
    conn = _ledger(settings, create=True)
    key_id, secret = ledger_keys.create(conn, profile, label=label, role=role)
    if as_json:
        _emit_json(_key_json(key_id, secret, profile, role))
    else:
        click.echo(f"key id:  {key_id}\nprofile: {profile}\nrole:    {role}\n"
                   f"secret:  {secret}\n(the secret is shown only now)")


@keys.command("list")
@settings_options
@click.option("--profile", default=None, help="Only this profile's keys.")
@json_option
def keys_list(settings, profile, as_json):
    """List keys (never their secrets)."""
    from ..ledger import keys as ledger_keys
    from ..objects import rfc3339
    rows = ledger_keys.list_keys(_ledger(settings), profile)
    for row in rows:
        for name in ("created_at", "rotated_at", "revoked_at"):
            row[name] = rfc3339(row[name])
    if as_json:
        _emit_json({"object": "list", "data": rows})
        return
    for row in rows:
        state = "revoked" if row["revoked_at"] else "active"
        click.echo(f"{row['id']}  {row['profile_id']:<16} {row['role']:<6} {state:<8} "
                   f"{row['label'] or ''}")


@keys.command("revoke")
@settings_options
@click.argument("key_id")
@json_option
def keys_revoke(settings, key_id, as_json):
    """Revoke a key; requests with it get 401 from the next one on."""
    from ..ledger import keys as ledger_keys
    conn = _ledger(settings)
    if not ledger_keys.exists(conn, key_id):
        _fail(f"no key {key_id!r}")
    revoked = ledger_keys.revoke(conn, key_id)
    if as_json:
        _emit_json({"key_id": key_id, "revoked": True, "changed": revoked})
    else:
        click.echo(f"{key_id} revoked" if revoked else f"{key_id} was already revoked")


@keys.command("rotate")
@settings_options
@click.argument("key_id")
@json_option
def keys_rotate(settings, key_id, as_json):
    """Give a key a new secret; its id, runs and idempotency records stay."""
    from ..ledger import keys as ledger_keys
    rotated = ledger_keys.rotate(_ledger(settings), key_id)
    if rotated is None:
        _fail(f"no live key {key_id!r} (unknown or revoked)")
    secret, profile, role = rotated
    if as_json:
        _emit_json(_key_json(key_id, secret, profile, role))
    else:
        click.echo(f"key id:  {key_id}\nsecret:  {secret}\n(the old secret no longer works)")


@click.group("webhooks")
def webhooks() -> None:
    """Webhook signing secrets.

    See docs/operations.md, "Webhooks".
    """


@webhooks.command("secret")
@settings_options
@click.option("--profile", required=True, help="Profile whose deliveries it signs.")
@click.option("--rotate", is_flag=True,
              help="Make a new secret; the old one keeps signing for "
                   "RUNSTILE_WEBHOOK_ROTATION_GRACE_S.")
def webhooks_secret(settings, profile, rotate):
    """Print the profile's signing secret alone on the last line (created if absent).

    The profile must exist (made by `keys create`); an unknown one is an error, exit 1.
    """
    from ..ledger import webhook_secrets
    from ..webhooks import new_secret
    _check_profile(profile)
    secret = webhook_secrets.current(_ledger(settings), profile, new_secret, rotate=rotate,
                                     grace_s=settings.webhook_rotation_grace_s)
    if secret is None:
        _fail(f"profile_not_found: no profile {profile!r} (`runstile keys create --profile "
              f"{profile}` creates it with its first key)")
    if rotate:
        click.echo(f"rotated: the old secret keeps signing for "
                   f"{settings.webhook_rotation_grace_s:g}s", err=True)
    click.echo(secret)
