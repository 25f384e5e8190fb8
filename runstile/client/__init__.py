"""A Python client for the runstile HTTP API (docs/api.md), on the standard library alone.

    client = runstile.Client("http://127.0.0.1:8000", "rsk_…")
    run = client.submit("echo", {"text": "hi"})   # safe to retry: one Idempotency-Key
    done = client.wait(run["id"])                 # the terminal run object

Retries are safe by construction.  ``submit`` (and ``retry``, which asks for a new run of
a finished one) sends an ``Idempotency-Key`` (a uuid4 when the caller gives none) and
sends the *same* key on every retry of that call, so a retry after a lost answer returns
the run the first attempt admitted instead of a second run.
Connection errors, timeouts, 5xx and 429 are retried with exponential backoff and jitter,
honouring ``Retry-After``; other 4xx never are.  ``resume`` is the one call that is not
idempotent on the server, so it is retried only when the server surely did nothing (the
connection was refused, or a 429/503 answered).

Connections are kept alive in a small pool (one ``Client`` may be shared by threads); an
event stream holds a connection of its own.  Pass ``session=requests.Session()`` to send
through requests instead (proxies, custom TLS).  Every failure the API reports raises
:class:`runstile.errors.ApiError` with its ``status``, ``code``, ``message`` and
``details``; a server that cannot be reached after the retries raises it with
``status=None`` and code ``connection_failed``.

This module is the facade: :class:`Client`, one method per route.  ``transport.py`` holds
the connections, the retry policy and the decoding of errors (``Client``'s base class);
``sse.py`` reads event streams and resumes them.  The client imports nothing of the
server side (``runstile.errors`` only), so ``import runstile`` for it loads no Flask,
Dramatiq or ledger.
"""

from __future__ import annotations

import datetime as dt
import json
import time
import uuid
from collections.abc import Iterator
from typing import Any

from . import sse
from .sse import TERMINAL_EVENTS, TERMINAL_STATUSES
from .transport import HttpApi, quote

__all__ = ["Client", "TERMINAL_EVENTS", "TERMINAL_STATUSES"]


class Client(HttpApi):
    """One runstile server and one API key: ``Client(url, api_key, *, timeout_s=30,
    max_retries=5, session=None)``.

    ``timeout_s`` bounds each connect and each read; ``max_retries`` is how many times a
    call is retried (so a call makes at most ``max_retries + 1`` attempts).
    """

    def close(self) -> None:
        """Close the pooled connections (the client stays usable; it reconnects)."""
        self._transport.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Client({self.url!r})"

    # -------------------------------------------------------------- runs

    def submit(self, task: str | None, input: Any = None, *, idempotency_key: str | None = None,
               run_id: str | None = None, session_key: str | None = None,
               trigger_id: str | None = None, callback_url: str | None = None,
               metadata: dict[str, str] | None = None, priority: int | None = None,
               delay_s: float | None = None) -> dict:
        """Admit a run (``POST /v1/runs``); returns the run object with ``replayed``.
        ``priority`` (0-9) is sent only when given: without it the server's default, 5.
        ``delay_s``: start no sooner than that many seconds from now.

        Without ``idempotency_key`` a uuid4 is generated; every retry of this call sends
        the same key, so the server admits at most one run for it.
        """
        body = {"task": task, "input": input, "run_id": run_id, "session_key": session_key,
                "trigger_id": trigger_id, "callback_url": callback_url, "metadata": metadata,
                "priority": priority, "delay_s": delay_s}
        payload = json.dumps({k: v for k, v in body.items() if v is not None},
                             separators=(",", ":"), allow_nan=False).encode()
        key = idempotency_key if idempotency_key is not None else str(uuid.uuid4())
        return self._call("POST", "/v1/runs", body=payload,
                          headers={"Idempotency-Key": key, "Content-Type": "application/json"})

    def get(self, run_id: str) -> dict:
        """The run object (``GET /v1/runs/<id>``)."""
        return self._call("GET", f"/v1/runs/{quote(run_id)}")

    def list(self, **filters: Any) -> dict:
        """One page of runs, newest first: ``{"object": "list", "data", "has_more",
        "next_cursor"}``.  Filters: ``status`` (one or several), ``task``, ``session_key``,
        ``idempotency_key``, ``created_after``/``created_before`` (RFC 3339 text or an
        aware datetime), ``metadata`` (a dict, or ``metadata.<k>`` keys), ``limit``,
        ``cursor``."""
        return self._call("GET", "/v1/runs", query=_list_query(filters))

    def iter_runs(self, **filters: Any) -> Iterator[dict]:
        """Every run matching ``filters``, newest first, following ``next_cursor``
        (``limit`` is the page size)."""
        filters = dict(filters)
        while True:
            page = self.list(**filters)
            yield from page["data"]
            if not page.get("has_more") or not page.get("next_cursor"):
                return
            filters["cursor"] = page["next_cursor"]

    def steps(self, run_id: str) -> dict:
        """The run's step journal (``GET /v1/runs/<id>/steps``)."""
        return self._call("GET", f"/v1/runs/{quote(run_id)}/steps")

    def deliveries(self, run_id: str | None = None, **filters: Any) -> dict:
        """A run's delivery obligations (``GET /v1/runs/<id>/deliveries``), or without
        ``run_id`` those of every run the key may see (``GET /v1/deliveries``; filters
        ``state`` (one or several), ``limit``, ``cursor``)."""
        if run_id is not None:
            return self._call("GET", f"/v1/runs/{quote(run_id)}/deliveries")
        return self._call("GET", "/v1/deliveries", query=_list_query(filters))

    def retry_delivery(self, delivery_id: str) -> dict:
        """Re-arm a parked delivery (``POST /v1/deliveries/<id>/retry``); repeats are
        harmless."""
        return self._call("POST", f"/v1/deliveries/{quote(delivery_id)}/retry")

    def discard_delivery(self, delivery_id: str) -> dict:
        """Settle a delivery for good (``POST /v1/deliveries/<id>/discard``); repeats
        are harmless."""
        return self._call("POST", f"/v1/deliveries/{quote(delivery_id)}/discard")

    def stop(self, run_id: str) -> dict:
        """Ask a run to stop (``POST /v1/runs/<id>/stop``); returns the run object.
        Repeats are harmless, so it is retried like a read."""
        return self._call("POST", f"/v1/runs/{quote(run_id)}/stop")

    def resume(self, run_id: str) -> dict:
        """Re-queue a ``paused`` run (``POST /v1/runs/<id>/resume``); 409
        ``run_not_paused`` otherwise.  Retried only when the server surely did nothing."""
        return self._call("POST", f"/v1/runs/{quote(run_id)}/resume", only_if_refused=True)

    def retry(self, run_id: str, *, idempotency_key: str | None = None) -> dict:
        """A new run of a ``failed``, ``cancelled`` or ``interrupted`` run's task and input
        (``POST /v1/runs/<id>/retry``); returns it with ``retry_of`` and ``replayed``.
        409 ``run_not_retryable`` for a run in any other status.

        Without ``idempotency_key`` a uuid4 is generated; every retry of this call sends
        the same key, so the server makes at most one new run for it.
        """
        key = idempotency_key if idempotency_key is not None else str(uuid.uuid4())
        return self._call("POST", f"/v1/runs/{quote(run_id)}/retry",
                          headers={"Idempotency-Key": key})

    def approve(self, run_id: str, approval_id: str, decision: str) -> dict:
        """Decide a pending approval (``POST /v1/runs/<id>/approval``); ``decision`` is
        ``"approve"`` or ``"deny"``.  The same decision again is answered 200, so retries
        are safe."""
        if decision not in ("approve", "deny"):
            raise ValueError(f"decision must be 'approve' or 'deny', not {decision!r}")
        payload = json.dumps({"approval_id": approval_id, "decision": decision}).encode()
        return self._call("POST", f"/v1/runs/{quote(run_id)}/approval", body=payload,
                          headers={"Content-Type": "application/json"})

    # -------------------------------------------------------------- events

    def events(self, run_id: str, after: int = 0) -> Iterator[dict]:
        """The run's events with ``seq`` above ``after``, as they happen: a generator of
        ``{"seq", "type", "data", "created_at"}`` over the server-sent event stream.

        A dropped connection, a read timeout or the server's stream-lifetime close is
        resumed with ``Last-Event-ID``: no event is lost or repeated.  The generator ends
        after the terminal event (``run.completed|failed|cancelled|interrupted``), or at
        once when ``after`` is already past it.  Close it to stop early.
        """
        return sse.follow(self, run_id, after, deadline=None)

    def wait(self, run_id: str, timeout_s: float | None = None) -> dict:
        """Block until the run is terminal and return its run object.

        Follows the event stream; raises the built-in ``TimeoutError`` after ``timeout_s``.
        """
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        run = self.get(run_id)
        if run["status"] in TERMINAL_STATUSES:
            return run
        for _ in sse.follow(self, run_id, 0, deadline=deadline):
            pass
        return self.get(run_id)


def _list_query(filters: dict[str, Any]) -> list[tuple[str, str]]:
    query: list[tuple[str, str]] = []
    for name, value in filters.items():
        if value is None:
            continue
        if name == "metadata":
            query += [(f"metadata.{k}", str(v)) for k, v in dict(value).items()]
        elif isinstance(value, (list, tuple, set, frozenset)):
            query += [(name, _query_value(v)) for v in value]
        else:
            query.append((name, _query_value(value)))
    return query


def _query_value(value: Any) -> str:
    if isinstance(value, dt.datetime):
        if value.tzinfo is None:
            raise ValueError("created_after/created_before need a timezone-aware datetime")
        return value.isoformat()
    return str(value)
