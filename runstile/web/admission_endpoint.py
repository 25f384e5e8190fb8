"""POST /v1/runs as plain WSGI, in front of Flask (docs/architecture.md, "The admission
endpoint").

Admission is the request a web process answers most, and the one whose rate the product
is judged by.  Profiled under load (issue 15), Flask's per-request machinery -- the app and
request contexts, the session the dashboard's interface opens, URL matching, the
``before_request`` hook, response finalisation -- was a fifth of a web process's CPU on
this path, and the path needs none of it.  :class:`AdmissionEndpoint` wraps the Flask
app's ``wsgi_app``: ``POST /v1/runs`` is answered here, every other request goes on to
Flask.  The Flask route stays registered and answers through the same
:func:`admitted_answer` (after its blueprint's hook resolved the key), so the URL map
still knows the method (a ``PUT /v1/runs`` is a 405 whose ``Allow`` lists
POST) and the answer is the same whichever way a request comes in.

Nothing here reads Flask's context: the process's :class:`WebState` is passed in.  The
checks and their order are the Flask route's (docs/api.md, "Check order"): the key
first (web/auth.py), then the body cap, then what web/admission.py checks.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from werkzeug.wrappers import Request

from .. import crashpoints, dispatch
from ..errors import RunstileError
from ..ledger.admission import AdmissionRequest, Admitted, admit
from ..ledger.keys import Principal
from ..objects import run_object
from ..queues import queue_of
from . import admission, auth, metrics
from .errors import Answer, answer_for, compact, status_line

if TYPE_CHECKING:
    from collections.abc import Iterable

    from _typeshed.wsgi import StartResponse, WSGIApplication, WSGIEnvironment

    from . import WebState

#: The path and method this endpoint answers; anything else is Flask's.
PATH, METHOD = "/v1/runs", "POST"


class AdmissionEndpoint:
    """The WSGI app a web process serves: POST /v1/runs here, the rest to ``fallback``."""

    def __init__(self, web: WebState, fallback: WSGIApplication) -> None:
        self.web = web
        self.fallback = fallback

    def __call__(self, environ: WSGIEnvironment,
                 start_response: StartResponse) -> Iterable[bytes]:
        # Only this exact path: "/v1/runs/" and the like are Flask's to answer (404).
        if environ.get("PATH_INFO") != PATH or environ.get("REQUEST_METHOD") != METHOD:
            return self.fallback(environ, start_response)
        status, headers, body = answer(self.web, environ)
        start_response(status, headers)
        return [body]


def answer(web: WebState, environ: WSGIEnvironment) -> Answer:
    """The whole answer to one POST /v1/runs, success or error (docs/api.md)."""
    try:
        principal = auth.principal_for(web, environ)
    except Exception as exc:  # noqa: BLE001 - every error is answered (answer_for)
        # Answered before admission, so not counted as one (docs/operations.md, "Metrics").
        return answer_for(exc, web)
    return admitted_answer(web, environ, principal)


def admitted_answer(web: WebState, environ: WSGIEnvironment, principal: Principal) -> Answer:
    """The answer to a POST /v1/runs whose key is ``principal``: every check after the
    key's, the commit, the publish; timed and counted (docs/operations.md, "Metrics")."""
    started = time.perf_counter()
    outcome = "error"
    try:
        req, refusal = admission.build(Request(environ), principal,
                                       settings=web.settings, task_names=web.task_names)
        admitted = admit_and_publish(web, req, refusal)
        outcome = "replayed" if admitted.replayed else "created"
        if not admitted.replayed:
            metrics.observe_admitted(admitted.run["task"])
        return accepted(admitted)
    except Exception as exc:  # noqa: BLE001 - every error is answered (answer_for)
        if isinstance(exc, RunstileError):
            outcome = exc.code
        return answer_for(exc, web)
    finally:
        metrics.observe_admission(outcome, time.perf_counter() - started)


def admit_and_publish(web: WebState, req: AdmissionRequest,
                      refusal: RunstileError | None) -> Admitted:
    """Admit ``req`` through the web process's committer, then publish the new run's
    dispatch record: admission's path for a POST /v1/runs and for a retry alike."""
    settings = web.settings
    admitted = admit(None, req, refusal=refusal, max_active_runs=settings.max_active_runs,
                     enqueue=web.dispatcher.in_transaction, committer=web.committer)
    crashpoints.hit(settings, "after_admit_commit")
    if not admitted.replayed and admitted.dispatch_id is not None:
        # Redis/RabbitMQ: publish now that the admission committed (nothing to do for
        # the embedded broker, whose message committed with it).  Never raises: a
        # failed publish leaves the record unsent for recovery, and the 202 stands.
        # A delayed run's message is published delayed until the not_before the
        # reservation stored (docs/api.md, "Delayed runs").
        dispatch.publish(settings, None, admitted.run["id"], admitted.dispatch_id,
                         delay_s=dispatch.publish_wait(admitted.run),
                         priority=dispatch.priority_of(admitted.run),
                         queue=queue_of(admitted.run), mark=web.committer.run)
    return admitted


def accepted(admitted: Admitted) -> Answer:
    """The 202 of an admission, new or replayed (docs/api.md, "Reservation")."""
    body = run_object(admitted.run)
    body["replayed"] = admitted.replayed
    payload = compact(body).encode()
    headers = [("Content-Type", "application/json"), ("Content-Length", str(len(payload))),
               ("Location", f"/v1/runs/{admitted.run['id']}")]
    if admitted.replayed:
        headers.append(("Idempotency-Replayed", "true"))
    return status_line(202), headers, payload
