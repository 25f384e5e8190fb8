-- Migration 11 on PostgreSQL: the embedded broker's wake-up (docs/architecture.md, "The
-- embedded broker").  Whatever makes a broker row ready -- an admission's insert, a
-- re-publish, a release, a reap -- notifies channel 'runstile_broker' with the row's
-- queue name (ledger/broker_queue.py CHANNEL), so an idle consumer's watcher, which
-- LISTENs on that channel, wakes without polling.  PostgreSQL delivers a notification
-- at COMMIT (never for a rolled-back row) and folds identical payloads of one
-- transaction into one, so a batch of a thousand admissions to one queue costs one.
-- PostgreSQL only: SQLite's watcher sees commits through the WAL file (migration 11 on
-- SQLite is a no-op); the schema-equivalence test lists this trigger as PostgreSQL's own.
CREATE FUNCTION broker_messages_notify() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('runstile_broker', NEW.queue_name);
    RETURN NULL;
END;
$$;
CREATE TRIGGER broker_messages_ready_notify
    AFTER INSERT OR UPDATE OF state ON broker_messages
    FOR EACH ROW WHEN (NEW.state = 'ready')
    EXECUTE FUNCTION broker_messages_notify();
