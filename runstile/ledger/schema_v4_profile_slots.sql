-- Migration 4: the per-profile cap on running runs (RUNSTILE_MAX_RUNNING_PER_PROFILE,
-- docs/configuration.md).  All SQL that reads or writes these is in ledger/profile_slots.py,
-- but for add_dispatch (runs.py), which clears the mark, and the claim, which clears it too.
--
-- slot_wait_since: set by a claim that was refused because the run's profile already had
-- its cap of runs running or stopping.  The run stays queued and its message was a no-op,
-- so nothing else would hand it to a worker again: whatever frees one of the profile's
-- slots dispatches the oldest marked run in its own transaction, and recovery dispatches
-- marked runs of profiles with a free slot.  A dispatch clears the mark (the run has a
-- message again); NULL for every other run.  Adding a column rewrites nothing.
ALTER TABLE runs ADD COLUMN slot_wait_since REAL;

-- The claim counts its profile's running and stopping runs: a handful, read from this
-- index, never a walk of the profile's whole history (runs_by_profile).
CREATE INDEX runs_running_by_profile ON runs (profile_id)
    WHERE status IN ('running', 'stopping');

-- The runs waiting for a slot, oldest first within each profile.
CREATE INDEX runs_waiting_for_slot ON runs (profile_id, seq)
    WHERE slot_wait_since IS NOT NULL AND status = 'queued';
