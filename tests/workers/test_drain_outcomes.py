"""A drain waits for the outcomes of the bodies that ended before it exits.

A worker thread hands its run's finish to its process's committer without waiting for it
(docs/architecture.md, "Worker processes"), so a stop can come while a body is over and
its outcome is not committed yet.  The process must not exit then: the run would be left
`running` for recovery, as if its body had died (docs/operations.md, `runstile up`).
Here the finish is held back for real: the test holds the ledger's write lock while the
body returns and the SIGTERM arrives, and lets it go a moment later.
"""

from __future__ import annotations

import os
import signal
import time

from tests.conftest import Api, wait_for_status, wait_until
from tests.unit.commit_helpers import WriteLockHolder

#: Seconds the test holds the write lock after the SIGTERM: well inside the drain timeout
#: below and the ledger's busy timeout (5 s), so the finish waits and then commits.
HOLD_S = 1.0


def test_a_sigterm_while_a_finished_body_waits_for_its_commit_still_records_it(
        make_system, ledger, tmp_path):
    system = make_system(workers=1, threads=1, RUNSTILE_DRAIN_TIMEOUT_S="10")
    api = Api(system, ledger.key(), ledger)
    release = tmp_path / "release"
    rid = api.post_run({"task": "t.changing_args", "input": {"release": str(release)}}
                       ).json()["id"]
    # The body's step is journaled (its own write): from here on it only waits for the file.
    wait_until(lambda: ledger.query("SELECT state FROM journal WHERE run_id = ?", (rid,)) ==
               [("completed",)], 30, 0.05, "the body's step")
    with WriteLockHolder(ledger.target):
        release.touch()
        # The body returns within its 20 ms poll; its finish then waits for the lock.
        time.sleep(0.3)
        os.killpg(system.proc.pid, signal.SIGTERM)
        time.sleep(HOLD_S)
        assert system.proc.poll() is None, "the tree exited with an outcome not committed"
    system.proc.wait(timeout=30)
    assert ledger.query("SELECT status, result FROM runs WHERE id = ?", (rid,)) == [
        ("completed", '"finished"')]
    system.kill()
    system.start()
    assert wait_for_status(api, rid)["status"] == "completed"
