-- Migration 8 on PostgreSQL: the twin of ../schema_v8_priority.sql.
ALTER TABLE runs ADD COLUMN priority bigint NOT NULL DEFAULT 5;
ALTER TABLE broker_messages ADD COLUMN priority bigint NOT NULL DEFAULT 5;
CREATE INDEX broker_messages_ready_by_priority
    ON broker_messages (queue_name, eta, priority DESC, id) WHERE state = 'ready';
DROP INDEX broker_messages_ready;
