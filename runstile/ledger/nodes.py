"""Nodes (docs/operations.md, "Node lock and generations"): the node lock, its key, and
the generation bumped only by the process holding the lock.

The lock is the engine's: SQLite's is an flock on ``<data-dir>/node-<id>.lock``
(runstile/nodelock.py), PostgreSQL's a session-level advisory lock on a connection the
supervisor keeps for life (ledger/db_postgresql_nodes.py), keyed by the node's
``lock_key``.  Either way the lock dies with its holder, so holding it proves the node
alive and taking it proves every earlier holder gone.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Protocol

from . import db
from .db import NOW

#: A node's lock key when its row is first written: one above the largest, under the
#: writer lock (so two new nodes never draw the same one; the unique index says so too).
_NEXT_KEY = "(SELECT COALESCE(MAX(lock_key), 0) + 1 FROM nodes)"


class HeldLock(Protocol):
    """What the supervisor holds for its whole life (nodelock.NodeLock or
    db_postgresql_nodes.AdvisoryNodeLock)."""

    #: Whether the lock can end while its holder lives (a server session can; an flock
    #: cannot), so that the holder must keep asking :meth:`held`.
    can_be_lost: bool

    def acquire(self) -> HeldLock: ...

    def held(self) -> bool: ...

    def release(self) -> None: ...


def node_lock(target: Path | str, *, data_dir: Path, node_id: str,
              busy_timeout_ms: int) -> HeldLock:
    """The lock of ``node_id`` for the ledger at ``target`` (not yet taken): the
    engine's, chosen by ``db.node_lock``."""
    return db.node_lock(target, data_dir=data_dir, node_id=node_id,
                        busy_timeout_ms=busy_timeout_ms)


def lock_key(conn: sqlite3.Connection, node_id: str) -> int:
    """The node's lock key, assigned the first time it is asked for (a row at generation
    0: never booted, so the barrier has nothing to wait for) and never changed."""
    with db.transaction(conn):
        conn.execute(f"INSERT INTO nodes (id, generation, lock_key) VALUES (?, 0, {_NEXT_KEY}) "
                     "ON CONFLICT (id) DO NOTHING", (node_id,))
        row = conn.execute("SELECT lock_key FROM nodes WHERE id = ?", (node_id,)).fetchone()
    return int(row[0])


def boot(conn: sqlite3.Connection, node_id: str) -> int:
    """Start a new generation of ``node_id`` and return it.

    Call only while holding the node lock: at that moment every earlier generation of
    this node is dead by definition, so recovery may treat their leases as expired.
    """
    with db.transaction(conn):
        row = conn.execute(
            f"INSERT INTO nodes (id, generation, booted_at, lock_key) VALUES "
            f"(?, 1, {NOW}, {_NEXT_KEY}) ON CONFLICT (id) DO UPDATE SET "
            f"generation = nodes.generation + 1, booted_at = {NOW} "
            "RETURNING generation", (node_id,)).fetchone()
    return int(row[0])
