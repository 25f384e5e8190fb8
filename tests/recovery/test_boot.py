"""A node's boot while the ledger is unavailable (docs/operations.md, "`runstile up`"):
the boot waits for the ledger instead of exiting, and no worker consumes before it has
booted and recovered."""

from __future__ import annotations

import contextlib
import re
import signal

from runstile.ledger import db
from tests.conftest import Workers, wait_until

#: The node's busy timeout: a write waiting longer than this is "unavailable".
BUSY_MS = "300"


@contextlib.contextmanager
def booting_while_locked(ledger, tries: int):
    """A ``runstile worker`` started while another writer holds the ledger's write lock
    (SQLite: the writer gate and BEGIN IMMEDIATE; PostgreSQL: the ledger's advisory
    writer lock), once its boot has said ``tries`` times that it will try again; the
    lock is released when the block ends (the node is killed after the test, by
    tests/conftest.no_process_outlives_its_test)."""
    holder = ledger.connect()
    node = Workers(ledger.data_dir, {"RUNSTILE_BUSY_TIMEOUT_MS": BUSY_MS}, workers=1, threads=1)
    try:
        with db.transaction(holder):
            node.start(wait=False)
            wait_until(lambda: node.log().count("trying again in") >= tries, 20, 0.05,
                       "the boot to try again")
            assert node.proc is not None
            yield node
    finally:
        holder.close()


def test_a_node_booting_while_another_writer_holds_the_ledger_waits_and_then_boots(ledger):
    with booting_while_locked(ledger, tries=2) as node:
        assert node.proc.poll() is None, node.log()
        # The first step that writes waits: the node lock's key on PostgreSQL, the
        # generation on SQLite.
        assert re.search(r"runstile: (node lock|boot): the ledger", node.log()), node.log()
        assert "worker up" not in node.log(), node.log()
    # Released: the same process boots, recovers and starts its worker.
    wait_until(node._up, 30, 0.05, "the node to boot")
    assert node.proc.poll() is None


def test_a_stop_during_a_boot_that_waits_for_the_ledger_exits_0_and_starts_no_worker(ledger):
    with booting_while_locked(ledger, tries=1) as node:
        node.proc.send_signal(signal.SIGTERM)
        assert node.proc.wait(10) == 0, node.log()
        assert "worker up" not in node.log(), node.log()
        assert "Traceback" not in node.log(), node.log()
