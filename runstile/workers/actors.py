"""The one Dramatiq actor: claim, then run the task body, then record the outcome.

Thin on purpose (docs/architecture.md, "Worker processes").  The claim is the gate of
at-most-once execution: a message whose claim loses — a duplicate, a redelivery, a run
already finished or stopped — is acknowledged as a logged no-op, and the body never
starts.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
import time

import dramatiq

from .. import crashpoints, dispatch, logs
from .. import tasks as registry
from ..config import Settings
from ..errors import LedgerUnavailable, RunstileError
from ..jsondepth import MAX_DEPTH
from ..ledger import execution
from ..ledger.db import ConnectionPool
from ..ledger.execution import Owner
from ..ledger.group_commit import GroupCommitter, Unit
from ..queues import DEFAULT_QUEUE
from . import metrics
from .context import (
    ApprovalParked,
    Interrupt,
    LeaseLostInterrupt,
    PausedInterrupt,
    ResultTooDeep,
    RunContext,
    Stopped,
    TimeLimitInterrupt,
    encode_json,
)
from .lease import Executions
from .sqlite_broker import current_delivery

log = logging.getLogger("runstile.workers")

#: Milliseconds before a message whose claim hit an unavailable ledger is tried again.
CLAIM_RETRY_DELAY_MS = 1000
#: Seconds between attempts to record an outcome while the ledger is unavailable.
FINISH_RETRY_S = 0.2


class Executor:
    """Everything ``execute_run`` needs, built once per worker process.

    What a transition owes after its commit (a freed session's next run, a freed profile
    slot's waiter, a callback) is paid by the dispatcher its pool's connections settle
    with (docs/architecture.md, "What a commit owes"): nothing here remembers it.

    A run's claim and its finish go through one committer per process
    (ledger/group_commit.py): the claims and finishes its threads have ready at one
    moment commit in one transaction, each in a savepoint of its own, instead of
    queueing one by one for the ledger's write lock.  A thread learns its claim's
    outcome only after that COMMIT, so a body still starts only on a durable claim.  Its
    finish it hands over without waiting (``_aftermath``).
    """

    def __init__(self, settings: Settings, broker: dramatiq.Broker, *, node: str,
                 generation: int, executions: Executions, pool: ConnectionPool,
                 dispatcher: dispatch.Dispatcher) -> None:
        self.settings, self.broker = settings, broker
        self.node, self.generation = node, generation
        self.executions, self.pool = executions, pool
        self.dispatcher = dispatcher
        self.committer = GroupCommitter(pool.open)
        #: The tasks a claim may start without reading the run first (ledger/execution.py
        #: ``_start_plain``): registered here, with no concurrency limit.  Read once: a
        #: task registered later is only slower to claim, never claimed wrongly.
        self.unlimited_tasks = json.dumps(sorted(
            name for name, limit in registry.concurrencies().items() if limit is None))

    def owner(self) -> Owner:
        return Owner(self.node, self.generation, os.getpid(), threading.get_ident())

    def __call__(self, run_id: str, dispatch_id: int | None = None,
                 queue: str = DEFAULT_QUEUE) -> None:
        # Every log line of this message, the task body's own included, names the run.
        with logs.run_context(run_id):
            self._execute(run_id, dispatch_id, queue)

    def _execute(self, run_id: str, dispatch_id: int | None, queue: str) -> None:
        owner = self.owner()
        run = self._claim(run_id, dispatch_id, queue, owner)
        if run is None:
            return
        started = time.monotonic()
        logs.set_task(run["task"])
        metrics.claimed(run)
        self.executions.outcome_owed()
        handed_over = False
        try:
            outcome = self._body(run, owner, self.pool.get())
            if outcome is not None:
                handed_over = self._aftermath(run, owner, outcome, started)
        finally:
            if not handed_over:
                self.executions.outcome_settled()

    def _claim(self, run_id: str, dispatch_id: int | None, queue: str,
               owner: Owner) -> dict | None:
        """The run, once this worker's claim of it has committed; None when the claim
        lost (the message is a logged no-op) or met an unavailable ledger (the message
        comes back shortly)."""
        # On the embedded broker the claim also acks this message, in its transaction:
        # a run costs two durable commits, its claim and its finish (docs/guarantees.md,
        # "Commits per run").
        message = current_delivery()
        delivery = None if message is None else execution.Delivery(message.delivery_id,
                                                                   message.consumer_id)
        try:
            claim: execution.Claim = self.committer.run(lambda batch: execution.claim(
                batch, run_id, owner, lease_s=self.settings.lease_s,
                enqueue=self.dispatcher.enqueue,
                task_known=lambda name: registry.get(name) is not None,
                task_limit=registry.concurrency_of,
                max_running_per_profile=self.settings.max_running_per_profile,
                delivery=delivery, unlimited_tasks=self.unlimited_tasks))
        except LedgerUnavailable as exc:
            # The run stays queued; try the message again shortly instead of losing it.
            # (The committer reopens its own connection after a failed batch.)
            log.warning("run %s: claim failed (%s); retrying in %d ms", run_id, exc.message,
                        CLAIM_RETRY_DELAY_MS)
            self.broker.enqueue(dispatch.message_for(run_id, dispatch_id, queue=queue),
                                delay=CLAIM_RETRY_DELAY_MS)
            return None
        if message is not None:
            message.settled = True
        crashpoints.hit(self.settings, "after_claim")
        if claim.run is None:
            metrics.claim_lost(claim.outcome)
            log.info("run %s: claim lost (%s); message acknowledged as a no-op (dispatch %s)",
                     run_id, claim.outcome, dispatch_id)
        return claim.run

    def _body(self, run: dict, owner: Owner, conn) -> dict | None:
        """Run the task body; the outcome to record, or None when there is nothing left
        to record here (the body unwound through a transition of its own — a pause, a
        parked approval, a time limit — or the run is no longer this worker's)."""
        spec = registry.get(run["task"])
        assert spec is not None  # the claim refuses a run of a task not registered here
        item = self.executions.begin(run["id"], owner, spec.time_limit_s)
        try:
            try:
                ctx = RunContext(run, owner, conn, stop_requested=lambda: item.stop_requested,
                                 lease_lost=lambda: item.lost,
                                 on_step_started=lambda: crashpoints.hit(self.settings,
                                                                         "after_step_start"),
                                 enqueue=self.dispatcher.enqueue,
                                 allowlist=self.settings.callback_allowlist,
                                 max_payload_bytes=self.settings.max_result_bytes)
                outcome = self._completed(self._call(spec, ctx, json.loads(run["input"])))
            except Stopped:
                # The stop was seen (or its grace ran out): the run ends cancelled.
                outcome = {"status": "cancelled"}
                log.info("run %s: body stopped on request", run["id"])
            except Interrupt:
                raise
            except BaseException as exc:  # noqa: BLE001 - the task's own failure: logged
                outcome = self._failed(run, exc)  # and recorded by _failed, not re-raised
            finally:
                still_ours = self.executions.finishing(item)
        except (LeaseLostInterrupt, TimeLimitInterrupt, PausedInterrupt, ApprovalParked) as exc:
            # Each but a lost lease is a transition already committed (and settled).
            log.info("run %s: body unwound (%s)", run["id"], type(exc).__name__)
            return None
        except Stopped:
            # The grace interrupt landed after the body had already returned: still a stop.
            outcome, still_ours = {"status": "cancelled"}, True
        finally:
            self.executions.end(item)
        return outcome if still_ours else None

    @staticmethod
    def _failed(run: dict, exc: BaseException) -> dict:
        # SystemExit from a body is a failure of that run, not of the worker.  runstile's
        # own errors (invalid_event, ...) keep their stable code; anything else the task
        # raised is task_error with its class and text.  The traceback goes to the log.
        log.warning("run %s: task %s raised", run["id"], run["task"], exc_info=True)
        code = exc.code if isinstance(exc, RunstileError) else "task_error"
        return {"status": "failed", "error_code": code,
                "error_message": f"{type(exc).__name__}: {exc}"[:2000]}

    def _aftermath(self, run: dict, owner: Owner, outcome: dict, started: float) -> bool:
        """Record what the body came to: a retry, or the run's terminal status.  True
        when the finish was handed to the committer (``_finished`` settles it)."""
        crashpoints.hit(self.settings, "after_body")
        spec = registry.get(run["task"])
        assert spec is not None
        if outcome["status"] == "failed" and self._retry(run, owner, spec, outcome):
            return False
        # Not waited for: this thread goes on to its next message, whose claim then
        # usually commits in the same transaction as this finish (one fsync for both,
        # where waiting cost a commit each).  Nothing of this run is left to this thread:
        # its body is over, its message was acked by its claim (or is acked by Dramatiq
        # now, Redis/RabbitMQ), and the committer settles units in the order they came,
        # so this finish commits no later than this thread's next claim (unless its batch
        # fails: then it is retried, and the claim's checks of sessions and slots see the
        # run still running, as they would see any other's).  Its outcome
        # stays owed (Executions) until settled: a drain waits for it before exiting.
        self.committer.hand_over(
            lambda batch: execution.finish(batch, run["id"], owner, **outcome,
                                           enqueue=self.dispatcher.enqueue),
            then=lambda unit: self._finished(run, owner, outcome, started, unit))
        return True

    def _finished(self, run: dict, owner: Owner, outcome: dict, started: float,
                  unit: Unit) -> None:
        """On the committer thread, once the finish's batch is settled: count it, or
        retry an unavailable ledger on a thread of its own (never here: the retry waits
        for this very committer)."""
        if isinstance(unit.error, LedgerUnavailable):
            threading.Thread(target=self._finish_retrying, name="runstile-finish-retry",
                             args=(run, owner, outcome, started, unit.error),
                             daemon=True).start()
            return
        try:
            if unit.error is not None:
                log.error("run %s: recording its outcome failed; recovery will classify it",
                          run["id"], exc_info=unit.error)
            else:
                self._recorded(run, outcome, unit.result, started)
        finally:
            self.executions.outcome_settled()

    def _finish_retrying(self, run: dict, owner: Owner, outcome: dict, started: float,
                         first: LedgerUnavailable) -> None:
        try:
            log.warning("run %s: recording its outcome failed (%s); retrying", run["id"],
                        first.message)
            self._recorded(run, outcome, self._finish(run["id"], owner, outcome), started)
        finally:
            self.executions.outcome_settled()

    def _recorded(self, run: dict, outcome: dict, finished: dict | None,
                  started: float) -> None:
        if finished is None:
            log.warning("run %s: no longer owned by this worker; outcome %s dropped",
                        run["id"], outcome["status"])
            return
        metrics.finished(run["task"], finished["status"], started)
        # If this process dies here, recovery's sweep sends what the finish owed.
        crashpoints.hit(self.settings, "after_finish")

    def _retry(self, run: dict, owner: Owner, spec: registry.TaskSpec, outcome: dict) -> bool:
        """Task retries (docs/tasks.md, "Registering a task"): a raising body with retries
        left is re-queued with attempt + 1 after retry_backoff_s — a ledger transition
        (with a delayed message), never Dramatiq's Retries.  ``attempt`` counts every
        execution of the run, so a run re-queued by recovery has used one of its tries."""
        if outcome.get("error_code") not in ("task_error",) or run["attempt"] > spec.retries:
            return False
        try:
            requeued = execution.requeue(
                self.pool.get(), run["id"], from_statuses=("running",), reason="retry",
                owner=owner, event_data={"error": {"code": outcome["error_code"],
                                                   "message": outcome["error_message"]}},
                enqueue=self.dispatcher.delayed(spec.retry_backoff_s))
        except LedgerUnavailable:
            return False  # record the failure instead (finish retries while the lease lasts)
        if requeued is None:
            return False
        log.info("run %s: attempt %d failed; retry as attempt %d in %.1fs", run["id"],
                 run["attempt"], requeued["attempt"], spec.retry_backoff_s)
        return True

    def _finish(self, run_id: str, owner: Owner, outcome: dict) -> dict | None:
        """Record the outcome, retrying a briefly unavailable ledger while the lease
        lasts: the body's work is done, and losing its outcome would leave the run to
        recovery as if the body had died."""
        deadline = time.monotonic() + self.settings.lease_s
        while True:
            try:
                finished: dict | None = self.committer.run(lambda batch: execution.finish(
                    batch, run_id, owner, **outcome, enqueue=self.dispatcher.enqueue))
                return finished
            except LedgerUnavailable as exc:
                # The committer reopens its own connection after a failed batch.
                if time.monotonic() >= deadline:
                    log.error("run %s: could not record its outcome (%s); recovery will "
                              "classify it", run_id, exc.message)
                    return None
                time.sleep(FINISH_RETRY_S)

    @staticmethod
    def _call(spec: registry.TaskSpec, ctx: RunContext, value):
        if spec.is_async:
            return asyncio.run(spec.fn(ctx, value))
        return spec.fn(ctx, value)

    def _completed(self, value) -> dict:
        try:
            encoded = encode_json(value)
        except (TypeError, ValueError) as exc:
            return {"status": "failed", "error_code": "invalid_result",
                    "error_message": f"the task returned a value that is not JSON: {exc}"}
        if encoded is None:
            # Stored, it would break reading the run (docs/api.md "JSON depth").
            return {"status": "failed", "error_code": ResultTooDeep.code,
                    "error_message": f"the result nests deeper than {MAX_DEPTH} levels of "
                                     "arrays and objects"}
        if len(encoded.encode()) > self.settings.max_result_bytes:
            return {"status": "failed", "error_code": "result_too_large",
                    "error_message": f"the result is larger than "
                                     f"{self.settings.max_result_bytes} bytes"}
        return {"status": "completed", "result_json": encoded}


def declare(broker: dramatiq.Broker, executor: Executor) -> dramatiq.Actor:
    """Bind the executor to ``broker`` as the actor dispatch.ACTOR on dispatch.QUEUE.

    The actor's queue is only where ``.send()`` would put a message: runstile writes a
    run's message to its queue's broker queue (dispatch.message_for), and a worker runs
    a message by its actor name whichever queue it came from (workers/pools.py).  No
    retry or time-limit options: those are ledger transitions, never Dramatiq's (the
    broker's middleware list leaves Retries and TimeLimit out, so the options do not
    even exist).
    """
    def runstile_execute(run_id: str, dispatch_id: int | None = None,
                         queue: str = DEFAULT_QUEUE) -> None:
        executor(run_id, dispatch_id, queue)

    return dramatiq.actor(actor_name=dispatch.ACTOR, queue_name=dispatch.QUEUE,
                          broker=broker)(runstile_execute)
