-- Migration 6: per-task concurrency, @runstile.task(name, concurrency=N) (docs/tasks.md,
-- "Registering a task"), kept by the same mechanism as the per-profile cap of migration 4
-- (docs/architecture.md, "Per-task concurrency").  All SQL that reads or writes these is in
-- ledger/slots.py (which was ledger/profile_slots.py), but for add_dispatch (runs.py) and
-- the claim, which clear the marks.
--
-- task_wait_since: set by a claim that was refused because the run's task already had its
-- concurrency of runs running or stopping, as slot_wait_since is for its profile's cap (a
-- run over both carries both).  The run stays queued and its message was a no-op, so
-- whatever frees one of the task's slots dispatches the oldest marked run in its own
-- transaction, and recovery dispatches marked runs of tasks with a free slot.  A dispatch
-- clears it (the run has a message again); NULL for every other run.  Its own column,
-- not a wider meaning for slot_wait_since: a freed slot of a task must find only the runs
-- that wait for that task, not every waiting run of each profile.
ALTER TABLE runs ADD COLUMN task_wait_since REAL;

-- The limits the claim that marked the run applied (NULL: none): a freed slot of one kind
-- goes only to a waiting run whose limit of the other kind has room, and the ledger knows
-- no registry and no settings to count that against.  Written by that claim, read only
-- while the run is marked.
ALTER TABLE runs ADD COLUMN wait_profile_cap INTEGER;
ALTER TABLE runs ADD COLUMN wait_task_limit INTEGER;

-- The claim counts its task's running and stopping runs: a handful, read from this index,
-- never a walk of the task's whole history.
CREATE INDEX runs_running_by_task ON runs (task)
    WHERE status IN ('running', 'stopping');

-- The runs waiting for a slot of their task, oldest first within each task.
CREATE INDEX runs_waiting_for_task ON runs (task, seq)
    WHERE task_wait_since IS NOT NULL AND status = 'queued';
