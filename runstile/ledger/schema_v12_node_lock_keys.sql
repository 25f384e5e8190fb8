-- Migration 12: node lock keys and takeover reports (docs/operations.md, "Node lock and
-- generations").  Registered after 10: migration 11 is another branch's, and
-- migrations.py tolerates the gap.
--
-- nodes.lock_key: a small integer of the node's own, assigned once (the first time the
-- node's row is written, ledger/nodes.py) and never changed.  On PostgreSQL the node
-- lock is the advisory lock (NODE_LOCKS, lock_key): unique keys, so two node names never
-- share a lock, which a hash of the name could not promise.  SQLite's flock ignores it.
-- Rows already there are numbered in id order.
ALTER TABLE nodes ADD COLUMN lock_key INTEGER;
UPDATE nodes SET lock_key = (SELECT COUNT(*) FROM nodes AS earlier WHERE earlier.id <= nodes.id);
CREATE UNIQUE INDEX nodes_by_lock_key ON nodes (lock_key);
-- recovery_reports.taken_over: JSON object {node id: generation} of the other nodes
-- whose lock this pass found free and whose runs it classified (takeover); NULL when
-- none.
ALTER TABLE recovery_reports ADD COLUMN taken_over TEXT;
