-- Migration 9 on PostgreSQL: the twin of SQLite's schema_v9_queue.sql (the queue a run
-- travels on).  Applied only once SQLite's migration 9 is registered too
-- (db_postgresql_migrate.py follows SQLite's list of versions).
ALTER TABLE runs ADD COLUMN queue text NOT NULL DEFAULT 'default';
