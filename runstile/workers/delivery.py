"""The deliverer (docs/api.md, "Deliveries (webhooks)"): one Dramatiq message = one attempt at one obligation.

claim (guarded: pending and due -> attempting, fence + 1) -> sign and POST through the
SSRF guard (``runstile.webhooks``) -> settle with a compare-and-set on the fence.  A
duplicate message, or one for an obligation another deliverer holds, loses the claim and
does nothing.  A deliverer that dies mid-attempt leaves the obligation ``attempting``;
recovery re-arms it once its lease is gone and the next send carries
``"recovered": true`` with the same ``webhook-id``.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from collections.abc import Callable

import dramatiq

from .. import crashpoints, dispatch, logs, webhooks
from ..config import Settings
from ..errors import LedgerUnavailable
from ..ledger import obligations, webhook_secrets
from ..ledger.db import ConnectionPool
from ..objects import rfc3339, run_object
from ..queues import DELIVERY_QUEUE
from . import metrics

log = logging.getLogger("runstile.delivery")

#: Bytes of a receiver's answer read at most (the status decides; the body is quoted).
MAX_RESPONSE_BYTES = 64 * 1024


def payload(obligation: dict, run: dict | None) -> dict:
    """The JSON body of an attempt: ``{"type","timestamp","data"}`` (docs/api.md, "Deliveries (webhooks)").

    A callback's ``data`` is the run object as it was when the event was written: the
    run's columns that change are taken from the snapshot the trigger stored, the rest
    (input, metadata, result) never change once set.  A task's delivery carries its
    payload as ``data`` and the run id beside it.
    """
    body: dict = {"type": obligation["type"],
                  "timestamp": rfc3339(obligation["occurred_at"])}
    if obligation["kind"] == "callback":
        snapshot = json.loads(obligation["snapshot"] or "{}")
        for name in ("updated_at", "started_at", "finished_at"):
            if snapshot.get(name) is not None:
                snapshot[name] = float(snapshot[name])  # stored as exact text
        body["data"] = run_object({**(run or {}), **snapshot})
        if snapshot.get("status") != "completed":
            body["data"]["result"] = None  # a notice sent after the run went on to finish
    else:
        body["run_id"] = obligation["run_id"]
        body["data"] = obligations.payload_of(obligation)
    if obligation["ambiguous"]:
        # An earlier attempt's fate is unknown: the receiver may have it already (same
        # webhook-id), and may want to know this one is a redelivery.
        body["recovered"] = True
    return body


class Deliverer:
    """Everything ``runstile_deliver`` needs, built once per worker process."""

    def __init__(self, settings: Settings, pool: ConnectionPool, *, node: str,
                 generation: int, resolver: Callable = socket.getaddrinfo) -> None:
        self.settings, self.pool = settings, pool
        self.node, self.generation = node, generation
        self.resolver = resolver
        #: An attempt's lease: its own timeouts plus a margin, so only a dead (or
        #: frozen) deliverer outlives it; nothing renews it.
        self.lease_s = (settings.delivery_connect_timeout_s
                        + settings.delivery_read_timeout_s + settings.lease_s)

    def __call__(self, obligation_id: str) -> None:
        conn = self.pool.get()
        try:
            claim = obligations.claim(conn, obligation_id, node=self.node,
                                      generation=self.generation, pid=os.getpid(),
                                      lease_s=self.lease_s)
        except LedgerUnavailable as exc:
            self.pool.discard()
            log.warning("delivery %s: claim failed (%s); recovery sends it again",
                        obligation_id, exc.message)
            return
        if claim.row is None:
            if claim.wait_s > 0:  # the message came before the backoff ended
                dispatch.send_delivery_later(self.settings, conn, obligation_id, claim.wait_s)
            return
        with logs.run_context(claim.row["run_id"]):
            self.attempt(conn, claim.row)

    def attempt(self, conn, row: dict) -> None:
        settings = self.settings
        body = json.dumps(payload(row, obligations.run_row(conn, row["run_id"])),
                          separators=(",", ":")).encode()
        secrets = webhook_secrets.signing(conn, row["profile_id"], webhooks.new_secret)
        headers = webhooks.headers(row["id"], int(time.time()), body, secrets)
        outcome = webhooks.deliver(
            row["url"], body, headers, allowlist=settings.callback_allowlist,
            connect_timeout_s=settings.delivery_connect_timeout_s,
            read_timeout_s=settings.delivery_read_timeout_s,
            max_response_bytes=MAX_RESPONSE_BYTES, resolver=self.resolver)
        crashpoints.hit(settings, "after_delivery_send")
        park = False
        if outcome.kind == "delivered":
            won = obligations.settle_delivered(conn, row, status=outcome.status)
            log.info("delivery %s (run %s, %s): delivered on attempt %d", row["id"],
                     row["run_id"], row["type"], row["attempts"])
        else:
            park = outcome.kind == "gone" or row["attempts"] >= settings.delivery_max_attempts
            delay_s = webhooks.next_delay_s(row["attempts"], settings.delivery_backoff_s,
                                            settings.delivery_backoff_max_s,
                                            outcome.retry_after_s)
            won = obligations.settle_failed(conn, row, status=outcome.status,
                                            error=outcome.error or outcome.kind,
                                            delay_s=delay_s, park=park)
            # The log may name the addresses a host resolved to; last_error (shown to
            # API clients) never does.
            log.info("delivery %s (run %s): attempt %d failed (%s); %s", row["id"],
                     row["run_id"], row["attempts"], outcome.detail or outcome.error,
                     "parked" if park else f"next in {delay_s:.2f}s")
            if won and not park:
                dispatch.send_delivery_later(settings, conn, row["id"], delay_s)
        metrics.delivery(("delivered" if outcome.kind == "delivered" else
                          "parked" if park else "retry") if won else "lost")
        if not won:
            log.warning("delivery %s: attempt %d was no longer ours when it ended (recovery "
                        "re-armed it); its outcome is dropped", row["id"], row["attempts"])


def declare(broker: dramatiq.Broker, deliverer: Deliverer) -> dramatiq.Actor:
    """Bind the deliverer to ``broker`` as dispatch.DELIVER_ACTOR on the deliveries' own
    broker queue (runstile/queues.py), which every worker process consumes."""
    def runstile_deliver(obligation_id: str) -> None:
        deliverer(obligation_id)

    return dramatiq.actor(actor_name=dispatch.DELIVER_ACTOR, queue_name=DELIVERY_QUEUE,
                          broker=broker)(runstile_deliver)
