"""The list query's time limit on a real ledger file (ledger/db.py ``time_limit``)."""

from __future__ import annotations

import pytest

from runstile.errors import ListQueryTimeout
from runstile.ledger import db, runs
from runstile.ledger.keys import Principal
from tests.conftest import bare_ledger

SCAN = ("SELECT count(*) FROM runs WHERE EXISTS (SELECT 1 FROM json_each(runs.metadata) "
        "AS m WHERE m.key = 'env' AND m.value = 'nowhere')")


def test_a_list_cut_off_by_its_time_limit_leaves_its_pooled_connection_unlimited(tmp_path):
    conn = bare_ledger(tmp_path / "ledger.db")
    with db.transaction(conn):
        conn.execute(
            "INSERT INTO runs (id, profile_id, key_id, task, input, metadata, fingerprint, "
            "fingerprint_version, status, created_at, updated_at) "
            "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < 20000) "
            "SELECT printf('run_%032x', i), 'p', 'key_1', 'echo', 'null', "
            "'{\"env\":\"prod\"}', 'f', 1, 'completed', 1, 1 FROM n")
    principal = Principal("p", "key_1", "client")
    with pytest.raises(ListQueryTimeout, match="1 ms"):
        runs.list_visible(conn, principal, runs.RunFilter(metadata=(("env", "nowhere"),) * 8),
                          before_seq=None, limit=20, timeout_s=0.001)
    # The deadline went with the query: a scan far longer than 1 ms runs to its end on the
    # same connection, which is not left inside a read transaction either.
    assert not conn.in_transaction
    assert conn.execute(SCAN).fetchone()[0] == 0
    page, has_more = runs.list_visible(conn, principal, runs.RunFilter(), before_seq=None,
                                       limit=2, timeout_s=2)
    assert [r["id"] for r in page] == [f"run_{20_000:032x}", f"run_{19_999:032x}"] and has_more
    conn.close()
