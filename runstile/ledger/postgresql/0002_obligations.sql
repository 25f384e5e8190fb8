-- Migration 2 on PostgreSQL: the twin of ../schema_v2_obligations.sql (delivery
-- obligations and webhook signing secrets; see there for what each column means).

CREATE TABLE obligations (
    id               text PRIMARY KEY,
    run_id           text NOT NULL REFERENCES runs(id) ON DELETE CASCADE,
    profile_id       text NOT NULL,
    kind             text NOT NULL CHECK (kind IN ('callback', 'deliver')),
    type             text NOT NULL,
    url              text NOT NULL,
    payload          text,
    snapshot         text,
    event_seq        bigint,
    occurred_at      double precision NOT NULL,
    state            text NOT NULL DEFAULT 'pending' CHECK (state IN
                         ('pending', 'attempting', 'delivered', 'parked', 'discarded')),
    attempts         bigint NOT NULL DEFAULT 0,
    fence            bigint NOT NULL DEFAULT 0,
    ambiguous        bigint NOT NULL DEFAULT 0,
    next_attempt_at  double precision NOT NULL,
    message_due_at   double precision,
    owner_node       text,
    owner_generation bigint,
    owner_pid        bigint,
    lease_expires_at double precision,
    last_status      bigint,
    last_error       text,
    settled_by       text,
    created_at       double precision NOT NULL,
    updated_at       double precision NOT NULL,
    settled_at       double precision,
    CHECK ((state = 'attempting') = (owner_node IS NOT NULL))
);
CREATE INDEX obligations_by_run     ON obligations (run_id, created_at);
CREATE INDEX obligations_due        ON obligations (next_attempt_at) WHERE state = 'pending';
CREATE INDEX obligations_attempting ON obligations (lease_expires_at)
    WHERE state = 'attempting';
CREATE INDEX obligations_unsettled  ON obligations (run_id)
    WHERE state NOT IN ('delivered', 'discarded');

-- The callback obligation of an event that ends a run or needs a person, in the event's
-- own transaction.  Times in the snapshot as text (shortest exact form: float() of it
-- gives the stored value back), as SQLite writes them with 17 digits; extra_float_digits
-- is pinned for the function, as a session with a lower one would round them.  The id
-- is 'msg_' and 32 hex digits, as on SQLite (from gen_random_uuid: 122 random bits).
CREATE FUNCTION obligations_from_events() RETURNS trigger LANGUAGE plpgsql
SET extra_float_digits = 1 AS $$
BEGIN
    INSERT INTO obligations (id, run_id, profile_id, kind, type, url, snapshot, event_seq,
                             occurred_at, next_attempt_at, created_at, updated_at)
    SELECT 'msg_' || replace(CAST(gen_random_uuid() AS text), '-', ''), r.id, r.profile_id,
           'callback', NEW.type, r.callback_url,
           CAST(json_build_object(
               'status', r.status, 'attempt', r.attempt,
               'updated_at', CAST(r.updated_at AS text),
               'started_at', CAST(r.started_at AS text),
               'finished_at', CAST(r.finished_at AS text),
               'error_code', r.error_code,
               'error_message', r.error_message,
               'recovery_attempts', r.recovery_attempts,
               'recovery_reason', r.recovery_reason, 'approval', r.approval) AS text),
           NEW.seq, NEW.created_at, NEW.created_at, NEW.created_at, NEW.created_at
    FROM runs r WHERE r.id = NEW.run_id AND r.callback_url IS NOT NULL;
    RETURN NULL;
END $$;
CREATE TRIGGER obligations_from_events AFTER INSERT ON events FOR EACH ROW
WHEN (NEW.type IN ('run.completed', 'run.failed', 'run.cancelled', 'run.interrupted',
                   'run.paused', 'approval.requested'))
EXECUTE FUNCTION obligations_from_events();

CREATE TABLE webhook_secrets (
    profile_id text NOT NULL,
    secret     text NOT NULL,
    created_at double precision NOT NULL,
    retires_at double precision,
    PRIMARY KEY (profile_id, secret)
);
CREATE UNIQUE INDEX webhook_secrets_current ON webhook_secrets (profile_id)
    WHERE retires_at IS NULL;
