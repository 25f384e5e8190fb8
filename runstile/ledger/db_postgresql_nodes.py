"""The node lock on a PostgreSQL ledger (docs/operations.md, "Node lock and
generations"): a session-level advisory lock ``(NODE_LOCKS, nodes.lock_key)`` held on a
connection of its own for the supervisor's whole life.

The server drops a session's advisory locks when the session ends, however it ends (the
process killed, the connection cut, the server restarted), as the kernel drops an flock:
holding it proves the node alive, and taking it proves every earlier holder gone.  The
converse matters too: once the connection is lost the lock may already be someone
else's, so :meth:`AdvisoryNodeLock.held` answers False and the supervisor stops its
workers (runstile/up.py).
"""

from __future__ import annotations

import contextlib
import os
import sqlite3

from ..errors import LedgerUnavailable, NodeLocked, redact_url
from . import db, migrations, nodes
from .db_postgresql_dialect import NODE_LOCK_ROWS, NODE_LOCKS

#: Is this session the holder (the lock, by key, granted to this backend)?
_HELD = f"SELECT EXISTS ({NODE_LOCK_ROWS.format(key='CAST(? AS bigint)')} " \
        "AND pid = pg_backend_pid())"
#: Who holds it: the holder's application_name names the node and its pid.
_HOLDER = ("SELECT a.application_name FROM pg_locks l JOIN pg_stat_activity a ON "
           "a.pid = l.pid WHERE l.locktype = 'advisory' AND "
           f"CAST(l.classid AS bigint) = {NODE_LOCKS} AND CAST(l.objid AS bigint) = ? "
           "AND l.objsubid = 2 AND l.granted AND l.database = "
           "(SELECT oid FROM pg_database WHERE datname = current_database())")


class AdvisoryNodeLock:
    #: A server session can end under a live holder (connection cut, server restart).
    can_be_lost = True

    def __init__(self, url: str, node_id: str, *, busy_timeout_ms: int) -> None:
        self.url = url
        self.node_id = node_id
        self.busy_timeout_ms = busy_timeout_ms
        self.key: int | None = None
        self._conn: sqlite3.Connection | None = None  # a PgConnection, by db.connect

    def acquire(self) -> AdvisoryNodeLock:
        """Take the lock or raise NodeLocked (one line, exit 2).  Migrates first: the key
        is a column of migration 12."""
        migrations.migrate(self.url, busy_timeout_ms=self.busy_timeout_ms)
        conn = db.connect(self.url, busy_timeout_ms=self.busy_timeout_ms)
        try:
            self.key = nodes.lock_key(conn, self.node_id)
            conn.execute("SELECT set_config('application_name', ?, false)",
                         (f"runstile node {self.node_id} pid {os.getpid()}"[:63],))
            # try, never wait: a second live node of this name is an operator's mistake
            # to report now, not a start to hold until the first one stops.
            got = conn.execute("SELECT pg_try_advisory_lock(CAST(? AS integer), CAST(? AS integer))",
                               (NODE_LOCKS, self.key)).fetchone()[0]
            holder = None if got else conn.execute(_HOLDER, (self.key,)).fetchone()
        except BaseException:
            conn.close()
            raise
        if not got:
            conn.close()
            who = holder[0] if holder and holder[0] else "another process"
            raise NodeLocked(
                f"node {self.node_id!r} is already running on {redact_url(self.url)} ({who}); "
                "stop it first or give this one another RUNSTILE_NODE_ID")
        self._conn = conn
        return self

    def held(self) -> bool:
        """Whether the server still holds the lock for this session: False once the
        connection is gone (the lock went with it) or cannot be asked."""
        if self._conn is None:
            return False
        try:
            return bool(self._conn.execute(_HELD, (self.key,)).fetchone()[0])
        except LedgerUnavailable:
            return False

    def release(self) -> None:
        """Unlock, then end the session.  Ending it alone would release the lock too, but
        the server may notice a closed connection a moment later: the unlock makes a
        clean stop's lock free before this returns (a restart right after finds it so)."""
        if self._conn is not None:
            with contextlib.suppress(LedgerUnavailable):
                self._conn.execute("SELECT pg_advisory_unlock(CAST(? AS integer), "
                                   "CAST(? AS integer))", (NODE_LOCKS, self.key))
            self._conn.close()
            self._conn = None
