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

from .. import crashpoints, dispatch
from .. import tasks as registry
from ..config import Settings
from ..errors import LedgerUnavailable, RunstileError
from ..jsondepth import MAX_DEPTH
from ..ledger import execution
from ..ledger.db import ConnectionPool
from ..ledger.execution import Owner
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

log = logging.getLogger("runstile.workers")

#: Milliseconds before a message whose claim hit an unavailable ledger is tried again.
CLAIM_RETRY_DELAY_MS = 1000
#: Seconds between attempts to record an outcome while the ledger is unavailable.
FINISH_RETRY_S = 0.2


class Executor:
    """Everything ``execute_run`` needs, built once per worker process."""

    def __init__(self, settings: Settings, broker: dramatiq.Broker, *, node: str,
                 generation: int, executions: Executions, pool: ConnectionPool) -> None:
        self.settings, self.broker = settings, broker
        self.node, self.generation = node, generation
        self.executions, self.pool = executions, pool
        #: How transitions that free a session hand its next run to the broker.
        self.enqueue = dispatch.in_transaction_enqueue(settings)

    def owner(self) -> Owner:
        return Owner(self.node, self.generation, os.getpid(), threading.get_ident())

    def __call__(self, run_id: str, dispatch_id: int | None = None) -> None:
        owner = self.owner()
        conn = self.pool.get()
        try:
            claim = execution.claim(
                conn, run_id, owner, lease_s=self.settings.lease_s, enqueue=self.enqueue,
                task_known=lambda name: registry.get(name) is not None,
                max_running_per_profile=self.settings.max_running_per_profile)
        except LedgerUnavailable as exc:
            # The run stays queued; try the message again shortly instead of losing it.
            log.warning("run %s: claim failed (%s); retrying in %d ms", run_id, exc.message,
                        CLAIM_RETRY_DELAY_MS)
            self.pool.discard()
            self.broker.enqueue(dispatch.message_for(run_id, dispatch_id),
                                delay=CLAIM_RETRY_DELAY_MS)
            return
        crashpoints.hit(self.settings, "after_claim")
        if claim.run is None:
            log.info("run %s: claim lost (%s); message acknowledged as a no-op (dispatch %s)",
                     run_id, claim.outcome, dispatch_id)
            if claim.outcome == "unknown_task":  # failed at claim: its callback is owed
                dispatch.send_deliveries(self.settings, conn, run_id=run_id)
            return
        self._execute(claim.run, owner, conn)

    def _execute(self, run: dict, owner: Owner, conn) -> None:
        spec = registry.get(run["task"])
        assert spec is not None  # the claim refuses a run of a task not registered here
        item = self.executions.begin(run["id"], owner, spec.time_limit_s)
        outcome: dict | None = None
        try:
            try:
                ctx = RunContext(run, owner, conn, stop_requested=lambda: item.stop_requested,
                                 lease_lost=lambda: item.lost,
                                 on_step_started=lambda: crashpoints.hit(self.settings,
                                                                         "after_step_start"),
                                 enqueue=self.enqueue,
                                 allowlist=self.settings.callback_allowlist,
                                 on_delivery=lambda: dispatch.send_deliveries(
                                     self.settings, self.pool.get(), run_id=run["id"]),
                                 max_payload_bytes=self.settings.max_result_bytes)
                value = self._call(spec, ctx, json.loads(run["input"]))
                outcome = self._completed(value)
            except Stopped:
                # The stop was seen (or its grace ran out): the run ends cancelled.
                outcome = {"status": "cancelled"}
                log.info("run %s: body stopped on request", run["id"])
            except Interrupt:
                raise
            except BaseException as exc:  # the task's own failure: recorded, not re-raised
                # SystemExit from a body is a failure of that run, not of the worker.
                # runstile's own errors (invalid_event, ...) keep their stable code;
                # anything else the task raised is task_error with its class and text.
                log.warning("run %s: task %s raised", run["id"], run["task"], exc_info=True)
                code = exc.code if isinstance(exc, RunstileError) else "task_error"
                outcome = {"status": "failed", "error_code": code,
                           "error_message": f"{type(exc).__name__}: {exc}"[:2000]}
            finally:
                still_ours = self.executions.finishing(item)
        except (LeaseLostInterrupt, TimeLimitInterrupt, PausedInterrupt, ApprovalParked) as exc:
            log.info("run %s: body unwound (%s)", run["id"], type(exc).__name__)
            if not isinstance(exc, LeaseLostInterrupt):
                # A pause, a parked approval or a time limit may owe its callback a notice.
                dispatch.send_deliveries(self.settings, self.pool.get(), run_id=run["id"])
                # And each freed the run's profile slot (all but the approval wait, its
                # session too): publish what that dispatched.
                self._publish_successors(run)
            return
        except Stopped:
            # The grace interrupt landed after the body had already returned: still a stop.
            outcome, still_ours = {"status": "cancelled"}, True
        finally:
            self.executions.end(item)
        if not still_ours:
            return
        crashpoints.hit(self.settings, "after_body")
        if outcome["status"] == "failed" and self._retry(run, owner, spec, outcome):
            return
        finished = self._finish(run["id"], owner, outcome)
        if finished is None:
            log.warning("run %s: no longer owned by this worker; outcome %s dropped",
                        run["id"], outcome["status"])
            return
        crashpoints.hit(self.settings, "after_finish")
        if finished["callback_url"] is not None:
            # The terminal write created the callback obligation; hand it to a deliverer
            # now (if this process dies first, recovery's sweep sends it).
            dispatch.send_deliveries(self.settings, self.pool.get(), run_id=run["id"])
        # The run freed its session and its profile slot: publish what that dispatched.
        self._publish_successors(finished)

    def _publish_successors(self, run: dict) -> None:
        """After a transition that freed ``run``'s session or profile slot: publish the
        dispatch records it wrote (Redis/RabbitMQ; the embedded broker's messages
        committed with the transition).  With a cap, every unsent record of the profile:
        its session's next run is one of them."""
        if self.settings.max_running_per_profile is not None:
            dispatch.publish_pending(self.settings, self.pool.get(),
                                     profile=run["profile_id"])
        elif run["session_key"] is not None:
            dispatch.publish_pending(self.settings, self.pool.get(), session=(
                run["profile_id"], run["key_id"], run["session_key"]))

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
                enqueue=dispatch.in_transaction_enqueue(self.settings,
                                                        delay_s=spec.retry_backoff_s))
        except LedgerUnavailable:
            return False  # record the failure instead (finish retries while the lease lasts)
        if requeued is not None:
            log.info("run %s: attempt %d failed; retry as attempt %d in %.1fs", run["id"],
                     run["attempt"], requeued["attempt"], spec.retry_backoff_s)
            # Redis/RabbitMQ: publish the re-queue's dispatch now, as a delayed message,
            # then whatever the slot it left was handed to.
            dispatch.publish_pending(self.settings, self.pool.get(), run_ids=[run["id"]],
                                     delay_s=spec.retry_backoff_s)
            self._publish_successors(requeued)
            return True
        return False

    def _finish(self, run_id: str, owner: Owner, outcome: dict) -> dict | None:
        """Record the outcome, retrying a briefly unavailable ledger while the lease
        lasts: the body's work is done, and losing its outcome would leave the run to
        recovery as if the body had died."""
        deadline = time.monotonic() + self.settings.lease_s
        while True:
            try:
                return execution.finish(self.pool.get(), run_id, owner, **outcome,
                                        enqueue=self.enqueue)
            except LedgerUnavailable as exc:
                self.pool.discard()
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

    No retry or time-limit options: those are ledger transitions, never Dramatiq's (the
    broker's middleware list leaves Retries and TimeLimit out, so the options do not
    even exist).
    """
    def runstile_execute(run_id: str, dispatch_id: int | None = None) -> None:
        executor(run_id, dispatch_id)

    return dramatiq.actor(actor_name=dispatch.ACTOR, queue_name=dispatch.QUEUE,
                          broker=broker)(runstile_execute)
