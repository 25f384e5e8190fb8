-- Migration 6 on PostgreSQL: the twin of ../schema_v6_task_slots.sql.
ALTER TABLE runs ADD COLUMN task_wait_since double precision;
ALTER TABLE runs ADD COLUMN wait_profile_cap bigint;
ALTER TABLE runs ADD COLUMN wait_task_limit bigint;
CREATE INDEX runs_running_by_task ON runs (task)
    WHERE status IN ('running', 'stopping');
CREATE INDEX runs_waiting_for_task ON runs (task, seq)
    WHERE task_wait_since IS NOT NULL AND status = 'queued';
