-- Migration 10: schedules (docs/tasks.md, "Schedules"; docs/architecture.md, "The
-- scheduler").  Registered after 8: migration 9 is another branch's, and migrations.py
-- tolerates the gap.
--
-- schedules: one row per schedule name a scheduler has seen, its durable state.  The
-- declaration itself (task, cron or every_s, input, catch-up) lives in the task modules,
-- never here.  Written by ledger/schedules.py alone:
--   * the scheduler inserts the row the first time it sees the name (first_seen_at: no
--     tick before it is due), and advances settled_through in the transaction that
--     admits a tick, oldest first: settled_through itself is admitted, and every tick
--     before it admitted or passed over by the schedule's catch-up policy, for good;
--   * `runstile schedules pause|resume` set paused_at, or clear it and set resumed_at
--     (no tick at or before resumed_at is due: the ticks of a pause are skipped).
-- last_tick / last_run_id: the latest tick this table saw admitted, and its run.
-- Times are Unix seconds; ticks are whole seconds.
CREATE TABLE schedules (
    name            TEXT PRIMARY KEY,
    profile_id      TEXT NOT NULL,
    first_seen_at   REAL NOT NULL,
    settled_through REAL,
    last_tick       REAL,
    last_run_id     TEXT,
    paused_at       REAL,
    resumed_at      REAL,
    updated_at      REAL NOT NULL
) WITHOUT ROWID;
