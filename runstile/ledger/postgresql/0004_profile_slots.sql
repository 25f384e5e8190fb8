-- Migration 4 on PostgreSQL: the twin of ../schema_v4_profile_slots.sql.
ALTER TABLE runs ADD COLUMN slot_wait_since double precision;
CREATE INDEX runs_running_by_profile ON runs (profile_id)
    WHERE status IN ('running', 'stopping');
CREATE INDEX runs_waiting_for_slot ON runs (profile_id, seq)
    WHERE slot_wait_since IS NOT NULL AND status = 'queued';
