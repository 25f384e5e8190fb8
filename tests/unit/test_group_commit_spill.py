"""A group committer's connection keeps SQLite's rollback copies in memory
(docs/architecture.md, "The writer gate and group commit", sub-journals in memory).

A batch's savepoints and multi-row statements make SQLite copy every page they change, for
a rollback; past 64 KiB that copy spills to a temporary file, created and unlinked at once
and held open until the transaction ends.  Here a batch of admissions on a ledger with
history looks at its own process's open files from inside its transaction."""

from __future__ import annotations

import contextlib
import os
import sys

import pytest

from runstile import dispatch
from runstile.config import Settings
from runstile.ledger import admission, db, group_commit, keys, migrations
from runstile.ledger.keys import Principal

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="reads /proc/self/fd, which only Linux has")

ENQUEUE = dispatch.Dispatcher(Settings()).enqueue


def spill_files() -> list[str]:
    """The temporary files SQLite holds open in this process (named etilqs_*)."""
    found = []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/self/fd/{fd}")
            if "etilqs_" in target:
                found.append(target)
    return found


def units(who: Principal, tag: str, n: int) -> list[group_commit.Unit]:
    return [group_commit.Unit(admission.Reservation(admission.AdmissionRequest(
        principal=who, key=f"{tag}-{i}", key_is_derived=False, run_id=None, task="echo",
        input_json=f'{{"n":{i}}}', session_key=None, trigger_id=None, metadata_json=None,
        callback_url=None, fingerprint=f"{i:064d}", fingerprint_version=1),
        None, 1_000_000, ENQUEUE)) for i in range(n)]


def test_a_batch_of_admissions_holds_no_temporary_file_while_it_writes(tmp_path):
    target = tmp_path / "ledger.db"
    migrations.migrate(target)
    conn = db.connect(target)
    key_id, _ = keys.create(conn, "p")
    conn.close()
    who = Principal("p", key_id, "client")
    batches = group_commit.Batches(lambda: db.connect(target))
    for round_ in range(20):  # history: the pages a batch changes existed before it
        history = units(who, f"old{round_}", 64)
        batches.settle(history)
        assert [u.error for u in history] == [None] * 64
    seen: list[list[str]] = []
    batch = [*units(who, "new", 63), group_commit.Unit(lambda c: seen.append(spill_files()))]
    batches.settle(batch)
    assert [u.error for u in batch] == [None] * 64
    assert seen == [[]]
    batches.close()
