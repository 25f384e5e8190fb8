-- Migration 2: delivery obligations and webhook signing secrets (docs/api.md,
-- "Deliveries (webhooks)").
-- All SQL that reads or moves these rows is in ledger/obligations.py and
-- ledger/webhook_secrets.py; the trigger below is the only other writer.

-- obligations: one row per durable promise to deliver something outbound.
-- Inserted in the very transaction of the change that creates it:
--   * kind 'callback' — by the trigger obligations_from_events below, when a run that
--     has a callback_url gets one of the events that ends it or needs a person
--     (run.completed|failed|cancelled|interrupted, run.paused, approval.requested).
--     Every transition appends its event in its own transaction (docs/architecture.md,
--     "Run lifecycle"), so hooking the event covers every code path that moves a run,
--     set-based recovery included.
--   * kind 'deliver' — by ctx.deliver (ledger/obligations.py), with its journal row.
-- id is the delivery id, sent as `webhook-id`; it never changes, so every redelivery of
-- one obligation carries the same id.  fence grows by one at every claim; clearing an
-- attempt is a compare-and-set on (id, run_id, fence, 'attempting'), so a deliverer that
-- lost its attempt (recovery re-armed it, another deliverer claimed it) cannot settle it.
-- States: pending -> attempting (claim) -> delivered | pending (retry, backoff) | parked
-- (attempts used up, or 410); attempting -> pending (owner gone: recovery, ambiguous=1);
-- parked -> pending (a person re-arms it) ; pending|parked -> discarded (a person).
-- Never deleted while undelivered: retention purges a run's obligations with the run,
-- and it skips runs that still have one that is neither delivered nor discarded.
CREATE TABLE obligations (
    id               TEXT PRIMARY KEY,                 -- 'msg_' + 32 hex
    run_id           TEXT NOT NULL REFERENCES runs(id) ON DELETE CASCADE,
    profile_id       TEXT NOT NULL,                    -- whose secret signs it
    kind             TEXT NOT NULL CHECK (kind IN ('callback', 'deliver')),
    type             TEXT NOT NULL,                    -- payload "type"
    url              TEXT NOT NULL,
    payload          TEXT,                             -- JSON: ctx.deliver's data
    -- callback: the run's changing columns when the event was written, so a notice
    -- shows the run as it was then even if it moved on before the send.
    snapshot         TEXT,                             -- JSON
    event_seq        INTEGER,                          -- the event that created it
    occurred_at      REAL NOT NULL,                    -- payload "timestamp"
    state            TEXT NOT NULL DEFAULT 'pending' CHECK (state IN
                         ('pending', 'attempting', 'delivered', 'parked', 'discarded')),
    attempts         INTEGER NOT NULL DEFAULT 0,       -- claims made (sends tried)
    fence            INTEGER NOT NULL DEFAULT 0,
    ambiguous        INTEGER NOT NULL DEFAULT 0,       -- an earlier attempt's fate unknown
    next_attempt_at  REAL NOT NULL,
    -- When the message for the next attempt is due at a worker; NULL = none sent.
    -- Recovery sends one again when it is long past due (a broker can lose messages).
    message_due_at   REAL,
    owner_node       TEXT,
    owner_generation INTEGER,
    owner_pid        INTEGER,
    lease_expires_at REAL,
    last_status      INTEGER,                          -- receiver's HTTP status
    last_error       TEXT,
    settled_by       TEXT,                             -- who discarded or re-armed it
    created_at       REAL NOT NULL,
    updated_at       REAL NOT NULL,
    settled_at       REAL,                             -- delivered / parked / discarded
    CHECK ((state = 'attempting') = (owner_node IS NOT NULL))
);
CREATE INDEX obligations_by_run     ON obligations (run_id, created_at);
CREATE INDEX obligations_due        ON obligations (next_attempt_at) WHERE state = 'pending';
CREATE INDEX obligations_attempting ON obligations (lease_expires_at)
    WHERE state = 'attempting';
CREATE INDEX obligations_unsettled  ON obligations (run_id)
    WHERE state NOT IN ('delivered', 'discarded');

-- The WHEN clause is a chain of = rather than an IN list: SQLite builds a temporary
-- b-tree for an IN list each time a trigger fires, and this one fires for every event.
CREATE TRIGGER obligations_from_events AFTER INSERT ON events
WHEN new.type = 'run.completed' OR new.type = 'run.failed' OR new.type = 'run.cancelled'
     OR new.type = 'run.interrupted' OR new.type = 'run.paused'
     OR new.type = 'approval.requested'
BEGIN
    INSERT INTO obligations (id, run_id, profile_id, kind, type, url, snapshot, event_seq,
                             occurred_at, next_attempt_at, created_at, updated_at)
    SELECT 'msg_' || lower(hex(randomblob(16))), r.id, r.profile_id, 'callback', new.type,
           r.callback_url,
           -- Times as text with 17 digits: JSON's 15 would shift some by a millisecond.
           json_object('status', r.status, 'attempt', r.attempt,
                       'updated_at', printf('%!.17g', r.updated_at),
                       'started_at', iif(r.started_at IS NULL, NULL,
                                         printf('%!.17g', r.started_at)),
                       'finished_at', iif(r.finished_at IS NULL, NULL,
                                          printf('%!.17g', r.finished_at)),
                       'error_code', r.error_code,
                       'error_message', r.error_message,
                       'recovery_attempts', r.recovery_attempts,
                       'recovery_reason', r.recovery_reason, 'approval', r.approval),
           new.seq, new.created_at, new.created_at, new.created_at, new.created_at
    FROM runs r WHERE r.id = new.run_id AND r.callback_url IS NOT NULL;
END;

-- webhook_secrets: each profile's signing secrets (`whsec_…`).  Written by
-- `runstile webhooks secret` (and created on first use by a delivery).  retires_at NULL
-- is the current secret; a rotation sets the old one's retires_at to now + the grace
-- period and inserts a new one, and until then both sign (docs/operations.md,
-- "Webhooks").  Secrets are stored as they are (HMAC needs them), so ledger backups must
-- be kept like the secrets.
CREATE TABLE webhook_secrets (
    profile_id TEXT NOT NULL,
    secret     TEXT NOT NULL,
    created_at REAL NOT NULL,
    retires_at REAL,
    PRIMARY KEY (profile_id, secret)
) WITHOUT ROWID;
CREATE UNIQUE INDEX webhook_secrets_current ON webhook_secrets (profile_id)
    WHERE retires_at IS NULL;
