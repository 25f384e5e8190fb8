-- runstile ledger, schema version 1 (applied by migrations.py; PRAGMA user_version).
--
-- The ledger is the single source of truth (docs/architecture.md, "The ledger").  All SQL
-- lives in runstile/ledger/.
-- Times are Unix seconds (REAL, millisecond precision) taken from the ledger's clock
-- (db.NOW), so that every process compares leases and retention against one clock.
-- Statuses (ledger/states.py): queued, running, stopping, waiting_for_approval, paused
-- (non-terminal); completed, failed, cancelled, interrupted (terminal).

-- ledger_meta: facts about this ledger file.  Written by migrations only.
CREATE TABLE ledger_meta (
    name  TEXT PRIMARY KEY,
    value TEXT NOT NULL
);

-- profiles: tenants.  Created by `runstile keys create` when a profile is new.
-- active_runs counts the profile's non-terminal runs; it is kept exact by the triggers
-- on runs below, never written by application code, and checked by `runstile db check`.
CREATE TABLE profiles (
    id          TEXT PRIMARY KEY,
    created_at  REAL NOT NULL,
    active_runs INTEGER NOT NULL DEFAULT 0 CHECK (active_runs >= 0)
);

-- api_keys: one row per key.  Written by `runstile keys create|rotate|revoke`.
-- id is stable for the key's life (scopes hang on it); the secret is never stored,
-- only its SHA-256.  Revocation is a timestamp so that it shows in `keys list`.
CREATE TABLE api_keys (
    id          TEXT PRIMARY KEY,                       -- 'key_' + 16 hex
    profile_id  TEXT NOT NULL REFERENCES profiles(id),
    label       TEXT,
    role        TEXT NOT NULL CHECK (role IN ('client', 'admin')),
    secret_hash TEXT NOT NULL,                          -- sha256 hex of the secret
    created_at  REAL NOT NULL,
    rotated_at  REAL,
    revoked_at  REAL
);

-- runs: one row per admitted run.  Inserted by admission (ledger/admission.py admit); every
-- later change is one guarded UPDATE in ledger/ that names the status it expects.
-- seq orders runs by admission (list cursors, session order); id is the public id and
-- is unique across every scope (a client run id is taken "anywhere": docs/api.md,
-- "Reservation").
-- (profile_id, key_id) is the scope that admitted the run.
CREATE TABLE runs (
    seq                 INTEGER PRIMARY KEY AUTOINCREMENT,
    id                  TEXT NOT NULL UNIQUE,
    profile_id          TEXT NOT NULL REFERENCES profiles(id),
    key_id              TEXT NOT NULL REFERENCES api_keys(id),
    task                TEXT NOT NULL,
    input               TEXT NOT NULL,                  -- JSON
    session_key         TEXT,
    trigger_id          TEXT,
    metadata            TEXT,                           -- JSON object or NULL
    callback_url        TEXT,
    fingerprint         TEXT NOT NULL,                  -- sha256 hex of the JCS body
    fingerprint_version INTEGER NOT NULL,
    status              TEXT NOT NULL CHECK (status IN ('queued', 'running', 'stopping',
                            'waiting_for_approval', 'paused', 'completed', 'failed',
                            'cancelled', 'interrupted')),
    attempt             INTEGER NOT NULL DEFAULT 1 CHECK (attempt >= 1),
    result              TEXT,                           -- JSON, when completed
    error_code          TEXT,
    error_message       TEXT,
    recovery_attempts   INTEGER NOT NULL DEFAULT 0,
    recovery_reason     TEXT,
    created_at          REAL NOT NULL,
    updated_at          REAL NOT NULL,
    started_at          REAL,
    finished_at         REAL,
    -- The lease (docs/tasks.md, "Time limits, leases and the heartbeat"): set by the
    -- claim, renewed by the owner process's heartbeat, cleared when the run leaves
    -- running/stopping.  Owner = (node, generation, pid, thread); a guarded UPDATE that
    -- names all four is how a worker proves it still owns the run.  interruption =
    -- 'drain' marks a controlled interruption (docs/architecture.md, "Worker processes").
    approval            TEXT,                           -- JSON: the latest approval request
    owner_node          TEXT,
    owner_generation    INTEGER,
    owner_pid           INTEGER,
    owner_thread        INTEGER,
    lease_expires_at    REAL,
    interruption        TEXT
);
CREATE INDEX runs_by_scope   ON runs (profile_id, key_id, seq);
CREATE INDEX runs_by_profile ON runs (profile_id, seq);
CREATE INDEX runs_by_session ON runs (profile_id, key_id, session_key, seq)
    WHERE session_key IS NOT NULL;
CREATE INDEX runs_finished   ON runs (finished_at) WHERE finished_at IS NOT NULL;
-- Recovery's two scans: runs handed to a worker (whose lease may have lapsed), and
-- runs waiting in the queue (whose message a broker may have lost).
CREATE INDEX runs_in_flight  ON runs (lease_expires_at) WHERE status IN ('running', 'stopping');
CREATE INDEX runs_queued     ON runs (updated_at) WHERE status = 'queued';

-- A terminal run never changes status again (docs/architecture.md, "Run lifecycle");
-- this is the ledger's own guard beneath the guarded UPDATEs.
CREATE TRIGGER runs_terminal_is_final BEFORE UPDATE OF status ON runs
WHEN old.status IN ('completed', 'failed', 'cancelled', 'interrupted')
     AND new.status IS NOT old.status
BEGIN
    SELECT RAISE(ABORT, 'a terminal run never changes status');
END;

-- Keep profiles.active_runs exact whatever code path changes a status.
CREATE TRIGGER runs_active_on_insert AFTER INSERT ON runs
WHEN new.status NOT IN ('completed', 'failed', 'cancelled', 'interrupted')
BEGIN
    UPDATE profiles SET active_runs = active_runs + 1 WHERE id = new.profile_id;
END;
CREATE TRIGGER runs_active_on_finish AFTER UPDATE OF status ON runs
WHEN old.status NOT IN ('completed', 'failed', 'cancelled', 'interrupted')
     AND new.status IN ('completed', 'failed', 'cancelled', 'interrupted')
BEGIN
    UPDATE profiles SET active_runs = active_runs - 1 WHERE id = new.profile_id;
END;
CREATE TRIGGER runs_active_on_delete AFTER DELETE ON runs
WHEN old.status NOT IN ('completed', 'failed', 'cancelled', 'interrupted')
BEGIN
    UPDATE profiles SET active_runs = active_runs - 1 WHERE id = old.profile_id;
END;

-- idempotency_keys: (scope, key) -> run.  Inserted by admission, in the same
-- transaction as the run it names (new run) or when a replay binds a new key to an
-- existing client run id.  derived = 1 for 'legacy-run:<run_id>' keys made from a body
-- run_id.  Deleted only by retention, which leaves a key tombstone behind.
CREATE TABLE idempotency_keys (
    profile_id          TEXT NOT NULL,
    key_id              TEXT NOT NULL,
    idempotency_key     TEXT NOT NULL,
    run_id              TEXT NOT NULL REFERENCES runs(id),
    fingerprint         TEXT NOT NULL,
    fingerprint_version INTEGER NOT NULL,
    derived             INTEGER NOT NULL DEFAULT 0,
    created_at          REAL NOT NULL,
    PRIMARY KEY (profile_id, key_id, idempotency_key)
) WITHOUT ROWID;
CREATE INDEX idempotency_keys_by_run ON idempotency_keys (run_id);

CREATE INDEX runs_by_owner   ON runs (owner_node, owner_generation, owner_pid)
    WHERE owner_node IS NOT NULL;

-- journal: what each execution of a run's body did, in call order
-- (docs/tasks.md, "What replays and what re-runs").
-- One row per journaled call (ctx.step, ctx.emit; later deliver and request_approval),
-- keyed by (run, position).  Written by the owning worker only, each write guarded on
-- its lease; a re-run body replays completed rows instead of repeating them.
-- state: started -> completed | failed.  A non-idempotent step left 'started' by a
-- dead owner is an uncertain side effect (docs/tasks.md, "When the worker is gone").
CREATE TABLE journal (
    run_id       TEXT NOT NULL REFERENCES runs(id) ON DELETE CASCADE,
    position     INTEGER NOT NULL,
    kind         TEXT NOT NULL CHECK (kind IN ('step', 'emit', 'deliver', 'approval')),
    name         TEXT NOT NULL,
    args_hash    TEXT NOT NULL,
    idempotent   INTEGER NOT NULL DEFAULT 0,
    state        TEXT NOT NULL CHECK (state IN ('started', 'completed', 'failed')),
    result       TEXT,                                  -- JSON
    attempt      INTEGER NOT NULL,                      -- the run attempt that last started it
    starts       INTEGER NOT NULL DEFAULT 1,            -- how many times it was started
    started_at   REAL NOT NULL,
    completed_at REAL,
    PRIMARY KEY (run_id, position)
) WITHOUT ROWID;

-- key_tombstones / run_tombstones: what retention purged, remembered until expires_at so
-- that a late retry answers 410 instead of silently creating a second run
-- (docs/guarantees.md, "2. Idempotent admission").
-- Written by retention only; expired rows are purged by retention too.
CREATE TABLE key_tombstones (
    profile_id      TEXT NOT NULL,
    key_id          TEXT NOT NULL,
    idempotency_key TEXT NOT NULL,
    expires_at      REAL NOT NULL,
    PRIMARY KEY (profile_id, key_id, idempotency_key)
) WITHOUT ROWID;
CREATE TABLE run_tombstones (
    run_id     TEXT PRIMARY KEY,
    profile_id TEXT NOT NULL,
    key_id     TEXT NOT NULL,
    expires_at REAL NOT NULL
) WITHOUT ROWID;
CREATE INDEX key_tombstones_expiry ON key_tombstones (expires_at);
CREATE INDEX run_tombstones_expiry ON run_tombstones (expires_at);

-- dispatches: "this run must be handed to a worker".  Inserted in the same transaction
-- as the change that makes a run claimable (admission, re-queue).  sent_at stays NULL
-- until a broker accepted the message (the embedded broker sets it in that same
-- transaction); recovery re-publishes rows left unsent (docs/operations.md, "Recovery",
-- step 4).
CREATE TABLE dispatches (
    id         INTEGER PRIMARY KEY,                     -- never reused while the run lives
    run_id     TEXT NOT NULL REFERENCES runs(id) ON DELETE CASCADE,
    attempt    INTEGER NOT NULL,
    reason     TEXT NOT NULL,
    created_at REAL NOT NULL,
    sent_at    REAL
);
CREATE INDEX dispatches_by_run ON dispatches (run_id);
CREATE INDEX dispatches_unsent ON dispatches (created_at) WHERE sent_at IS NULL;

-- events: each run's durable event log, seq from 1
-- (docs/api.md, "GET /v1/runs/{run_id}/events — the event log").  Appended in the same
-- transaction as the transition or emit that causes it; never updated; deleted with
-- their run by retention.
CREATE TABLE events (
    run_id     TEXT NOT NULL REFERENCES runs(id) ON DELETE CASCADE,
    seq        INTEGER NOT NULL,
    type       TEXT NOT NULL,
    data       TEXT NOT NULL,                           -- JSON
    created_at REAL NOT NULL,
    PRIMARY KEY (run_id, seq)
) WITHOUT ROWID;

-- nodes: one row per node id.  generation grows by one each time a process takes the
-- node's flock (docs/operations.md, "Node lock and generations"): owners of earlier
-- generations are dead by definition, so recovery treats their leases as expired at
-- once.  Written only by the lock holder.
CREATE TABLE nodes (
    id                   TEXT PRIMARY KEY,
    generation           INTEGER NOT NULL DEFAULT 0,
    booted_at            REAL,
    -- The generation whose boot recovery has finished: the recovery barrier
    -- (docs/guarantees.md, "4. Recovery barrier") is open for this node exactly when
    -- recovered_generation = generation.
    recovered_generation INTEGER NOT NULL DEFAULT 0
);

-- recovery_reports: one row per recovery pass (boot, scheduled or `runstile recover`),
-- written by recovery/reconcile.py when the pass ends; read by GET /v1/recovery.
CREATE TABLE recovery_reports (
    id          INTEGER PRIMARY KEY AUTOINCREMENT,
    node_id     TEXT NOT NULL,
    generation  INTEGER NOT NULL,
    trigger     TEXT NOT NULL CHECK (trigger IN ('boot', 'scheduled', 'command')),
    started_at  REAL NOT NULL,
    finished_at REAL NOT NULL,
    counts      TEXT NOT NULL                           -- JSON: class -> runs
);

-- ---------------------------------------------------------------------------------------
-- Embedded broker (RUNSTILE_BROKER_URL=sqlite; docs/architecture.md, "The embedded broker"):
-- Dramatiq's messages live here so that admission inserts a run's message in the run's own
-- transaction.  All SQL for these tables is in ledger/broker_queue.py;
-- workers/sqlite_broker.py is the Dramatiq side.
-- ---------------------------------------------------------------------------------------

-- broker_messages: one row per delivery.  Inserted by admission and re-queues in the
-- transaction of the dispatch they carry, or by SQLiteBroker.enqueue (its own transaction:
-- an actor's .send(), a delayed message moved back to its queue by a Dramatiq worker).
-- id is the delivery id: Message.copy() keeps message_id, so message_id is not unique and
-- the broker never dedupes (runstile's claim does).  States: ready -> claimed (claimed_by
-- = a broker_consumers id) -> row deleted by ack, or dead (nack; Dramatiq's <queue>.XQ,
-- purged by retention), or back to ready (requeue, consumer close, or reaped when the
-- claiming consumer's heartbeat stops).  Delayed messages sit on '<queue>.DQ' with eta.
CREATE TABLE broker_messages (
    id          INTEGER PRIMARY KEY AUTOINCREMENT,
    queue_name  TEXT NOT NULL,                          -- 'default', 'default.DQ', ...
    message_id  TEXT NOT NULL,                          -- Dramatiq message id
    body        BLOB NOT NULL,                          -- Dramatiq's encoder output
    run_id      TEXT,                                   -- the run it carries, if any
    eta         REAL,                                   -- delayed messages: due time
    state       TEXT NOT NULL DEFAULT 'ready' CHECK (state IN ('ready', 'claimed', 'dead')),
    claimed_by  TEXT,
    enqueued_at REAL NOT NULL,
    claimed_at  REAL,
    dead_at     REAL,
    CHECK ((state = 'claimed') = (claimed_by IS NOT NULL))
);
CREATE INDEX broker_messages_ready   ON broker_messages (queue_name, eta, id)
    WHERE state = 'ready';
CREATE INDEX broker_messages_claimed ON broker_messages (claimed_by) WHERE state = 'claimed';
CREATE INDEX broker_messages_dead    ON broker_messages (dead_at) WHERE state = 'dead';
CREATE INDEX broker_messages_run     ON broker_messages (run_id) WHERE run_id IS NOT NULL;

-- broker_consumers: one row per live consumer of the embedded broker.  Inserted when a
-- consumer opens; last_seen_at renewed every few seconds by its process's heartbeat
-- thread; deleted when the consumer closes, or by any process's heartbeat once
-- last_seen_at + timeout_s has passed (the consumer's rows then go back to ready).
-- pid and host are for operators; liveness is the heartbeat alone.
CREATE TABLE broker_consumers (
    id           TEXT NOT NULL PRIMARY KEY,             -- random hex, one per consumer
    queue_name   TEXT NOT NULL,
    pid          INTEGER NOT NULL,
    host         TEXT NOT NULL,
    timeout_s    REAL NOT NULL,
    started_at   REAL NOT NULL,
    last_seen_at REAL NOT NULL
);
