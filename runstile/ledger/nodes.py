"""Node generations (docs/operations.md, "Node lock and generations"): bumped only by the
process holding the node's flock."""

from __future__ import annotations

import sqlite3

from . import db
from .db import NOW


def boot(conn: sqlite3.Connection, node_id: str) -> int:
    """Start a new generation of ``node_id`` and return it.

    Call only while holding the node lock: at that moment every earlier generation of
    this node is dead by definition, so recovery may treat their leases as expired.
    """
    with db.transaction(conn):
        row = conn.execute(
            f"INSERT INTO nodes (id, generation, booted_at) VALUES (?, 1, {NOW}) "
            f"ON CONFLICT (id) DO UPDATE SET generation = nodes.generation + 1, booted_at = {NOW} "
            "RETURNING generation", (node_id,)).fetchone()
    return int(row[0])
