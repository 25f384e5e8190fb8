-- Migration 12 on PostgreSQL: the twin of ../schema_v12_node_lock_keys.sql (node lock
-- keys, takeover reports).
ALTER TABLE nodes ADD COLUMN lock_key bigint;
UPDATE nodes SET lock_key = (SELECT COUNT(*) FROM nodes AS earlier WHERE earlier.id <= nodes.id);
CREATE UNIQUE INDEX nodes_by_lock_key ON nodes (lock_key);
ALTER TABLE recovery_reports ADD COLUMN taken_over text;
