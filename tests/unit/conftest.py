"""Fixtures of the unit tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from runstile.ledger import db, keys, migrations
from runstile.ledger.keys import Principal
from tests.unit.commit_helpers import HANDED_TABLE


@pytest.fixture
def handed_ledger(ledger_target) -> Iterator[tuple[object, Principal]]:
    """A migrated ledger on each engine with the group-commit tests' ``handed`` table,
    and a client key: (target, principal)."""
    migrations.migrate(ledger_target)
    conn = db.connect(ledger_target)
    conn.execute(HANDED_TABLE)
    key_id, _ = keys.create(conn, "p")
    conn.close()
    yield ledger_target, Principal("p", key_id, "client")
