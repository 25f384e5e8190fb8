"""One recovery pass, in the order of docs/operations.md, "Recovery".

Called at every boot before any worker consumes (the barrier), on a schedule inside
``runstile up``/``runstile worker``, and by ``runstile recover``.  Recovered runs go back
through the queue's claim (a re-queue with a dispatch), never executed here: one path
to execution (DBOS recovery does the same).
"""

from __future__ import annotations

import collections
import logging
import time
from dataclasses import dataclass, field
from typing import TypedDict

from .. import crashpoints, dispatch
from .. import tasks as registry
from ..config import Settings
from ..errors import LedgerUnavailable
from ..ledger import (
    broker_queue,
    db,
    dispatches,
    migrations,
    obligations,
    profile_slots,
    recovery,
    retention,
    sessions,
)

log = logging.getLogger("runstile.recovery")


class _ConnectOptions(TypedDict):
    """How a pass connects to the ledger (``migrations.migrate``, ``recovery.open_pass``)."""

    synchronous: str
    busy_timeout_ms: int

#: Rows per transaction for the sweeps (bounded batches: the write lock is shared).
BATCH = 200
#: Runs classified per transaction: larger, because each commit (an fsync) dominated a
#: pass over many orphans; ~0.05 ms of lock per run.
CLASSIFY_BATCH = 1000
#: Full classification batches between two checkpoints of a long step 3 (the pass's
#: commits do not checkpoint, see ledger.recovery.open_pass): ~9 MB of WAL a batch.
CHECKPOINT_EVERY_BATCHES = 8
#: A queued run idle this many leases without a live message is re-published.
REPUBLISH_AFTER_LEASES = 2
#: Seconds an unsent dispatch record is left to the process that wrote it before a
#: scheduled pass publishes it (Redis/RabbitMQ; boot and `runstile recover` publish
#: every one).
UNSENT_GRACE_S = 5.0
#: Publishing batches one pass may do (the rest waits for the next pass).
MAX_PUBLISH_BATCHES = 20
#: Retention batches one pass may purge (the rest waits for the next pass).
MAX_PURGE_BATCHES = 20


@dataclass
class Report:
    node_id: str
    generation: int
    trigger: str
    counts: dict = field(default_factory=lambda: collections.Counter())
    duration_s: float = 0.0
    report_id: int | None = None

    def as_dict(self) -> dict:
        return {"node_id": self.node_id, "generation": self.generation,
                "trigger": self.trigger,
                "counts": {name: n for name, n in self.counts.items() if n},
                "duration_s": round(self.duration_s, 4), "report_id": self.report_id}


def _on_crash(task: str) -> str:
    spec = registry.get(task)
    return spec.on_crash if spec is not None else "interrupt"


def run_pass(settings: Settings, *, generation: int, trigger: str) -> Report:
    """One complete, idempotent recovery pass; returns its report (also recorded)."""
    started = time.monotonic()
    report = Report(settings.node_id, generation, trigger)
    # 1. Migrate / check the ledger.
    conn = _open_migrated(settings)
    try:
        started_at = recovery.ledger_now(conn)
        enqueue = dispatch.Dispatcher(settings).in_transaction
        # 2. Sweep delivery obligations: outbound results go out before any run is
        #    replayed (docs/operations.md, "Recovery").
        _sweep_obligations(settings, conn, report, generation=generation, trigger=trigger)
        # 3. Reconcile the journal: runs whose owner is gone, batch by batch.
        batches = 0
        while True:
            with db.transaction(conn):
                batch = recovery.orphaned(conn, node_id=settings.node_id,
                                          generation=generation, limit=CLASSIFY_BATCH)
                uncertain = recovery.uncertain_among(conn, [run["id"] for run in batch])
                terminal = []
                for run in batch:
                    klass, reason = recovery.classify(
                        conn, run, on_crash=_on_crash(run["task"]),
                        budget=settings.recovery_budget, uncertain=run["id"] in uncertain)
                    if klass in ("interrupted", "cancelled"):
                        terminal.append((run, klass, reason))  # set-based, below
                    elif recovery.apply(conn, run, klass, reason, enqueue):
                        report.counts[klass] += 1
                        log.info("run %s: owner gone -> %s (%s)", run["id"], klass, reason)
                    crashpoints.hit(settings, "mid_recovery")
                won = set(recovery.apply_terminal_many(conn, terminal, enqueue))
                for run, klass, reason in terminal:
                    if run["id"] in won:
                        report.counts[klass] += 1
                        log.info("run %s: owner gone -> %s (%s)", run["id"], klass, reason)
            if len(batch) < CLASSIFY_BATCH:
                break
            batches += 1
            if batches % CHECKPOINT_EVERY_BATCHES == 0:
                _checkpoint(conn)  # keeps the WAL bounded; no lock held here
        # Step 3 may have ended or paused runs that have a callback: send those now.
        report.counts["deliveries_sent"] += dispatch.send_deliveries(settings, conn)
        # 4. Re-publish unsent dispatch records, and runs still queued long after their
        #    dispatch without a live message (a broker can lose messages).
        if enqueue is None:
            _republish_external(settings, conn, report, trigger=trigger, since=started_at)
        else:
            while True:
                with db.transaction(conn):
                    stale = recovery.stranded_queued(
                        conn, older_than_s=REPUBLISH_AFTER_LEASES * settings.lease_s,
                        limit=BATCH)
                    for run in stale:
                        if recovery.republish(conn, run, enqueue):
                            report.counts["republished"] += 1
                if len(stale) < BATCH:
                    break
        # 5. Dispatch the head of every session left without a holder (its freeing
        #    transition dispatched it already; this covers a message lost since), and the
        #    runs waiting for a free slot of their profile.
        with db.transaction(conn):
            for head in sessions.heads_without_dispatch(conn, limit=BATCH):
                if head["updated_at"] is not None and recovery.ledger_now(conn) - \
                        head["updated_at"] > REPUBLISH_AFTER_LEASES * settings.lease_s:
                    if recovery.republish(conn, head, enqueue) if enqueue else False:
                        report.counts["session_heads"] += 1
        _dispatch_slot_waiters(settings, conn, report, enqueue)
        # 6. Purge by retention, in bounded batches.
        _purge(settings, conn, report)
        # 7. Record the report (the barrier is opened by the caller).
        report.duration_s = time.monotonic() - started
        report.report_id = recovery.record_report(
            conn, node_id=settings.node_id, generation=generation, trigger=trigger,
            started_at=started_at,
            counts={**report.as_dict()["counts"], "duration_s": report.duration_s})
        # The pass's commits left their pages in the WAL (see recovery.open_pass): copy
        # them back now, holding no lock that a writer waits for.  After the report, so
        # not in its duration_s (the barrier, at boot, still opens only after it).
        _checkpoint(conn)
    finally:
        conn.close()
    # A scheduled pass that found nothing says so at DEBUG: at INFO it was one line every
    # RUNSTILE_RECOVERY_INTERVAL_S (8,640 a day) saying nothing.  Boot and `runstile
    # recover` passes always say what they did.
    counts = report.as_dict()["counts"]
    level = logging.DEBUG if trigger == "scheduled" and not counts else logging.INFO
    log.log(level, "recovery (%s, generation %d): %s in %.3fs", trigger, generation,
            counts or "nothing to do", report.duration_s)
    return report


def _purge(settings: Settings, conn, report: Report) -> None:
    """Step 6: runs past retention and expired tombstones, dead-lettered broker messages,
    and old recovery reports, each in bounded batches."""
    for _ in range(MAX_PURGE_BATCHES):
        purged = retention.purge(conn, run_retention_s=settings.run_retention_s,
                                 key_tombstone_s=settings.key_tombstone_s, batch=BATCH)
        report.counts["purged"] += purged.runs
        report.counts["tombstones_expired"] += purged.tombstones
        if purged.runs < BATCH:
            break
    report.counts["dead_letters_purged"] += broker_queue.purge_dead_letters(
        conn, settings.run_retention_s, limit=BATCH * MAX_PURGE_BATCHES)
    for _ in range(MAX_PURGE_BATCHES):
        pruned = retention.prune_reports(conn, younger_than_s=settings.run_retention_s,
                                         batch=BATCH)
        report.counts["reports_pruned"] += pruned
        if pruned < BATCH:
            break


def _checkpoint(conn) -> None:
    """A checkpoint that fails (disk full, I/O error) loses nothing: the pages stay in
    the WAL, committed, for the next checkpoint.  So it never fails the pass, as an
    automatic checkpoint never failed the COMMIT it followed."""
    try:
        recovery.checkpoint(conn)
    except LedgerUnavailable as exc:
        log.warning("WAL checkpoint after recovery failed (%s); a later one copies it", exc)


def _open_migrated(settings: Settings):
    """Step 1: the pass's connection, to a ledger at this runstile's schema.  A ledger
    already there (every pass but a first boot's) is only checked, on this connection;
    otherwise migrations.migrate does the work on its own connection, re-checking the
    version under the write lock."""
    options: _ConnectOptions = {"synchronous": settings.synchronous,
                                "busy_timeout_ms": settings.busy_timeout_ms}
    if not settings.ledger_path.exists():
        migrations.migrate(settings.ledger_path, **options)
    conn = recovery.open_pass(settings.ledger_path, **options)
    try:
        if not migrations.is_current(conn):
            migrations.migrate(settings.ledger_path, **options)
    except BaseException:
        conn.close()
        raise
    return conn


def _sweep_obligations(settings: Settings, conn, report: Report, *, generation: int,
                       trigger: str) -> None:
    """Step 2: attempts whose deliverer is gone go back to pending (ambiguous: the next
    send says ``"recovered": true``), then every pending, due obligation without a
    message gets one, as does one whose message is REPUBLISH_AFTER_LEASES leases
    overdue (a broker can lose messages).  A scheduled pass leaves obligations younger
    than UNSENT_GRACE_S to the process that created them."""
    for _ in range(MAX_PUBLISH_BATCHES):
        rearmed, parked = obligations.rearm_orphans(
            conn, node_id=settings.node_id, generation=generation,
            max_attempts=settings.delivery_max_attempts, limit=BATCH)
        report.counts["deliveries_rearmed"] += rearmed
        report.counts["deliveries_parked"] += parked
        if rearmed + parked < BATCH:
            break
    grace_s = UNSENT_GRACE_S if trigger == "scheduled" else 0.0
    for _ in range(MAX_PUBLISH_BATCHES):
        sent = dispatch.send_deliveries(settings, conn, grace_s=grace_s, limit=BATCH,
                                        stale_s=REPUBLISH_AFTER_LEASES * settings.lease_s)
        report.counts["deliveries_sent"] += sent
        if sent < BATCH:
            break


def _republish_external(settings: Settings, conn, report: Report, *, trigger: str,
                        since: float) -> None:
    """Step 4 for Redis/RabbitMQ, which cannot be looked into.  First the unsent records:
    every one at boot and on `runstile recover`; in a scheduled pass those older than
    UNSENT_GRACE_S (younger ones are being published by whoever wrote them) or written
    by this pass (step 3's re-queues).  Then queued runs whose dispatch went out
    REPUBLISH_AFTER_LEASES leases ago and which are still not claimed get a new record,
    published (a duplicate is harmless)."""
    grace_s = UNSENT_GRACE_S if trigger == "scheduled" else 0.0
    for _ in range(MAX_PUBLISH_BATCHES):
        published = dispatch.publish_pending(settings, conn, limit=BATCH, older_than_s=grace_s,
                                             created_since=since)
        report.counts["published"] += published
        if published < BATCH:
            break
    for _ in range(MAX_PUBLISH_BATCHES):
        with db.transaction(conn):
            lost = dispatches.lost_queued(
                conn, older_than_s=REPUBLISH_AFTER_LEASES * settings.lease_s, limit=BATCH)
            run_ids = [run["id"] for run in lost if recovery.republish(conn, run, None)]
        for run_id in run_ids:
            log.info("run %s: still queued long after its dispatch; re-published", run_id)
        report.counts["republished"] += len(run_ids)
        report.counts["published"] += dispatch.publish_pending(settings, conn, limit=BATCH,
                                                               run_ids=run_ids)
        if len(lost) < BATCH:
            break


def _dispatch_slot_waiters(settings: Settings, conn, report: Report, enqueue) -> None:
    """Step 5, second half: queued runs a claim refused for their profile's cap
    (ledger/profile_slots.py) whose profile now has a free slot.  The transition that
    freed it dispatched one already; this covers a message lost since and a cap raised
    or removed at a restart.  With a cap, one batch per pass: a dispatched run holds no
    slot until its claim, so a second batch would hand the same free slots out again."""
    cap = settings.max_running_per_profile
    for _ in range(MAX_PUBLISH_BATCHES if cap is None else 1):
        with db.transaction(conn):
            run_ids = profile_slots.dispatch_stranded(conn, cap, enqueue, limit=BATCH)
        report.counts["slot_waiters"] += len(run_ids)
        if enqueue is None:  # Redis/RabbitMQ: publish the records now
            report.counts["published"] += dispatch.publish_pending(settings, conn,
                                                                   limit=BATCH, run_ids=run_ids)
        if len(run_ids) < BATCH:
            break


def boot(settings: Settings, generation: int) -> Report:
    """Recovery for a new generation, then open the barrier (docs/guarantees.md,
    "4. Recovery barrier")."""
    report = run_pass(settings, generation=generation, trigger="boot")
    conn = db.connect(settings.ledger_path, synchronous=settings.synchronous,
                      busy_timeout_ms=settings.busy_timeout_ms)
    try:
        recovery.open_barrier(conn, settings.node_id, generation)
    finally:
        conn.close()
    return report
