"""Each profile's webhook signing secrets (`runstile webhooks secret`: docs/operations.md,
"Webhooks").

One current secret per profile (``retires_at IS NULL``, a unique partial index says so);
a rotation gives the current one a ``retires_at`` of now + the grace period and adds a
new current one.  Until a retired secret's time is up, both sign every delivery.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable

from . import db
from .db import NOW


def current(conn: sqlite3.Connection, profile_id: str, new_secret: Callable[[], str], *,
            rotate: bool = False, grace_s: float = 0.0) -> str | None:
    """The profile's current secret, created if it has none; with ``rotate`` a new one
    replaces it and the old one keeps signing for ``grace_s`` seconds.  None, changing
    nothing, when no such profile exists (a typo must not leave a secret behind)."""
    with db.transaction(conn):
        if conn.execute("SELECT 1 FROM profiles WHERE id = ?", (profile_id,)).fetchone() is None:
            return None
        if rotate:
            conn.execute(f"UPDATE webhook_secrets SET retires_at = {NOW} + ? "
                         "WHERE profile_id = ? AND retires_at IS NULL", (grace_s, profile_id))
        # ON CONFLICT DO NOTHING against the unique current-secret index: a concurrent
        # creator that got there first keeps its secret, and we read that one back.
        conn.execute("INSERT INTO webhook_secrets (profile_id, secret, created_at) "
                     f"VALUES (?, ?, {NOW}) ON CONFLICT DO NOTHING", (profile_id, new_secret()))
        secret: str = conn.execute("SELECT secret FROM webhook_secrets WHERE profile_id = ? "
                                   "AND retires_at IS NULL", (profile_id,)).fetchone()[0]
        return secret


def signing(conn: sqlite3.Connection, profile_id: str,
            new_secret: Callable[[], str]) -> list[str]:
    """Every secret that signs now: the current one first (created on first use), then
    those retiring after a rotation."""
    rows = _signing_rows(conn, profile_id)
    if not rows or rows[0][1] is not None:
        current(conn, profile_id, new_secret)
        rows = _signing_rows(conn, profile_id)
    return [secret for secret, _ in rows]


def _signing_rows(conn: sqlite3.Connection, profile_id: str) -> list[tuple[str, float | None]]:
    with db.ledger_errors():
        return [tuple(r) for r in conn.execute(
            "SELECT secret, retires_at FROM webhook_secrets WHERE profile_id = ? AND "
            f"(retires_at IS NULL OR retires_at > {NOW}) "
            "ORDER BY retires_at IS NOT NULL, created_at DESC", (profile_id,)).fetchall()]
