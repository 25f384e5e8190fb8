-- Migration 10 on PostgreSQL: the twin of ../schema_v10_schedules.sql.
CREATE TABLE schedules (
    name            text PRIMARY KEY,
    profile_id      text NOT NULL,
    first_seen_at   double precision NOT NULL,
    settled_through double precision,
    last_tick       double precision,
    last_run_id     text,
    paused_at       double precision,
    resumed_at      double precision,
    updated_at      double precision NOT NULL
);
