"""One recovery pass, in the order of docs/operations.md, "Recovery".

Called at every boot before any worker consumes (the barrier), on a schedule inside
``runstile up``/``runstile worker``, and by ``runstile recover``.  Recovered runs go back
through the queue's claim (a re-queue with a dispatch), never executed here: one path
to execution (DBOS recovery does the same).
"""

from __future__ import annotations

import collections
import logging
import socket
import sqlite3
import time
from dataclasses import dataclass, field
from typing import Any, TypedDict

from .. import crashpoints, dispatch, processes
from .. import tasks as registry
from ..config import Settings
from ..errors import LedgerUnavailable
from ..ledger import (
    broker_queue,
    db,
    dispatches,
    migrations,
    obligations,
    recovery,
    retention,
    sessions,
    slots,
)
from ..ledger.runs import Enqueue
from . import metrics

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
    #: Other nodes found dead whose runs this pass classified: {node id: generation}.
    taken_over: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {"node_id": self.node_id, "generation": self.generation,
                "trigger": self.trigger,
                "counts": {name: n for name, n in self.counts.items() if n},
                "duration_s": round(self.duration_s, 4), "report_id": self.report_id,
                "taken_over": self.taken_over}


def _on_crash(task: str) -> str:
    spec = registry.get(task)
    return spec.on_crash if spec is not None else "interrupt"


@dataclass
class _Pass:
    """What every step of one pass works with."""

    settings: Settings
    conn: sqlite3.Connection
    report: Report
    generation: int
    trigger: str
    #: The embedded broker's enqueue, or None (Redis/RabbitMQ: the pass publishes and
    #: counts its own records, step 4).
    enqueue: Enqueue | None
    #: The ledger's clock when the pass began (step 4 publishes what it wrote since).
    started_at: float

    @property
    def grace_s(self) -> float:
        """A scheduled pass leaves rows younger than UNSENT_GRACE_S to the process that
        wrote them; boot and `runstile recover` take every one."""
        return UNSENT_GRACE_S if self.trigger == "scheduled" else 0.0

    @property
    def stale_s(self) -> float:
        """How long a message may be overdue before it is taken as lost."""
        return REPUBLISH_AFTER_LEASES * self.settings.lease_s


def run_pass(settings: Settings, *, generation: int, trigger: str) -> Report:
    """One complete, idempotent recovery pass, its steps in the order of
    docs/operations.md, "Recovery"; returns its report (also recorded)."""
    started = time.monotonic()
    report = Report(settings.node_id, generation, trigger)
    conn = _open_migrated(settings)  # 1. migrate / check the ledger
    try:
        step = _Pass(settings, conn, report, generation, trigger,
                     enqueue=dispatch.Dispatcher(settings).in_transaction,
                     started_at=recovery.ledger_now(conn))
        _sweep_obligations(step)       # 2. outbound results first
        _reconcile_journal(step)       # 3. runs whose owner is gone
        _republish(step)               # 4. records unsent, messages lost
        _dispatch_session_heads(step)  # 5. sessions without a holder ...
        _dispatch_slot_waiters(step)   #    ... and runs waiting for a profile's or task's slot
        _purge(step)                   # 6. retention
        report.duration_s = time.monotonic() - started
        report.report_id = recovery.record_report(  # 7. the report
            conn, node_id=settings.node_id, generation=generation, trigger=trigger,
            started_at=step.started_at,
            counts={**report.as_dict()["counts"], "duration_s": report.duration_s},
            taken_over=report.taken_over)
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
    metrics.observe_pass(trigger, report.duration_s, counts)
    level = logging.DEBUG if trigger == "scheduled" and not counts else logging.INFO
    log.log(level, "recovery (%s, generation %d): %s in %.3fs", trigger, generation,
            counts or "nothing to do", report.duration_s)
    return report


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
    if not db.ledger_exists(settings.ledger_target):
        migrations.migrate(settings.ledger_target, **options)
    conn = recovery.open_pass(settings.ledger_target, **options)
    try:
        if not migrations.is_current(conn):
            migrations.migrate(settings.ledger_target, **options)
    except BaseException:
        conn.close()
        raise
    return conn


def _sweep_obligations(p: _Pass) -> None:
    """Step 2: attempts whose deliverer is gone go back to pending (ambiguous: the next
    send says ``"recovered": true``), then every pending, due obligation without a
    message gets one, as does one whose message is REPUBLISH_AFTER_LEASES leases
    overdue (a broker can lose messages)."""
    for _ in range(MAX_PUBLISH_BATCHES):
        rearmed, parked = obligations.rearm_orphans(
            p.conn, node_id=p.settings.node_id, generation=p.generation,
            max_attempts=p.settings.delivery_max_attempts, limit=BATCH)
        p.report.counts["deliveries_rearmed"] += rearmed
        p.report.counts["deliveries_parked"] += parked
        if rearmed + parked < BATCH:
            break
    for _ in range(MAX_PUBLISH_BATCHES):
        sent = dispatch.send_deliveries(p.settings, p.conn, grace_s=p.grace_s, limit=BATCH,
                                        stale_s=p.stale_s)
        p.report.counts["deliveries_sent"] += sent
        if sent < BATCH:
            break


def _reconcile_journal(p: _Pass) -> None:
    """Step 3: the runs whose owner is gone, CLASSIFY_BATCH per transaction, each
    classified (docs/tasks.md, "When the worker is gone") and moved by a guarded UPDATE;
    then the deliveries the moves owe (ended or paused runs with a callback).  First
    the runs of other nodes found dead by their lock (takeover), reported as such."""
    _take_over(p)
    batches = 0
    while True:
        with db.transaction(p.conn):
            batch = recovery.orphaned(p.conn, node_id=p.settings.node_id,
                                      generation=p.generation, limit=CLASSIFY_BATCH)
            _classify_batch(p, batch)
        if len(batch) < CLASSIFY_BATCH:
            break
        batches += 1
        if batches % CHECKPOINT_EVERY_BATCHES == 0:
            _checkpoint(p.conn)  # keeps the WAL bounded; no lock held here
    p.report.counts["deliveries_sent"] += dispatch.send_deliveries(p.settings, p.conn)


_CLASSES = ("requeued", "paused", "interrupted", "cancelled")  # runs classified


def _take_over(p: _Pass) -> None:
    """Step 3, first: every other node whose lock is free (dead) and which still owns
    runs: its runs of the generation read, or earlier, are classified at once by the same
    guarded moves (ledger.recovery.dead_nodes says why).  Survivors racing for one dead
    node classify each run once: a later guard finds the owner already cleared."""
    for node, generation in recovery.dead_nodes(p.conn, node_id=p.settings.node_id).items():
        before = sum(p.report.counts[k] for k in _CLASSES)
        while True:
            with db.transaction(p.conn):
                batch = recovery.orphaned_of(p.conn, node_id=node, generation=generation,
                                             limit=CLASSIFY_BATCH)
                _classify_batch(p, batch)
            if len(batch) < CLASSIFY_BATCH:
                break
        if taken := sum(p.report.counts[k] for k in _CLASSES) - before:
            p.report.counts["taken_over"] += taken
            p.report.taken_over[node] = generation
            log.warning("node %s (generation %d) is gone (its node lock is free): %d of its "
                        "runs classified", node, generation, taken)


def _classify_batch(p: _Pass, batch: list[dict[str, Any]]) -> None:
    """One batch of step 3, inside its transaction: re-queues and pauses one by one,
    interruptions and cancellations set-based (one UPDATE for the batch)."""
    uncertain = recovery.uncertain_among(p.conn, [run["id"] for run in batch])
    terminal = []
    for run in batch:
        klass, reason = recovery.classify(
            p.conn, run, on_crash=_on_crash(run["task"]), budget=p.settings.recovery_budget,
            uncertain=run["id"] in uncertain)
        if klass in ("interrupted", "cancelled"):
            terminal.append((run, klass, reason))
        elif recovery.apply(p.conn, run, klass, reason, p.enqueue):
            p.report.counts[klass] += 1
            log.info("run %s: owner gone -> %s (%s)", run["id"], klass, reason)
        crashpoints.hit(p.settings, "mid_recovery")
    won = set(recovery.apply_terminal_many(p.conn, terminal, p.enqueue))
    for run, klass, reason in terminal:
        if run["id"] in won:
            p.report.counts[klass] += 1
            log.info("run %s: owner gone -> %s (%s)", run["id"], klass, reason)


def _release_dead_consumers(p: _Pass) -> None:
    """At boot, on the embedded broker: the messages held by consumers of this host whose
    process is gone (a SIGKILLed tree) go back to ready at once, not a consumer timeout
    later; a delayed run's message keeps its eta (docs/api.md, "Delayed runs").  A pid
    that is alive (perhaps reused) is left to the timeout."""
    for consumer_id, pid in broker_queue.consumers_on(p.conn, socket.gethostname()):
        # A zombie counts as gone: the workers of a tree SIGKILLed a moment ago may not
        # be reaped yet when the node starts again.
        if processes.exited(pid):
            p.report.counts["messages_released"] += broker_queue.close_consumer(
                p.conn, consumer_id)


def _republish(p: _Pass) -> None:
    """Step 4: runs still queued long after their dispatch without a live message (a
    broker can lose messages) get a new one; Redis/RabbitMQ also their unsent records.
    At boot, first the messages held by this host's dead consumers go back to ready."""
    if p.enqueue is None:
        _republish_external(p)
        return
    if p.trigger == "boot":
        _release_dead_consumers(p)
    while True:
        with db.transaction(p.conn):
            stale = recovery.stranded_queued(p.conn, older_than_s=p.stale_s, limit=BATCH)
            for run in stale:
                if recovery.republish(p.conn, run, p.enqueue):
                    p.report.counts["republished"] += 1
        if len(stale) < BATCH:
            break


def _republish_external(p: _Pass) -> None:
    """Step 4 for Redis/RabbitMQ, which cannot be looked into.  First the unsent records:
    every one at boot and on `runstile recover`; in a scheduled pass those older than
    UNSENT_GRACE_S (younger ones are being published by whoever wrote them) or written
    by this pass (step 3's re-queues).  Then queued runs whose dispatch went out
    REPUBLISH_AFTER_LEASES leases ago and which are still not claimed get a new record,
    published (a duplicate is harmless)."""
    for _ in range(MAX_PUBLISH_BATCHES):
        published = dispatch.publish_pending(p.settings, p.conn, limit=BATCH,
                                             older_than_s=p.grace_s,
                                             created_since=p.started_at)
        p.report.counts["published"] += published
        if published < BATCH:
            break
    for _ in range(MAX_PUBLISH_BATCHES):
        with db.transaction(p.conn):
            lost = dispatches.lost_queued(p.conn, older_than_s=p.stale_s, limit=BATCH)
            run_ids = [run["id"] for run in lost if recovery.republish(p.conn, run, None)]
        for run_id in run_ids:
            log.info("run %s: still queued long after its dispatch; re-published", run_id)
        p.report.counts["republished"] += len(run_ids)
        p.report.counts["published"] += dispatch.publish_pending(p.settings, p.conn,
                                                                 limit=BATCH, run_ids=run_ids)
        if len(lost) < BATCH:
            break


def _dispatch_session_heads(p: _Pass) -> None:
    """Step 5, first half: the head of every session left without a holder.  Its
    freeing transition dispatched it already; this covers a message lost since."""
    if p.enqueue is None:
        return  # Redis/RabbitMQ: step 4's lost-message sweep covers queued heads
    with db.transaction(p.conn):
        for head in sessions.heads_without_dispatch(p.conn, limit=BATCH):
            # Idle since its last change, or since its time (a delayed head).
            idle_since = max(head["updated_at"] or 0.0, head["not_before"] or 0.0)
            if head["updated_at"] is not None and \
                    recovery.ledger_now(p.conn) - idle_since > p.stale_s:
                if recovery.republish(p.conn, head, p.enqueue):
                    p.report.counts["session_heads"] += 1


def _dispatch_slot_waiters(p: _Pass) -> None:
    """Step 5, second half: queued runs a claim refused for their profile's cap or their
    task's concurrency (ledger/slots.py) whose profile or task now has a free slot, by
    this process's setting and registry.  The transition that freed it dispatched one
    already; this covers a message lost since and a limit raised or removed at a
    restart.  With a limit, one batch per pass: a dispatched run holds no slot until its
    claim, so a second batch would hand the same free slots out again."""
    limits = slots.Limits(p.settings.max_running_per_profile, registry.concurrencies())
    for _ in range(1 if limits.bounded else MAX_PUBLISH_BATCHES):
        with db.transaction(p.conn):
            run_ids = slots.dispatch_stranded(p.conn, limits, p.enqueue, most=BATCH)
        p.report.counts["slot_waiters"] += len(run_ids)
        if p.enqueue is None:  # Redis/RabbitMQ: publish the records now
            p.report.counts["published"] += dispatch.publish_pending(
                p.settings, p.conn, limit=BATCH, run_ids=run_ids)
        if len(run_ids) < BATCH:
            break


def _purge(p: _Pass) -> None:
    """Step 6: runs past retention and expired tombstones, dead-lettered broker messages,
    and old recovery reports, each in bounded batches."""
    settings, report = p.settings, p.report
    for _ in range(MAX_PURGE_BATCHES):
        purged = retention.purge(p.conn, run_retention_s=settings.run_retention_s,
                                 key_tombstone_s=settings.key_tombstone_s, batch=BATCH)
        report.counts["purged"] += purged.runs
        report.counts["tombstones_expired"] += purged.tombstones
        if purged.runs < BATCH:
            break
    report.counts["dead_letters_purged"] += broker_queue.purge_dead_letters(
        p.conn, settings.run_retention_s, limit=BATCH * MAX_PURGE_BATCHES)
    for _ in range(MAX_PURGE_BATCHES):
        pruned = retention.prune_reports(p.conn, younger_than_s=settings.run_retention_s,
                                         batch=BATCH)
        report.counts["reports_pruned"] += pruned
        if pruned < BATCH:
            break


def boot(settings: Settings, generation: int) -> Report:
    """Recovery for a new generation, then open the barrier (docs/guarantees.md,
    "4. Recovery barrier")."""
    report = run_pass(settings, generation=generation, trigger="boot")
    conn = db.connect(settings.ledger_target, synchronous=settings.synchronous,
                      busy_timeout_ms=settings.busy_timeout_ms)
    try:
        recovery.open_barrier(conn, settings.node_id, generation)
    finally:
        conn.close()
    return report
