-- Migration 7 on PostgreSQL: the twin of ../schema_v7_not_before.sql.
ALTER TABLE runs ADD COLUMN not_before double precision;
