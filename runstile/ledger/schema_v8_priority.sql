-- Migration 8: run priority (docs/api.md, "POST /v1/runs"; docs/architecture.md, "The
-- embedded broker").  Registered after 6: migration 7 is another branch's, and
-- migrations.py tolerates the gap.
--
-- runs.priority: 0-9, higher first, 5 by default (every run admitted before this
-- migration has the default).  Written by admission alone (ledger/admission.py and
-- ledger/admission_rows.py), never updated; a retry keeps its original's.  Every message
-- runstile writes for the run carries it (dispatch.py), on Redis it is ignored.
ALTER TABLE runs ADD COLUMN priority INTEGER NOT NULL DEFAULT 5;

-- broker_messages.priority: the embedded broker's order among the rows of one queue
-- ready at the same moment (ledger/broker_queue.py claim: eta, priority DESC, id).
-- Messages that are no run's (deliveries, an actor's .send()) have the default.
ALTER TABLE broker_messages ADD COLUMN priority INTEGER NOT NULL DEFAULT 5;

-- The consumer's fetch walks this index in its ORDER BY's order and stops at LIMIT: the
-- ready rows of one queue by eta (NULL, so one group, on a main queue), priority
-- descending, then id.  It replaces the index of schema.sql that ordered by eta and id.
CREATE INDEX broker_messages_ready_by_priority
    ON broker_messages (queue_name, eta, priority DESC, id) WHERE state = 'ready';
DROP INDEX broker_messages_ready;
