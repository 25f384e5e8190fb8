-- Migration 5 on PostgreSQL: the twin of ../schema_v5_retry_of.sql.
ALTER TABLE runs ADD COLUMN retry_of text;
