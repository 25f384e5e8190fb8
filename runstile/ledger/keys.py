"""Profiles and API keys.  Secrets are generated here, shown once, stored only as hashes.

A secret looks like ``rsk_<key id hex>_<43 base64url chars>`` (32 random bytes).  The
key id inside it lets a request find its row by primary key; the secret's SHA-256 is
then compared in constant time.  A plain SHA-256 is enough: the secret has 256 bits of
entropy, so there is nothing for a slow hash to protect.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
import sqlite3
from dataclasses import dataclass
from typing import Any

from . import db
from .db import NOW

_SECRET = re.compile(r"rsk_([0-9a-f]{16})_([A-Za-z0-9_-]{43})")
_PROFILE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
ROLES = ("client", "admin")


@dataclass(frozen=True)
class Principal:
    """Who is asking: the scope (profile, key id) and the key's role."""

    profile_id: str
    key_id: str
    role: str

    @property
    def is_admin(self) -> bool:
        return self.role == "admin"


#: The idempotency keys of scheduled runs begin so (docs/tasks.md, "Schedules").
SCHEDULE_KEY_PREFIX = "schedule:"


def schedule_key_id(profile_id: str) -> str:
    """The id of ``profile_id``'s schedule key: the scope its scheduled runs and their
    idempotency keys live in (ledger/schedules.py).  Derived from the profile's name, so
    every node agrees on it without asking."""
    return "key_" + hashlib.sha256(f"schedules:{profile_id}".encode()).hexdigest()[:16]


def valid_profile(name: str) -> bool:
    return bool(_PROFILE.fullmatch(name))


def _hash(secret: str) -> str:
    return hashlib.sha256(secret.encode("ascii")).hexdigest()


def _new_secret(key_id: str) -> str:
    return f"rsk_{key_id.removeprefix('key_')}_{secrets.token_urlsafe(32)}"


def ensure_profile(conn: sqlite3.Connection, profile_id: str) -> None:
    conn.execute(f"INSERT INTO profiles (id, created_at) VALUES (?, {NOW}) "
                 "ON CONFLICT (id) DO NOTHING", (profile_id,))


def create(conn: sqlite3.Connection, profile_id: str, *, label: str | None = None,
           role: str = "client") -> tuple[str, str]:
    """Create a key (and its profile if new); return (key id, secret)."""
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}")
    key_id = "key_" + secrets.token_hex(8)
    secret = _new_secret(key_id)
    with db.transaction(conn):
        ensure_profile(conn, profile_id)
        conn.execute(
            "INSERT INTO api_keys (id, profile_id, label, role, secret_hash, created_at) "
            f"VALUES (?, ?, ?, ?, ?, {NOW})", (key_id, profile_id, label, role, _hash(secret)))
    return key_id, secret


def rotate(conn: sqlite3.Connection, key_id: str) -> tuple[str, str, str] | None:
    """Give a live key a new secret (same id, so its runs and records stay); None if absent."""
    secret = _new_secret(key_id)
    with db.transaction(conn):
        row = conn.execute(
            f"UPDATE api_keys SET secret_hash = ?, rotated_at = {NOW} "
            "WHERE id = ? AND revoked_at IS NULL RETURNING profile_id, role",
            (_hash(secret), key_id)).fetchone()
    return None if row is None else (secret, row["profile_id"], row["role"])


def revoke(conn: sqlite3.Connection, key_id: str) -> bool:
    """Revoke a key; True if this call revoked it, False if absent or already revoked."""
    with db.transaction(conn):
        cur = conn.execute(f"UPDATE api_keys SET revoked_at = {NOW} "
                           "WHERE id = ? AND revoked_at IS NULL", (key_id,))
    return cur.rowcount == 1


def exists(conn: sqlite3.Connection, key_id: str) -> bool:
    with db.ledger_errors():
        return conn.execute("SELECT 1 FROM api_keys WHERE id = ?", (key_id,)).fetchone() is not None


def list_keys(conn: sqlite3.Connection, profile_id: str | None = None) -> list[dict[str, Any]]:
    sql = ("SELECT id, profile_id, label, role, created_at, rotated_at, revoked_at "
           "FROM api_keys")
    args: tuple[str, ...] = ()
    if profile_id is not None:
        sql, args = sql + " WHERE profile_id = ?", (profile_id,)
    with db.ledger_errors():
        return [db.as_dict(row) for row in conn.execute(sql + " ORDER BY created_at, id", args)]


def authenticate(conn: sqlite3.Connection, secret: str) -> Principal | None:
    """The principal for a presented secret, or None (malformed, unknown, revoked)."""
    match = _SECRET.fullmatch(secret)
    if not match:
        return None
    with db.ledger_errors():
        row = conn.execute(
            "SELECT id, profile_id, role, secret_hash, revoked_at FROM api_keys WHERE id = ?",
            ("key_" + match.group(1),)).fetchone()
    presented = _hash(secret)
    if row is None:
        hmac.compare_digest(presented, presented)  # same work whether or not the id exists
        return None
    if not hmac.compare_digest(presented, row["secret_hash"]) or row["revoked_at"] is not None:
        return None
    return Principal(row["profile_id"], row["id"], row["role"])
