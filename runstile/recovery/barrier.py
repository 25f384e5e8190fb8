"""The recovery barrier (SPEC §2.4, §6.1): no worker consumes before its boot's recovery.

The process holding the node lock bumps the generation, runs recovery, then opens the
barrier by recording ``recovered_generation`` in the ledger; only then does it start
the worker processes.  Readiness (``/readyz``) reads the same record, so a web process
on this node answers 503 until recovery for the current boot has finished.
"""

from __future__ import annotations

import sqlite3

from ..ledger import recovery


def is_open(conn: sqlite3.Connection, node_id: str) -> bool:
    """True when the node's current boot has recovered, or the node never booted
    workers (a web-only deployment has nothing to wait for)."""
    generation, recovered = recovery.node_generations(conn, node_id)
    return generation == 0 or recovered >= generation
